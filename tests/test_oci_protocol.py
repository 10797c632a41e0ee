"""The registry protocol around the bytes: the Bearer token flow (anonymous, docker config,
credential helpers), a token expiring mid-pull, blob redirects to storage, 429 with Retry-After,
a registry that ignores Range, a token endpoint that hangs, and kill -9 then resume. The registry
is the real docker-registry; tests/fakes/oci_proxy.py stands in front of it for the faults. All of
it over HTTPS with the session CA: the registry, the proxy (registry.prefetch.test) and the blob
storage it redirects to (another host, s3.prefetch.test)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import sync
from prefetch.sources.oci.auth import RegistryAuth, docker_credentials, parse_challenge
from prefetch.sources.oci.source import OciSource
from prefetch.support.errors import AccessDeniedError, SourceChangedError, TransientSourceError

from .fakes.oci_proxy import RegistryProxy
from .fakes.registry import Registry
from .support import journaled_bytes, kill_9_when
from .tls import TestCA

MiB = 1024 * 1024
CONFIG = TransferConfig(
    concurrency=4,
    chunk_size=1 * MiB,
    buffer_size=64 * 1024,
    retry=RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.1),
)
FILES = {"config.json": b'{"a": 1}', "model.safetensors": os.urandom(3 * MiB + 11)}


@pytest.fixture(scope="module")
def pushed(registry: Registry) -> str:
    return registry.pusher().modelpack("models/p", "v1", FILES).digest


@pytest.fixture
def proxy(registry: Registry, test_ca: TestCA) -> Iterator[RegistryProxy]:
    p = RegistryProxy(registry.url, test_ca).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(autouse=True)
def no_docker_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    return tmp_path / "docker"


def source(proxy: RegistryProxy, *, token_timeout: float = 10.0, attempts: int = 3) -> OciSource:
    http = urllib3.PoolManager(maxsize=16, retries=False)
    return OciSource(
        parse_source_uri(f"oci://{proxy.host}/models/p:v1"),
        http=http,
        auth=RegistryAuth(proxy.host, http, timeout=token_timeout),
        retry=RetryPolicy(attempts=attempts, base_delay=0.01, max_delay=0.1),
    )


def pull(src: OciSource, dest: Path, config: TransferConfig = CONFIG):  # type: ignore[no-untyped-def]
    spec = ModelSpec(source=src.uri)
    return sync(spec, src, PlainLayout(dest), config)


def published(dest: Path) -> dict[str, bytes]:
    return {p: (dest / p).read_bytes() for p in FILES if (dest / p).exists()}


def write_docker_config(folder: Path, config: dict[str, object]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))


# -- the token flow ------------------------------------------------------------------------------


def test_anonymous_bearer_token_flow(proxy, pushed, tmp_path):
    proxy.faults.require_token = True
    pull(source(proxy), tmp_path / "d")
    assert published(tmp_path / "d") == FILES
    assert len(proxy.token_requests) == 1  # one token for the manifest and every blob
    assert "Authorization" not in proxy.token_requests[0]  # anonymous
    assert all(h.get("Authorization", "").startswith("Bearer ") for _, h in proxy.blob_gets())


def test_docker_config_basic_credentials_get_the_token(proxy, pushed, tmp_path, no_docker_config):
    proxy.faults.require_token = True
    proxy.faults.token_user = ("alice", "s3cret")
    with pytest.raises(AccessDeniedError, match="token"):
        pull(source(proxy), tmp_path / "anon")
    auth = base64.b64encode(b"alice:s3cret").decode()
    write_docker_config(no_docker_config, {"auths": {proxy.host: {"auth": auth}}})
    pull(source(proxy), tmp_path / "d")
    assert published(tmp_path / "d") == FILES


def test_a_credential_helper_is_asked_when_the_config_names_it(
    proxy, pushed, tmp_path, no_docker_config, monkeypatch
):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    helper = bindir / "docker-credential-fake"
    helper.write_text(
        "#!/bin/sh\nread host\n"
        f'[ "$host" = "{proxy.host}" ] || exit 1\n'
        'echo \'{"Username": "alice", "Secret": "s3cret"}\'\n'
    )
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    write_docker_config(no_docker_config, {"credHelpers": {proxy.host: "fake"}})
    proxy.faults.require_token = True
    proxy.faults.token_user = ("alice", "s3cret")
    pull(source(proxy), tmp_path / "d")
    assert published(tmp_path / "d") == FILES
    # credsStore too, and a helper that is not installed means anonymous
    write_docker_config(no_docker_config, {"credsStore": "fake"})
    creds = docker_credentials(proxy.host)
    assert creds is not None and creds.username == "alice"
    write_docker_config(no_docker_config, {"credsStore": "absent"})
    assert docker_credentials(proxy.host) is None


def test_a_token_expiring_mid_pull_is_fetched_again_once(proxy, pushed, tmp_path):
    proxy.faults.require_token = True
    src = source(proxy)
    spec = ModelSpec(source=src.uri)
    snapshot = src.resolve(spec)
    proxy.expire_tokens()  # every token issued so far is now refused
    sync(spec, src, PlainLayout(tmp_path / "d"), CONFIG, snapshot=snapshot)
    assert published(tmp_path / "d") == FILES
    assert 2 <= len(proxy.token_requests) <= 1 + CONFIG.concurrency


def test_a_token_endpoint_that_hangs_is_bounded(proxy, pushed, tmp_path):
    proxy.faults.require_token = True
    proxy.faults.token_hang = True
    t0 = time.monotonic()
    with pytest.raises(TransientSourceError, match="token"):
        pull(source(proxy, token_timeout=0.5, attempts=2), tmp_path / "d")
    assert time.monotonic() - t0 < 10


def test_challenge_parsing():
    kind, params = parse_challenge(
        'Bearer realm="https://auth.example/token",service="registry.example",'
        'scope="repository:a/b:pull,push"'
    )
    assert kind == "bearer"
    assert params == {
        "realm": "https://auth.example/token",
        "service": "registry.example",
        "scope": "repository:a/b:pull,push",
    }


# -- the bytes -----------------------------------------------------------------------------------


def test_blob_redirects_keep_the_range_and_drop_the_authorization(proxy, pushed, tmp_path):
    proxy.faults.require_token = True
    proxy.faults.redirect_blobs = True
    pull(source(proxy), tmp_path / "d")
    assert published(tmp_path / "d") == FILES
    assert proxy.storage_requests, "no blob went through the redirect"
    for _, headers in proxy.storage_requests:
        assert "Range" in headers
        assert "Authorization" not in headers


def test_429_with_retry_after_is_retried(proxy, pushed, tmp_path):
    proxy.faults.refuse_429 = 2
    pull(source(proxy), tmp_path / "d")
    assert published(tmp_path / "d") == FILES
    assert proxy.faults.refused == 2


def test_a_registry_that_ignores_range_is_refused_and_nothing_is_published(proxy, pushed, tmp_path):
    proxy.faults.ignore_range = True
    with pytest.raises(SourceChangedError, match="ignored the Range"):
        pull(source(proxy), tmp_path / "d")
    assert "model.safetensors" not in published(tmp_path / "d")


def test_a_one_chunk_blob_from_a_registry_that_ignores_range_is_fine(proxy, pushed, tmp_path):
    proxy.faults.ignore_range = True
    src = source(proxy)
    spec = ModelSpec(source=src.uri, include=("config.json",))
    sync(spec, src, PlainLayout(tmp_path / "d"), CONFIG)
    assert published(tmp_path / "d") == {"config.json": FILES["config.json"]}


@pytest.mark.slow
def test_kill_9_mid_pull_then_resume_fetches_only_what_was_in_flight(registry, tmp_path, test_ca):
    big = {"model.safetensors": os.urandom(16 * MiB)}
    registry.pusher().modelpack("models/big", "v1", big)
    proxy = RegistryProxy(registry.url, test_ca).start()
    try:
        proxy.faults.throttle_bps = 3 * MiB  # per connection: ~2.5 s for the lot at 2
        dest = tmp_path / "d"
        args = [sys.executable, "-m", "prefetch.cli", "pull", f"oci://{proxy.host}/models/big:v1",
                str(dest), "--json", "--concurrency", "2", "--chunk-size", "1MiB"]  # fmt: skip
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        partial = dest / ".prefetch" / "partial"
        kill_9_when(proc, lambda: journaled_bytes(partial) >= 10 * MiB, "pull", interval=0.005)
        proxy.faults.throttle_bps = 0
        second = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stderr
        summary = json.loads(second.stdout)
        assert summary["resumed_bytes"] >= 10 * MiB
        # only the chunks that were in flight (2 at most) and the ones never started
        assert summary["bytes_downloaded"] <= 16 * MiB - summary["resumed_bytes"]
        assert summary["bytes_downloaded"] < 0.5 * 16 * MiB
        assert (dest / "model.safetensors").read_bytes() == big["model.safetensors"]
    finally:
        proxy.stop()


def test_ecr_hosts_get_a_login_from_the_aws_credential_chain():
    import boto3
    from botocore.stub import Stubber

    from prefetch.sources.oci.auth import ecr_credentials, ecr_region

    host = "123456789012.dkr.ecr.eu-west-1.amazonaws.com"
    assert ecr_region(host) == "eu-west-1"
    assert ecr_region("ghcr.io") is None and ecr_credentials("ghcr.io") is None
    client = boto3.client("ecr", region_name="eu-west-1", aws_access_key_id="a",
                          aws_secret_access_key="b")  # fmt: skip
    with Stubber(client) as stub:
        token = base64.b64encode(b"AWS:ecr-password").decode()
        stub.add_response("get_authorization_token", {"authorizationData": [
            {"authorizationToken": token, "proxyEndpoint": f"https://{host}"}]})  # fmt: skip
        creds = ecr_credentials(host, client)
    assert creds is not None and (creds.username, creds.secret) == ("AWS", "ecr-password")
    assert "ecr-password" not in repr(creds)


def bcrypt_line(user: str, password: str) -> str | None:
    """An htpasswd line (bcrypt, which distribution requires), from libc's crypt."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import crypt
        except ImportError:
            return None
        hashed = crypt.crypt(
            password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16)
        )  # cheap: a test
    return f"{user}:{hashed}" if hashed and hashed.startswith("$2") else None


def test_a_registry_behind_htpasswd_takes_the_docker_login(tmp_path, no_docker_config, test_ca):
    line = bcrypt_line("alice", "s3cret")
    if line is None:
        pytest.skip("no bcrypt in libc's crypt")
    (tmp_path / "htpasswd").write_text(line + "\n")
    reg = Registry(tmp_path / "reg", test_ca, htpasswd=tmp_path / "htpasswd")
    reg.start()
    try:
        auth = base64.b64encode(b"alice:s3cret").decode()
        reg.pusher({"Authorization": f"Basic {auth}"}).modelpack("models/p", "v1", FILES)
        uri = f"oci://{reg.host}/models/p:v1"
        spec = ModelSpec(source=parse_source_uri(uri))
        http = urllib3.PoolManager(retries=False)
        src = OciSource(spec.source, http=http, retry=RetryPolicy(attempts=1))
        with pytest.raises(AccessDeniedError, match="asks for a login") as info:
            src.resolve(spec)
        assert info.value.hint is not None and "docker login" in info.value.hint
        write_docker_config(no_docker_config, {"auths": {f"https://{reg.host}": {"auth": auth}}})
        src = OciSource(spec.source, http=http, retry=RetryPolicy(attempts=1))
        sync(spec, src, PlainLayout(tmp_path / "d"), CONFIG)
        assert published(tmp_path / "d") == FILES
    finally:
        reg.stop()
