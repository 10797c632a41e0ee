"""The agent's one HTTP port: ``/healthz``, ``/readyz`` and ``/metrics`` (standard library server).

It runs in its own thread so a scrape never waits on the reconcile loop; the handlers only read
what the loop publishes (thread-safe snapshots) and render the registry.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from prefetch.agent.config import parse_listen
from prefetch.constants import HEALTHZ_PATH, METRICS_PATH, READYZ_PATH

log = logging.getLogger(__name__)

#: () -> (status, body): plain text for /healthz, a JSON-able object for /readyz
HealthFn = Callable[[], tuple[int, str]]
ReadyFn = Callable[[], tuple[int, dict[str, Any]]]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class HealthServer:
    def __init__(
        self, listen: str, *, health: HealthFn, ready: ReadyFn, registry: CollectorRegistry
    ) -> None:
        self.host, self.port = parse_listen(listen)
        self._health = health
        self._ready = ready
        self._registry = registry
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> HealthServer:
        server_cls = _Server6 if ":" in self.host else _Server
        handler = _make_handler(self._health, self._ready, self._registry)
        self._server = server_cls((self.host, self.port), handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="prefetch-http", daemon=True
        )
        self._thread.start()
        log.info(
            "serving %s, %s and %s on %s:%d",
            HEALTHZ_PATH,
            READYZ_PATH,
            METRICS_PATH,
            self.host,
            self.port,
        )
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def _make_handler(
    health: HealthFn, ready: ReadyFn, registry: CollectorRegistry
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "model-prefetch"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # probes every few seconds would drown the log

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            try:
                if path == HEALTHZ_PATH:
                    code, text = health()
                    self._send(code, (text + "\n").encode(), "text/plain; charset=utf-8")
                elif path == READYZ_PATH:
                    code, body = ready()
                    data = json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"
                    self._send(code, data, "application/json")
                elif path == METRICS_PATH:
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                else:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")
            except Exception:  # a bug in a handler must not kill the server thread
                log.exception("error answering %s", path)
                self._send(500, b"internal error\n", "text/plain; charset=utf-8")

        def _send(self, code: int, data: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
