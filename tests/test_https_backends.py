"""Every backend over HTTPS with a private CA, end to end, and every TLS refusal in one line
(issue 28): the Hub (metadata, resolve, CDN redirects to another https host), S3 with static
keys (our SigV4 seam) and through botocore's credential chain (a profile whose ``ca_bundle``
names the CA), the S3 mirror writer and reader, OCI (token flow, manifests, blobs, redirects to
storage, registry mirrors, ``prefetch mirror ... oci://``), ``prefetch cache push`` and the
agent; then an untrusted certificate, one for another name, an expired one and a TLS handshake
to a plain-HTTP port, for the Hub, S3 and OCI.

The servers behind are the suite's plain ones (SeaweedFS, the Hub fake, docker-registry and the
fault-injecting registry front); :class:`TlsRelay` puts TLS in front of each, with the session CA's
certificate for ``<role>.prefetch.test`` (or a refused one). The push target is docker-registry
with its own TLS (``http.tls``): its upload URLs name the scheme it serves.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import select
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
import urllib3

from prefetch.demo.locals3 import SeaweedS3

from .fakes.hubserver import HubServer
from .fakes.oci_proxy import RegistryProxy
from .fakes.registry import Pusher, Registry, registry_binary
from .support import (
    HUB_REPO,
    AgentProcess,
    clean_env,
    config_text,
    put,
    run_cli,
    server_files,
    wait_for,
)
from .tls import TEST_HOSTS, TestCA

#: A relay's context that presents the session's certificate (see TlsRelay).
SESSION = "session"
#: Starts a relay in front of a port, presenting a context (None: plain; SESSION).
Relays = Callable[[int, ssl.SSLContext | str | None], "TlsRelay"]

# ---- a TLS front for a plain test server ----------------------------------------------------


class TlsRelay:
    """Accepts TLS on 127.0.0.1 (``context``: the certificate it presents; None: no TLS, a plain
    port) and relays the bytes to a plain server's port; ``accepted`` counts the connections it
    took (a retry loop shows there)."""

    def __init__(
        self, backend_port: int, context: ssl.SSLContext | str | None, test_ca: TestCA
    ) -> None:
        self._backend = ("127.0.0.1", backend_port)
        trust = test_ca.client_context()
        #: the suite's servers speak TLS themselves (tests/tls.py): a relay that presents the
        #: session's certificate (SESSION) then passes the TLS bytes through untouched, and one
        #: that presents another certificate, or none, speaks TLS to the server itself
        upstream_tls = _speaks_tls(self._backend, trust)
        self._passthrough = context == SESSION and upstream_tls
        self._context = test_ca.server_context() if context == SESSION else context
        self._upstream = trust if upstream_tls and not self._passthrough else None
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        try:
            tls = (
                conn
                if self._context is None or self._passthrough
                else self._context.wrap_socket(conn, server_side=True)
            )
        except (ssl.SSLError, OSError):
            conn.close()  # the client refused the certificate: what refusal tests provoke
            return
        try:
            up = socket.create_connection(self._backend, timeout=30)
            if self._upstream is not None:
                up = self._upstream.wrap_socket(up, server_hostname=self._backend[0])
        except (ssl.SSLError, OSError):
            tls.close()
            return
        _relay(tls, up)
        for s in (tls, up):
            with contextlib.suppress(OSError):
                s.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()


def _speaks_tls(backend: tuple[str, int], trust: ssl.SSLContext) -> bool:
    """Does the server at ``backend`` answer a TLS handshake (with a certificate ``trust``
    accepts for its address)?"""
    try:
        with (
            socket.create_connection(backend, timeout=10) as sock,
            trust.wrap_socket(sock, server_hostname=backend[0]),
        ):
            return True
    except (ssl.SSLError, OSError):
        return False


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side ends, in this one thread: an SSL socket read in
    one thread and written in another corrupts its records (OpenSSL's SSL object is not made
    for that), so one thread serves both directions, asking ``select`` which side has bytes
    and each SSL socket which bytes it already decrypted (``pending``)."""
    peer = {a: b, b: a}
    try:
        while True:
            ready = [s for s in (a, b) if isinstance(s, ssl.SSLSocket) and s.pending()]
            if not ready:
                ready, _, _ = select.select([a, b], [], [], 30)
                if not ready:
                    return  # idle for 30 s
            for src in ready:
                data = src.recv(256 * 1024)
                if not data:
                    return
                peer[src].sendall(data)
    except OSError:
        return


def _context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


@pytest.fixture
def relays(test_ca: TestCA) -> Iterator[Relays]:
    """Starts relays for one test and stops them after it."""
    started: list[TlsRelay] = []

    def start(port: int, context: ssl.SSLContext | str | None) -> TlsRelay:
        relay = TlsRelay(port, context, test_ca)
        started.append(relay)
        return relay

    yield start
    for relay in started:
        relay.stop()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


# ---- environments -----------------------------------------------------------------------------


def _env(work: Path, **extra: str) -> dict[str, str]:
    """A `prefetch` subprocess's environment: no CA variable of this machine's (a test names
    the one it means), no AWS settings beyond the ones given."""
    env = clean_env(work / "hf-home", **extra)
    for name in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "AWS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        if name not in extra:
            env.pop(name, None)
    env.setdefault("AWS_CONFIG_FILE", str(work / "no-aws-config"))
    env.setdefault("AWS_SHARED_CREDENTIALS_FILE", str(work / "no-aws-credentials"))
    return env


def _s3_env(server: SeaweedS3, work: Path, endpoint: str, **extra: str) -> dict[str, str]:
    keys = {**server.aws_env(work), "AWS_ENDPOINT_URL": endpoint, **extra}
    return _env(work, **keys)


def _profile_env(server: SeaweedS3, work: Path, endpoint: str, test_ca: TestCA) -> dict[str, str]:
    """Credentials, endpoint and CA bundle from an AWS profile only: botocore's chain lists."""
    keys = server.aws_env(work)
    config = work / "aws-config"
    config.write_text(
        f"[profile tls]\nregion = {keys['AWS_DEFAULT_REGION']}\n"
        f"ca_bundle = {test_ca.ca_file}\nendpoint_url = {endpoint}\n"
    )
    credentials = work / "aws-credentials"
    credentials.write_text(
        f"[tls]\naws_access_key_id = {keys['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {keys['AWS_SECRET_ACCESS_KEY']}\n"
    )
    return _env(
        work, AWS_PROFILE="tls", AWS_CONFIG_FILE=str(config),
        AWS_SHARED_CREDENTIALS_FILE=str(credentials),
    )  # fmt: skip


def _files_under(root: Path) -> dict[str, bytes]:
    """Every regular file under ``root`` (followed links included) by relative path, without
    the tool's own state."""
    out: dict[str, bytes] = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if ".prefetch" in rel.split("/") or not path.is_file():
            continue
        out[rel] = path.read_bytes()
    return out


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


# ---- the Hub over TLS ---------------------------------------------------------------------------


@pytest.fixture
def hub_tls(
    hub: HubServer, test_ca: TestCA, relays: Relays
) -> tuple[HubServer, TlsRelay, TlsRelay]:
    """The Hub fake behind TLS as ``hub.prefetch.test``, its CDN as ``cdn.prefetch.test``: the
    Hub's redirects name the https CDN, another host."""
    hub_relay = relays(_port(hub.endpoint), SESSION)
    cdn_relay = relays(_port(hub.cdn_endpoint), SESSION)
    hub.endpoint = test_ca.url(hub_relay.port, "hub")
    hub.cdn_endpoint = test_ca.url(cdn_relay.port, "cdn")
    return hub, hub_relay, cdn_relay


def test_a_hub_pull_over_https_trusts_the_ca_requests_ca_bundle_names(
    hub_tls: tuple[HubServer, TlsRelay, TlsRelay], test_ca: TestCA, tmp_path: Path
) -> None:
    hub, _, cdn_relay = hub_tls
    env = _env(tmp_path, HF_ENDPOINT=hub.endpoint, REQUESTS_CA_BUNDLE=str(test_ca.ca_file))
    dest = tmp_path / "cache"
    _ok(run_cli("pull", f"hf://{HUB_REPO}", str(dest), "--attempts", "3", env=env))
    snapshot = next((dest / "hub").glob("models--*/snapshots/*"))
    assert _files_under(snapshot) == server_files(hub)
    assert cdn_relay.accepted > 0  # the LFS files came from the https CDN
    assert any(r.port == "cdn" for r in hub.requests)


def test_the_ca_bundle_flag_alone_is_enough_and_a_bad_one_is_one_line(
    hub_tls: tuple[HubServer, TlsRelay, TlsRelay], test_ca: TestCA, tmp_path: Path
) -> None:
    hub, _, _ = hub_tls
    env = _env(tmp_path, HF_ENDPOINT=hub.endpoint)
    dest = tmp_path / "cache"
    args = ("pull", f"hf://{HUB_REPO}", str(dest), "--attempts", "3")
    _ok(run_cli(*args, "--ca-bundle", str(test_ca.ca_file), env=env))
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    for bundle in (tmp_path / "missing.pem", not_pem):
        proc = run_cli(*args, "--ca-bundle", str(bundle), env=env)
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert lines[0].startswith("Error: --ca-bundle: ") and str(bundle) in lines[0], lines
        assert "Traceback" not in proc.stderr
    proc = run_cli(*args, env={**env, "SSL_CERT_FILE": str(not_pem)})
    assert proc.returncode != 0
    assert proc.stderr.startswith(f"Error: SSL_CERT_FILE: the CA bundle {not_pem} ")


# ---- S3 over TLS --------------------------------------------------------------------------------


@pytest.fixture
def s3_tls(s3_server: SeaweedS3, test_ca: TestCA, relays: Relays) -> str:
    """The suite's SeaweedFS behind TLS: ``https://s3.prefetch.test:PORT``."""
    relay = relays(_port(s3_server.endpoint), SESSION)
    return test_ca.url(relay.port, "s3")


def _model(s3_client: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    files = {"config.json": b'{"a": 1}', "model.safetensors": os.urandom(3 << 20)}
    for name, data in files.items():
        put(s3_client, bucket, f"{prefix}{name}", data)
    return files


@pytest.mark.parametrize("variable", ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "AWS_CA_BUNDLE"])
def test_s3_with_static_keys_over_https_on_the_seam(
    variable: str, s3_server: SeaweedS3, s3_client: Any, bucket: str, s3_tls: str,
    test_ca: TestCA, tmp_path: Path,
) -> None:  # fmt: skip
    """Each variable alone is trusted by the listing and the GETs (on the seam: no botocore)."""
    files = _model(s3_client, bucket, "m/")
    env = _s3_env(s3_server, tmp_path, s3_tls, **{variable: str(test_ca.ca_file)})
    dest = tmp_path / "out"
    _ok(run_cli("pull", f"s3://{bucket}/m/", str(dest), "--attempts", "3", env=env))
    assert _files_under(dest) == files


def test_s3_through_a_profile_and_its_ca_bundle_goes_through_botocores_chain(
    s3_server: SeaweedS3, s3_client: Any, bucket: str, s3_tls: str, test_ca: TestCA,
    tmp_path: Path,
) -> None:  # fmt: skip
    files = _model(s3_client, bucket, "m/")
    env = _profile_env(s3_server, tmp_path, s3_tls, test_ca)
    dest = tmp_path / "out"
    _ok(run_cli("pull", f"s3://{bucket}/m/", str(dest), "--attempts", "3", env=env))
    assert _files_under(dest) == files


def test_the_mirror_writer_and_reader_and_cache_push_over_https(
    s3_server: SeaweedS3, s3_client: Any, bucket: str, s3_tls: str,
    hub_tls: tuple[HubServer, TlsRelay, TlsRelay], test_ca: TestCA, tmp_path: Path,
) -> None:  # fmt: skip
    hub, _, _ = hub_tls
    env = _s3_env(s3_server, tmp_path, s3_tls, HF_ENDPOINT=hub.endpoint)
    ca = ("--ca-bundle", str(test_ca.ca_file))
    mirror = f"s3://{bucket}/hf/{HUB_REPO}/"
    _ok(run_cli("mirror", f"hf://{HUB_REPO}", mirror, *ca, "--attempts", "3", env=env))
    hub_requests = len(hub.requests)
    dest = tmp_path / "cache"
    _ok(run_cli("pull", mirror, str(dest), *ca, "--attempts", "3", env=env))
    snapshot = next((dest / "hub").glob("models--*/snapshots/*"))
    assert _files_under(snapshot) == server_files(hub)
    assert len(hub.requests) == hub_requests  # read from the mirror alone
    built = tmp_path / "compile-cache"
    (built / "torch").mkdir(parents=True)
    (built / "torch" / "kernel.bin").write_bytes(b"k" * 1000)
    (built / ".cache_ready").write_text("")
    target = f"s3://{bucket}/cc/key1/"
    # botocore alone ignores REQUESTS_CA_BUNDLE: it is told the bundle the rule chose
    env_only = {**env, "REQUESTS_CA_BUNDLE": str(test_ca.ca_file)}
    _ok(run_cli("cache", "push", str(built), target, "--settle", "0", env=env_only))
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix="cc/")["Contents"]]
    assert any(k.endswith("torch/kernel.bin") for k in keys), keys


# ---- OCI over TLS -------------------------------------------------------------------------------


@pytest.fixture
def registry_front(registry: Registry) -> Iterator[RegistryProxy]:
    proxy = RegistryProxy(registry.url).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def test_oci_over_https_token_flow_redirects_and_a_registry_mirror(
    registry: Registry, registry_front: RegistryProxy, test_ca: TestCA,
    relays: Relays, tmp_path: Path,
) -> None:  # fmt: skip
    files = {"config.json": b"{}", "model.safetensors": os.urandom(1 << 20)}
    Pusher(registry.url).modelpack("org/tls", "v1", files)
    front = relays(_port(registry_front.url), SESSION)
    storage = relays(_port(registry_front.storage_url), SESSION)
    registry_front.url = test_ca.url(front.port, "registry")  # the token realm: https too
    registry_front.storage_url = test_ca.url(storage.port, "cdn")
    registry_front.faults.require_token = True
    registry_front.faults.redirect_blobs = True
    env = _env(tmp_path, SSL_CERT_FILE=str(test_ca.ca_file))
    origin = f"registry.prefetch.test:{front.port}" if test_ca.host != "127.0.0.1" else None
    if origin is None:
        pytest.skip("the prefetch.test names do not resolve here (127.0.0.1 is plain HTTP)")
    dest = tmp_path / "out"
    _ok(run_cli("pull", f"oci://{origin}/org/tls:v1", str(dest), "--attempts", "3", env=env))
    assert _files_under(dest) == files
    assert registry_front.token_requests and registry_front.storage_requests
    # a registry mirror in front: asked first, over https too
    mirror = relays(registry.port, SESSION)
    asked = len(registry_front.requests)
    dest2 = tmp_path / "out2"
    _ok(run_cli("pull", f"oci://{origin}/org/tls:v1", str(dest2), "--attempts", "3",
                "--mirror", f"oci://mirror.prefetch.test:{mirror.port}", env=env))  # fmt: skip
    assert _files_under(dest2) == files
    assert mirror.accepted > 0
    assert not [p for p, _ in registry_front.requests[asked:] if "/blobs/" in p]


class TlsRegistry(Registry):
    """docker-registry serving TLS itself (``http.tls``) as ``registry.prefetch.test``: a push
    follows the upload URLs it builds, which name the scheme it serves."""

    def __init__(self, root: Path, test_ca: TestCA) -> None:
        super().__init__(root)
        text = self.config.read_text()
        tls = f"  tls:\n    certificate: {test_ca.cert_file}\n    key: {test_ca.key_file}\n"
        addr = f"  addr: 127.0.0.1:{self.port}\n"
        self.config.write_text(text.replace(addr, addr + tls))
        self.host = f"{test_ca.host_for('registry')}:{self.port}"
        self.url = f"https://{self.host}"
        self._ca = test_ca

    def start(self) -> None:
        binary = registry_binary()
        assert binary is not None
        log = (self.root / "registry.log").open("ab")
        self._proc = subprocess.Popen([binary, "serve", str(self.config)], stdout=log, stderr=log)
        http = urllib3.PoolManager(ssl_context=self._ca.client_context())

        def up() -> bool:
            with contextlib.suppress(urllib3.exceptions.HTTPError):
                return http.request("GET", f"{self.url}/v2/", retries=False).status == 200
            return False

        wait_for(up, "docker-registry over TLS", timeout=15)


def test_prefetch_mirror_pushes_to_a_registry_over_https(
    hub_tls: tuple[HubServer, TlsRelay, TlsRelay], test_ca: TestCA, tmp_path: Path
) -> None:
    if registry_binary() is None:
        pytest.skip("docker-registry is not installed")
    if test_ca.host == "127.0.0.1":
        pytest.skip("the prefetch.test names do not resolve here (127.0.0.1 is plain HTTP)")
    hub, _, _ = hub_tls
    reg = TlsRegistry(tmp_path / "registry", test_ca)
    reg.start()
    try:
        env = _env(tmp_path, HF_ENDPOINT=hub.endpoint, AWS_CA_BUNDLE=str(test_ca.ca_file))
        target = f"oci://{reg.host}/org/pushed:v1"
        _ok(run_cli("mirror", f"hf://{HUB_REPO}", target, "--attempts", "3", env=env))
        dest = tmp_path / "out"
        _ok(run_cli("pull", target, str(dest), "--hf-repo", HUB_REPO, "--attempts", "3",
                    env=env))  # fmt: skip
        snapshot = next((dest / "hub").glob("models--*/snapshots/*"))
        assert _files_under(snapshot) == server_files(hub)
    finally:
        reg.stop()


# ---- the agent ------------------------------------------------------------------------------


def test_the_agent_syncs_over_https_with_the_configs_ca_bundle(
    hub_tls: tuple[HubServer, TlsRelay, TlsRelay], test_ca: TestCA, tmp_path: Path
) -> None:
    hub, _, _ = hub_tls
    cache = tmp_path / "cache"
    config = tmp_path / "agent.yaml"
    models = [{"name": "tiny", "source": f"hf://{HUB_REPO}"}]
    config.write_text(config_text(cache, models, caBundle=str(test_ca.ca_file)))
    agent = AgentProcess(config, _env(tmp_path, HF_ENDPOINT=hub.endpoint), tmp_path / "agent.log")
    try:
        body = agent.ready_then_terminated()
    finally:
        agent.stop()
    assert body["models"][0]["state"] == "ready"
    snapshot = next((cache / "hub").glob("models--*/snapshots/*"))
    assert _files_under(snapshot) == server_files(hub)


# ---- refusals -------------------------------------------------------------------------------

REFUSALS = ("other-ca", "other-name", "expired", "plain-http")


def _refused_context(test_ca: TestCA, case: str) -> ssl.SSLContext | None:
    """The TLS a refused server speaks: a certificate of another CA, for another name, expired,
    or none at all (plain HTTP)."""
    hosts = [*TEST_HOSTS, "127.0.0.1"]
    if case == "plain-http":
        return None
    if case == "other-ca":
        cert, key = test_ca.issue("other-ca", hosts, ca=trustme.CA())
    elif case == "other-name":
        cert, key = test_ca.issue("other-name", ["elsewhere.example"])
    else:
        past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)
        cert, key = test_ca.issue("expired", hosts, not_after=past)
    return _context(cert, key)


_REASONS = {
    "other-ca": "certificate verify failed: unable to get local issuer certificate",
    "other-name": "certificate verify failed: Hostname mismatch",
    "expired": "certificate verify failed: certificate has expired",
    "plain-http": "TLS handshake failed",
}


def _refusal_target(
    case: str, plain_port: int, test_ca: TestCA,
    relays: Relays,
) -> tuple[int, TlsRelay]:  # fmt: skip
    """The relay a refused pull goes to, in front of the plain server (the port, the relay)."""
    relay = relays(plain_port, _refused_context(test_ca, case))
    return relay.port, relay


def _check_refusal(
    proc: subprocess.CompletedProcess[str], case: str, host: str, dest: Path,
    relay: TlsRelay, seconds: float,
) -> None:  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line]
    assert len(lines) == 2, lines
    error, hint = lines
    assert error.startswith("Error: ") and host in error and _REASONS[case] in error, error
    assert hint.startswith("Hint: ") and "--ca-bundle" in hint, hint
    assert _files_under(dest) == {} if dest.exists() else True
    assert 1 <= relay.accepted <= 2, relay.accepted  # no retry loop (default: 6 attempts)
    assert seconds < 30  # generous: it fails in about a second


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_hub_certificate_is_one_line_and_no_retry(
    case: str, hub: HubServer, test_ca: TestCA,
    relays: Relays, tmp_path: Path,
) -> None:  # fmt: skip
    port, relay = _refusal_target(case, _port(hub.endpoint), test_ca, relays)
    endpoint = test_ca.url(port, "hub")
    env = _env(tmp_path, HF_ENDPOINT=endpoint, SSL_CERT_FILE=str(test_ca.ca_file))
    dest = tmp_path / "cache"
    t0 = time.monotonic()
    proc = run_cli("pull", f"hf://{HUB_REPO}", str(dest), env=env)
    _check_refusal(proc, case, endpoint.split("//")[1], dest, relay, time.monotonic() - t0)


def test_a_refusal_says_which_bundle_this_run_trusted_and_where_it_came_from(
    hub_tls: tuple[HubServer, TlsRelay, TlsRelay], test_ca: TestCA, tmp_path: Path
) -> None:
    """A REQUESTS_CA_BUNDLE set for other tools (many images name the system store with it)
    comes before the SSL_CERT_FILE a user just set: the refusal's hint says which file was
    trusted, and from where."""
    hub, _, _ = hub_tls
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    env = _env(
        tmp_path, HF_ENDPOINT=hub.endpoint, REQUESTS_CA_BUNDLE=str(other),
        SSL_CERT_FILE=str(test_ca.ca_file),
    )  # fmt: skip
    proc = run_cli("pull", f"hf://{HUB_REPO}", str(tmp_path / "a"), env=env)
    assert proc.returncode == 1
    hint = proc.stderr.strip().splitlines()[-1]
    assert (
        hint.startswith("Hint: ") and f"this run trusted {other}, from REQUESTS_CA_BUNDLE" in hint
    )
    flag = ("--ca-bundle", str(other))
    proc = run_cli(
        "pull",
        f"hf://{HUB_REPO}",
        str(tmp_path / "b"),
        *flag,
        env=_env(tmp_path, HF_ENDPOINT=hub.endpoint),
    )
    assert proc.returncode == 1
    assert f"this run trusted {other}, from --ca-bundle" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_s3_certificate_is_one_line_and_no_retry(
    case: str, s3_server: SeaweedS3, s3_client: Any, bucket: str, test_ca: TestCA,
    relays: Relays, tmp_path: Path,
) -> None:  # fmt: skip
    _model(s3_client, bucket, "m/")
    port, relay = _refusal_target(case, _port(s3_server.endpoint), test_ca, relays)
    endpoint = test_ca.url(port, "s3")
    env = _s3_env(s3_server, tmp_path, endpoint, AWS_CA_BUNDLE=str(test_ca.ca_file))
    dest = tmp_path / "out"
    t0 = time.monotonic()
    proc = run_cli("pull", f"s3://{bucket}/m/", str(dest), env=env)
    _check_refusal(proc, case, endpoint.split("//")[1], dest, relay, time.monotonic() - t0)


def test_a_refused_certificate_through_botocores_chain_is_one_line_too(
    s3_server: SeaweedS3, s3_client: Any, bucket: str, test_ca: TestCA,
    relays: Relays, tmp_path: Path,
) -> None:  # fmt: skip
    _model(s3_client, bucket, "m/")
    port, relay = _refusal_target("other-ca", _port(s3_server.endpoint), test_ca, relays)
    endpoint = test_ca.url(port, "s3")
    env = _profile_env(s3_server, tmp_path, endpoint, test_ca)
    dest = tmp_path / "out"
    t0 = time.monotonic()
    proc = run_cli("pull", f"s3://{bucket}/m/", str(dest), env=env)
    _check_refusal(proc, "other-ca", endpoint.split("//")[1], dest, relay, time.monotonic() - t0)


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_registry_certificate_is_one_line_and_no_retry(
    case: str, registry: Registry, test_ca: TestCA,
    relays: Relays, tmp_path: Path,
) -> None:  # fmt: skip
    if test_ca.host == "127.0.0.1":
        pytest.skip("the prefetch.test names do not resolve here (127.0.0.1 is plain HTTP)")
    Pusher(registry.url).modelpack("org/refused", "v1", {"config.json": b"{}"})
    port, relay = _refusal_target(case, registry.port, test_ca, relays)
    host = f"{test_ca.host_for('registry')}:{port}"
    env = _env(tmp_path, SSL_CERT_FILE=str(test_ca.ca_file))
    dest = tmp_path / "out"
    t0 = time.monotonic()
    proc = run_cli("pull", f"oci://{host}/org/refused:v1", str(dest), env=env)
    _check_refusal(proc, case, host, dest, relay, time.monotonic() - t0)


def test_the_agent_reports_a_refused_certificate_as_its_own_reason(
    hub: HubServer, test_ca: TestCA, relays: Relays,
    tmp_path: Path,
) -> None:  # fmt: skip
    relay = relays(_port(hub.endpoint), _refused_context(test_ca, "other-ca"))
    cache = tmp_path / "cache"
    config = tmp_path / "agent.yaml"
    models = [{"name": "tiny", "source": f"hf://{HUB_REPO}", "caBundle": str(test_ca.ca_file)}]
    config.write_text(config_text(cache, models))
    env = _env(tmp_path, HF_ENDPOINT=test_ca.url(relay.port, "hub"))
    agent = AgentProcess(config, env, tmp_path / "agent.log")
    try:

        def failed() -> dict[str, Any] | None:
            if not agent.up():
                return None
            status, body = agent.get("/readyz")
            doc = json.loads(body)
            model = next(iter(doc.get("models", [])), {})
            return doc if status != 200 and model.get("error_reason") == "tls" else None

        doc = wait_for(failed, "the sync to fail with reason tls", timeout=60)
        assert "certificate verify failed" in json.dumps(doc)
    finally:
        agent.stop()


# ---- the trust rule and its config keys -------------------------------------------------------


def test_the_ca_bundle_order_is_flag_then_variables_then_profile_then_system(
    test_ca: TestCA, tmp_path: Path
) -> None:
    from prefetch.support.settings import ca_bundle

    pems = {}
    for name in ("flag", "requests", "ssl", "aws", "profile"):
        pems[name] = tmp_path / f"{name}.pem"
        pems[name].write_bytes(test_ca.ca_file.read_bytes())
    config = tmp_path / "aws-config"
    config.write_text(f"[profile p]\nca_bundle = {pems['profile']}\n")
    env = {
        "REQUESTS_CA_BUNDLE": str(pems["requests"]),
        "SSL_CERT_FILE": str(pems["ssl"]),
        "AWS_CA_BUNDLE": str(pems["aws"]),
        "AWS_CONFIG_FILE": str(config),
        "AWS_PROFILE": "p",
    }
    chosen = ca_bundle(str(pems["flag"]), origin="--ca-bundle", environ=env)
    assert (chosen.path, chosen.origin) == (str(pems["flag"]), "--ca-bundle")
    for name, variable in (
        ("requests", "REQUESTS_CA_BUNDLE"), ("ssl", "SSL_CERT_FILE"), ("aws", "AWS_CA_BUNDLE")
    ):  # fmt: skip
        assert ca_bundle(environ=env).path == str(pems[name])
        del env[variable]
    assert ca_bundle(environ=env).path == str(pems["profile"])
    del env["AWS_PROFILE"]
    assert ca_bundle(environ=env).path is None  # the system's store


def test_a_variable_naming_the_public_store_gives_way_to_a_private_ca(
    test_ca: TestCA, tmp_path: Path
) -> None:
    """Images often set REQUESTS_CA_BUNDLE (or SSL_CERT_FILE) to the public store for every
    tool: that chooses nothing, so the private CA a user names in a later variable or the AWS
    profile is the one trusted; alone, the public store is still what the run is given."""
    import certifi

    from prefetch.support.settings import ca_bundle

    public = certifi.where()
    private = str(test_ca.ca_file)
    env = {"REQUESTS_CA_BUNDLE": public, "SSL_CERT_FILE": private}
    assert (ca_bundle(environ=env).path, ca_bundle(environ=env).origin) == (
        private, "SSL_CERT_FILE"
    )  # fmt: skip
    env = {"SSL_CERT_FILE": public, "AWS_CA_BUNDLE": private}
    assert ca_bundle(environ=env).path == private
    config = tmp_path / "aws-config"
    config.write_text(f"[profile p]\nca_bundle = {private}\n")
    env = {"REQUESTS_CA_BUNDLE": public, "AWS_CONFIG_FILE": str(config), "AWS_PROFILE": "p"}
    assert ca_bundle(environ=env).path == private
    assert ca_bundle(environ={"REQUESTS_CA_BUNDLE": public}).path == public
    assert ca_bundle(public, environ={"SSL_CERT_FILE": private}).path == public  # a flag: as is


def test_a_variable_naming_the_public_store_is_not_parsed_at_start_up(
    test_ca: TestCA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The public store a variable names is the system's own file, like the default store: it
    is checked to exist, not parsed (its ~140 certificates were ~35 ms of every pull's
    start-up, issue 33); a private bundle is still parsed, with its one-line error."""
    import certifi

    from prefetch.support import settings
    from prefetch.support.errors import ConfigError

    parsed: list[str] = []
    check = settings.check_ca_bundle

    def counted(path: str, origin: str) -> str:
        parsed.append(path)
        return check(path, origin)

    monkeypatch.setattr(settings, "check_ca_bundle", counted)
    public = certifi.where()
    assert settings.ca_bundle(environ={"REQUESTS_CA_BUNDLE": public}).path == public
    assert parsed == []
    private = str(test_ca.ca_file)
    assert settings.ca_bundle(environ={"REQUESTS_CA_BUNDLE": public, "SSL_CERT_FILE": private})
    assert parsed == [private]
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(ConfigError, match=r"SSL_CERT_FILE: the CA bundle .* is not a PEM file"):
        settings.ca_bundle(environ={"REQUESTS_CA_BUNDLE": public, "SSL_CERT_FILE": str(not_pem)})
    missing = str(tmp_path / "gone.pem")  # a public store that is not there is still an error
    monkeypatch.setattr(settings, "public_stores", lambda: frozenset({missing}))
    with pytest.raises(ConfigError, match=r"REQUESTS_CA_BUNDLE: the CA bundle .* does not exist"):
        settings.ca_bundle(environ={"REQUESTS_CA_BUNDLE": missing})


def test_a_hub_pull_trusts_ssl_cert_file_beside_a_public_requests_ca_bundle(
    hub_tls: tuple[HubServer, TlsRelay, TlsRelay], test_ca: TestCA, tmp_path: Path
) -> None:
    """The issue's own command, on a machine whose environment names the public store."""
    import certifi

    hub, _, _ = hub_tls
    env = _env(
        tmp_path, HF_ENDPOINT=hub.endpoint, REQUESTS_CA_BUNDLE=certifi.where(),
        SSL_CERT_FILE=str(test_ca.ca_file),
    )  # fmt: skip
    _ok(run_cli("pull", f"hf://{HUB_REPO}", str(tmp_path / "d"), "--attempts", "3", env=env))


def test_the_agents_ca_bundle_keys_are_checked_when_the_config_loads(
    test_ca: TestCA, tmp_path: Path
) -> None:
    from prefetch.agent.config import parse_config
    from prefetch.support.errors import ConfigError

    ca = str(test_ca.ca_file)
    model = {"name": "tiny", "source": f"hf://{HUB_REPO}"}
    text = config_text(tmp_path, [model, {**model, "name": "own", "source": "hf://o/n",
                                          "caBundle": ca}], caBundle=ca)  # fmt: skip
    config = parse_config(text)
    assert config.ca_bundle == ca
    assert [m.ca_bundle for m in config.models] == [None, ca]  # the top-level one: the opener's
    missing = tmp_path / "missing.pem"
    with pytest.raises(ConfigError, match=r"^models\[0\]\.caBundle: the CA bundle .*missing\.pem"):
        parse_config(config_text(tmp_path, [{**model, "caBundle": str(missing)}]))
    with pytest.raises(ConfigError, match=r"^caBundle: the CA bundle .*missing\.pem"):
        parse_config(config_text(tmp_path, [model], caBundle=str(missing)))
