"""S3 source: list, describe (HEAD with checksums) and ranged GETs pinned to the ETag.

S3 is addressing plus a signer, on the one transport seam (:mod:`prefetch.sources.http.transport`):
every object request (HEAD, whole-object GET, ranged GET, part-size HEAD, metadata reads) is built
by an :class:`~prefetch.sources.s3.direct.S3Bucket` and signed by one of two signers: static keys
(SigV4 here, :mod:`prefetch.sources.s3.direct`: no botocore import, no client) or botocore's
credential chain (its public ``S3SigV4Auth``, :mod:`prefetch.sources.s3.sdk`), whose
addressing comes from the listing botocore made. What stays on botocore's client: the listing
when the keys are not static, keys with "." / ".." segments and what the seam cannot sign (see
sdk), through :class:`~prefetch.sources.s3.sdk.BotocoreObjects`, answered in the
same shape. boto3's retries are off (:func:`make_s3_client`): retrying lives in
prefetch.pipeline.retry.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import logging
import re
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, Unpack

import urllib3.exceptions

from prefetch.pipeline.deadline import SCOPE, Alarms, Watch, call_with_deadline
from prefetch.pipeline.retry import AdaptiveRate, RetryPolicy, call_with_retries
from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot, listing_digest
from prefetch.pipeline.spec import SIDECAR_MANIFEST, ModelSpec, SourceURI
from prefetch.pipeline.verify import STRENGTH
from prefetch.sources.base import shutdown_socket_of
from prefetch.sources.http.transport import (
    NETWORK_HINT,
    BodyReader,
    HttpClient,
    Response,
    check_range_answer,
    connection_failure,
    error_class,
    origin_of,
    parse_retry_after,
    range_body_reader,
    shared_http_pool,
    tls_error,
    transport_error,
)
from prefetch.sources.s3.direct import (
    S3Bucket,
    StaticCredentials,
    direct_settings,
    sends_as_signed,
)
from prefetch.sources.s3.listing import ListingPages, listed_objects
from prefetch.support import settings
from prefetch.support.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    NoMatchingFilesError,
    PrefetchError,
    SourceChangedError,
    SourceError,
    ThrottledError,
    TlsError,
    TransientSourceError,
)

if TYPE_CHECKING:  # imported where used: a pull with static keys never needs botocore's path
    from prefetch.sources.s3.sdk import BotocoreObjects, S3Client

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
#: The codes (and statuses) of an answer asking the client to slow down (see AdaptiveRate).
_THROTTLE_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "503", "429",
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
T = TypeVar("T")

SMALL_OBJECT = 1024 * 1024
_SMALL_BUDGET = 64 * 1024 * 1024
#: A SHA256SUMS sidecar is read up to this size (a line per file: ~100 bytes each).
MAX_SIDECAR_BYTES = 64 * 1024 * 1024
#: The error codes of a GET for a key that does not exist.
_MISSING_KEY_CODES = ("NoSuchKey", "404", "NotFound")
#: botocore's response field name -> the header it comes from (what the S3 source reads).
HEADER_FIELDS = (
    ("ETag", "etag"),
    ("ContentLength", "content-length"),
    ("ContentRange", "content-range"),
    ("ChecksumSHA256", "x-amz-checksum-sha256"),
    ("ChecksumSHA1", "x-amz-checksum-sha1"),
    ("ChecksumCRC64NVME", "x-amz-checksum-crc64nvme"),
    ("ChecksumCRC32C", "x-amz-checksum-crc32c"),
    ("ChecksumCRC32", "x-amz-checksum-crc32"),
    ("ChecksumType", "x-amz-checksum-type"),
    ("ServerSideEncryption", "x-amz-server-side-encryption"),
    ("SSECustomerAlgorithm", "x-amz-server-side-encryption-customer-algorithm"),
)
_ERROR_CODE = re.compile(rb"<Code>([^<]{1,200})</Code>")
_ERROR_MESSAGE = re.compile(rb"<Message>([^<]{0,500})</Message>")
#: At most this much of an error answer's body is read for its code and message.
_ERROR_BODY_LIMIT = 64 * 1024
#: A small object's body must arrive within this many seconds (at least 17 KiB/s for 1 MiB).
SMALL_GET_LIMIT = 60.0
#: A listing page or a metadata object (sidecar, mirror refs and commits) must arrive within this
#: many seconds per attempt (as the Hub's metadata calls).
METADATA_TIMEOUT = 120.0


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
    ca_bundle: str | None = None,
) -> Any:  # boto3's client: boto3 publishes no types (see S3Client for what the source calls)
    """A boto3 S3 client tuned for many parallel ranged GETs, with boto3's retries off.

    ``proxy`` is the source's own proxy setting (None: ``HTTP(S)_PROXY``; "": direct; see
    :func:`prefetch.support.settings.proxies`). ``sign_payloads=False`` sends request bodies as
    UNSIGNED-PAYLOAD instead of SHA256-hashing each one into the signature (botocore does hash
    them, even over HTTPS, when the caller supplies the body's checksum itself); only for
    callers whose every body carries a checksum S3 verifies. None: botocore's rule (and the
    AWS config file's ``payload_signing_enabled``). ``ca_bundle``: the CA bundle a flag or
    config key chose; TLS is verified with the one :func:`prefetch.support.settings.ca_bundle`
    decides from it and the environment (botocore alone ignores ``SSL_CERT_FILE`` and
    ``REQUESTS_CA_BUNDLE``, so it is always told)."""
    trust = settings.ca_bundle(ca_bundle, aws_profile=profile)
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
    kwargs: dict[str, object] = {"config": config}
    if trust.path is not None:
        kwargs["verify"] = trust.path
    if endpoint_url:
        kwargs["endpoint_url"] = endpoint_url
    if access_key and secret_key:
        kwargs["aws_access_key_id"] = access_key
        kwargs["aws_secret_access_key"] = secret_key
    if region or endpoint_url:
        kwargs["region_name"] = region_name
    return session.client("s3", **kwargs)


class S3ClientSettings(TypedDict, total=False):
    """:func:`make_s3_client`'s keyword arguments."""

    endpoint_url: str | None
    access_key: str | None
    secret_key: str | None
    region: str | None
    max_pool_connections: int
    connect_timeout: float
    read_timeout: float
    profile: str | None
    proxy: str | None
    sign_payloads: bool | None
    ca_bundle: str | None


class LazyS3Client:
    """A boto3 S3 client made by :func:`make_s3_client` when first used (any attribute is the
    client's), plus a listing without botocore when the settings allow it (see
    :mod:`prefetch.sources.s3.direct`): a no-op pull then neither imports botocore nor creates a
    client (~0.5 CPU-s of the ~0.9 such a pull cost, bench/README.md issue 15)."""

    def __init__(self, **settings: Unpack[S3ClientSettings]) -> None:
        self.settings = settings  #: make_s3_client's keyword arguments
        self._client: Any = None  # boto3's client (untyped: see make_s3_client)
        self._direct_buckets: dict[str, S3Bucket | None] = {}
        self._lock = threading.Lock()
        #: The request rate to this client's endpoint, shared by every source using the client
        #: (the agent shares a client per endpoint between models): a throttled node slows
        #: down as a whole.
        self.pace = AdaptiveRate()

    @property
    def created(self) -> bool:
        return self._client is not None

    def client(self) -> Any:  # boto3's client
        with self._lock:
            if self._client is None:
                self._client = make_s3_client(**self.settings)
            return self._client

    def __getattr__(self, name: str) -> Any:  # an attribute of boto3's client
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.client(), name)

    def direct_bucket(self, bucket: str) -> S3Bucket | None:
        """The botocore-free lister of ``bucket`` (one per bucket, so the region a redirect
        taught it is kept), or None when botocore must list."""
        with self._lock:
            if bucket not in self._direct_buckets:
                self._direct_buckets[bucket] = self._make_direct(bucket)
            return self._direct_buckets[bucket]

    def http(self) -> HttpClient:
        """The seam's pool for this client's settings (size, proxy, CA bundle)."""
        opts = self.settings
        return shared_http_pool(
            int(opts.get("max_pool_connections", 32)),
            settings.proxies(override=opts.get("proxy")),
            ca_certs=self.ca_certs(),
        )

    def ca_certs(self) -> str | None:
        """The CA bundle botocore's client verifies TLS with (None: the system's)."""
        opts = self.settings
        return settings.ca_bundle(opts.get("ca_bundle"), aws_profile=opts.get("profile")).path

    def timeout(self) -> urllib3.Timeout:
        opts = self.settings
        return urllib3.Timeout(
            connect=float(opts.get("connect_timeout", 10)), read=float(opts.get("read_timeout", 60))
        )

    def _make_direct(self, bucket: str) -> S3Bucket | None:
        opts = self.settings
        if opts.get("profile") is not None:
            return None  # a profile's own credentials or settings: botocore's to resolve
        keys = None
        access_key, secret_key = opts.get("access_key"), opts.get("secret_key")
        if access_key and secret_key:
            keys = StaticCredentials(access_key, secret_key)
        found = direct_settings(
            bucket, endpoint_url=opts.get("endpoint_url"), region=opts.get("region"),
            credentials=keys,
        )  # fmt: skip
        if found is None:
            return None
        return S3Bucket.static(
            bucket, endpoint_url=found.endpoint_url, region=found.region,
            credentials=found.credentials, http=self.http(), timeout=self.timeout(),
            on_error=lambda what, answer: answer_error(what, answer, has_body=True),
        )  # fmt: skip


def lazy_s3_client(**settings: Unpack[S3ClientSettings]) -> LazyS3Client:
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

    if isinstance(exc, bce.SSLError):
        url = str(exc.kwargs.get("endpoint_url") or "")
        scheme, host, port = origin_of(url)
        refused = tls_error(exc, f"{what}: {scheme}://{host}:{port}" if host else what)
        if refused is not None:
            return refused
    if isinstance(exc, bce.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        meta = exc.response.get("ResponseMetadata", {})
        status = meta.get("HTTPStatusCode", 0)
        msg = err.get("Message") or code
        if code == "NoSuchBucket":
            return BucketNotFoundError(f"{what}: bucket does not exist")
        error = _client_error(what, code, int(status or 0), msg)
        # the server's Retry-After (S3 throttling may send it), as answer_error keeps it
        return _with_retry_after(error, dict(meta.get("HTTPHeaders") or {}))
    if isinstance(exc, bce.ProxyConnectionError):
        # botocore's "Failed to connect to proxy URL": the proxy's own answer, in one sentence
        # as the seam's requests say it (its cause is urllib3's ProxyError)
        cause = exc.kwargs.get("error")
        if isinstance(cause, urllib3.exceptions.ProxyError):
            return transport_error(cause, what)
        return TransientSourceError(f"{what}: cannot connect through the proxy")
    if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
        return AccessDeniedError(
            f"{what}: no AWS credentials found",
            hint="set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or use IRSA",
        )
    if isinstance(exc, bce.EndpointConnectionError | bce.ConnectTimeoutError):
        return TransientSourceError(
            f"{what}: cannot connect to the S3 endpoint: {exc}", hint=NETWORK_HINT
        )
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
    refused = tls_error(exc, what)
    if refused is not None:
        return refused
    if isinstance(exc, urllib3.exceptions.ProxyError) or connection_failure(exc) is not None:
        return transport_error(exc, what)
    if isinstance(
        exc,
        urllib3.exceptions.HTTPError | http.client.HTTPException | ConnectionError | TimeoutError,
    ):
        return TransientSourceError(f"{what}: {type(exc).__name__}: {exc}")
    return SourceError(f"{what}: {type(exc).__name__}: {exc}")


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
        throttled = code in _THROTTLE_CODES or status in (429, 503)
        kind = ThrottledError if throttled else TransientSourceError
        return kind(f"{what}: {code or status}: {msg}")
    return cls(f"{what}: {code or status}: {msg}")


def error_code_and_message(answer: Response, *, has_body: bool) -> tuple[str, str]:
    """The S3 error code and message of an error answer (read from at most 64 KiB of its XML
    body; a HEAD has none: then the status); the connection is not reused."""
    if answer.error is not None:
        answer.discard()
        return answer.error
    body = b""
    if has_body:
        with contextlib.suppress(Exception):
            body = answer.read(_ERROR_BODY_LIMIT)
    answer.discard()
    code = _ERROR_CODE.search(body)
    message = _ERROR_MESSAGE.search(body)
    code_text = code.group(1).decode("utf-8", "replace").strip() if code else str(answer.status)
    return code_text, (message.group(1).decode("utf-8", "replace") if message else code_text)


def fields_of(answer: Response) -> dict[str, str]:
    """An answer's headers under botocore's names (``ETag``, ``ContentLength``, ``Checksum*``,
    ...): what the describe code reads. A ``ContentLength`` that is not a whole number is
    left out."""
    out: dict[str, str] = {}
    for name, header in HEADER_FIELDS:
        value = answer.headers.get(header)
        if value is not None:
            out[name] = value
    if "ContentLength" in out:
        try:
            int(out["ContentLength"])
        except ValueError:
            del out["ContentLength"]
    return out


def answer_error(what: str, answer: Response, *, has_body: bool) -> SourceError:
    """The error of an S3 error answer, as :func:`translate` makes it of botocore's (plus the
    server's Retry-After on a transient one: S3 throttling may send it)."""
    code, msg = error_code_and_message(answer, has_body=has_body)
    if code == msg == str(answer.status):  # no S3 error document: say what the status means
        from prefetch.sources.http.status_text import bare_status  # an error's words: rare

        msg = bare_status(answer.status, answer.headers)
    if code == "NoSuchBucket":
        return BucketNotFoundError(f"{what}: bucket does not exist")
    error = _client_error(what, code, answer.status, msg)
    return _with_retry_after(error, answer.headers)


def _with_retry_after(error: SourceError, headers: Mapping[str, str]) -> SourceError:
    """``error`` carrying the answer's ``Retry-After`` when it is transient and one was sent
    (``headers``: urllib3's, or botocore's lowercased ``HTTPHeaders``)."""
    value = headers.get("Retry-After") or headers.get("retry-after")
    retry_after = parse_retry_after(value)
    if isinstance(error, TransientSourceError) and retry_after is not None:
        return type(error)(str(error), retry_after=retry_after)
    return error


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

    def __init__(
        self,
        client: S3Client | LazyS3Client,
        uri: SourceURI,
        *,
        retry: RetryPolicy | None = None,
        pace: AdaptiveRate | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        if uri.scheme != "s3":
            raise ValueError(f"not an S3 URI: {uri}")
        self._client = client
        self._uri = uri
        self._retry = retry or RetryPolicy()
        #: Every request waits its turn here: the one given (the agent's, per endpoint), else
        #: the lazy client's (shared by its other sources), else this source's own.
        if pace is None:
            pace = client.pace if isinstance(client, LazyS3Client) else AdaptiveRate()
        self.pace = pace
        #: the CA bundle a flag or config key chose for a client that is not lazy (a lazy
        #: client's settings carry their own), see _ca_bundle
        self._ca_choice = ca_bundle
        self._small: dict[tuple[str, str], bytes] = {}  # (key, etag) -> body, see SMALL_OBJECT
        self._small_reserved = 0
        self._small_lock = threading.Lock()
        #: Seconds a whole-object GET of a small object (see SMALL_OBJECT) may take.
        self.small_get_limit = SMALL_GET_LIMIT
        #: Seconds one attempt at a listing page or a metadata object may take in all.
        self.metadata_timeout = METADATA_TIMEOUT
        self._alarms = Alarms(name="s3-alarms")
        #: The bucket on the transport seam (addressing + a signer), set up by the first
        #: listing; None until then, or when the seam cannot reproduce botocore's requests.
        self._bucket: S3Bucket | None = None
        #: Object requests through botocore's client (see ``_objects_for``), made when needed.
        self._botocore: BotocoreObjects | None = None
        #: False: every request goes through botocore's client (for comparisons; see bench/).
        self.signed_requests = True

    def _call(
        self, what: str, fn: Callable[..., T], *, bounded: bool = False, **kwargs: object
    ) -> T:
        """``fn(**kwargs)`` retried per the policy, its errors the package's; ``bounded``: each
        attempt as a whole within ``metadata_timeout`` (a listing page or metadata object
        trickled byte by byte resets the socket timeout at every byte)."""

        def attempt() -> T:
            ticket = self.pace.acquire(SCOPE.raise_if_aborted)
            try:
                result = fn(**kwargs)
            except TlsError as exc:
                self._paced(ticket, exc)
                raise transport_error(exc, what) from exc  # the seam's, named with what failed
            except PrefetchError as exc:  # already one of ours (e.g. a stalled small GET)
                self._paced(ticket, exc)
                raise
            except Exception as exc:
                SCOPE.raise_if_aborted()  # a stop interrupted it: not a failure to retry
                error = translate(exc, what)
                self._paced(ticket, error)
                raise error from exc
            self.pace.succeeded(ticket)
            return result

        def once() -> T:
            if not bounded:
                return attempt()
            return call_with_deadline(
                attempt, self.metadata_timeout, what=what, alarms=self._alarms
            )

        return call_with_retries(once, self._retry, what=what)

    def _paced(self, ticket: float, error: Exception) -> None:
        """Tell the pace how the request of ``ticket`` ended (it failed with ``error``)."""
        if isinstance(error, ThrottledError):
            self.pace.throttled(ticket)
        else:
            self.pace.succeeded(ticket)

    def _objects_for(self, key: str) -> S3Bucket | BotocoreObjects:
        """Who sends requests about ``key``: the seam's bucket once a listing set it up, else
        botocore's client (and for a key with a dot segment: see ``sends_as_signed``)."""
        bucket = self._bucket
        if bucket is None or not sends_as_signed(key):
            if self._botocore is None:
                from prefetch.sources.s3.sdk import BotocoreObjects

                self._botocore = BotocoreObjects(self._client, self._uri.location)
            return self._botocore
        return bucket

    def list_page(self, what: str, **kwargs: str | int) -> Mapping[str, object]:
        """One ListObjectsV2 page of the bucket (botocore's arguments but Bucket, and answer
        shape): on the seam with static keys (see LazyS3Client), else through botocore, whose
        signed request then sets up the seam's bucket with botocore's signer."""
        bucket = self._uri.location
        direct = self._direct_client()
        lister = direct.direct_bucket(bucket) if direct is not None else None
        if lister is not None:
            named = functools.partial(lister.list_objects_v2, what=what)
            page: Mapping[str, object] = self._call(
                what, named, bounded=True, Bucket=bucket, **kwargs
            )
            if self.signed_requests and self._bucket is None:
                self._bucket = lister  # its object requests need no botocore either
            return page
        from prefetch.sources.s3.sdk import botocore_signed_endpoint, capture_listing_requests

        with capture_listing_requests(self._client) as sent:
            page = self._call(
                what, self._client.list_objects_v2, bounded=True, Bucket=bucket, **kwargs
            )
        if self.signed_requests and self._bucket is None:
            found = botocore_signed_endpoint(sent)
            if found is not None:
                endpoint, signer = found
                http, timeout = self._seam_pool(self._ca_bundle())
                self._bucket = S3Bucket(
                    bucket, base_url=lambda _region: endpoint.base_url, region=endpoint.region,
                    signer=signer, http=http, timeout=timeout,
                    on_error=lambda what, answer: answer_error(what, answer, has_body=True),
                )  # fmt: skip
        return page

    def _ca_bundle(self) -> str | None:
        """The CA bundle botocore's client verifies TLS with, so the seam verifies with the
        same (:func:`prefetch.support.settings.ca_bundle`): a lazy client's own choice, else the
        source's; None for the system's store."""
        if isinstance(self._client, LazyS3Client):
            return self._client.ca_certs()
        return settings.ca_bundle(self._ca_choice).path

    def _seam_pool(self, ca_certs: str | None) -> tuple[HttpClient, urllib3.Timeout]:
        """The seam's pool and timeouts for requests botocore's signer signs: the lazy
        client's settings, or a client's own public configuration."""
        if isinstance(self._client, LazyS3Client):
            opts = self._client.settings
            proxy = opts.get("proxy")
            size = int(opts.get("max_pool_connections", 32))
            timeout = self._client.timeout()
        else:
            config = getattr(getattr(self._client, "meta", None), "config", None)
            # botocore's explicit proxies (make_s3_client always sets them; {} is "direct"),
            # or None: the environment's, as botocore would read them
            chosen = getattr(config, "proxies", None)
            proxy = (
                (chosen.get("https") or chosen.get("http") or "") if chosen is not None else None
            )
            size = int(getattr(config, "max_pool_connections", None) or 32)
            timeout = urllib3.Timeout(
                connect=float(getattr(config, "connect_timeout", None) or 10),
                read=float(getattr(config, "read_timeout", None) or 60),
            )
        pool = shared_http_pool(size, settings.proxies(override=proxy), ca_certs=ca_certs)
        return pool, timeout

    def ensure_signed_path(self) -> None:
        """Set up the seam's bucket for a reader that lists nothing (the mirror source reads
        its blobs by key): a listing of at most one key under the prefix tells where the bucket
        is and how to sign, as the model's listing would."""
        if self.signed_requests and self._bucket is None:
            where = f"s3://{self._uri.location}/{self._uri.path}"
            self.list_page(f"listing {where}", Prefix=self._uri.path, MaxKeys=1)

    def _direct_client(self) -> LazyS3Client | None:
        """The client when it may list without botocore (see LazyS3Client), else None."""
        client = self._client
        return client if self.signed_requests and isinstance(client, LazyS3Client) else None

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
            kwargs: dict[str, str | int] = {"Prefix": prefix, "MaxKeys": 1000}
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
        mirror's refs and commits): on the seam once it is set up, so a pull with static keys
        reads them without botocore too."""
        objects = self._objects_for(key)

        def read() -> bytes | None:
            answer = objects.send("GET", key, headers={})
            if answer.status >= 300:
                if answer.status == 404:
                    code, _ = error_code_and_message(answer, has_body=True)
                    if code != "NoSuchBucket":
                        return None
                    raise BucketNotFoundError(f"{what}: bucket does not exist")
                raise answer_error(what, answer, has_body=True)
            data = answer.read(limit + 1)
            if len(data) > limit:
                answer.discard()
                raise SourceError(f"{what}: larger than {limit} bytes")
            answer.release()
            return data

        found: bytes | None = self._call(what, read, bounded=True)
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
        head = self._call(
            f"HEAD {what}", self._head, key=key, label=f"HEAD {what}",
            headers={"x-amz-checksum-mode": "ENABLED", **_if_match(file.version)},
        )  # fmt: skip
        return self._described(file, head, what)

    def _answer(
        self, method: str, key: str, what: str, *, headers: dict[str, str], query: str = ""
    ) -> Response:
        """Send one object request; an error answer or a transport failure raises the
        package's error (the same whoever sent it: the seam or botocore's client)."""
        try:
            answer = self._objects_for(key).send(method, key, headers=headers, query=query)
        except Exception as exc:
            raise translate(exc, what) from exc
        if answer.status >= 300:
            raise answer_error(what, answer, has_body=method != "HEAD")
        return answer

    def _head(
        self, *, key: str, label: str, headers: dict[str, str], query: str = ""
    ) -> dict[str, str]:
        """A HEAD, its headers under botocore's names (``label`` names it in errors)."""
        answer = self._answer("HEAD", key, label, headers=headers, query=query)
        answer.release()
        return fields_of(answer)

    def _described(self, file: RemoteFile, head: dict[str, str], what: str) -> RemoteFile:
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

        def get() -> tuple[int, dict[str, str], bytes]:
            answer = self._answer(
                "GET", key, f"GET {what}",
                headers={"x-amz-checksum-mode": "ENABLED", **_if_match(file.version)},
            )  # fmt: skip
            data = self._read_small_body(answer, what)
            return answer.status, fields_of(answer), data

        status, resp, data = self._call(f"GET {what}", get)
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

    def _read_small_body(self, answer: Response, what: str) -> bytes:
        """The whole body of a small object's GET (then the connection is released). A
        trickling server would hold this read for ever (each byte resets the socket's read
        timeout), and the engine's stall rule only watches ranged reads: so the read is bounded
        by ``small_get_limit``."""
        body = answer.raw
        watch = Watch(f"GET {what}")
        watch.attach(lambda: shutdown_socket_of(body))
        limit = self.small_get_limit
        too_slow = TransientSourceError(
            f"GET {what}: the body took longer than {limit:g}s (a stalled server)"
        )
        alarm = self._alarms.schedule(limit, lambda: watch.abort(too_slow))
        clean = False
        try:
            data = bytes(body.read()) if body is not None else b""
            clean = True
            return data
        except Exception:
            watch.raise_if_aborted()
            raise
        finally:
            alarm.cancel()
            watch.close()  # from here no abort: the connection may go back to the pool
            if clean and not watch.aborted:
                answer.release()
            else:
                answer.discard()

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

        def part_size(n: int) -> int:
            h = self._call(f"{what} {n}", self._head, key=key, label=f"{what} {n}", headers={},
                           query=f"partNumber={n}")  # fmt: skip
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
        headers = {"Range": f"bytes={start}-{end - 1}", **_if_match(file.version)}
        ticket = self.pace.acquire(SCOPE.raise_if_aborted)
        try:
            answer = self._answer("GET", key, what, headers=headers)
        except PrefetchError as exc:
            self._paced(ticket, exc)
            raise
        self.pace.succeeded(ticket)
        etag = str(answer.headers.get("ETag") or "").strip('"')
        if file.version and etag and etag != file.version:
            answer.discard()
            raise SourceChangedError(f"{what}: the object changed during the download")
        try:
            check_range_answer(
                what, start, end, file.size, answer.status, answer.headers.get("Content-Range"),
                answer.headers.get("Content-Length"),
            )  # fmt: skip
        except SourceChangedError:
            answer.discard()
            raise
        return range_body_reader(answer, what, end - start, translate=_read_failure)


def _part_layout_needed(head: Mapping[str, str]) -> bool:
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
