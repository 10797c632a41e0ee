"""The front door (prefetch.sources.open_source) and the pipeline's resolve: one table of source
URIs opened and resolved through the CLI's path (``prefetch pull``) and the agent's path, which
must find the same thing: the same kind of source, serving the same commit, the same spec and
the same layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from prefetch.agent.config import parse_config
from prefetch.agent.jobs import model_pipeline
from prefetch.agent.loop import Agent
from prefetch.agent.source_opener import SourceOpener
from prefetch.cli.common import make_config
from prefetch.cli.pull import open_pull_source, pull_spec
from prefetch.demo.locals3 import SeaweedS3
from prefetch.pipeline.compose import Pipeline, Resolved
from prefetch.pipeline.layout import layout_for
from prefetch.pipeline.store import Store
from prefetch.sources import S3Clients, pool_size
from prefetch.support.errors import ConfigError

from .fakes.hubserver import HubServer
from .support import (
    HUB_REPO,
    AgentThread,
    config_text,
    is_ready,
    model_status,
    put,
    server_files,
    wait_for,
    write_mirror,
)

REPO = HUB_REPO


@pytest.fixture
def reach(
    monkeypatch: pytest.MonkeyPatch, s3_server: SeaweedS3, hub: HubServer, tmp_path: Path
) -> None:
    """Both paths find the servers the way a user's environment tells them: credentials and
    the Hub endpoint from the environment (the S3 endpoint is each path's own setting)."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)


def via_cli(
    uri: str, s3: SeaweedS3, dest: Path, *, layout: str | None = None, **flags: Any
) -> Found:
    """What ``prefetch pull URI DEST [flags]`` opens and resolves."""
    options: dict[str, Any] = dict(name="", include=(), exclude=(), revision=None, hf_repo=None,
                                   hf_revision=None, layout_name=layout)  # fmt: skip
    spec, _ = pull_spec(uri, **{**options, **flags})
    config = make_config(4, "64MiB", False, False, 2)
    source = open_pull_source(
        spec, layout, config, s3_endpoint=s3.endpoint, hub_endpoint=None, token=None
    )
    place = Pipeline(
        spec, source, lambda s, kind: layout_for(s, dest, layout_name=kind), layout_name=layout
    )
    return source, place.resolve(None)


def via_agent(uri: str, s3: SeaweedS3, cache: Path, **keys: Any) -> Found:
    """What the agent opens and resolves for a model ``{source: URI, **keys}`` of its config
    file."""
    model = {"name": "m", "source": uri, **keys}
    doc = {"s3": {"endpointUrl": s3.endpoint}, "concurrency": 4, "models": [model]}
    config = parse_config(yaml.safe_dump(doc))
    spec = config.models[0]
    source = SourceOpener(None, None).open(spec, config)
    return source, model_pipeline(spec, source, Store(cache)).resolve(None)


#: What was opened, and what resolving it found.
Found = tuple[object, Resolved]


def opened(found: Found) -> tuple[object, ...]:
    """What was opened, comparably: the kind of source serving the snapshot (an S3 prefix: the
    mirror when it is one), the source that serves the snapshot and its commit, the spec's repo
    id, and the layout."""
    source, o = found
    serving = getattr(source, "serving", source)
    snapshot = o.snapshot
    return (type(serving).__name__, snapshot.source, snapshot.repo_id, o.spec.repo_id,
            o.layout_name)  # fmt: skip


def test_one_table_of_uris_opens_the_same_through_the_cli_and_the_agent(
    reach: None,
    s3_server: SeaweedS3,
    s3_client: Any,
    bucket: str,
    hub: HubServer,
    tmp_path: Path,
) -> None:
    commit = write_mirror(s3_client, bucket, "mirror/", hub)
    put(s3_client, bucket, "plain/config.json", b'{"a": 1}')
    plain, mirror, hf = f"s3://{bucket}/plain/", f"s3://{bucket}/mirror/", f"hf://{REPO}"
    # (uri, CLI flags, the agent's model keys (None: the CLI's alone), what is opened)
    table: list[tuple[str, dict[str, Any], dict[str, Any] | None, tuple[object, ...]]] = [
        (plain, {}, {}, ("S3Source", plain, None, None, "plain")),
        (plain, {"hf_repo": "org/plain"}, {"hfRepo": "org/plain"},
         ("S3Source", plain, "org/plain", "org/plain", "hf")),
        (plain, {"hf_repo": "org/plain", "layout": "hf"}, {"hfRepo": "org/plain"},
         ("S3Source", plain, "org/plain", "org/plain", "hf")),
        (mirror, {"hf_repo": REPO}, {"hfRepo": REPO}, ("MirrorSource", mirror, REPO, REPO, "hf")),
        (mirror, {"hf_repo": REPO, "layout": "hf"}, {"hfRepo": REPO},
         ("MirrorSource", mirror, REPO, REPO, "hf")),
        (mirror, {"layout": "plain"}, None, ("S3Source", mirror, None, None, "plain")),
        (hf, {}, {}, ("HubSource", hf, REPO, REPO, "hf")),
        (hf, {"layout": "plain"}, None, ("HubSource", hf, REPO, REPO, "plain")),
        (hf, {"mirrors": (mirror,)}, {"mirrors": [mirror]},
         ("OrderedSource", mirror, REPO, REPO, "hf")),
        (hf, {"mirrors": (mirror,), "hub_fallback": False},
         {"mirrors": [mirror], "hubFallback": False}, ("OrderedSource", mirror, REPO, REPO, "hf")),
    ]  # fmt: skip
    for uri, flags, keys, expected in table:
        row = f"{uri} {flags}"
        assert opened(via_cli(uri, s3_server, tmp_path / "dest", **flags)) == expected, row
        if keys is not None:
            assert opened(via_agent(uri, s3_server, tmp_path / "cache", **keys)) == expected, row
    # the mirror prefix named by itself: the CLI publishes it in the Hub's layout under the
    # repo id its metadata records, at the commit it resolved while probing
    found = via_cli(mirror, s3_server, tmp_path / "dest")
    assert opened(found) == ("MirrorSource", mirror, REPO, REPO, "hf")
    assert found[1].snapshot is not None and found[1].snapshot.revision_id == commit
    assert found[1].spec.hf_repo == REPO
    # the agent does too, once its config names the repo id (its cache index is read offline,
    # by `prefetch gc` and eviction, so the id cannot come from the network): told so
    told = f"m: hfRepo: s3://{bucket}/mirror/ is a mirror of {REPO}"
    with pytest.raises(ConfigError, match=told):
        via_agent(mirror, s3_server, tmp_path / "cache")


def test_pool_size_is_the_reads_in_flight_of_every_stream_plus_spare_for_metadata() -> None:
    assert pool_size(16) == 24 and pool_size(16, streams=2) == 40


def test_the_agent_shares_one_s3_client_per_endpoint_pool_and_proxy() -> None:
    made: list[dict[str, Any]] = []

    def make(**settings: Any) -> object:
        made.append(settings)
        return object()

    clients = S3Clients(make)
    first = clients.get("http://127.0.0.1:1", 40, None)
    assert clients.get("http://127.0.0.1:1", 40, None) is first
    assert clients.get("http://127.0.0.1:1", 40, "") is not first  # its own proxy: its own
    assert clients.get("http://127.0.0.1:2", 40, None) is not first
    assert made[0] == {"endpoint_url": "http://127.0.0.1:1", "max_pool_connections": 40,
                       "proxy": None}  # fmt: skip
    assert len(made) == 3


@pytest.mark.slow
def test_the_agent_publishes_an_s3_mirror_prefix_in_the_hub_layout_as_the_cli_does(
    s3_client: Any, bucket: str, hub: HubServer, tmp_path: Path
) -> None:
    commit = write_mirror(s3_client, bucket, "mirror/", hub)
    cache = tmp_path / "cache"
    config = tmp_path / "models.yaml"
    models = [
        {"name": "tiny", "source": f"s3://{bucket}/mirror/", "hfRepo": REPO},
        {"name": "unnamed", "source": f"s3://{bucket}/mirror/"},
    ]
    config.write_text(config_text(cache, models))
    agent = Agent(config, s3_client=s3_client, serve=False, tick=0.2)
    with AgentThread(agent):
        wait_for(lambda: is_ready(agent, "tiny"), "tiny", dump=agent.status)
        wait_for(lambda: model_status(agent, "unnamed").get("last_error"), "unnamed refused",
                 dump=agent.status)  # fmt: skip
        refused = model_status(agent, "unnamed")
    snapshot = cache / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit
    files = {p.relative_to(snapshot).as_posix(): p for p in snapshot.rglob("*") if p.is_file()}
    assert {path: p.read_bytes() for path, p in files.items()} == server_files(hub)
    assert not (cache / "models").exists()  # neither as the mirror's raw objects
    assert "unnamed: hfRepo:" in refused["last_error"] and REPO in refused["last_error"]
    assert refused["error_reason"] == "config" and not refused["ready"]
