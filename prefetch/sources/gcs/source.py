"""The Cloud Storage source: objects under ``gs://bucket/prefix`` on the JSON API.

* resolve: ``GET /storage/v1/b/<bucket>/o?prefix=...&fields=...``, page by page; each object's
  size, generation, ``crc32c`` and ``md5Hash`` come with the listing, so no per-file request is
  made before the bytes (``describe`` has nothing to add).
* open_range: ``GET /storage/v1/b/<bucket>/o/<name>?alt=media&generation=<listed>`` with a
  ``Range`` header, on the project's HTTP seam (watched connections, proxies, the stall rule):
  each range is pinned to the listed generation, so an object replaced mid-pull answers 404
  (or, with versioning, the listed generation's own bytes) and never a mix; a
  ``x-goog-generation`` header naming another generation is refused too.
* verification: the object's CRC32C (per range, joined at the end: no re-read). Cloud Storage
  states an MD5 only for objects uploaded whole; composite objects (``gcloud storage cp`` of
  large files uploads in parallel and composes) have only the CRC32C, which is then what is
  verified. ``Accept-Encoding: gzip`` is sent so an object stored gzip-encoded is served as
  stored (its size and CRC32C are those of the stored bytes), never decompressed in transit.

Bytes go through the seam, not google-cloud-storage: measured in bench/README.md (issue 32).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import quote, urlencode

import urllib3

from prefetch.pipeline.deadline import SCOPE, Alarms, call_with_deadline
from prefetch.pipeline.retry import AdaptiveRate, RetryPolicy, call_with_retries
from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, SourceURI
from prefetch.sources import SourceSettings
from prefetch.sources.base import listed_snapshot
from prefetch.sources.gcs.auth import CREDENTIALS_HINT, GcsAuth, gcs_auth
from prefetch.sources.http.transport import (
    BodyReader,
    HttpClient,
    Sent,
    checked_range_body,
    parse_retry_after,
    redact_url,
    send,
    shared_http_pool,
    status_error,
    transport_error,
)
from prefetch.support import settings
from prefetch.support.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    InvalidListingError,
    SourceChangedError,
    SourceError,
    ThrottledError,
)
from prefetch.support.safejson import load_json

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Google's endpoint (``STORAGE_EMULATOR_HOST`` names another).
GOOGLE_ENDPOINT = "https://storage.googleapis.com"
#: Only the fields the source reads, so a page of 1000 objects stays small.
_FIELDS = "items(name,size,generation,crc32c,md5Hash,componentCount),nextPageToken"
#: A listing page is refused past this size (1000 objects of a few hundred bytes each).
MAX_PAGE_BYTES = 16 * 1024 * 1024
#: At most this much of an error answer is read for its message.
_ERROR_BODY_LIMIT = 64 * 1024
#: A listing page must arrive within this many seconds per attempt (as S3's and the Hub's).
METADATA_TIMEOUT = 120.0
#: A listing of more pages than this is refused (a server handing out page tokens for ever).
MAX_PAGES = 100_000


@dataclass(frozen=True)
class GcsClient:
    """How a source reaches Cloud Storage: the endpoint, the seam's pool, its timeouts and
    the credentials."""

    endpoint: str
    http: HttpClient
    auth: GcsAuth
    timeout: urllib3.Timeout


def open_gcs_source(spec: ModelSpec, options: SourceSettings) -> GcsSource:
    """A source for ``spec``'s ``gs://`` URI: the endpoint from ``STORAGE_EMULATOR_HOST`` (else
    Google's), the seam's shared pool with the model's proxy and CA bundle."""
    endpoint = settings.gcs_endpoint()
    trust = settings.ca_bundle(spec.ca_bundle)
    http = shared_http_pool(
        options.pool, settings.proxies(override=spec.proxy), ca_certs=trust.path
    )
    client = GcsClient(
        endpoint=endpoint or GOOGLE_ENDPOINT,
        http=http,
        auth=gcs_auth(endpoint, http),
        timeout=urllib3.Timeout(connect=10, read=60),
    )
    return GcsSource(client, spec.source, retry=options.retry)


class GcsSource:
    """Objects under ``gs://bucket/prefix``; a file's path is its name relative to the prefix."""

    def __init__(
        self,
        client: GcsClient,
        uri: SourceURI,
        *,
        retry: RetryPolicy | None = None,
        pace: AdaptiveRate | None = None,
    ) -> None:
        self._client = client
        self._uri = uri
        self._retry = retry or RetryPolicy()
        self.pace = pace or AdaptiveRate()
        self.metadata_timeout = METADATA_TIMEOUT
        self._alarms = Alarms(name="gcs-alarms")
        self._base = f"{client.endpoint}/storage/v1/b/{quote(uri.location, safe='')}/o"

    @property
    def where(self) -> str:
        return f"gs://{self._uri.location}/{self._uri.path}"

    # -- requests ------------------------------------------------------------------------------

    def _get(self, url: str, headers: Mapping[str, str], what: str) -> Sent:
        """GET ``url`` with the credentials (to the endpoint's origin only), paced; a 401 to a
        token that can be refreshed is answered once by refreshing it. Transport failures are
        the package's errors; an error answer is returned for the caller to word."""
        for attempt in (1, 2):
            ticket = self.pace.acquire(SCOPE.raise_if_aborted)
            auth = self._client.auth.header()
            try:
                answer = send(
                    self._client.http, "GET", url, headers=headers,
                    timeout=self._client.timeout,
                    credentials={"Authorization": auth} if auth is not None else None,
                    credentials_origin=self._client.endpoint,
                )  # fmt: skip
            except Exception as exc:
                self.pace.succeeded(ticket)
                raise transport_error(exc, what) from exc
            if answer.status in (429, 503):
                self.pace.throttled(ticket)
            else:
                self.pace.succeeded(ticket)
            if answer.status == 401 and attempt == 1 and self._client.auth.expired(auth):
                answer.discard()
                continue
            return answer
        raise AssertionError("unreachable")

    def _refusal(self, answer: Sent, what: str, *, listing: bool) -> SourceError:
        """The package's error for an error answer, with Cloud Storage's own message."""
        status = answer.status
        message = _error_message(answer)
        detail = f" ({message})" if message else ""
        if status == 404 and listing:
            return BucketNotFoundError(f"{what}: the bucket does not exist{detail}")
        if status in (401, 403):
            who = self._client.auth.origin
            return AccessDeniedError(
                f"{what}: access denied to {who} (HTTP {status}{detail})", hint=CREDENTIALS_HINT
            )
        if status in (429, 503):
            return ThrottledError(
                f"{what}: HTTP {status}{detail}",
                retry_after=parse_retry_after(answer.headers.get("Retry-After")),
            )
        return status_error(
            status, f"{what}: HTTP {status}{detail}",
            retry_after=answer.headers.get("Retry-After"),
        )  # fmt: skip

    # -- resolve -------------------------------------------------------------------------------

    def resolve(self, spec: ModelSpec) -> Snapshot:
        prefix = self._uri.path
        files: list[RemoteFile] = []
        seen_any = False
        for item in self._listing():
            name = _text(item, "name", self.where)
            rel = name[len(prefix) :] if name.startswith(prefix) else ""
            if not rel or rel.endswith("/"):
                continue  # the prefix itself, or a "folder" placeholder
            seen_any = True
            remote = _remote_file(item, rel, self.where)
            if spec.wants(rel):
                files.append(remote)
        return listed_snapshot(
            self._uri, spec, files, seen_any=seen_any, noun="object", where=self.where
        )

    def _listing(self) -> Iterator[Mapping[str, object]]:
        """Every object under the prefix, page by page."""
        token: str | None = None
        for _ in range(MAX_PAGES):
            page = self._page(token)
            items = page.get("items", [])
            if not isinstance(items, list):
                raise InvalidListingError(f"listing {self.where}: 'items' is not a list")
            for item in items:
                if not isinstance(item, dict):
                    raise InvalidListingError(f"listing {self.where}: an item is not an object")
                yield item
            next_token = page.get("nextPageToken")
            if not next_token:
                return
            if not isinstance(next_token, str) or next_token == token:
                raise InvalidListingError(f"listing {self.where}: a page token that goes nowhere")
            token = next_token
        raise InvalidListingError(f"listing {self.where}: more than {MAX_PAGES} pages")

    def _page(self, token: str | None) -> Mapping[str, object]:
        query = {"prefix": self._uri.path, "fields": _FIELDS, "maxResults": "1000"}
        if token is not None:
            query["pageToken"] = token
        url = f"{self._base}?{urlencode(query, quote_via=quote)}"
        what = f"listing {self.where}"

        def attempt() -> Mapping[str, object]:
            answer = self._get(url, {"Accept": "application/json"}, what)
            if answer.status != 200:
                raise self._refusal(answer, what, listing=True)
            data = answer.read_whole(MAX_PAGE_BYTES + 1, what)
            page = load_json(data, where=what, max_bytes=MAX_PAGE_BYTES)
            if not isinstance(page, dict):
                raise InvalidListingError(f"{what}: the answer is not a JSON object")
            return page

        return self._retried(attempt, what)

    def _retried(self, fn: Callable[[], T], what: str) -> T:
        def bounded() -> T:
            return call_with_deadline(fn, self.metadata_timeout, what=what, alarms=self._alarms)

        return call_with_retries(bounded, self._retry, what=what)

    # -- describe, read ------------------------------------------------------------------------

    def describe(self, file: RemoteFile) -> RemoteFile:
        return file  # the listing stated everything

    def open_range(self, file: RemoteFile, start: int, end: int) -> BodyReader:
        what = f"gs://{self._uri.location}/{file.locator} bytes {start}-{end - 1}"
        generation = generation_of(file)
        query = urlencode({"alt": "media", "generation": generation})
        url = f"{self._base}/{quote(file.locator, safe='')}?{query}"
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "gzip"}
        answer = self._get(url, headers, what)
        if answer.status in (404, 412):
            answer.discard()
            raise SourceChangedError(
                f"{what}: generation {generation} of the object is gone (it was replaced "
                "or deleted during the download)"
            )
        if answer.status >= 300:
            raise self._refusal(answer, what, listing=False)
        served = answer.headers.get("x-goog-generation")
        if served is not None and served.strip() != generation:
            answer.discard()
            raise SourceChangedError(
                f"{what}: the server sent generation {served.strip()}, not {generation}"
            )
        return checked_range_body(answer, what, start, end, file.size)

    def __repr__(self) -> str:
        return f"GcsSource({self.where!r}, endpoint={redact_url(self._client.endpoint)!r})"


def _text(item: Mapping[str, object], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidListingError(f"listing {where}: an object without a {key!r}")
    return value


def _remote_file(item: Mapping[str, object], rel: str, where: str) -> RemoteFile:
    """A listed object as a file: its generation pins its reads; its CRC32C (and MD5 when it
    has one: composite objects do not) are its checksums, strongest first."""
    name = _text(item, "name", where)
    size_text, generation = _text(item, "size", where), _text(item, "generation", where)
    if not (size_text.isdigit() and generation.isdigit()):
        raise InvalidListingError(f"listing {where}: {name!r} has no whole size and generation")
    checksums: list[Checksum] = []
    crc = item.get("crc32c")
    if isinstance(crc, str) and crc:
        checksums.append(Checksum("crc32c", crc, encoding="base64", origin="gcs crc32c"))
    md5 = item.get("md5Hash")
    if isinstance(md5, str) and md5:
        checksums.append(Checksum("md5", md5, encoding="base64", origin="gcs md5Hash"))
    return RemoteFile(
        path=rel,
        size=int(size_text),
        version=_version(where, name, generation),
        checksums=tuple(checksums),
        locator=name,
        described=True,
    )


def _version(where: str, name: str, generation: str) -> str:
    """What pins a file's content: its generation, then a digest of its bucket and name. A
    generation is unique per object, not per bucket (two shards uploaded in the same
    microsecond may share one), and the layouts know a file's content by version and size."""
    bucket = where.removeprefix("gs://").split("/", 1)[0]
    named = hashlib.sha1(f"{bucket}/{name}".encode()).hexdigest()[:16]
    return f"{generation}-{named}"


def generation_of(file: RemoteFile) -> str:
    """The generation a file was listed at (see :func:`_version`)."""
    return file.version.split("-", 1)[0]


def _error_message(answer: Sent) -> str:
    """Cloud Storage's message from an error answer's JSON (``{"error": {"message": ...}}``),
    or ""; the connection is not reused."""
    try:
        body = answer.read(_ERROR_BODY_LIMIT)
    except Exception:
        body = b""
    answer.discard()
    try:
        doc = load_json(body, where="an error answer", max_bytes=_ERROR_BODY_LIMIT)
    except SourceError:
        return ""
    error = doc.get("error") if isinstance(doc, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return " ".join(message.split())[:300] if isinstance(message, str) else ""
