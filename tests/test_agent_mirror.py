"""The agent with a Hub model and its S3 mirror: the config keys, and the fallback from an empty
mirror to the Hub and back to the mirror once it has the commit, told by /readyz's ``source``,
the ``model_prefetch_model_source`` metric and the sync's log line."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest

from prefetch.agent.config import parse_config, spec_digest
from prefetch.agent.config_values import AgentConfig
from prefetch.agent.loop import Agent
from prefetch.agent.scheduler import Intervals, JobKind
from prefetch.sources.s3.factory import make_s3_client
from prefetch.support.errors import ConfigError

from .fakes.hubserver import HubServer, make_model_repo
from .fakes.s3proxy import S3FaultProxy
from .support import (
    HUB_REPO,
    AgentProcess,
    AgentThread,
    config_text,
    is_ready,
    model_status,
    s3_subprocess_env,
    wait_for,
    write_mirror,
)
from .tls import TestCA

# -- the config keys ------------------------------------------------------------------------------


def test_a_model_names_its_mirrors_in_order_and_may_turn_the_hub_fallback_off() -> None:
    model = parse_config(
        "models:\n  - {name: a, source: hf://o/n, mirrors: [s3://bkt/one/, 's3://bkt/two'],"
        " hubFallback: false}"
    ).models[0]
    assert [str(m) for m in model.mirrors] == ["s3://bkt/one/", "s3://bkt/two/"]
    assert model.hub_fallback is False
    plain = parse_config("models: [{name: a, source: hf://o/n}]").models[0]
    assert plain.mirrors == () and plain.hub_fallback is True


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("{name: a, source: s3://bkt/p, mirrors: [s3://bkt/m]}", "models[0].mirrors: only for"),
        ("{name: a, source: hf://o/n, mirrors: [hf://o/m]}", "is not an s3:// URI"),
        ("{name: a, source: hf://o/n, mirrors: {a: 1}}", "models[0].mirrors: expected a list"),
        ("{name: a, source: hf://o/n, hubFallback: false}", "models[0].hubFallback: turning"),
        ("{name: a, source: hf://o/n, mirrors: [s3://b]}", "models[0].mirrors[0]: malformed"),
    ],
)
def test_mirror_keys_that_make_no_sense_are_refused_naming_the_key(model: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(f"models:\n  - {model}\n")
    assert words in str(e.value)


def test_two_models_of_one_hub_repo_are_refused_even_through_different_mirrors() -> None:
    with pytest.raises(ConfigError, match="same Hub repo"):
        parse_config(
            "models:\n"
            "  - {name: a, source: hf://o/n, mirrors: [s3://bkt/one/]}\n"
            "  - {name: b, source: hf://o/n, mirrors: [s3://bkt/two/], include: ['*.json']}\n"
        )


def test_mirrors_hub_fallback_and_proxy_are_not_content_so_they_keep_the_spec_digest() -> None:
    def digest(extra: str) -> str:
        return spec_digest(
            parse_config(f"models: [{{name: a, source: hf://o/n{extra}}}]").models[0]
        )

    plain = digest("")
    assert digest(", mirrors: [s3://bkt/one/]") == plain
    assert digest(", mirrors: [s3://bkt/one/, s3://bkt/two/], hubFallback: false") == plain
    assert digest(", proxy: 'http://127.0.0.1:3128'") == plain
    assert digest(", revision: v2") != plain  # content does count


def test_changing_a_ready_models_mirrors_keeps_it_ready_and_confirms_it_with_them_at_once(
    tmp_path: Path,
) -> None:
    def config(extra: str) -> AgentConfig:
        text = f"cacheDir: {tmp_path}\nmodels: [{{name: a, source: hf://o/n{extra}}}]"
        return parse_config(text)

    agent = Agent(None, config=config(""), serve=False)
    agent._set_models(config(""))
    state = agent.scheduler.table()["a"]
    state.found_copy("0" * 40, 10, None)
    state.last_resolved = time.monotonic()
    intervals = Intervals(resolve=3600.0, verify=None)
    assert state.due(time.monotonic(), intervals) is None

    agent._set_models(config(", mirrors: [s3://bkt/one/]"))
    after = agent.scheduler.table()["a"]
    assert after is state and after.ready  # the copy is still the model: no cold re-sync
    assert [str(m) for m in after.spec.mirrors] == ["s3://bkt/one/"]
    assert after.due(time.monotonic(), intervals) is JobKind.SYNC  # confirmed with the mirror now


# -- the agent falls back and comes back ----------------------------------------------------------


def _source_of(agent: AgentProcess) -> Any:
    status, body = agent.get("/readyz")
    if status != 200:
        return None
    return json.loads(body)["models"][0]["source"]


@pytest.mark.slow
def test_the_agent_falls_back_to_the_hub_from_an_empty_mirror_and_returns_once_it_has_the_commit(
    s3_server: Any, s3_client: Any, bucket: str, tmp_path: Path, test_ca: TestCA
) -> None:
    cache = tmp_path / "cache"
    mirror = f"s3://{bucket}/hf/acme/tiny/"
    with HubServer(test_ca) as hub:
        make_model_repo(hub, "acme/tiny", tmp_path / "src", seed=5)
        config = tmp_path / "models.yaml"
        models = [{"name": "tiny", "source": "hf://acme/tiny", "mirrors": [mirror]}]
        config.write_text(config_text(cache, models, resolveInterval="1s"))
        env = s3_subprocess_env(s3_server, tmp_path)
        env.update(HF_ENDPOINT=hub.endpoint, HF_HUB_DISABLE_TELEMETRY="1")
        agent = AgentProcess(config, env, tmp_path / "agent.log")
        try:
            wait_for(lambda: agent.up() and agent.get("/readyz")[0] == 200, "ready", timeout=60)
            assert _source_of(agent) == "hf://acme/tiny"
            assert agent.metric("model_prefetch_model_source", model="tiny", source_kind="hub") == 1
            assert (
                agent.metric("model_prefetch_model_source", model="tiny", source_kind="mirror") == 0
            )
            assert "from hf://acme/tiny" in agent.stderr()
            # the mirror gets the commit: the next resolve is served by it, the Hub left alone
            write_mirror(s3_client, bucket, "hf/acme/tiny/", hub, "acme/tiny")
            wait_for(lambda: _source_of(agent) == mirror, "served by the mirror", timeout=30,
                     dump=lambda: agent.stderr()[-3000:])  # fmt: skip
            assert (
                agent.metric("model_prefetch_model_source", model="tiny", source_kind="mirror") == 1
            )
            assert agent.metric("model_prefetch_model_source", model="tiny", source_kind="hub") == 0
            hub.clear_requests()
            time.sleep(2.5)  # two more resolves (resolveInterval 1s), each served by the mirror
            assert [r.url_path for r in hub.requests] == []
            assert _source_of(agent) == mirror
        finally:
            agent.stop()


# -- an S3 mirror prefix: resolved once per sync ---------------------------------------------------


def test_the_agent_resolves_an_s3_mirror_prefix_once_per_sync(
    s3_server: Any, s3_client: Any, bucket: str, hub: HubServer, test_ca: TestCA, tmp_path: Path
) -> None:
    """Opening a model's source makes no request; the sync's resolve probes the prefix (one
    listing of ``snapshots/``) and reads its metadata once. Counted where the requests arrive."""
    write_mirror(s3_client, bucket, "mirror/", hub)
    config = tmp_path / "models.yaml"
    models = [{"name": "tiny", "source": f"s3://{bucket}/mirror/", "hfRepo": HUB_REPO}]
    config.write_text(config_text(tmp_path / "cache", models))
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        client = make_s3_client(
            endpoint_url=proxy.endpoint,
            access_key=s3_server.access_key,
            secret_key=s3_server.secret_key,
        )
        agent = Agent(config, s3_client=client, serve=False, tick=0.2)
        with AgentThread(agent):
            wait_for(lambda: is_ready(agent, "tiny"), "tiny ready", dump=agent.status)
            state = model_status(agent, "tiny")
    listed = Counter(
        parse_qs(query)["prefix"][0]
        for method, key, query in proxy.requests
        if method == "GET" and key == bucket and "prefix=" in query
    )
    metadata = Counter(
        key.split("/")[1]  # the proxy names an object by its key
        for method, key, _ in proxy.requests
        if method == "GET" and key.startswith(("mirror/refs/", "mirror/snapshots/"))
    )
    assert state["failures"] == 0  # one sync: the first, and it succeeded
    assert listed == {"mirror/snapshots/": 1, "mirror/refs/": 1}
    assert metadata == {"snapshots": 1, "refs": 1}
