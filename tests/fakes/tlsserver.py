"""HTTPS for the standard library's threading HTTP server, as the S3 stand-ins serve it.

The TLS handshake happens in each connection's own thread (not in ``accept``, where one client
that connects and never says hello would stall every other), with a bound, and a failed handshake
(a plain-HTTP client, a client that does not trust the certificate) ends only that connection.
``accepted`` / ``handshakes`` count TCP connections and completed TLS handshakes, for tests that
check a client reuses its connections.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: Seconds a client has to complete the TLS handshake.
HANDSHAKE_TIMEOUT = 10.0


class TLSThreadingHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` that speaks HTTPS when given a server ``context`` (else plain
    HTTP, unchanged)."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        context: ssl.SSLContext | None = None,
    ) -> None:
        self.context = context
        self.accepted = 0
        self.handshakes = 0
        self._count_lock = threading.Lock()
        super().__init__(address, handler)

    @property
    def scheme(self) -> str:
        return "http" if self.context is None else "https"

    def finish_request(self, request: Any, client_address: Any) -> None:
        with self._count_lock:
            self.accepted += 1
        if self.context is None:
            super().finish_request(request, client_address)
            return
        raw: socket.socket = request
        raw.settimeout(HANDSHAKE_TIMEOUT)
        try:
            tls = self.context.wrap_socket(raw, server_side=True)
        except OSError:  # ssl.SSLError included: this client could not talk TLS with us
            return
        with self._count_lock:
            self.handshakes += 1
        try:
            tls.settimeout(None)
            self.RequestHandlerClass(tls, client_address, self)
        finally:
            with contextlib.suppress(OSError):
                tls.close()
