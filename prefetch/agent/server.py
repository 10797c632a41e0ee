"""The agent's one HTTP port: ``/healthz``, ``/readyz`` and ``/metrics``.

The server runs its own asyncio loop in its own thread, so a scrape never waits on the reconcile
loop and the reconcile loop never waits on a client; the handlers only read what the loop
publishes (thread-safe snapshots) and render the registry.

Why a small asyncio server rather than ``http.server`` with a thread per connection: there, each
idle keep-alive client held a thread forever (200 idle clients: 207 threads), and a client that
hung up early made ``socketserver`` print a raw traceback on stderr, in the middle of the JSON log.
Here an idle connection costs a socket, not a thread (the server is one thread whatever clients
do), and every bound is explicit:

* at most ``max_connections`` open connections; one more is answered 503 and closed;
* ``idle_timeout`` seconds for a client to send (all of) its next request, or to take a response;
  then the connection is closed;
* a request line of at most 8 KiB, at most 100 header lines, no request body; a listen backlog
  of 128.

A client that leaves early (reset, broken pipe, end of stream mid-request) is routine: logged at
debug. Anything else is logged through ``logging`` (JSON lines in the agent); nothing is printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from prefetch.agent.config_checks import parse_listen
from prefetch.support.constants import HEALTHZ_PATH, METRICS_PATH, READYZ_PATH

log = logging.getLogger(__name__)

#: () -> (status, body): plain text for /healthz, a JSON-able object for /readyz
HealthFn = Callable[[], tuple[int, str]]
ReadyFn = Callable[[], tuple[int, dict[str, object]]]

#: Seconds a connection may sit without completing a request (or taking a response).
IDLE_TIMEOUT = 10.0
#: Open connections beyond which a new one is answered 503 and closed.
MAX_CONNECTIONS = 256
LISTEN_BACKLOG = 128
_MAX_LINE = 8192
_MAX_HEADERS = 100
_TEXT = "text/plain; charset=utf-8"


class _BadRequest(Exception):
    """A request we answer with ``status`` and then close the connection."""

    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class _Request:
    method: str
    path: str
    keep_alive: bool


@dataclass(frozen=True)
class _Response:
    status: int
    body: bytes
    content_type: str = _TEXT


class HealthServer:
    """Serves the probes and metrics on ``listen`` from one background thread."""

    def __init__(
        self,
        listen: str,
        *,
        health: HealthFn,
        ready: ReadyFn,
        registry: CollectorRegistry,
        idle_timeout: float = IDLE_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.host, self.port = parse_listen(listen)
        self._health = health
        self._ready = ready
        self._registry = registry
        self._idle_timeout = idle_timeout
        self._max_connections = max_connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._bound = threading.Event()
        self._bind_error: OSError | None = None
        self._open: set[asyncio.StreamWriter] = set()

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def start(self) -> HealthServer:
        """Bind and serve in the background; a bind error (port taken) is raised here."""
        self._thread = threading.Thread(target=self._run, name="prefetch-http", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._bind_error is not None:
            self._thread.join()
            self._thread = None
            raise self._bind_error
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
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
        self._thread = None

    # -- the loop thread -------------------------------------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            try:
                loop.run_until_complete(self._bind())
            except OSError as exc:
                self._bind_error = exc
                return
            finally:
                self._bound.set()
            loop.run_forever()
            loop.run_until_complete(self._close())
        finally:
            loop.close()

    async def _bind(self) -> None:
        self._server = await asyncio.start_server(
            self._connection,
            self.host,
            self.port,
            backlog=LISTEN_BACKLOG,
            limit=_MAX_LINE,
            reuse_address=True,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- one connection --------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if len(self._open) >= self._max_connections:
            log.debug("refusing %s: %d connections are open", peer, len(self._open))
            writer.write(
                _render(_Response(503, b"too many connections\n"), keep_alive=False, head=False)
            )
            writer.transport.close()
            return
        self._open.add(writer)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            log.debug("client %s left: %s", peer, exc or type(exc).__name__)
        except TimeoutError:
            log.debug("closing %s: idle for %.0fs", peer, self._idle_timeout)
        except Exception:  # a bug here must not take the server down, nor reach stderr raw
            log.exception("error serving %s", peer)
        finally:
            self._open.discard(writer)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                request = await asyncio.wait_for(_read_request(reader), self._idle_timeout)
            except _BadRequest as exc:
                body = f"{exc}\n".encode()
                writer.write(_render(_Response(exc.status, body), keep_alive=False, head=False))
                await asyncio.wait_for(writer.drain(), self._idle_timeout)
                return
            if request is None:  # the client closed between requests
                return
            response = self._answer(request)
            head = request.method == "HEAD"
            writer.write(_render(response, keep_alive=request.keep_alive, head=head))
            await asyncio.wait_for(writer.drain(), self._idle_timeout)
            if not request.keep_alive:
                return

    def _answer(self, request: _Request) -> _Response:
        if request.method not in ("GET", "HEAD"):
            return _Response(405, b"only GET and HEAD\n")
        try:
            if request.path == HEALTHZ_PATH:
                code, text = self._health()
                return _Response(code, (text + "\n").encode())
            if request.path == READYZ_PATH:
                code, body = self._ready()
                data = json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"
                return _Response(code, data, "application/json")
            if request.path == METRICS_PATH:
                return _Response(200, generate_latest(self._registry), CONTENT_TYPE_LATEST)
            return _Response(404, b"not found\n")
        except Exception:  # a bug in a handler answers 500; the server keeps serving
            log.exception("error answering %s", request.path)
            return _Response(500, b"internal error\n")


async def _read_request(reader: asyncio.StreamReader) -> _Request | None:
    """The next request's line and headers; None at a clean end of stream before one."""
    line = await _read_line(reader)
    if line in (b"\r\n", b"\n"):  # a stray empty line between requests is allowed (RFC 9112)
        line = await _read_line(reader)
    if not line:
        return None
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "malformed request line")
    method, target, version = parts
    headers: dict[str, str] = {}
    for _ in range(_MAX_HEADERS):
        header = await _read_line(reader)
        if not header:
            raise asyncio.IncompleteReadError(b"", None)  # the client left mid-request
        if header in (b"\r\n", b"\n"):
            break
        name, colon, value = header.decode("latin-1").partition(":")
        if not colon or not name.strip():
            raise _BadRequest(HTTPStatus.BAD_REQUEST, "malformed header line")
        headers[name.strip().lower()] = value.strip()
    else:
        raise _BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "too many header lines")
    if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "request bodies are not accepted")
    connection = headers.get("connection", "").lower()
    keep_alive = version == "HTTP/1.1" and "close" not in connection
    return _Request(method=method, path=target.split("?", 1)[0], keep_alive=keep_alive)


async def _read_line(reader: asyncio.StreamReader) -> bytes:
    """One line (b"" at end of stream); longer than the limit is a 431, not a crash."""
    try:
        line = await reader.readline()
    except ValueError as exc:  # the stream's limit: asyncio.LimitOverrunError, wrapped
        raise _BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "line too long") from exc
    if line and not line.endswith(b"\n"):
        raise asyncio.IncompleteReadError(line, None)  # end of stream mid-line
    return line


def _render(response: _Response, *, keep_alive: bool, head: bool) -> bytes:
    """The response's bytes (for a HEAD request: its status and headers only)."""
    status = HTTPStatus(response.status)
    lines = [
        f"HTTP/1.1 {status.value} {status.phrase}",
        "Server: model-prefetch",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
    ]
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head else response.body)
