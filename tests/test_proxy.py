"""Every source goes through a proxy: HTTP(S)_PROXY, a model's own ``proxy`` (agent config) or
``--proxy``, with NO_PROXY bypassing it; checked through a real forward proxy
(tests/fakes/forward_proxy.py) that counts requests per target host.

The servers are addressed by name or as 127.0.0.1 and NO_PROXY is emptied in each test's
environment (tests/support.clean_env sets it to 127.0.0.1 for every other test), so nothing here
passes because a client skipped the proxy for a loopback address on its own. The Hub speaks HTTPS
(the session CA), so its traffic crosses the proxy in CONNECT tunnels, as in production: the proxy
counts tunnels, the Hub counts the connections it accepted, and the two must agree.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefetch.agent.config import parse_config
from prefetch.demo.locals3 import SeaweedS3
from prefetch.pipeline.layout import layout_for
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import sync
from prefetch.sources import SourceSettings, open_source
from prefetch.sources.hf.source import HubOptions
from prefetch.sources.s3.source import s3_proxies
from prefetch.support.errors import ConfigError
from prefetch.support.settings import parse_proxy, proxies

from .fakes.forward_proxy import ForwardProxy
from .fakes.hubserver import HubServer, make_model_repo
from .support import (
    FAST,
    AgentProcess,
    clean_env,
    config_text,
    run_cli,
    server_files,
    upload,
    wait_for,
)
from .tls import TestCA

MiB = 1024 * 1024
REPO = "acme/proxied"
#: NO_PROXY naming every test server: the loopback address and the test domain.
DIRECT = "127.0.0.1,prefetch.test"
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY")


@pytest.fixture
def proxy() -> Iterator[ForwardProxy]:
    with ForwardProxy() as p:
        yield p


@pytest.fixture
def hub(tmp_path: Path, test_ca: TestCA) -> Iterator[HubServer]:
    with HubServer(test_ca) as server:
        make_model_repo(server, REPO, tmp_path / "hub-src", seed=5, shard_sizes=(2 * MiB,))
        yield server


@pytest.fixture
def s3_model(s3_client, bucket: str, tmp_path: Path) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    """A model under s3://<bucket>/m/ on the local SeaweedFS."""
    return upload(s3_client, bucket, "m/", tmp_path, 3 * MiB)


def _proxy_env(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    """This process's proxy variables: exactly ``values`` (both cases of each cleared first)."""
    for name in _PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def _s3_credentials(monkeypatch: pytest.MonkeyPatch, server: SeaweedS3) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def _pull_hub(hub: HubServer, dest: Path, proxy: str | None = None) -> None:
    spec = ModelSpec(source=parse_source_uri(f"hf://{REPO}"), proxy=proxy)
    source = open_source(
        spec, SourceSettings(hub=HubOptions(endpoint=hub.endpoint, token=False, pool_size=9))
    )
    result = sync(spec, source, layout_for(spec, dest), FAST)
    assert result.files_downloaded == len(server_files(hub, REPO))


def _pull_s3(server: SeaweedS3, bucket: str, dest: Path, proxy: str | None = None) -> int:
    """Pull s3://bucket/m/ into ``dest``; the number of files."""
    spec = ModelSpec(source=parse_source_uri(f"s3://{bucket}/m/"), proxy=proxy)
    source = open_source(spec, SourceSettings(s3_endpoint=server.endpoint, concurrency=4))
    result = sync(spec, source, layout_for(spec, dest), FAST)
    assert result.files_downloaded > 0 and result.bytes_downloaded > 3 * MiB
    return result.files_downloaded


# -- the fake proxy itself ------------------------------------------------------------------------


def test_the_forward_proxy_tunnels_connect_and_counts_its_target(
    proxy: ForwardProxy, hub: HubServer, test_ca: TestCA
) -> None:
    import http.client
    import ssl
    from urllib.parse import urlsplit

    target = urlsplit(hub.endpoint)
    proxy_port = int(proxy.url.rsplit(":", 1)[1])
    # TLS to the Hub inside the tunnel (the session CA, the Hub's host name checked)
    context = ssl.create_default_context(cafile=str(test_ca.ca_file))
    conn = http.client.HTTPSConnection("127.0.0.1", proxy_port, timeout=10, context=context)
    conn.set_tunnel(str(target.hostname), target.port)
    conn.request("GET", f"/api/models/{REPO}")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["id"] == REPO
    conn.close()
    assert proxy.through(hub.endpoint) == 1 and proxy.methods["CONNECT"] == 1


# -- the environment's proxies -------------------------------------------------------------------


def test_a_hub_pull_goes_through_the_environments_proxy_metadata_and_bytes(
    proxy: ForwardProxy, hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _proxy_env(monkeypatch, HTTPS_PROXY=proxy.url, HTTP_PROXY=proxy.url, NO_PROXY="")
    _pull_hub(hub, tmp_path / "dest")
    hub_requests = [r for r in hub.requests if r.port == "hub"]
    api = [r for r in hub_requests if r.url_path.startswith("/api/")]
    # every connection the Hub accepted was a tunnel through the proxy: the listing and the
    # resolve GETs, and the CDN's bytes
    assert api and hub_requests
    assert proxy.through(hub.endpoint) == hub.connections["hub"] > 0
    assert proxy.through(hub.cdn_endpoint) == hub.connections["cdn"] > 0


def test_an_s3_pull_goes_through_the_environments_proxy(
    proxy: ForwardProxy,
    s3_server: SeaweedS3,
    bucket: str,
    s3_model: dict[str, bytes],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _proxy_env(monkeypatch, HTTPS_PROXY=proxy.url, HTTP_PROXY=proxy.url, NO_PROXY="")
    _s3_credentials(monkeypatch, s3_server)
    files = _pull_s3(s3_server, bucket, tmp_path / "dest")
    assert files == len(s3_model)
    # HTTPS: the proxy sees CONNECT tunnels, not requests; every byte of the model came back
    # through them (the listing and the files, inside TLS)
    assert proxy.through(s3_server.endpoint) >= 1
    host = s3_server.endpoint.split("://", 1)[1]
    assert proxy.tunneled[host] > sum(len(data) for data in s3_model.values())


def test_no_proxy_sends_both_sources_direct(
    proxy: ForwardProxy,
    hub: HubServer,
    s3_server: SeaweedS3,
    bucket: str,
    s3_model: dict[str, bytes],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _proxy_env(monkeypatch, HTTPS_PROXY=proxy.url, HTTP_PROXY=proxy.url, NO_PROXY=DIRECT)
    _s3_credentials(monkeypatch, s3_server)
    _pull_hub(hub, tmp_path / "hub")
    _pull_s3(s3_server, bucket, tmp_path / "s3")
    assert sum(proxy.requests.values()) == 0


def test_no_proxy_also_bypasses_a_sources_own_proxy(
    proxy: ForwardProxy, hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _proxy_env(monkeypatch, NO_PROXY=DIRECT)
    _pull_hub(hub, tmp_path / "hub", proxy=proxy.url)
    assert sum(proxy.requests.values()) == 0


# -- a source's own proxy --------------------------------------------------------------------------


def test_a_models_own_proxy_carries_the_hub_pull_without_any_environment_proxy(
    proxy: ForwardProxy, hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _proxy_env(monkeypatch, NO_PROXY="")
    _pull_hub(hub, tmp_path / "dest", proxy=proxy.url)
    assert proxy.through(hub.endpoint) == hub.connections["hub"] > 0
    assert proxy.through(hub.cdn_endpoint) == hub.connections["cdn"] > 0


def test_proxy_none_goes_direct_even_when_the_environment_names_a_proxy(
    hub: HubServer,
    s3_server: SeaweedS3,
    bucket: str,
    s3_model: dict[str, bytes],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens, every proxied request fails
    _proxy_env(monkeypatch, HTTPS_PROXY=dead, HTTP_PROXY=dead, NO_PROXY="")
    _s3_credentials(monkeypatch, s3_server)
    _pull_hub(hub, tmp_path / "hub", proxy="none")
    _pull_s3(s3_server, bucket, tmp_path / "s3", proxy="")


@pytest.mark.slow
@pytest.mark.parametrize("proxied", ["hub", "s3"])
def test_the_agent_sends_each_model_through_its_own_proxy_setting(
    proxied: str,
    hub: HubServer,
    s3_server: SeaweedS3,
    bucket: str,
    s3_model: dict[str, bytes],
    tmp_path: Path,
) -> None:
    """One model names the proxy, the other ``proxy: none``, while the environment names a
    second proxy: each model's traffic goes exactly its own way."""
    cache = tmp_path / "cache"
    with ForwardProxy() as model_proxy, ForwardProxy() as env_proxy:
        own = {"hub": "none", "s3": "none", proxied: model_proxy.url}
        models = [
            {"name": "hubmodel", "source": f"hf://{REPO}", "proxy": own["hub"]},
            {"name": "s3model", "source": f"s3://{bucket}/m/", "proxy": own["s3"]},
        ]
        config = tmp_path / "models.yaml"
        config.write_text(config_text(cache, models))
        env = clean_env(
            tmp_path / "home",
            HF_ENDPOINT=hub.endpoint,
            AWS_ENDPOINT_URL=s3_server.endpoint,
            AWS_ACCESS_KEY_ID=s3_server.access_key,
            AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
            AWS_DEFAULT_REGION="us-east-1",
            AWS_CONFIG_FILE=str(tmp_path / "aws-config"),
            HTTP_PROXY=env_proxy.url,
            HTTPS_PROXY=env_proxy.url,
        )
        env["NO_PROXY"] = ""
        agent = AgentProcess(config, env, tmp_path / "agent.log")
        try:
            wait_for(lambda: agent.up() and agent.get("/readyz")[0] == 200, "ready", timeout=90)
        finally:
            agent.stop()
    assert sum(env_proxy.requests.values()) == 0, env_proxy.requests
    targets = {"hub": [hub.endpoint, hub.cdn_endpoint], "s3": [s3_server.endpoint]}
    assert all(model_proxy.through(url) > 0 for url in targets[proxied])
    other = "s3" if proxied == "hub" else "hub"
    assert all(model_proxy.through(url) == 0 for url in targets[other])


@pytest.mark.slow
def test_pull_proxy_flag_carries_the_hub_pull(
    proxy: ForwardProxy, hub: HubServer, tmp_path: Path
) -> None:
    env = clean_env(tmp_path / "home", HF_ENDPOINT=hub.endpoint)
    env["NO_PROXY"] = ""
    proc = run_cli(
        "pull", f"hf://{REPO}", str(tmp_path / "dest"), "--proxy", proxy.url, "--json", env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["files_downloaded"] == len(server_files(hub, REPO))
    assert proxy.through(hub.endpoint) > 0 and proxy.through(hub.cdn_endpoint) > 0


# -- the settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", ["", "none", "None", " direct "])
def test_an_empty_or_none_proxy_setting_means_direct(direct: str) -> None:
    assert parse_proxy(direct, field="proxy") == ""
    env = {"HTTPS_PROXY": "http://corp:3128"}
    assert proxies(env, override=parse_proxy(direct, field="proxy")).proxy_for("https://x") is None


def test_a_sources_proxy_replaces_the_environments_for_both_schemes() -> None:
    env = {"HTTPS_PROXY": "http://corp:3128", "NO_PROXY": "internal.example"}
    mine = proxies(env, override="http://dfdaemon:65001")
    assert mine.proxy_for("https://huggingface.co/x") == "http://dfdaemon:65001"
    assert mine.proxy_for("http://s3.internal.example:9000/b") is None  # NO_PROXY still applies


def test_the_s3_client_gets_explicit_proxies_decided_for_its_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _proxy_env(monkeypatch, HTTPS_PROXY="http://corp:3128", NO_PROXY="s3.eu-west-1.amazonaws.com")
    assert s3_proxies(None, "us-east-1", None) == {
        "http": "http://corp:3128",
        "https": "http://corp:3128",
    }
    assert s3_proxies(None, "eu-west-1", None) == {}  # explicit {}: botocore must not decide
    assert s3_proxies("http://10.0.0.5:8333", "us-east-1", None) == {}  # http: no HTTP_PROXY
    assert s3_proxies(None, "us-east-1", "") == {}
    assert s3_proxies(None, "us-east-1", "none") == {}


@pytest.mark.parametrize("bad", ["socks5://h:1080", "proxy:3128", "http://", "http://h:port"])
def test_a_malformed_model_proxy_is_refused_naming_the_field(bad: str) -> None:
    text = f"models:\n  - name: m\n    source: hf://org/name\n    proxy: {bad!r}\n"
    with pytest.raises(ConfigError, match=r"models\[0\]\.proxy: .*not a proxy URL|invalid port"):
        parse_config(text)


def test_the_agent_config_reads_a_models_proxy() -> None:
    text = (
        "models:\n"
        "  - {name: a, source: hf://org/a, proxy: 'http://dfdaemon:65001'}\n"
        "  - {name: b, source: hf://org/b, proxy: none}\n"
        "  - {name: c, source: hf://org/c}\n"
    )
    a, b, c = parse_config(text).models
    assert (a.proxy, b.proxy, c.proxy) == ("http://dfdaemon:65001", "", None)


def test_pull_refuses_a_malformed_proxy_flag(tmp_path: Path) -> None:
    proc = run_cli(
        "pull", "hf://org/name", str(tmp_path), "--proxy", "ftp://x", env=clean_env(tmp_path)
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("Error: --proxy: 'ftp://x' is not a proxy URL")


@pytest.mark.slow
def test_mirror_proxy_flag_carries_the_hub_and_the_s3_traffic(
    proxy: ForwardProxy, hub: HubServer, s3_server: SeaweedS3, bucket: str, tmp_path: Path
) -> None:
    env = clean_env(
        tmp_path / "home",
        HF_ENDPOINT=hub.endpoint,
        AWS_ENDPOINT_URL=s3_server.endpoint,
        AWS_ACCESS_KEY_ID=s3_server.access_key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(tmp_path / "aws-config"),
    )
    env["NO_PROXY"] = ""
    dest = f"s3://{bucket}/hf/{REPO}"
    proc = run_cli("mirror", f"hf://{REPO}", dest, "--proxy", proxy.url, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["files"] == len(server_files(hub, REPO))
    for url in (hub.endpoint, hub.cdn_endpoint, s3_server.endpoint):
        assert proxy.through(url) > 0, (url, proxy.requests)


def test_a_proxy_password_never_reaches_the_error_line(tmp_path: Path) -> None:
    bad = "socks5://alice:s3cret-pw@proxy.example:1080"
    proc = run_cli("pull", "hf://org/name", str(tmp_path), "--proxy", bad, env=clean_env(tmp_path))
    assert proc.returncode == 1
    assert "alice:***@proxy.example" in proc.stderr and "s3cret" not in proc.stderr


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("via http://bob:pa55@proxy:3128 failed", "via http://bob:***@proxy:3128 failed"),
        ("http://proxy:3128/path@x", "http://proxy:3128/path@x"),  # a port is not a password
        ("https://huggingface.co/org/name", "https://huggingface.co/org/name"),
    ],
)
def test_redact_hides_the_password_of_a_url_with_user_info(text: str, shown: str) -> None:
    from prefetch.support.redact import redact

    assert redact(text) == shown
