"""S3 source: list, describe (HEAD with checksums) and ranged GETs pinned to the ETag, via boto3.

The boto3 client is passed in (tests give one pointed at a local server). boto3's own retries
are turned off by :func:`make_s3_client`: retrying lives in one place (prefetch.retry), around
whole operations and inside the range task, so a retry resumes from the last byte written.
With the static keys of the environment or the settings, the listing and every object
request are signed and sent without botocore (:mod:`prefetch.sources.s3_direct`: no botocore
import, no client). Otherwise the listing goes through the client; once it has, the per-object
requests (HEAD, whole-object GET, ranged GET) are sent on the lean path of
:mod:`prefetch.sources.s3_lean`, addressed and signed as botocore signed the listing but
without its per-request cost (~1.5 ms of CPU each).
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import urllib3.exceptions

from prefetch import settings
from prefetch.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    NoMatchingFilesError,
    PrefetchError,
    SourceChangedError,
    SourceError,
    TransientSourceError,
)
from prefetch.retry import RetryPolicy, call_with_retries
from prefetch.snapshot import Checksum, RemoteFile, Snapshot, listing_digest
from prefetch.sources._http import (
    BodyReader,
    error_class,
    http_client_response,
    parse_retry_after,
    shared_http_pool,
    transport_error,
)
from prefetch.sources.base import range_answer_problem, shutdown_socket_of
from prefetch.sources.s3_direct import (
    DirectBucket,
    StaticCredentials,
    direct_settings,
    sends_as_signed,
)
from prefetch.sources.s3_lean import (
    LeanResponse,
    ObjectRequests,
    capture_listing_requests,
    lean_requests_for,
)
from prefetch.sources.s3_xml import ListingPages, listed_objects, read_page
from prefetch.sources.status_text import bare_status
from prefetch.spec import SIDECAR_MANIFEST, ModelSpec, SourceURI
from prefetch.verify import STRENGTH

log = logging.getLogger(__name__)

#: S3 additional checksums, strongest first, with the response field that carries each.
_ADDITIONAL = (
    ("sha256", "ChecksumSHA256"),
    ("sha1", "ChecksumSHA1"),
    ("crc64nvme", "ChecksumCRC64NVME"),
    ("crc32c", "ChecksumCRC32C"),
    ("crc32", "ChecksumCRC32"),
)
_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "503", "500", "502", "504", "RequestLimitExceeded",
}  # fmt: skip
_DENIED_CODES = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "401",
    "ExpiredToken", "InvalidToken", "AllAccessDisabled", "AccountProblem",
}  # fmt: skip
_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")
_MULTIPART_ETAG = re.compile(r"^[0-9a-f]{32}-(\d+)$")
_SIDECAR_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")
#: Objects up to this size are described by one GET of the whole object instead of a HEAD (the
#: GET answers the same checksum headers); the bytes wait in memory for ``open_range``, so a small
#: file costs one request instead of two. At most _SMALL_BUDGET bytes wait at any time.
SMALL_OBJECT = 1024 * 1024
_SMALL_BUDGET = 64 * 1024 * 1024
#: A SHA256SUMS sidecar is read up to this size (a line per file: ~100 bytes each).
MAX_SIDECAR_BYTES = 64 * 1024 * 1024
#: The error codes of a GET for a key that does not exist.
_MISSING_KEY_CODES = ("NoSuchKey", "404", "NotFound")
#: A small object's body must arrive within this many seconds (at least 17 KiB/s for 1 MiB).
SMALL_GET_LIMIT = 60.0


def make_s3_client(
    *,
    endpoint_url: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    region: str | None = None,
    max_pool_connections: int = 32,
    connect_timeout: float = 10,
    read_timeout: float = 60,
    profile: str | None = None,
    proxy: str | None = None,
    sign_payloads: bool | None = None,
) -> Any:
    """A boto3 S3 client tuned for many parallel ranged GETs, with boto3's retries off.

    ``proxy`` is the source's own proxy setting (None: ``HTTP(S)_PROXY``; "": direct; see
    :func:`prefetch.settings.proxies`). ``sign_payloads=False`` sends request bodies as
    UNSIGNED-PAYLOAD instead of SHA256-hashing each one into the signature (botocore does hash
    them, even over HTTPS, when the caller supplies the body's checksum itself); only for
    callers whose every body carries a checksum S3 verifies. None: botocore's rule (and the
    AWS config file's ``payload_signing_enabled``)."""
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(profile_name=profile)
    region_name = region or session.region_name or "us-east-1"
    config = Config(
        proxies=s3_proxies(endpoint_url, region_name, proxy),
        max_pool_connections=max_pool_connections,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"total_max_attempts": 1, "mode": "standard"},
        tcp_keepalive=True,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3=None if sign_payloads is None else {"payload_signing_enabled": sign_payloads},
    )
    kwargs: dict[str, Any] = {"config": config}
    if endpoint_url:
        kwargs["endpoint_url"] = endpoint_url
    if access_key and secret_key:
        kwargs["aws_access_key_id"] = access_key
        kwargs["aws_secret_access_key"] = secret_key
    if region or endpoint_url:
        kwargs["region_name"] = region_name
    return session.client("s3", **kwargs)


class LazyS3Client:
    """A boto3 S3 client made by :func:`make_s3_client` when first used (any attribute is the
    client's), plus a listing without botocore when the settings allow it (see
    :mod:`prefetch.sources.s3_direct`): a no-op pull then neither imports botocore nor creates a
    client (~0.5 CPU-s of the ~0.9 such a pull cost, bench/README.md issue 15)."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings  #: make_s3_client's keyword arguments
        self._client: Any = None
        self._direct_buckets: dict[str, DirectBucket | None] = {}
        self._lock = threading.Lock()

    @property
    def created(self) -> bool:
        return self._client is not None

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = make_s3_client(**self.settings)
            return self._client

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.client(), name)

    def direct_bucket(self, bucket: str) -> DirectBucket | None:
        """The botocore-free lister of ``bucket`` (one per bucket, so the region a redirect
        taught it is kept), or None when botocore must list."""
        with self._lock:
            if bucket not in self._direct_buckets:
                self._direct_buckets[bucket] = self._make_direct(bucket)
            return self._direct_buckets[bucket]

    def _make_direct(self, bucket: str) -> DirectBucket | None:
        opts = self.settings
        if opts.get("profile") is not None:
            return None  # a profile's own credentials or settings: botocore's to resolve
        keys = None
        if opts.get("access_key") and opts.get("secret_key"):
            keys = StaticCredentials(opts["access_key"], opts["secret_key"])
        found = direct_settings(
            bucket, endpoint_url=opts.get("endpoint_url"), region=opts.get("region"),
            credentials=keys,
        )  # fmt: skip
        if found is None:
            return None
        http = shared_http_pool(
            int(opts.get("max_pool_connections", 32)), settings.proxies(override=opts.get("proxy"))
        )
        timeout = urllib3.Timeout(
            connect=float(opts.get("connect_timeout", 10)), read=float(opts.get("read_timeout", 60))
        )
        return DirectBucket(
            bucket, endpoint_url=found.endpoint_url, region=found.region,
            credentials=found.credentials, http=http, timeout=timeout,
            on_error=lambda what, answer: _answer_error(what, answer, has_body=True),
        )  # fmt: skip


def lazy_s3_client(**settings: Any) -> LazyS3Client:
    """:func:`make_s3_client`'s client, created when something first needs it."""
    return LazyS3Client(**settings)


def s3_proxies(endpoint_url: str | None, region: str, proxy: str | None) -> dict[str, str]:
    """botocore's ``proxies`` for a client of ``endpoint_url`` (None: AWS S3 in ``region``).

    Always explicit, even empty: left unset, botocore would read the environment itself with
    its own NO_PROXY reading, and a per-source setting could not say "direct". The decision is
    the one every source makes (settings.Proxies.proxy_for), taken for the endpoint's host,
    which is where botocore sends every request of the client (a bucket's virtual host is a
    subdomain of it, which NO_PROXY's suffix rule covers the same way)."""
    endpoint = endpoint_url or f"https://s3.{region}.amazonaws.com"
    chosen = settings.proxies(override=proxy).proxy_for(endpoint)
    if chosen is None:
        return {}
    return {"http": chosen, "https": chosen}


def translate(exc: Exception, what: str) -> Exception:
    """A boto3/botocore exception as the package's error (raise it ``from exc``)."""
    if "botocore" not in sys.modules:
        # nothing has loaded botocore, so this is no botocore exception: a direct request's
        # (s3_direct) failure, translated without importing botocore (~0.2 s)
        return _transport_or_other(exc, what)
    import botocore.exceptions as bce

    if isinstance(exc, bce.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        msg = err.get("Message") or code
        if code == "NoSuchBucket":
            return BucketNotFoundError(f"{what}: bucket does not exist")
        return _client_error(what, code, int(status or 0), msg)
    if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
        return AccessDeniedError(
            f"{what}: no AWS credentials found",
            hint="set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or use IRSA",
        )
    if isinstance(exc, bce.EndpointConnectionError | bce.ConnectTimeoutError):
        return TransientSourceError(f"{what}: cannot connect to the S3 endpoint: {exc}")
    if isinstance(
        exc,
        bce.ReadTimeoutError
        | bce.ResponseStreamingError
        | bce.ConnectionClosedError
        | bce.IncompleteReadError
        | bce.HTTPClientError
        | ConnectionError
        | TimeoutError,
    ):
        return TransientSourceError(f"{what}: {type(exc).__name__}: {exc}")
    if isinstance(exc, bce.ParamValidationError):
        return SourceError(f"{what}: invalid request: {exc}")
    return _transport_or_other(exc, what)


def _transport_or_other(exc: Exception, what: str) -> SourceError:
    """A failure that is not botocore's: urllib3's and http.client's (and socket errors) are
    transient, anything else a SourceError naming it."""
    if isinstance(exc, urllib3.exceptions.ProxyError):
        return transport_error(exc, what)
    if isinstance(
        exc,
        urllib3.exceptions.HTTPError | http.client.HTTPException | ConnectionError | TimeoutError,
    ):
        return TransientSourceError(f"{what}: {type(exc).__name__}: {exc}")
    return SourceError(f"{what}: {type(exc).__name__}: {exc}")


def _body_reader(body: Any, what: str, length: int, *, length_known: bool) -> BodyReader:
    """The reader of a checked ranged GET's StreamingBody. botocore's StreamingBody wraps a
    urllib3 response; the ``http.client`` response beneath it is read directly when nothing
    has been read or buffered above it yet (the layers are private: otherwise the StreamingBody
    itself is read). A body running past the range is a SourceError."""
    raw = getattr(body, "_raw_stream", None)
    fresh = getattr(body, "_amount_read", 0) == 0 and not getattr(raw, "_decoded_buffer", None)
    return BodyReader(
        body,
        what,
        length,
        raw=http_client_response(raw) if fresh else None,
        socket_owner=raw,
        on_close=lambda _reusable: body.close(),
        length_known=length_known,
        translate=_read_failure,
        overrun=SourceError,
    )


def _read_failure(exc: Exception, what: str) -> Exception:
    """A failed body read: a socket or protocol failure is transient (as for every source),
    anything else is translated as botocore's."""
    if isinstance(exc, OSError | http.client.HTTPException):
        return transport_error(exc, what)
    return translate(exc, what)


def _client_error(what: str, code: str, status: int, msg: str) -> SourceError:
    """An S3 error answer: its code when S3 names one we know, else the status through the one
    status table; a 404 while reading a pinned object means it went away (it was listed)."""
    if code in ("PreconditionFailed", "412"):
        cls: type[SourceError] = SourceChangedError
    elif code in ("NoSuchKey", "404") or status == 404:
        return SourceChangedError(f"{what}: the object disappeared during the download")
    elif code in _DENIED_CODES:
        cls = AccessDeniedError
    elif code in _TRANSIENT_CODES:
        cls = TransientSourceError
    else:
        cls = error_class(status) if status else SourceError
    if cls is SourceChangedError:
        return SourceChangedError(f"{what}: the object changed during the download")
    if cls is AccessDeniedError:
        return AccessDeniedError(
            f"{what}: access denied ({code}: {msg})",
            hint="check the AWS credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID, IRSA role) "
            "and that they may s3:ListBucket and s3:GetObject here",
        )
    if cls is TransientSourceError:
        return TransientSourceError(f"{what}: {code or status}: {msg}")
    return cls(f"{what}: {code or status}: {msg}")


def _answer_error(what: str, answer: LeanResponse, *, has_body: bool) -> SourceError:
    """The error of a lean request's error answer, as :func:`translate` makes it of botocore's
    (plus the server's Retry-After on a transient one: S3 throttling may send it)."""
    code, msg = answer.error_code_and_message(has_body=has_body)
    if code == msg == str(answer.status):  # no S3 error document: say what the status means
        msg = bare_status(answer.status, answer.headers)
    if code == "NoSuchBucket":
        return BucketNotFoundError(f"{what}: bucket does not exist")
    error = _client_error(what, code, answer.status, msg)
    retry_after = parse_retry_after(answer.headers.get("Retry-After"))
    if isinstance(error, TransientSourceError) and retry_after is not None:
        return TransientSourceError(str(error), retry_after=retry_after)
    return error


def _lean_body_reader(answer: LeanResponse, what: str, length: int) -> BodyReader:
    """The reader of a checked ranged GET sent by the lean path: straight from the
    ``http.client`` response; the connection goes back to the pool only after a clean read."""

    def finish(reusable: bool) -> None:
        if reusable:
            answer.release()
        else:
            answer.discard()

    return BodyReader(
        answer.raw,
        what,
        length,
        raw=http_client_response(answer.raw),
        socket_owner=answer.raw,
        on_close=finish,
        length_known=answer.headers.get("Content-Length") is not None,
        translate=_read_failure,
        overrun=SourceError,
    )


class _Alarms:
    """Callbacks run at deadlines by one daemon thread. The whole-object GET of every small
    object is bounded in time (see ``_read_small_body``); a ``threading.Timer`` each would
    start and stop one OS thread per file (~7% of the CPU of 1000 small files, measured). Each
    S3 source has its own; the thread ends after ``idle`` seconds with nothing scheduled (the
    agent makes a source per sync) and starts again with the next alarm."""

    def __init__(self, idle: float = 30.0) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, list[Callable[[], None] | None]]] = []
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._idle = idle

    def schedule(self, delay: float, fn: Callable[[], None]) -> list[Callable[[], None] | None]:
        """Run ``fn`` in ``delay`` seconds unless the returned handle is cancelled first."""
        handle: list[Callable[[], None] | None] = [fn]
        with self._cond:
            self._seq += 1
            heapq.heappush(self._heap, (time.monotonic() + delay, self._seq, handle))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="s3-alarms", daemon=True)
                self._thread.start()
            self._cond.notify()
        return handle

    @staticmethod
    def cancel(handle: list[Callable[[], None] | None]) -> None:
        handle[0] = None

    @property
    def running(self) -> bool:
        with self._cond:
            return self._thread is not None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    if self._heap and self._heap[0][2][0] is None:
                        heapq.heappop(self._heap)  # cancelled: forget it now
                        continue
                    if not self._heap:
                        if not self._cond.wait(self._idle) and not self._heap:
                            self._thread = None  # idle: the next schedule starts another
                            return
                        continue
                    self._cond.wait(self._heap[0][0] - time.monotonic())
                _, _, handle = heapq.heappop(self._heap)
            fn = handle[0]
            if fn is not None:
                with contextlib.suppress(Exception):
                    fn()


class _BytesReader:
    """A range of an object already in memory (a small object fetched whole by describe)."""

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._pos = 0

    def readinto(self, buf: memoryview, /) -> int:
        n = min(len(buf), len(self._data) - self._pos)
        buf[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._data = memoryview(b"")


class S3Source:
    """Objects under ``s3://bucket/prefix``; a file's path is its key relative to the prefix."""

    def __init__(self, client: Any, uri: SourceURI, *, retry: RetryPolicy | None = None) -> None:
        if uri.scheme != "s3":
            raise ValueError(f"not an S3 URI: {uri}")
        self._client = client
        self._uri = uri
        self._retry = retry or RetryPolicy()
        self._small: dict[tuple[str, str], bytes] = {}  # (key, etag) -> body, see SMALL_OBJECT
        self._small_reserved = 0
        self._small_lock = threading.Lock()
        #: Seconds a whole-object GET of a small object (see SMALL_OBJECT) may take.
        self.small_get_limit = SMALL_GET_LIMIT
        self._alarms = _Alarms()
        #: Object GETs and HEADs without botocore's per-request machinery: the bucket's
        #: DirectBucket when the listing was made without botocore (s3_direct), else set up
        #: from the listing request botocore signed (s3_lean); None until the first listing,
        #: or when neither can be.
        self._lean_path: ObjectRequests | None = None
        #: False: every request goes through botocore (for comparisons; see bench/).
        self.lean_requests = True

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        def once() -> Any:
            try:
                return fn(**kwargs)
            except PrefetchError:
                raise  # already one of ours (e.g. a stalled small-object GET)
            except Exception as exc:
                raise translate(exc, what) from exc

        return call_with_retries(once, self._retry, what=what)

    def _lean_for(self, key: str) -> ObjectRequests | None:
        """The lean path for requests about ``key`` (None: botocore's). A key with a dot
        segment stays on botocore when the path is the direct one (see ``sends_as_signed``)."""
        lean = self._lean_path
        if isinstance(lean, DirectBucket) and not sends_as_signed(key):
            return None
        return lean

    def list_page(self, what: str, **kwargs: Any) -> dict[str, Any]:
        """One ListObjectsV2 page of the bucket (botocore's arguments but Bucket, and answer
        shape): without botocore when the client allows it (see LazyS3Client), else through
        botocore, whose signed request then sets up the lean object path."""
        bucket = self._uri.location
        lister = self._client.direct_bucket(bucket) if self._lists_directly() else None
        if lister is not None:
            page: dict[str, Any] = self._call(what, lister.list_objects_v2, Bucket=bucket, **kwargs)
            if self.lean_requests and self._lean_path is None:
                self._lean_path = lister  # its object requests need no botocore either
            return page
        with capture_listing_requests(self._client) as sent:
            page = self._call(what, self._client.list_objects_v2, Bucket=bucket, **kwargs)
        if sent and self.lean_requests:
            self._lean_path = lean_requests_for(self._client, sent[-1])
        return page

    def ensure_lean_path(self) -> None:
        """Set up the lean object path for a reader that lists nothing (the mirror source reads
        its blobs by key): a listing of at most one key under the prefix tells where the bucket
        is and how to sign, as the model's listing would."""
        if self.lean_requests and self._lean_path is None:
            where = f"s3://{self._uri.location}/{self._uri.path}"
            self.list_page(f"listing {where}", Prefix=self._uri.path, MaxKeys=1)

    def _lists_directly(self) -> bool:
        return self.lean_requests and isinstance(self._client, LazyS3Client)

    # -- resolve -----------------------------------------------------------------------------

    def resolve(self, spec: ModelSpec) -> Snapshot:
        bucket, prefix = self._uri.location, self._uri.path
        where = f"s3://{bucket}/{prefix}"
        files: list[RemoteFile] = []
        sidecar: RemoteFile | None = None
        seen_any = False
        token: str | None = None
        pages = ListingPages(where)
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix, "MaxKeys": 1000}
            if token:
                kwargs["ContinuationToken"] = token
            page = self.list_page(f"listing {where}", **kwargs)
            for obj in listed_objects(page, where):
                key: str = obj["Key"]
                rel = key[len(prefix) :]
                if not rel or rel.endswith("/"):
                    continue  # the prefix itself, or a "folder" marker
                seen_any = True
                remote = RemoteFile(
                    path=rel,
                    size=int(obj["Size"]),
                    version=str(obj.get("ETag", "")).strip('"'),
                    locator=key,
                )
                if rel == SIDECAR_MANIFEST:
                    sidecar = remote
                elif spec.wants(rel):
                    files.append(remote)
            token = pages.next_token(page)
            if token is None:
                break
        if not seen_any:
            raise NoMatchingFilesError(f"no objects under {where}")
        if not files:
            raise NoMatchingFilesError(
                f"no object under {where} matches the include/exclude patterns",
                hint=f"include={list(spec.include)} exclude={list(spec.exclude)}",
            )
        if sidecar is not None:
            files = self._apply_sidecar(sidecar, files)
        files.sort(key=lambda f: f.path)
        digest = listing_digest([(f.path, f.size, f.version) for f in files])
        return Snapshot(
            source=str(self._uri),
            revision_id=spec.hf_revision or digest,
            files=tuple(files),
            requested_revision=None,
            repo_id=spec.repo_id,
        )

    def read_object(self, key: str, what: str, *, limit: int) -> bytes | None:
        """The whole body of the object ``key`` of the bucket (None: there is no such object),
        refused past ``limit`` bytes; retried like every S3 call. For metadata (a sidecar, a
        mirror's refs and commits): on the lean path once it is set up, so a pull with static
        keys reads them without botocore too."""
        lean = self._lean_for(key)

        def over_limit() -> SourceError:
            return SourceError(f"{what}: larger than {limit} bytes")

        def read_lean() -> bytes | None:
            assert lean is not None
            answer = lean.send("GET", key, headers={})
            if answer.status >= 300:
                if answer.status == 404:
                    code, _ = answer.error_code_and_message(has_body=True)
                    if code != "NoSuchBucket":
                        return None
                raise _answer_error(what, answer, has_body=True)
            data: bytes = read_page(answer.raw, limit + 1)
            if len(data) > limit:
                answer.discard()
                raise over_limit()
            answer.release()
            return data

        def read_botocore() -> bytes | None:
            import botocore.exceptions as bce  # loaded with the client this read creates

            try:
                resp = self._client.get_object(Bucket=self._uri.location, Key=key)
            except bce.ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code", "")) in _MISSING_KEY_CODES:
                    return None
                raise
            body = resp["Body"]
            try:
                data: bytes = body.read(limit + 1)
            finally:
                body.close()
            if len(data) > limit:
                raise over_limit()
            return data

        found: bytes | None = self._call(what, read_lean if lean is not None else read_botocore)
        return found

    def _apply_sidecar(self, sidecar: RemoteFile, files: list[RemoteFile]) -> list[RemoteFile]:
        what = f"reading s3://{self._uri.location}/{sidecar.locator}"
        body = self.read_object(sidecar.locator, what, limit=MAX_SIDECAR_BYTES)
        if body is None:
            raise SourceChangedError(f"{what}: the object disappeared since it was listed")
        sums: dict[str, str] = {}
        for n, line in enumerate(body.decode("utf-8", "replace").splitlines(), 1):
            if not line.strip() or line.startswith("#"):
                continue
            m = _SIDECAR_LINE.match(line.rstrip("\r"))
            if m is None:
                raise SourceError(
                    f"{what}: line {n} is not '<sha256>  <path>' (sha256sum format): {line[:80]!r}"
                )
            sums[m.group(2).removeprefix("./")] = m.group(1).lower()
        return [
            f.with_(
                checksums=(*f.checksums, Checksum("sha256", sums[f.path], origin="sidecar")),
                blob_id=sums[f.path],
            )
            if f.path in sums
            else f
            for f in files
        ]

    # -- describe ----------------------------------------------------------------------------

    def describe(self, file: RemoteFile) -> RemoteFile:
        if file.described:
            return file
        if (
            0 < file.size <= SMALL_OBJECT
            and not _MULTIPART_ETAG.match(file.version)
            and self._reserve_small(file.size)
        ):
            try:
                return self._describe_by_get(file)
            except BaseException:
                self._release_small(file.size)
                raise
        bucket, key = self._uri.location, file.locator
        what = f"s3://{bucket}/{key}"
        lean = self._lean_for(key)
        if lean is not None:
            head = self._call(
                f"HEAD {what}", self._lean_head, lean=lean, key=key, label=f"HEAD {what}",
                headers={"x-amz-checksum-mode": "ENABLED", **_if_match(file.version)},
            )  # fmt: skip
            return self._described(file, head, what)
        head = self._call(
            f"HEAD {what}",
            self._client.head_object,
            Bucket=bucket,
            Key=key,
            ChecksumMode="ENABLED",
            **({"IfMatch": file.version} if file.version else {}),
        )
        return self._described(file, head, what)

    def _lean_answer(
        self,
        lean: ObjectRequests,
        method: str,
        key: str,
        what: str,
        *,
        headers: dict[str, str],
        query: str = "",
    ) -> LeanResponse:
        """Send one request on the lean path; an error answer or a transport failure raises
        the error botocore's path would."""
        try:
            answer = lean.send(method, key, headers=headers, query=query)
        except Exception as exc:
            raise translate(exc, what) from exc
        if answer.status >= 300:
            raise _answer_error(what, answer, has_body=method != "HEAD")
        return answer

    def _lean_head(
        self,
        *,
        lean: ObjectRequests,
        key: str,
        label: str,
        headers: dict[str, str],
        query: str = "",
    ) -> dict[str, Any]:
        """A HEAD on the lean path, answered in botocore's shape (``label`` names it in errors)."""
        answer = self._lean_answer(lean, "HEAD", key, label, headers=headers, query=query)
        answer.release()
        return answer.fields()

    def _described(self, file: RemoteFile, head: dict[str, Any], what: str) -> RemoteFile:
        """``file`` with the checksums a HEAD (or whole-object GET) response states."""
        bucket, key = self._uri.location, file.locator
        etag = str(head.get("ETag", "")).strip('"')
        size = int(head["ContentLength"])
        if (file.version and etag != file.version) or size != file.size:
            raise SourceChangedError(f"{what}: the object changed since it was listed")
        m = _MULTIPART_ETAG.match(etag)
        parts: tuple[int, ...] | None = None
        if m is not None and _part_layout_needed(head):
            parts = self._part_sizes(bucket, key, size, int(m.group(1)))
        composite_type = head.get("ChecksumType") == "COMPOSITE"
        found: list[Checksum] = []
        for algorithm, field_name in _ADDITIONAL:
            value = head.get(field_name)
            if not value:
                continue
            is_composite = composite_type or bool(re.search(r"-\d+$", value))
            if is_composite and parts is None:
                continue  # composite of a layout we do not know: cannot be checked
            found.append(
                Checksum(
                    algorithm,
                    value,
                    encoding="base64",
                    part_sizes=parts if is_composite else None,
                    origin="s3-checksum",
                )
            )
        encrypted_kms = str(head.get("ServerSideEncryption", "")).startswith("aws:kms") or bool(
            head.get("SSECustomerAlgorithm")
        )
        if not encrypted_kms and _MD5_ETAG.match(etag):
            found.append(Checksum("md5", etag, origin="etag"))
        elif not encrypted_kms and parts is not None:
            found.append(Checksum("md5", etag, part_sizes=parts, origin="multipart etag"))
        return file.with_(
            checksums=(*found, *file.checksums), described=True, version=etag or file.version
        )

    def _describe_by_get(self, file: RemoteFile) -> RemoteFile:
        bucket, key = self._uri.location, file.locator
        what = f"s3://{bucket}/{key}"

        lean = self._lean_for(key)

        def get() -> tuple[dict[str, Any], bytes]:
            if lean is not None:
                answer = self._lean_answer(
                    lean, "GET", key, f"GET {what}",
                    headers={"x-amz-checksum-mode": "ENABLED", **_if_match(file.version)},
                )  # fmt: skip
                data = self._read_small_body(answer.raw, what, finish=answer.discard)
                return answer.fields(), data
            resp = self._client.get_object(
                Bucket=bucket,
                Key=key,
                ChecksumMode="ENABLED",
                **({"IfMatch": file.version} if file.version else {}),
            )
            body = resp["Body"]
            # the raw bytes: botocore would check the checksum itself, and a mismatch must be
            # found (and handled: delete, retry once) by Verify like for every other file
            raw = getattr(body, "_raw_stream", None)
            return resp, self._read_small_body(raw if raw is not None else body, what,
                                               finish=body.close)  # fmt: skip

        resp, data = self._call(f"GET {what}", get)
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status != 200:
            raise SourceError(f"GET {what}: the server answered {status} to a whole-object GET")
        if len(data) != int(resp.get("ContentLength", -1)) or len(data) != file.size:
            raise TransientSourceError(
                f"GET {what}: got {len(data)} bytes of the object, the listing says {file.size}"
            )
        described = self._described(file, resp, what)
        with self._small_lock:
            self._small[(key, described.version)] = data
        return described

    def _read_small_body(self, body: Any, what: str, *, finish: Callable[[], None]) -> bytes:
        """The whole body of a small object's GET, then ``finish()``. A trickling server would
        hold this read for ever (each byte resets the socket's read timeout), and the engine's
        stall rule only watches ranged reads: so the read is bounded by ``small_get_limit``."""
        fired = threading.Event()

        def too_slow() -> None:
            fired.set()
            shutdown_socket_of(body)

        cut = self._alarms.schedule(self.small_get_limit, too_slow)
        try:
            return bytes(body.read())
        except Exception as exc:
            if fired.is_set():
                raise TransientSourceError(
                    f"GET {what}: the body took longer than {self.small_get_limit:g}s "
                    "(a stalled server)"
                ) from exc
            raise
        finally:
            self._alarms.cancel(cut)
            finish()

    def _reserve_small(self, size: int) -> bool:
        with self._small_lock:
            if self._small_reserved + size > _SMALL_BUDGET:
                return False
            self._small_reserved += size
            return True

    def _release_small(self, size: int) -> None:
        with self._small_lock:
            self._small_reserved -= size

    def _take_small(self, file: RemoteFile) -> bytes | None:
        """The body describe fetched, once; later reads of the file go to the server."""
        with self._small_lock:
            data = self._small.pop((file.locator, file.version), None)
            if data is not None:
                self._small_reserved -= len(data)
        return data

    def _part_sizes(self, bucket: str, key: str, size: int, count: int) -> tuple[int, ...] | None:
        """Part layout of a multipart object: HEAD ?partNumber=1, assuming equal parts but the last;
        when the sizes do not add up, HEAD every part."""
        what = f"HEAD s3://{bucket}/{key} part"

        lean = self._lean_for(key)

        def part_size(n: int) -> int:
            if lean is not None:
                h = self._call(f"{what} {n}", self._lean_head, lean=lean, key=key,
                               label=f"{what} {n}", headers={},
                               query=f"partNumber={n}")  # fmt: skip
            else:
                h = self._call(f"{what} {n}", self._client.head_object, Bucket=bucket, Key=key,
                               PartNumber=n)  # fmt: skip
            return int(h["ContentLength"])

        try:
            first = part_size(1)
        except SourceError as exc:
            log.warning("cannot read the part layout of s3://%s/%s: %s", bucket, key, exc)
            return None
        last = size - first * (count - 1)
        if count == 1:
            return (size,)
        if 0 < last <= first:
            return (first,) * (count - 1) + (last,)
        sizes = tuple([first] + [part_size(n) for n in range(2, count + 1)])
        return sizes if sum(sizes) == size else None

    # -- read --------------------------------------------------------------------------------

    def open_range(self, file: RemoteFile, start: int, end: int) -> BodyReader | _BytesReader:
        small = self._take_small(file)
        if small is not None and len(small) == file.size:
            return _BytesReader(memoryview(small)[start:end])
        bucket, key = self._uri.location, file.locator
        what = f"s3://{bucket}/{key} bytes {start}-{end - 1}"
        lean = self._lean_for(key)
        if lean is not None:
            return self._lean_open_range(lean, file, start, end, what)
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
        if file.version:
            kwargs["IfMatch"] = file.version
        try:
            resp = self._client.get_object(**kwargs)
        except Exception as exc:
            raise translate(exc, what) from exc
        etag = str(resp.get("ETag", "")).strip('"')
        if file.version and etag and etag != file.version:
            resp["Body"].close()
            raise SourceChangedError(f"{what}: the object changed during the download")
        problem = range_answer_problem(
            start,
            end,
            file.size,
            resp.get("ResponseMetadata", {}).get("HTTPStatusCode"),
            resp.get("ContentRange"),
            resp.get("ContentLength"),
        )
        if problem is not None:
            resp["Body"].close()
            raise SourceError(f"{what}: {problem}")
        length = resp.get("ContentLength")
        return _body_reader(resp["Body"], what, end - start, length_known=length is not None)

    def _lean_open_range(
        self, lean: ObjectRequests, file: RemoteFile, start: int, end: int, what: str
    ) -> BodyReader:
        """``open_range`` on the lean path: the same checks of the answer as botocore's path."""
        headers = {"Range": f"bytes={start}-{end - 1}", **_if_match(file.version)}
        answer = self._lean_answer(lean, "GET", file.locator, what, headers=headers)
        resp = answer.fields()
        etag = str(resp.get("ETag", "")).strip('"')
        if file.version and etag and etag != file.version:
            answer.discard()
            raise SourceChangedError(f"{what}: the object changed during the download")
        problem = range_answer_problem(
            start, end, file.size, answer.status, resp.get("ContentRange"),
            resp.get("ContentLength"),
        )  # fmt: skip
        if problem is not None:
            answer.discard()
            raise SourceError(f"{what}: {problem}")
        return _lean_body_reader(answer, what, end - start)


def _part_layout_needed(head: dict[str, Any]) -> bool:
    """Does checking this multipart object need its part sizes (a HEAD ?partNumber=1 more)?
    Only for a composite checksum, or for the multipart ETag when no full-object checksum
    stronger than MD5 is served: Verify checks the strongest served checksum, so with a
    FULL_OBJECT CRC64NVME (the usual upload today) the layout would go unused."""
    composite_type = head.get("ChecksumType") == "COMPOSITE"
    strong_full_object = False
    for algorithm, field_name in _ADDITIONAL:
        value = head.get(field_name)
        if not value:
            continue
        if composite_type or re.search(r"-\d+$", str(value)):
            return True
        strong_full_object |= STRENGTH.index(algorithm) < STRENGTH.index("md5")
    encrypted = str(head.get("ServerSideEncryption", "")).startswith("aws:kms") or bool(
        head.get("SSECustomerAlgorithm")
    )
    return not strong_full_object and not encrypted


def _if_match(version: str) -> dict[str, str]:
    """The If-Match header pinning a request to the listed ETag (none when unknown)."""
    return {"If-Match": version} if version else {}
