"""A pooled HTTPS connection is never reused dirty: after an error answer, a body read in part,
a read the watchdog aborted, a header wait a deadline or a stop interrupted, a wrong Range
answer refused, the next request on the same pool gets its own answer, byte for byte (or the
connection is dropped and a new one made).

Found once: an answer whose socket a watch shut down was read as ciphertext
(``BadStatusLine('\\x17\\x03\\x03...')``: ``ssl.SSLSocket.shutdown`` drops the TLS state, and
the TLS records still queued were then read as they are), and a watch that had covered one
request shut down the socket of a later request another thread sent on the same pooled
connection. The rule lives in the seam (:mod:`prefetch.sources.http.transport`), so every
backend has it; these tests hold it against a real TLS server with the session CA.
"""

from __future__ import annotations

import contextlib
import http.client
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

import pytest
import urllib3

from prefetch.pipeline.deadline import Alarms, Watch, call_with_deadline, watching
from prefetch.pipeline.snapshot import RemoteFile
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.sources.http.transport import (
    BodyReader,
    HttpClient,
    Sent,
    check_range_answer,
    make_http_pool,
    range_body_reader,
    send,
)
from prefetch.sources.s3.errors import answer_error
from prefetch.sources.s3.factory import lazy_s3_client
from prefetch.sources.s3.source import S3Source
from prefetch.support.errors import SourceChangedError, SourceError, TransientSourceError

from .fakes.scripted_s3 import ScriptedS3
from .fakes.tlsserver import TLSThreadingHTTPServer
from .tls import TestCA

#: A body several TLS records long, every byte telling where it is (so a wrong byte shows).
BODY = bytes(range(256)) * 4096
ERROR_XML = b"<Error><Code>InternalError</Code><Message>try again</Message></Error>"


@dataclass
class Script:
    """What the server answers; ``hold`` keeps a held answer back until the test sets it."""

    hold: threading.Event = field(default_factory=threading.Event)
    served: list[str] = field(default_factory=list)


_WHOLE = {"Content-Range": f"bytes 0-{len(BODY) - 1}/{len(BODY)}"}
#: path -> status, body and headers of its answer (any other path: 200 "ok <path>")
ROUTES: dict[str, tuple[int, bytes, dict[str, str]]] = {
    "/body": (206, BODY, _WHOLE),
    "/wrong-range": (206, BODY, _WHOLE),  # asked for the first half, answers the whole
    "/error": (500, ERROR_XML, {}),
    # more than the 64 KiB an error's code is read from
    "/big-error": (503, ERROR_XML + b" " * (256 * 1024), {}),
}


def _handler(script: Script) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            script.served.append(self.path)
            route = self.path.split("?")[0]
            default = (200, b"ok " + self.path.encode(), {})
            status, body, headers = ROUTES.get(route, default)
            if route == "/slow-headers":
                script.hold.wait(10)
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command == "HEAD":
                return
            with contextlib.suppress(OSError):  # the client hung up: what some tests do
                if route == "/held-body":  # one byte, the rest when the test says
                    self.wfile.write(body[:1])
                    self.wfile.flush()
                    script.hold.wait(10)
                    body = body[1:]
                self.wfile.write(body)

        do_HEAD = do_GET

    return Handler


@dataclass
class Server:
    base: str
    script: Script
    httpd: TLSThreadingHTTPServer


@pytest.fixture
def server(test_ca: TestCA) -> Iterator[Server]:
    script = Script()
    httpd = TLSThreadingHTTPServer(("127.0.0.1", 0), _handler(script), test_ca.server_context())
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield Server(test_ca.url(httpd.server_address[1], "s3"), script, httpd)
    finally:
        script.hold.set()
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def pool(test_ca: TestCA) -> HttpClient:
    """One connection per host: the next request reuses the last one when it went back."""
    return make_http_pool(1, ca_certs=str(test_ca.ca_file))


def _get(pool: HttpClient, url: str) -> Sent:
    return send(pool, "GET", url, headers={})


def assert_next_request_succeeds(pool: HttpClient, server: Server) -> None:
    """The rule: the next request on the pool gets its own answer, whole."""
    answer = _get(pool, f"{server.base}/ok?next")
    assert answer.status == 200
    assert answer.read(1024) == b"ok /ok?next"
    answer.release()


def _reader(answer: Sent, length: int = len(BODY)) -> BodyReader:
    return range_body_reader(answer, "GET /body", length)


def _read_into(reader: BodyReader, buf: bytearray, start: int) -> int:
    """Read ``reader`` into ``buf`` from ``start`` until it ends or fails; how far it got."""
    view = memoryview(buf)
    pos = start
    try:
        while pos < len(buf) and (n := reader.readinto(view[pos:])):
            pos += n
    except SourceError:
        pass
    return pos


# -- error answers ---------------------------------------------------------------------------------


def test_after_an_error_answer_the_pooled_connection_serves_the_next_request(
    pool: HttpClient, server: Server
) -> None:
    error = answer_error("GET s3://bkt/k", _get(pool, f"{server.base}/error"), has_body=True)
    assert isinstance(error, TransientSourceError) and "InternalError" in str(error)
    assert_next_request_succeeds(pool, server)
    assert server.httpd.handshakes == 1  # read to its end: the connection was reused, clean


def test_after_an_error_answer_read_in_part_the_next_request_succeeds(
    pool: HttpClient, server: Server
) -> None:
    answer_error("GET s3://bkt/k", _get(pool, f"{server.base}/big-error"), has_body=True)
    assert_next_request_succeeds(pool, server)


def test_a_release_before_the_end_of_the_body_does_not_hand_the_rest_to_the_next_request(
    pool: HttpClient, server: Server
) -> None:
    """A caller that stops at its limit (a redirect's body past the drain limit, a listing
    page past its bound) and releases: the connection is closed, not pooled with the rest of
    the body waiting on it (the next request failed on it)."""
    answer = _get(pool, f"{server.base}/body")
    assert answer.read(len(BODY) - 10) == BODY[:-10]  # the rest waits in the TLS buffers
    answer.release()
    assert_next_request_succeeds(pool, server)
    assert server.httpd.handshakes == 2


def test_a_head_answer_released_keeps_its_connection(pool: HttpClient, server: Server) -> None:
    """The other side of the rule: an answer without a body is finished as it arrives, its
    connection reused. (A HEAD released left http.client's response open: while the answer
    lived, the next request on the connection failed with ``ResponseNotReady``; describe's
    HEAD got away with it only because its answer was garbage collected at once.)"""
    answer = send(pool, "HEAD", f"{server.base}/ok?head", headers={})
    assert answer.status == 200
    answer.release()
    assert_next_request_succeeds(pool, server)
    assert server.httpd.handshakes == 1


# -- ranged bodies cut short -----------------------------------------------------------------------


def test_a_ranged_read_given_up_part_way_is_not_reused(pool: HttpClient, server: Server) -> None:
    """A checksum failure mid-body, a read the engine abandons: the reader closes unclean."""
    reader = _reader(_get(pool, f"{server.base}/body"))
    assert reader.readinto(memoryview(bytearray(100))) == 100
    reader.close()
    assert_next_request_succeeds(pool, server)


def test_a_wrong_range_answer_refused_is_not_reused(pool: HttpClient, server: Server) -> None:
    half = len(BODY) // 2
    answer = _get(pool, f"{server.base}/wrong-range")
    with pytest.raises(SourceChangedError):
        check_range_answer(
            "GET /wrong-range", 0, half, len(BODY), answer.status,
            answer.headers.get("Content-Range"), answer.headers.get("Content-Length"),
        )  # fmt: skip
    answer.discard()  # what every source does with a refused answer
    assert_next_request_succeeds(pool, server)


def test_a_ranged_read_the_watchdog_aborts_is_not_reused(pool: HttpClient, server: Server) -> None:
    reader = _reader(_get(pool, f"{server.base}/held-body"), len(b"ok /held-body"))
    assert reader.readinto(memoryview(bytearray(1))) == 1
    failed: list[BaseException] = []

    def blocked_read() -> None:
        try:
            reader.readinto(memoryview(bytearray(100)))
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=blocked_read, daemon=True)
    thread.start()
    thread.join(0.3)  # blocked on the socket (the server holds the rest back)
    reader.abort()
    thread.join(10)
    assert not thread.is_alive() and failed
    reader.close()
    server.script.hold.set()
    assert_next_request_succeeds(pool, server)


def test_a_read_after_an_abort_returns_the_bodys_bytes_or_nothing_never_ciphertext(
    pool: HttpClient, server: Server
) -> None:
    """The rest of the body is queued when the abort comes: what a read returns after it is
    the body's bytes (decrypted) or the end, never the TLS records as they are."""
    reader = _reader(_get(pool, f"{server.base}/body"))
    buf = bytearray(len(BODY))
    assert reader.readinto(memoryview(buf)[:100]) == 100
    server.script.hold.wait(0.3)  # the rest arrives and waits in the kernel
    reader.abort()
    got = _read_into(reader, buf, 100)
    assert buf[:got] == BODY[:got]
    reader.close()
    assert_next_request_succeeds(pool, server)


# -- header waits interrupted ----------------------------------------------------------------------


def test_a_header_wait_a_deadline_interrupts_is_not_reused(
    pool: HttpClient, server: Server
) -> None:
    with pytest.raises(TransientSourceError, match="no answer within"):
        call_with_deadline(
            lambda: _get(pool, f"{server.base}/slow-headers"), 0.3, what="GET /slow-headers",
            alarms=Alarms(idle=1.0),
        )  # fmt: skip
    server.script.hold.set()
    assert_next_request_succeeds(pool, server)


def test_a_request_under_a_stopped_watch_never_reads_ciphertext_as_its_status_line(
    pool: HttpClient, server: Server
) -> None:
    """The engineer's case: a GET sent under a watch that is already aborted (a stop, a
    deadline) has its socket shut down before its answer is read; on a new TLS 1.3 connection
    the session tickets are queued there already. It must fail as a closed connection, not as
    ``BadStatusLine('\\x17\\x03\\x03...')``; and the pool must serve the next request."""
    watch = Watch("stopped")
    watch.abort(TransientSourceError("stopped"))
    with watching(watch), pytest.raises(urllib3.exceptions.ProtocolError) as failed:
        _get(pool, f"{server.base}/ok?stopped")
    cause = failed.value.args[1]
    assert isinstance(cause, http.client.RemoteDisconnected), cause  # not ciphertext parsed
    assert_next_request_succeeds(pool, server)


# -- a watch that outlives its request -------------------------------------------------------------


def test_a_watch_aborted_after_its_request_never_cuts_another_request_on_that_connection(
    pool: HttpClient, server: Server
) -> None:
    """A watch covering several requests (a describe retried, a resolve under a stop) keeps
    the interrupt of a connection that went back to the pool; that connection then serves
    another request (another thread's, in the agent another sync's). Aborting the watch must
    leave that request alone: it read ciphertext as body bytes."""
    watch = Watch("an earlier describe")
    with watching(watch):
        first = _get(pool, f"{server.base}/ok?first")
        assert first.read(1024) == b"ok /ok?first"
        first.release()
    reader = _reader(_get(pool, f"{server.base}/body"))  # the same pooled connection
    assert server.httpd.handshakes == 1
    buf = bytearray(len(BODY))
    assert reader.readinto(memoryview(buf)[:100]) == 100
    server.script.hold.wait(0.3)  # the rest of the body waits in the kernel
    watch.abort(TransientSourceError("stopped"))
    assert _read_into(reader, buf, 100) == len(BODY)
    assert buf == BODY
    reader.close()
    assert_next_request_succeeds(pool, server)


# -- the S3 source, end to end ---------------------------------------------------------------------


def test_the_s3_sources_reads_after_error_answers_get_their_bytes(test_ca: TestCA) -> None:
    """A describe's HEAD and S3 error answers (a missing key, a throttled GET) on the
    source's one pooled connection, then reads: each gets exactly its range, first time."""
    data = bytes(range(256)) * 4096 + b"tail"  # past the size fetched whole by describe
    with ScriptedS3(test_ca, objects={"m/w.bin": data}) as s3:
        client = lazy_s3_client(
            endpoint_url=s3.endpoint, access_key="a", secret_key="b", region="us-east-1",
            ca_bundle=str(test_ca.ca_file), max_pool_connections=1,
        )  # fmt: skip
        spec = ModelSpec(source=parse_source_uri("s3://bkt/m"))
        source = S3Source(client, spec.source)
        listed = source.describe(source.resolve(spec).files[0])  # a HEAD
        assert s3.count("head") == 1
        missing = RemoteFile(path="gone.bin", size=10, locator="m/gone.bin", version="")
        with pytest.raises(SourceChangedError):
            source.open_range(missing, 0, 10)
        s3.rate = 0  # every request answered 503 SlowDown
        with pytest.raises(TransientSourceError, match="SlowDown"):
            source.open_range(listed, 0, 10)
        s3.rate = None
        for start, end in ((0, 10), (1000, 70_000), (len(data) - 4, len(data))):
            reader = source.open_range(listed, start, end)
            buf = bytearray(end - start)
            view = memoryview(buf)
            pos = 0
            while pos < len(buf):
                n = reader.readinto(view[pos:])
                assert n > 0
                pos += n
            reader.close()
            assert bytes(buf) == data[start:end]
