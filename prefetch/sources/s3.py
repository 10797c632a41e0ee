"""S3 source: list, describe (HEAD with checksums) and ranged GETs pinned to the ETag, via boto3.

The boto3 client is passed in (tests give one pointed at a local server). boto3's own retries
are turned off by :func:`make_s3_client`: retrying lives in one place (prefetch.retry), around
whole operations and inside the range task, so a retry resumes from the last byte written.
"""

from __future__ import annotations

import http.client
import logging
import re
import threading
from typing import Any

import botocore.exceptions as bce
import urllib3.exceptions
from botocore.config import Config

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
from prefetch.sources._http import BodyReader, error_class, http_client_response, transport_error
from prefetch.sources.base import range_answer_problem, shutdown_socket_of
from prefetch.spec import SIDECAR_MANIFEST, ModelSpec, SourceURI

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
) -> Any:
    """A boto3 S3 client tuned for many parallel ranged GETs, with boto3's retries off."""
    import boto3

    session = boto3.session.Session(profile_name=profile)
    config = Config(
        max_pool_connections=max_pool_connections,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"total_max_attempts": 1, "mode": "standard"},
        tcp_keepalive=True,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    kwargs: dict[str, Any] = {"config": config}
    if endpoint_url:
        kwargs["endpoint_url"] = endpoint_url
    if access_key and secret_key:
        kwargs["aws_access_key_id"] = access_key
        kwargs["aws_secret_access_key"] = secret_key
    if region or endpoint_url:
        kwargs["region_name"] = region or session.region_name or "us-east-1"
    return session.client("s3", **kwargs)


def translate(exc: Exception, what: str) -> Exception:
    """A boto3/botocore exception as the package's error (raise it ``from exc``)."""
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
    if isinstance(exc, urllib3.exceptions.HTTPError | http.client.HTTPException):
        return TransientSourceError(f"{what}: {type(exc).__name__}: {exc}")
    if isinstance(exc, bce.ParamValidationError):
        return SourceError(f"{what}: invalid request: {exc}")
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

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        def once() -> Any:
            try:
                return fn(**kwargs)
            except PrefetchError:
                raise  # already one of ours (e.g. a stalled small-object GET)
            except Exception as exc:
                raise translate(exc, what) from exc

        return call_with_retries(once, self._retry, what=what)

    # -- resolve -----------------------------------------------------------------------------

    def resolve(self, spec: ModelSpec) -> Snapshot:
        bucket, prefix = self._uri.location, self._uri.path
        where = f"s3://{bucket}/{prefix}"
        files: list[RemoteFile] = []
        sidecar: RemoteFile | None = None
        seen_any = False
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": 1000}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(f"listing {where}", self._client.list_objects_v2, **kwargs)
            for obj in page.get("Contents", []):
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
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
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

    def _apply_sidecar(self, sidecar: RemoteFile, files: list[RemoteFile]) -> list[RemoteFile]:
        what = f"reading s3://{self._uri.location}/{sidecar.locator}"
        resp = self._call(
            what, self._client.get_object, Bucket=self._uri.location, Key=sidecar.locator
        )
        sums: dict[str, str] = {}
        for n, line in enumerate(resp["Body"].read().decode("utf-8", "replace").splitlines(), 1):
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
            f"HEAD {what}",
            self._client.head_object,
            Bucket=bucket,
            Key=key,
            ChecksumMode="ENABLED",
            **({"IfMatch": file.version} if file.version else {}),
        )
        return self._described(file, head, what)

    def _described(self, file: RemoteFile, head: dict[str, Any], what: str) -> RemoteFile:
        """``file`` with the checksums a HEAD (or whole-object GET) response states."""
        bucket, key = self._uri.location, file.locator
        etag = str(head.get("ETag", "")).strip('"')
        size = int(head["ContentLength"])
        if (file.version and etag != file.version) or size != file.size:
            raise SourceChangedError(f"{what}: the object changed since it was listed")
        m = _MULTIPART_ETAG.match(etag)
        parts: tuple[int, ...] | None = None
        if m is not None:
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

        def get() -> tuple[dict[str, Any], bytes]:
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
            # a trickling server would hold this read for ever (each byte resets the socket's
            # read timeout), and the engine's stall rule only watches ranged reads: bound it
            fired = threading.Event()

            def too_slow() -> None:
                fired.set()
                shutdown_socket_of(raw)

            cut = threading.Timer(self.small_get_limit, too_slow)
            cut.daemon = True
            cut.start()
            try:
                data = raw.read() if raw is not None else body.read()
            except Exception as exc:
                if fired.is_set():
                    raise TransientSourceError(
                        f"GET {what}: the body took longer than {self.small_get_limit:g}s "
                        "(a stalled server)"
                    ) from exc
                raise
            finally:
                cut.cancel()
                body.close()
            return resp, bytes(data)

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
