"""Hostile review, issue 22: a proxy URL with credentials. They are sent as Proxy-Authorization
on the Hub and static-key S3 paths, never printed (errors, -vv, --json), and a proxy refusing
the tunnel is one clear error line."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .fakes.forward_proxy import ForwardProxy, _Handler
from .fakes.hubserver import HubServer
from .support import HUB_REPO, clean_env, free_port, run_cli, upload
from .tls import TestCA

USER, PASSWORD = "alice", "pr0xy-S3cret!pw"
EXPECTED = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


class _AuthHandler(_Handler):
    """The forward proxy, answering 407 to anything without the right Proxy-Authorization."""

    def _authorized(self) -> bool:
        sent = self.headers.get("Proxy-Authorization")
        self.server.proxy.count(f"auth:{sent == EXPECTED}", "AUTH")
        if sent == EXPECTED:
            return True
        self.send_response(407)
        self.send_header("Proxy-Authenticate", 'Basic realm="test"')
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        return False

    def _forward(self) -> None:
        if self._authorized():
            super()._forward()

    def do_CONNECT(self) -> None:
        if self._authorized():
            super().do_CONNECT()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


class _RefusingHandler(_Handler):
    """A proxy that refuses every tunnel (403) and every request."""

    def do_CONNECT(self) -> None:
        self._refuse(403, "tunnels forbidden here")

    def _forward(self) -> None:
        self._refuse(403, "forbidden here")

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


@pytest.fixture
def auth_proxy() -> Iterator[ForwardProxy]:
    proxy = ForwardProxy()
    proxy._server.RequestHandlerClass = _AuthHandler
    with proxy:
        yield proxy


def with_credentials(url: str) -> str:
    return url.replace("http://", f"http://{USER}:{PASSWORD.replace('!', '%21')}@")


def assert_no_password(*outputs: str) -> None:
    for out in outputs:
        assert PASSWORD not in out and "pr0xy" not in out
        assert EXPECTED.split()[1] not in out


def test_the_hub_path_sends_the_proxy_credentials(
    auth_proxy: ForwardProxy, model_dir: Path, tmp_path: Path, test_ca: TestCA
) -> None:
    with HubServer(test_ca) as hub:
        hub.add_commit(HUB_REPO, model_dir)
        env = clean_env(tmp_path / "hf", HF_ENDPOINT=hub.endpoint)
        env["HTTP_PROXY"] = env["HTTPS_PROXY"] = with_credentials(auth_proxy.url)
        env["NO_PROXY"] = ""  # the servers are on 127.0.0.1: through the proxy all the same
        dest = tmp_path / "d"
        proc = run_cli("-vv", "pull", f"hf://{HUB_REPO}", str(dest), "--json", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert auth_proxy.requests["auth:True"] > 0 and auth_proxy.requests["auth:False"] == 0
    assert auth_proxy.through(hub.endpoint) > 0
    assert_no_password(proc.stdout, proc.stderr)


def test_the_static_key_s3_path_sends_the_proxy_credentials(
    auth_proxy: ForwardProxy, s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    upload(s3_client, bucket, "m", tmp_path, 256 * 1024)
    env = {k: v for k, v in s3_env.items() if "proxy" not in k.lower()}
    env["HTTP_PROXY"] = env["HTTPS_PROXY"] = with_credentials(auth_proxy.url)
    env["NO_PROXY"] = ""
    proc = run_cli("-vv", "pull", f"s3://{bucket}/m", str(tmp_path / "d"), "--json", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert auth_proxy.requests["auth:True"] > 0 and auth_proxy.requests["auth:False"] == 0
    assert_no_password(proc.stdout, proc.stderr)


def test_wrong_proxy_credentials_are_one_error_line_without_them(
    auth_proxy: ForwardProxy, model_dir: Path, tmp_path: Path, test_ca: TestCA
) -> None:
    with HubServer(test_ca) as hub:
        hub.add_commit(HUB_REPO, model_dir)
        env = clean_env(tmp_path / "hf", HF_ENDPOINT=hub.endpoint)
        wrong = auth_proxy.url.replace("http://", f"http://{USER}:wrong-{PASSWORD}@")
        env["HTTP_PROXY"] = env["HTTPS_PROXY"] = wrong
        env["NO_PROXY"] = ""
        proc = run_cli("pull", f"hf://{HUB_REPO}", str(tmp_path / "d"), "--attempts", "1",
                       env=env)  # fmt: skip
    assert proc.returncode == 1
    first = proc.stderr.splitlines()[0]
    assert first.startswith("Error: ") and "407" in first, proc.stderr
    assert "407: 407" not in first
    assert "Traceback" not in proc.stderr
    assert_no_password(proc.stdout, proc.stderr)


def test_a_proxy_refusing_connect_is_one_clear_error(tmp_path: Path) -> None:
    proxy = ForwardProxy()
    proxy._server.RequestHandlerClass = _RefusingHandler
    with proxy:
        env = clean_env(tmp_path / "hf", HF_ENDPOINT="https://hub.invalid")
        env["HTTPS_PROXY"] = with_credentials(proxy.url)
        env["NO_PROXY"] = ""
        proc = run_cli("pull", "hf://acme/x", str(tmp_path / "d"), "--attempts", "1", env=env)
    assert proc.returncode == 1
    first = proc.stderr.splitlines()[0]
    assert first.startswith("Error: ")
    assert "the proxy refused the connection (Tunnel connection failed: 403" in first, first
    assert "Unable to connect to proxy" not in first and "OSError" not in first
    assert "Traceback" not in proc.stderr
    assert_no_password(proc.stdout, proc.stderr)


def test_a_proxy_nobody_answers_is_named_by_host_and_port_with_a_proxy_hint(
    tmp_path: Path,
) -> None:
    """No private class name (urllib3's connection repr) and never the password: the proxy's
    host and port, the reason, and a hint about the proxy settings."""
    port = free_port()  # nothing listens there
    env = clean_env(tmp_path / "hf", HF_ENDPOINT="https://hub.invalid")
    env["HTTPS_PROXY"] = with_credentials(f"http://127.0.0.1:{port}")
    env["NO_PROXY"] = ""
    proc = run_cli("pull", "hf://acme/x", str(tmp_path / "d"), "--attempts", "1", env=env)
    assert proc.returncode == 1
    error, hint = proc.stderr.splitlines()
    assert error.endswith(
        f": cannot connect to the proxy 127.0.0.1:{port} "
        "(Failed to establish a new connection: [Errno 111] Connection refused)"
    ), error
    assert "Connection(" not in error
    assert hint.startswith("Hint: check HTTPS_PROXY / HTTP_PROXY"), hint
    assert_no_password(proc.stdout, proc.stderr)


def test_an_https_proxy_url_for_a_plain_proxy_names_the_proxy(tmp_path: Path) -> None:
    """TLS to the proxy itself fails (its port speaks plain HTTP): the error names the proxy,
    not the target, and never its password."""
    with ForwardProxy() as proxy:
        env = clean_env(tmp_path / "hf", HF_ENDPOINT="https://hub.invalid")
        url = with_credentials(proxy.url).replace("http://", "https://")
        env["HTTPS_PROXY"] = url
        env["NO_PROXY"] = ""
        proc = run_cli("pull", "hf://acme/x", str(tmp_path / "d"), "--attempts", "1", env=env)
    assert proc.returncode == 1
    error = proc.stderr.splitlines()[0]
    port = proxy.url.rsplit(":", 1)[1]
    assert f": the proxy https://127.0.0.1:{port}: TLS handshake failed: " in error, error
    assert "Traceback" not in proc.stderr
    assert_no_password(proc.stdout, proc.stderr)


def test_wrong_proxy_credentials_on_the_s3_path_are_one_clear_error_line(
    auth_proxy: ForwardProxy, s3_server: Any, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    env = {k: v for k, v in s3_env.items() if "proxy" not in k.lower()}
    wrong = auth_proxy.url.replace("http://", f"http://{USER}:wrong-{PASSWORD}@")
    env["HTTP_PROXY"] = env["HTTPS_PROXY"] = wrong
    env["NO_PROXY"] = ""
    proc = run_cli("pull", "s3://bkt/m", str(tmp_path / "d"), "--attempts", "1", env=env)
    assert proc.returncode == 1
    first = proc.stderr.splitlines()[0]
    assert first.startswith("Error: listing s3://bkt/m"), first
    # S3 is HTTPS: the proxy refuses the CONNECT (the request itself never reaches it)
    assert "407 Proxy Authentication Required" in first and "credentials" in first, first
    assert "Traceback" not in proc.stderr
    assert_no_password(proc.stdout, proc.stderr)


class _BadHeaderHub:
    """Answers every GET with a malformed header line placed before Content-Length, and keeps
    the connection open (the body, as http.client would read it, never ends)."""

    def __enter__(self) -> str:
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.stop = threading.Event()

        def serve() -> None:
            conns = []
            while not self.stop.is_set():
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                conn.recv(65536)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"this line has no colon\r\nContent-Length: 2\r\n\r\n{}"
                )
                conns.append(conn)  # held open

        threading.Thread(target=serve, daemon=True).start()
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.sock.close()


def test_a_malformed_header_line_is_one_error_line_without_waiting(tmp_path: Path) -> None:
    import time

    with _BadHeaderHub() as endpoint:
        started = time.monotonic()
        proc = run_cli("pull", "hf://acme/x", str(tmp_path / "d"), "--endpoint", endpoint,
                       env=clean_env(tmp_path / "hf"), timeout=40)  # fmt: skip
        took = time.monotonic() - started
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "HeaderParsingError" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "has a malformed header line" in errors[0], proc.stderr
    assert took < 20, took
