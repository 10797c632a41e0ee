"""The agent's HTTP server against real sockets on 127.0.0.1: clients that leave early, idle
clients, too many clients; every line it writes is JSON, and its threads stay bounded."""

from __future__ import annotations

import functools
import io
import json
import logging
import socket
import struct
import threading
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from prefetch.agent.server import HealthServer
from prefetch.support.logjson import JsonFormatter, setup_logging

from . import support

wait_for = functools.partial(support.wait_for, timeout=20.0, interval=0.02)
"""Connection counts change fast: poll often."""


def slow_health() -> tuple[int, str]:
    time.sleep(0.2)  # long enough for the client's reset to arrive before the answer
    return 200, "ok"


def make_server(health: Callable[[], tuple[int, str]] = lambda: (200, "ok"), **kw: Any) -> Any:
    registry = CollectorRegistry()
    Counter("model_prefetch_test_total", "a sample", registry=registry).inc()
    return HealthServer(
        "127.0.0.1:0",
        health=health,
        ready=lambda: (503, {"ready": False}),
        registry=registry,
        **kw,
    ).start()


@pytest.fixture
def json_stderr() -> Iterator[None]:
    """Log records at debug level as JSON on (the captured) stderr, as the agent does."""
    handler = logging.StreamHandler()  # sys.stderr at this moment: the capture
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a client that gives up does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def exchange(sock: socket.socket, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one request, read one response (status, headers, body) on a kept-alive socket."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before the response ended: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    length = 0 if request.startswith(b"HEAD") else int(headers["content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed the connection (reads end of stream, or a reset)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_clients_that_hang_up_early_put_no_raw_line_on_stderr(
    json_stderr: None, capfd: pytest.CaptureFixture[str]
) -> None:
    server = make_server(slow_health)
    try:
        for _ in range(5):
            for request in (get("/healthz"), get("/metrics"), b"GET /readyz HTTP/1.1\r\nHo"):
                sock = connect(server.port)
                sock.sendall(request)
                reset(sock)
        sock = connect(server.port)
        sock.sendall(get("/healthz"))
        sock.close()  # an orderly close before reading, too
        wait_for(lambda: server.open_connections == 0, "the server to drop the connections")
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10) as r:
            assert r.status == 200
    finally:
        server.stop()
    err = capfd.readouterr().err
    not_json = []
    for line in err.splitlines():
        try:
            json.loads(line)
        except ValueError:
            not_json.append(line)
    assert not_json == []


def test_idle_keep_alive_clients_hold_no_threads_and_are_closed_after_the_idle_timeout() -> None:
    before = threading.active_count()
    server = make_server(idle_timeout=2.0)
    clients: list[socket.socket] = []
    try:
        for _ in range(200):  # each one served once, then left idle on a kept-alive connection
            clients.append(connect(server.port))  # (served at once: a loaded machine may take
            assert exchange(clients[-1], get("/healthz"))[0] == 200  # longer than the timeout)
        assert threading.active_count() <= before + 1  # the server's one thread
        for sock in clients:
            assert closed_by_server(sock)
        wait_for(lambda: server.open_connections == 0, "the server to forget them")
    finally:
        for sock in clients:
            sock.close()
        server.stop()


def test_a_request_that_never_completes_is_closed_after_the_idle_timeout() -> None:
    server = make_server(idle_timeout=0.5)
    try:
        with connect(server.port) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # the headers never end
            assert closed_by_server(sock)
    finally:
        server.stop()


def test_healthz_answers_while_hundreds_of_idle_clients_are_connected() -> None:
    server = make_server(idle_timeout=60)
    idle = [connect(server.port) for _ in range(200)]
    try:
        for sock in idle[::2]:
            sock.sendall(b"GET /hea")  # half a request, then silence
        wait_for(lambda: server.open_connections == 200, "all 200 to be accepted")
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10) as r:
            assert (r.status, r.read()) == (200, b"ok\n")
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def test_a_connection_beyond_the_limit_is_answered_503_and_closed() -> None:
    server = make_server(max_connections=3)
    held = [connect(server.port) for _ in range(3)]
    try:
        wait_for(lambda: server.open_connections == 3, "three connections")
        with connect(server.port) as extra:
            status, headers, body = exchange(extra, get("/healthz"))
            assert (status, headers["connection"], body) == (
                503,
                "close",
                b"too many connections\n",
            )
            assert closed_by_server(extra)
        held.pop().close()
        wait_for(lambda: server.open_connections == 2, "a slot to free")
        with connect(server.port) as sock:
            assert exchange(sock, get("/healthz"))[0] == 200
    finally:
        for sock in held:
            sock.close()
        server.stop()


def test_routes_methods_and_keep_alive() -> None:
    server = make_server()
    try:
        with connect(server.port) as sock:
            status, headers, body = exchange(sock, get("/readyz?verbose=1"))
            assert (status, headers["content-type"], json.loads(body)) == (
                503,
                "application/json",
                {"ready": False},
            )
            status, _, body = exchange(sock, get("/metrics"))
            assert status == 200 and b"model_prefetch_test_total 1.0" in body
            status, headers, body = exchange(sock, b"HEAD /healthz HTTP/1.1\r\n\r\n")
            assert (status, headers["content-length"], body) == (200, "3", b"")
            assert exchange(sock, get("/nope"))[0] == 404
            assert exchange(sock, b"POST /healthz HTTP/1.1\r\n\r\n")[0] == 405
            status, headers, _ = exchange(
                sock, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"
            )
            assert (status, headers["connection"]) == (200, "close")
            assert closed_by_server(sock)
        with connect(server.port) as sock:
            assert exchange(sock, b"NONSENSE\r\n\r\n")[0] == 400
            assert closed_by_server(sock)
    finally:
        server.stop()


def test_a_port_in_use_is_an_error_at_start() -> None:
    server = make_server()
    try:
        with pytest.raises(OSError):
            HealthServer(
                f"127.0.0.1:{server.port}",
                health=lambda: (200, "ok"),
                ready=lambda: (200, {}),
                registry=CollectorRegistry(),
            ).start()
    finally:
        server.stop()


def test_warnings_and_uncaught_thread_errors_are_logged_as_json_lines() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, threading.excepthook)
    try:
        setup_logging("json", stream=stream)
        warnings.warn("a library's warning", UserWarning, stacklevel=1)

        def crash() -> None:
            raise RuntimeError("a bug in a thread")

        thread = threading.Thread(target=crash, name="crasher")
        thread.start()
        thread.join()
    finally:
        logging.captureWarnings(False)
        threading.excepthook = saved[2]
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(r["logger"], r["level"]) for r in records] == [
        ("py.warnings", "warning"),
        ("prefetch.thread", "error"),
    ]
    assert records[1]["error"] == "RuntimeError: a bug in a thread"
