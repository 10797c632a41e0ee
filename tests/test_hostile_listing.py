"""Hostile review, issue 22: S3 listings written by a hostile server, through the real CLI on the
direct (botocore-free) path. Each ends in one ``Error:`` line naming the prefix the user asked
for, quickly, with bounded memory. The hostile servers speak HTTPS (the session CA), as every S3 a
user meets does."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import parse_source_uri
from prefetch.sources.s3.listing import ListingPages, MalformedListingPage, parse_list_page
from prefetch.sources.s3.source import S3Source, lazy_s3_client
from prefetch.support.errors import InvalidListingError, TransientSourceError

from .fakes.tlsserver import TLSThreadingHTTPServer
from .support import clean_env, run_cli
from .tls import TestCA

Answer = Callable[[dict[str, str]], bytes]
HEAD = b'<?xml version="1.0" encoding="UTF-8"?>\n'
NS = b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
ENTRY = b"<Contents><Key>m/w.bin</Key><Size>3</Size><ETag>&quot;e&quot;</ETag></Contents>"


def page(body: bytes = ENTRY, *, token: str | None = None, truncated: bool = False) -> bytes:
    more = f"<NextContinuationToken>{token}</NextContinuationToken>".encode() if token else b""
    flag = b"<IsTruncated>true</IsTruncated>" if truncated else b"<IsTruncated>false</IsTruncated>"
    return HEAD + NS + b"<Name>bkt</Name>" + body + flag + more + b"</ListBucketResult>"


class ListingServer:
    """Answers every ListObjectsV2 with ``answer(query)``; the mirror probe (a listing of
    ``<prefix>snapshots/``) gets an empty page unless ``probe_too``."""

    def __init__(self, ca: TestCA, answer: Answer, *, probe_too: bool = False) -> None:
        self.answer, self.probe_too, self.requests = answer, probe_too, 0
        self.status, self.headers = 200, dict[str, str]()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                query = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
                server.requests += 1
                probe = query.get("prefix", "").endswith("snapshots/")
                body = page(b"") if probe and not server.probe_too else server.answer(query)
                status, headers = server.status, server.headers
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = TLSThreadingHTTPServer(("127.0.0.1", 0), Handler, ca.server_context())
        self.endpoint = ca.url(self.httpd.server_address[1], "s3")
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve(tmp_path: Path, test_ca: TestCA) -> Iterator[Callable[..., ListingServer]]:
    servers: list[ListingServer] = []

    def start(answer: Answer, **kwargs: Any) -> ListingServer:
        servers.append(ListingServer(test_ca, answer, **kwargs))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def pull(server: ListingServer, tmp_path: Path) -> tuple[int, list[str]]:
    env = clean_env(
        tmp_path / "hf",
        AWS_ENDPOINT_URL=server.endpoint,
        AWS_ACCESS_KEY_ID="AKIAHOSTILE",
        AWS_SECRET_ACCESS_KEY="hostile-secret",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
    )
    dest = tmp_path / "dest"
    proc = run_cli("pull", "s3://bkt/m", str(dest), "--attempts", "1", env=env, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not dest.exists() or not any(dest.rglob("*.bin"))  # nothing published
    return proc.returncode, proc.stderr.strip().splitlines()


def assert_error(code: int, lines: list[str], *needles: str) -> None:
    assert code == 1, lines
    assert lines[0].startswith("Error: listing s3://bkt/m"), lines
    assert "snapshots" not in lines[0], lines  # the user's prefix, not an internal probe
    for needle in needles:
        assert needle in lines[0], lines


@pytest.mark.parametrize(
    ("tokens", "needle"),
    [
        (["A"], "continuation token it had sent before"),
        (["A", "B"], "continuation token it had sent before"),
    ],
)
def test_a_continuation_token_that_repeats_ends_the_listing(
    serve: Callable[..., ListingServer], tmp_path: Path, tokens: list[str], needle: str
) -> None:
    def answer(query: dict[str, str]) -> bytes:
        after = query.get("continuation-token")
        index = 0 if after is None else (tokens.index(after) + 1) % len(tokens)
        return page(token=tokens[index], truncated=True)

    server = serve(answer)
    code, lines = pull(server, tmp_path)
    assert_error(code, lines, needle)
    assert server.requests <= len(tokens) + 3


def test_a_truncated_page_without_a_token_ends_the_listing(
    serve: Callable[..., ListingServer], tmp_path: Path
) -> None:
    code, lines = pull(serve(lambda q: page(truncated=True)), tmp_path)
    assert_error(code, lines, "continuation token")


LAUGHS = (
    HEAD
    + b'<!DOCTYPE ListBucketResult [<!ENTITY e "' + b"x" * 1000 + b'">]>'
    + NS + b"<Contents><Key>" + b"&e;" * 1_000_000 + b"</Key><Size>1</Size></Contents>"
    + b"</ListBucketResult>"
)  # fmt: skip
EXTERNAL = (
    HEAD
    + b'<!DOCTYPE ListBucketResult [<!ENTITY e SYSTEM "file:///etc/passwd">]>'
    + NS + b"<Contents><Key>&e;</Key><Size>1</Size></Contents></ListBucketResult>"
)  # fmt: skip
DEEP = HEAD + NS + b"<a>" * 200_000 + b"</a>" * 200_000 + b"</ListBucketResult>"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (LAUGHS, "document type declaration"),
        (EXTERNAL, "document type declaration"),
        (DEEP, "nested more than"),
        (b"", "not XML (no element found)"),
        (HEAD + NS + b"<Contents><Size>3</Size></Contents></ListBucketResult>", "has no Key"),
        (page(ENTRY.replace(b"<Size>3", b"<Size>3x")), "not a byte count"),
        (page(ENTRY.replace(b"<Size>3", b"<Size>-3")), "not a byte count"),
        (page(b"<Contents><Key>" + b"k" * 70_000 + b"</Key></Contents>"), "longer than"),
        (HEAD + b"<Error><Code>x</Code></Error>", "not a ListBucketResult"),
        (page(b"&undefined;"), "not XML (undefined entity)"),
    ],
    ids=[
        "laughs",
        "external",
        "deep",
        "empty",
        "no-key",
        "size",
        "negative",
        "long",
        "root",
        "undefined",
    ],
)
def test_a_malformed_listing_is_one_error_naming_the_prefix(
    serve: Callable[..., ListingServer], tmp_path: Path, body: bytes, needle: str
) -> None:
    code, lines = pull(serve(lambda q: body, probe_too=True), tmp_path)
    assert_error(code, lines, needle)


def test_entity_expansion_is_refused_before_it_grows() -> None:
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(MalformedListingPage, match="document type declaration"):
            parse_list_page(LAUGHS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(LAUGHS)


def test_listing_pages_are_bounded() -> None:
    pages = ListingPages("s3://bkt/m/", max_pages=3)
    assert pages.next_token({"IsTruncated": True, "NextContinuationToken": "a"}) == "a"
    assert pages.next_token({"IsTruncated": True, "NextContinuationToken": "b"}) == "b"
    with pytest.raises(InvalidListingError, match="more than 3 pages"):
        pages.next_token({"IsTruncated": True, "NextContinuationToken": "c"})
    assert ListingPages("x").next_token({"IsTruncated": False}) is None


def test_a_redirect_without_an_s3_error_document_says_where_it_points(
    serve: Callable[..., ListingServer], tmp_path: Path
) -> None:
    server = serve(lambda q: b"", probe_too=True)
    server.status = 307
    server.headers = {"Location": "https://elsewhere.example/bkt?X-Amz-Signature=abc"}
    code, lines = pull(server, tmp_path)
    assert code == 1 and lines[0].startswith("Error: listing s3://bkt/m"), lines
    assert "307: Temporary Redirect to https://elsewhere.example (not followed" in lines[0]
    assert "307: 307" not in lines[0] and "X-Amz-Signature" not in lines[0]


@contextlib.contextmanager
def trickling_source(ca: TestCA, *answers: tuple[bytes, bool]) -> Iterator[S3Source]:
    """An S3 source (static keys, one attempt, ``metadata_timeout`` 1.5 s) whose server answers
    each request on one kept-open HTTPS connection with the next body: at once, or trickled
    (one byte every 0.25 s, a TLS record each) when its flag says so."""
    sock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        raw, _ = sock.accept()
        conn = ca.server_context().wrap_socket(raw, server_side=True)
        for body, trickled in answers:
            conn.recv(65536)
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode())
            if not trickled:
                conn.sendall(body)
                continue
            for byte in body:
                if stop.wait(0.25):
                    break
                conn.sendall(bytes([byte]))
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    client = lazy_s3_client(
        endpoint_url=ca.url(sock.getsockname()[1], "s3"),
        access_key="a",
        secret_key="b",
        region="us-east-1",
    )
    source = S3Source(client, parse_source_uri("s3://bkt/m/"), retry=RetryPolicy(attempts=1))
    source.metadata_timeout = 1.5  # each attempt of a metadata call, as a whole
    try:
        yield source
    finally:
        stop.set()
        sock.close()


def test_a_trickled_listing_page_is_bounded_in_time(test_ca: TestCA) -> None:
    with trickling_source(test_ca, (page(), True)) as source:
        started = time.monotonic()
        with pytest.raises(TransientSourceError, match=r"no answer within 1\.5 s"):
            source.list_page("listing s3://bkt/m/", Prefix="m/")
    assert time.monotonic() - started < 5


def test_a_region_redirect_never_sends_the_listing_to_another_host(
    serve: Callable[..., ListingServer], tmp_path: Path
) -> None:
    server = serve(lambda q: b"", probe_too=True)
    server.status = 301
    server.headers = {
        "x-amz-bucket-region": "evil.example",  # not a region: never part of a host name
        "Location": "http://127.0.0.2:9/bkt",
    }
    code, lines = pull(server, tmp_path)
    assert code == 1 and lines[0].startswith("Error: listing s3://bkt/m"), lines
    assert "301: Moved Permanently to http://127.0.0.2:9 (not followed" in lines[0]
    assert server.requests == 1


@pytest.mark.parametrize("attempts", [1, 2])
def test_attempts_applies_to_s3_listing_retries(
    serve: Callable[..., ListingServer], tmp_path: Path, attempts: int
) -> None:
    server = serve(lambda q: b"<Error><Code>SlowDown</Code><Message>slow</Message></Error>",
                   probe_too=True)  # fmt: skip
    server.status = 503
    env = clean_env(
        tmp_path / "hf",
        AWS_ENDPOINT_URL=server.endpoint,
        AWS_ACCESS_KEY_ID="AKIAHOSTILE",
        AWS_SECRET_ACCESS_KEY="hostile-secret",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
    )
    proc = run_cli("pull", "s3://bkt/m", str(tmp_path / "d"), "--attempts", str(attempts),
                   env=env, timeout=60)  # fmt: skip
    assert proc.returncode == 1
    tries = "1 attempt:" if attempts == 1 else f"{attempts} attempts:"
    assert f"giving up after {tries}" in proc.stderr.splitlines()[0]
    assert server.requests == attempts


def test_trickled_mirror_metadata_is_bounded_in_time(test_ca: TestCA) -> None:
    # the listing answered at once (it sets up the signed path), the metadata GET trickled
    with trickling_source(test_ca, (page(), False), (b"c" * 40, True)) as source:
        source.ensure_signed_path()
        started = time.monotonic()
        with pytest.raises(TransientSourceError, match=r"no answer within 1\.5 s"):
            source.read_object("m/refs/main", "reading s3://bkt/m/refs/main", limit=100)
    assert time.monotonic() - started < 5


def test_a_listing_entry_without_a_key_on_the_botocore_path_is_one_error_line(
    serve: Callable[..., ListingServer], tmp_path: Path
) -> None:
    server = serve(lambda q: page(b"<Contents><Size>3</Size></Contents>"), probe_too=True)
    (tmp_path / "credentials").write_text(
        "[hostile]\naws_access_key_id = AKIAHOSTILE\naws_secret_access_key = s\n"
    )
    env = clean_env(
        tmp_path / "hf",
        AWS_ENDPOINT_URL=server.endpoint,
        AWS_PROFILE="hostile",  # a profile: botocore lists
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "credentials"),
    )
    proc = run_cli("pull", "s3://bkt/m", str(tmp_path / "d"), "--attempts", "1", env=env,
                   timeout=60)  # fmt: skip
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("Error: listing s3://bkt/m") and "entry 1 has no Key" in first, first
    assert "KeyError" not in first


@pytest.mark.parametrize(
    ("status", "code", "words"),
    [(403, b"AccessDenied", "access denied"), (503, b"SlowDown", "SlowDown")],
)
def test_a_refused_listing_names_the_prefix_asked_for_not_the_mirror_probe(
    serve: Callable[..., ListingServer], tmp_path: Path, status: int, code: bytes, words: str
) -> None:
    body = b"<Error><Code>" + code + b"</Code><Message>no</Message></Error>"
    server = serve(lambda q: body, probe_too=True)
    server.status = status
    rc, lines = pull(server, tmp_path)
    assert rc == 1 and lines[0].startswith("Error: listing s3://bkt/m/: "), lines
    assert words in lines[0] and "snapshots" not in "\n".join(lines), lines
