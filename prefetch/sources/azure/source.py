"""Blobs under ``az://account/container/prefix``, read on the project's HTTP seam.

* resolve: List Blobs (``restype=container&comp=list``), paged with the ``NextMarker``; a file's
  version is its ETag, its checksum the blob's ``Content-MD5`` when it has one.
* open_range: ``x-ms-range`` pinned with ``If-Match: <ETag>`` (a blob replaced mid-pull answers
  412, the engine's changed-object error), the answer checked to be exactly the range. A blob
  without ``Content-MD5`` (uploaded in blocks without one) is read in ranges of at most 4 MiB
  with ``x-ms-range-get-content-md5: true``, each range's bytes checked against the MD5 the
  service states for it; with one, the whole-file MD5 is checked instead (hashing both would
  cost twice the CPU for nothing more).

The service's CRC64 (``x-ms-range-get-content-crc64``) is not asked for: Azurite does not serve
it, so it could not be tested here.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import re
from collections.abc import Callable
from typing import TypeVar

import urllib3

from prefetch.pipeline.deadline import SCOPE, Alarms, call_with_deadline
from prefetch.pipeline.retry import AdaptiveRate, RetryPolicy, call_with_retries
from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, SourceURI
from prefetch.sources import SourceSettings
from prefetch.sources.azure.auth import (
    CREDENTIALS_HINT,
    Account,
    Anonymous,
    account_for,
    blob_path,
    request_headers,
)
from prefetch.sources.azure.listing import BlobPage, parse_blob_page
from prefetch.sources.base import listed_snapshot
from prefetch.sources.http.transport import (
    NETWORK_HINT,
    BodyReader,
    HttpClient,
    Response,
    check_range_answer,
    range_body_reader,
    redact_url,
    send,
    shared_http_pool,
    transport_error,
)
from prefetch.sources.s3.listing import ListingPages, MalformedListingPage
from prefetch.support import settings
from prefetch.support.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ChecksumMismatchError,
    InvalidListingError,
    NotFoundError,
    PrefetchError,
    SourceChangedError,
    SourceError,
    ThrottledError,
    TransientSourceError,
)

T = TypeVar("T")

#: The largest range the service states an MD5 for (``x-ms-range-get-content-md5``).
MD5_RANGE = 4 * 1024 * 1024
#: A listing page's XML is read up to this size (5000 blobs of 1 KiB names fit).
MAX_PAGE_BYTES = 16 * 1024 * 1024
#: Seconds one attempt at a listing page may take in all.
METADATA_TIMEOUT = 60.0
_ERROR_CODE = re.compile(rb"<Code>([^<]{1,200})</Code>")
_ERROR_MESSAGE = re.compile(rb"<Message>([^<\n]{1,500})")
_ERROR_BODY_LIMIT = 64 * 1024
#: Said when the account's endpoint cannot be reached.
AZURE_NETWORK_HINT = (
    "check the account name, the network and DNS; behind a proxy set HTTPS_PROXY (or --proxy); "
    "another endpoint (Azurite, a sovereign cloud): AZURE_STORAGE_BLOB_ENDPOINT"
)


def open_azure_source(spec: ModelSpec, options: SourceSettings) -> AzureBlobSource:
    """The source of ``spec`` (an ``az://`` URI), with its account's endpoint and credentials
    from the environment and a pool sized by ``options``."""
    account = account_for(spec.source.location, spec.source.secret, settings.azure_storage())
    ca = settings.ca_bundle(spec.ca_bundle).path
    pool = shared_http_pool(options.pool, settings.proxies(override=spec.proxy), ca_certs=ca)
    return AzureBlobSource(spec.source, account, pool, retry=options.retry)


class AzureBlobSource:
    """Blobs under a container's prefix; a file's path is its name relative to the prefix."""

    def __init__(
        self,
        uri: SourceURI,
        account: Account,
        http: HttpClient,
        *,
        retry: RetryPolicy | None = None,
        pace: AdaptiveRate | None = None,
        timeout: urllib3.Timeout | None = None,
    ) -> None:
        self._uri = uri
        self._account = account
        self._http = http
        self._retry = retry or RetryPolicy()
        self.pace = pace or AdaptiveRate()
        self._timeout = timeout or urllib3.Timeout(connect=10, read=60)
        self.container, _, self.prefix = uri.path.partition("/")
        self.metadata_timeout = METADATA_TIMEOUT
        self._alarms = Alarms(name="azure-alarms")

    @property
    def where(self) -> str:
        return f"az://{self._account.name}/{self.container}/{self.prefix}"

    # -- requests ----------------------------------------------------------------------------

    def _send(self, url: str, what: str, headers: dict[str, str]) -> Response:
        """One signed GET; an error answer raises the package's error naming ``what``."""
        headers = {**request_headers(), **headers}
        url = self._account.credential.authorize("GET", url, headers)
        # the Authorization header goes only to the account's endpoint (the seam's rule)
        secret = (
            {"Authorization": headers.pop("Authorization")} if "Authorization" in headers else {}
        )
        ticket = self.pace.acquire(SCOPE.raise_if_aborted)
        try:
            try:
                answer: Response = send(
                    self._http, "GET", url, headers=headers, timeout=self._timeout,
                    credentials=secret, credentials_origin=self._account.endpoint,
                )  # fmt: skip
            except PrefetchError:
                raise
            except Exception as exc:
                SCOPE.raise_if_aborted()
                error = transport_error(exc, what)
                if error.hint == NETWORK_HINT:  # the S3 and Hub settings it names are not ours
                    error.hint = AZURE_NETWORK_HINT
                raise error from exc
            if answer.status >= 300:
                raise self._answer_error(what, answer)
        except ThrottledError:
            self.pace.throttled(ticket)
            raise
        self.pace.succeeded(ticket)
        return answer

    def _answer_error(self, what: str, answer: Response) -> SourceError:
        body = b""
        with contextlib.suppress(Exception):
            body = answer.read(_ERROR_BODY_LIMIT)
        answer.discard()
        found = _ERROR_CODE.search(body)
        code = found.group(1).decode("utf-8", "replace") if found else ""
        code = code or str(answer.headers.get("x-ms-error-code") or "")
        said = _ERROR_MESSAGE.search(body)
        message = said.group(1).decode("utf-8", "replace").strip() if said else ""
        return _error(what, answer.status, code, message, self._account)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        def once() -> T:
            return call_with_deadline(fn, self.metadata_timeout, what=what, alarms=self._alarms)

        return call_with_retries(once, self._retry, what=what)

    # -- resolve -----------------------------------------------------------------------------

    def _list_url(self, marker: str) -> str:
        from urllib.parse import urlencode

        query = {"restype": "container", "comp": "list", "prefix": self.prefix}
        query["maxresults"] = "5000"
        if marker:
            query["marker"] = marker
        return f"{self._container_url()}?{urlencode(query)}"

    def _container_url(self) -> str:
        return f"{self._account.endpoint}/{self.container}"

    def list_page(self, marker: str) -> BlobPage:
        what = f"listing {self.where}"

        def fetch() -> BlobPage:
            answer = self._send(self._list_url(marker), what, {})
            body = answer.read_whole(MAX_PAGE_BYTES + 1, what)
            if len(body) > MAX_PAGE_BYTES:
                raise InvalidListingError(f"{what}: a page larger than {MAX_PAGE_BYTES} bytes")
            try:
                return parse_blob_page(body)
            except MalformedListingPage as exc:
                raise InvalidListingError(f"{what}: {exc}") from None

        return self._call(what, fetch)

    def resolve(self, spec: ModelSpec) -> Snapshot:
        files: list[RemoteFile] = []
        seen_any = False
        pages = ListingPages(self.where)
        marker = ""
        while True:
            page = self.list_page(marker)
            for blob in page.blobs:
                rel = blob.name[len(self.prefix) :] if blob.name.startswith(self.prefix) else ""
                if not rel or rel.endswith("/"):
                    continue  # the prefix itself, a "folder" marker, or not under it
                seen_any = True
                if spec.wants(rel):
                    files.append(
                        _remote_file(rel, blob.name, blob.size, blob.etag, blob.content_md5)
                    )
            token = pages.next_token(
                {"IsTruncated": bool(page.next_marker), "NextContinuationToken": page.next_marker}
            )
            if token is None:
                break
            marker = token
        return listed_snapshot(
            self._uri, spec, files, seen_any=seen_any, noun="blob", where=self.where
        )

    def describe(self, file: RemoteFile) -> RemoteFile:
        return file  # the listing has the size, the ETag and the Content-MD5

    # -- read --------------------------------------------------------------------------------

    def open_range(self, file: RemoteFile, start: int, end: int) -> BodyReader | _Md5Ranges:
        if file.checksum is None and end - start > 0:
            return _Md5Ranges(self, file, start, end)
        return self.get_range(file, start, end, range_md5=False)[0]

    def get_range(
        self, file: RemoteFile, start: int, end: int, *, range_md5: bool
    ) -> tuple[BodyReader, str]:
        """A reader of bytes ``[start, end)`` and (``range_md5``) the MD5 the service states
        for them (base64)."""
        what = f"{self.where}{file.path} bytes {start}-{end - 1}"
        headers = {"x-ms-range": f"bytes={start}-{end - 1}"}
        if file.version:
            headers["If-Match"] = file.version
        if range_md5:
            headers["x-ms-range-get-content-md5"] = "true"
        url = f"{self._container_url()}/{blob_path(file.locator)}"
        answer = self._send(url, what, headers)
        try:
            etag = str(answer.headers.get("ETag") or "")
            if file.version and etag and _quoted(etag) != file.version:
                raise SourceChangedError(f"{what}: the blob changed during the download")
            check_range_answer(
                what, start, end, file.size, answer.status, answer.headers.get("Content-Range"),
                answer.headers.get("Content-Length"),
            )  # fmt: skip
            md5 = str(answer.headers.get("Content-MD5") or "") if range_md5 else ""
            if range_md5 and not md5:
                raise SourceChangedError(f"{what}: the service stated no MD5 for the range")
        except SourceChangedError:
            answer.discard()
            raise
        return range_body_reader(answer, what, end - start), md5


class _Md5Ranges:
    """Bytes ``[start, end)`` of a blob without Content-MD5, read in ranges of at most
    :data:`MD5_RANGE`, each checked against the MD5 the service states for it once its last
    byte is read (a mismatch: ChecksumMismatchError, the partial file is dropped)."""

    def __init__(self, source: AzureBlobSource, file: RemoteFile, start: int, end: int) -> None:
        self._source = source
        self._file = file
        self._next = self._first = start
        self._end = end
        self._reader: BodyReader | None = None
        self._left = 0
        self._expected = ""
        self._hash = hashlib.md5()
        self._aborted = False
        self._open()

    def _open(self) -> None:
        stop = min(self._next + MD5_RANGE, self._end)
        self._first = self._next
        self._reader, self._expected = self._source.get_range(
            self._file, self._next, stop, range_md5=True
        )
        self._left = stop - self._next
        self._hash = hashlib.md5()
        self._next = stop

    def readinto(self, buf: memoryview, /) -> int:
        if self._reader is None:
            return 0
        n = self._reader.readinto(buf[: self._left] if len(buf) > self._left else buf)
        self._hash.update(buf[:n])
        self._left -= n
        if self._left == 0:
            self._finish_range()
        return n

    def _finish_range(self) -> None:
        assert self._reader is not None
        self._reader.close()
        self._reader = None
        got = base64.b64encode(self._hash.digest()).decode()
        if got != self._expected:
            raise ChecksumMismatchError(
                self._file.path, f"md5 of bytes {self._first}-{self._next - 1}", self._expected,
                got,
            )  # fmt: skip
        if self._next < self._end and not self._aborted:
            self._open()

    def abort(self) -> None:
        self._aborted = True
        if self._reader is not None:
            self._reader.abort()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def _remote_file(rel: str, name: str, size: int, etag: str, content_md5: str) -> RemoteFile:
    checksums: tuple[Checksum, ...] = ()
    if content_md5:
        checksums = (Checksum("md5", content_md5, encoding="base64", origin="content-md5"),)
    version = _quoted(etag) if etag else ""
    return RemoteFile(path=rel, size=size, version=version, checksums=checksums, locator=name)


def _quoted(etag: str) -> str:
    """An ETag as If-Match takes it (quoted: the listing gives it bare, a GET quoted)."""
    etag = etag.strip()
    return etag if etag.startswith('"') else f'"{etag}"'


def _error(what: str, status: int, code: str, message: str, account: Account) -> SourceError:
    """The package's error for an error answer of the Blob service."""
    said = f"{code}: {message}" if code and message else code or message or f"HTTP {status}"
    anonymous = isinstance(account.credential, Anonymous)
    if 300 <= status < 400:  # the Blob service never redirects: a credential stays here
        return SourceError(f"{what}: the server answered {status} (a redirect: not followed)")
    if status == 503 or code == "ServerBusy":
        return ThrottledError(f"{what}: {said}")
    if status >= 500 or status in (408, 429):
        return TransientSourceError(f"{what}: {said}")
    if code == "ContainerNotFound":
        return BucketNotFoundError(
            f"{what}: container does not exist in account {account.name}"
            + (" (or is not public)" if anonymous else "")
        )
    if code in ("ConditionNotMet",) or status == 412:
        return SourceChangedError(f"{what}: the blob changed during the download ({said})")
    if (
        status in (401, 403)
        or code.startswith("Authorization")
        or code.startswith("Authentication")
    ):
        return AccessDeniedError(
            f"{what}: access denied with {account.credential.kind} ({said})",
            hint=CREDENTIALS_HINT,
        )
    if code == "ResourceNotFound" and anonymous:
        return AccessDeniedError(
            f"{what}: not found without credentials (a private container answers so)",
            hint=CREDENTIALS_HINT,
        )
    if status == 404:
        return NotFoundError(f"{what}: {said}")
    if status == 416:
        return SourceChangedError(f"{what}: the range is past the end of the blob ({said})")
    return SourceError(f"{what}: {said}")


__all__ = ["MD5_RANGE", "AzureBlobSource", "open_azure_source", "redact_url"]
