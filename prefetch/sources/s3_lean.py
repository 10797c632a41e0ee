"""Signed S3 object requests (GET, HEAD) without botocore's per-request machinery.

A botocore ``get_object`` costs ~1.5-3 ms of CPU here (parameter validation, the event hooks,
endpoint rules, serializing, parsing the answer); signing the same request costs ~0.2 ms and
sending it ~0.4 ms. For a model of many small files that difference is most of the client's
time (bench/README.md). So object reads take a lean path that keeps what botocore decided and
skips the rest:

* **where** (the URL of a key, path-style or virtual-hosted, custom endpoint or AWS) and **how
  to sign** (region, service) are taken from the listing request botocore itself prepared and
  signed for the same bucket (after its region redirect, if any): the object URL is the
  listing's URL without its query, plus the quoted key;
* **credentials** are the client's own credentials object, frozen per request, so refreshable
  ones (IRSA / web identity, SSO, instance roles) refresh as they do under botocore;
* **signing** is botocore's ``S3SigV4Auth``; **sending** is the client's own HTTP session
  (its urllib3 pools with the client's proxies, TLS settings and timeouts).

Anything this cannot reproduce (no SigV4 header on the listing, another signing service such
as S3 Outposts or Object Lambda, S3 Express session auth, a client without the expected
parts) leaves :func:`lean_requests_for` returning None, and the caller keeps using botocore.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

from prefetch import __version__

#: ``Credential=<key id>/<date>/<region>/<service>/aws4_request`` of a SigV4 Authorization header.
_SIGV4_SCOPE = re.compile(r"^AWS4-HMAC-SHA256 Credential=[^/]+/\d{8}/([^/]+)/([^/]+)/aws4_request")
_ERROR_CODE = re.compile(rb"<Code>([^<]{1,200})</Code>")
_ERROR_MESSAGE = re.compile(rb"<Message>([^<]{0,500})</Message>")
#: At most this much of an error answer's body is read for its code and message.
_ERROR_BODY_LIMIT = 64 * 1024
_USER_AGENT = f"model-prefetch/{__version__}"
_HANDLER_ID = "prefetch-capture-listing-request"

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

_capture = threading.local()


def _remember_request(request: Any, **_: Any) -> None:
    """botocore ``before-send`` hook: keep the prepared request when this thread asked for it."""
    kept = getattr(_capture, "requests", None)
    if kept is not None:
        kept.append(request)


@contextlib.contextmanager
def capture_listing_requests(client: Any) -> Iterator[list[Any]]:
    """The ListObjectsV2 requests ``client`` sends from this thread inside the block, as signed
    and about to go out. The hook is registered once per client and records only for a thread
    inside this block, so other users of a shared client are not affected."""
    kept: list[Any] = []
    events = getattr(getattr(client, "meta", None), "events", None)
    if events is None:
        yield kept
        return
    events.register("before-send.s3.ListObjectsV2", _remember_request, unique_id=_HANDLER_ID)
    previous = getattr(_capture, "requests", None)
    _capture.requests = kept
    try:
        yield kept
    finally:
        _capture.requests = previous


@dataclass(frozen=True)
class ObjectEndpoint:
    """Where a bucket's objects are and how requests to them are signed."""

    base_url: str  #: ends with "/"; an object's URL is this plus its quoted key
    region: str

    def url_of(self, key: str, query: str = "") -> str:
        url = self.base_url + quote(key, safe="/~")
        return f"{url}?{query}" if query else url


def endpoint_of_listing(request: Any) -> ObjectEndpoint | None:
    """The object endpoint a signed ListObjectsV2 request implies, or None when the request is
    not one this module can imitate (unsigned, not SigV4 for "s3", S3 Express session auth)."""
    headers = getattr(request, "headers", None)
    url = getattr(request, "url", None)
    if headers is None or not isinstance(url, str):
        return None
    if headers.get("x-amz-s3session-token") is not None:
        return None
    auth = headers.get("Authorization")
    if isinstance(auth, bytes):
        auth = auth.decode("ascii", "replace")
    m = _SIGV4_SCOPE.match(auth or "")
    if m is None or m.group(2) != "s3":
        return None
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return None
    return ObjectEndpoint(f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}/", m.group(1))


class LeanResponse:
    """An answer to a lean request: status, headers, and the urllib3 response to read."""

    def __init__(self, status: int, headers: Any, raw: Any) -> None:
        self.status = status
        self.headers = headers
        self.raw = raw

    def fields(self) -> dict[str, Any]:
        """The answer in botocore's shape (``ETag``, ``ContentLength``, ``Checksum*``, ...,
        ``ResponseMetadata.HTTPStatusCode``), so callers read either the same way."""
        out: dict[str, Any] = {"ResponseMetadata": {"HTTPStatusCode": self.status}}
        for name, header in HEADER_FIELDS:
            value = self.headers.get(header)
            if value is not None:
                out[name] = value
        if "ContentLength" in out:
            try:
                out["ContentLength"] = int(out["ContentLength"])
            except ValueError:
                del out["ContentLength"]
        return out

    def error_code_and_message(self, *, has_body: bool) -> tuple[str, str]:
        """The S3 error code and message of an error answer (read from at most 64 KiB of its
        XML body; a HEAD has none: then the status); the connection is not reused."""
        body = b""
        if has_body:
            with contextlib.suppress(Exception):
                body = self.raw.read(_ERROR_BODY_LIMIT)
        self.discard()
        code = _ERROR_CODE.search(body)
        message = _ERROR_MESSAGE.search(body)
        code_text = code.group(1).decode("utf-8", "replace").strip() if code else str(self.status)
        return code_text, (message.group(1).decode("utf-8", "replace") if message else code_text)

    def release(self) -> None:
        """The body was read to its end: the connection goes back to the pool."""
        self.raw.release_conn()

    def discard(self) -> None:
        """Close the connection without reading (it may be the one that failed)."""
        try:
            self.raw.close()
        finally:
            self.raw.release_conn()


class ObjectRequests(Protocol):
    """Signed requests for one bucket's objects: :class:`LeanS3` (botocore's credentials and
    pools) or ``s3_direct.DirectBucket`` (static keys, no botocore)."""

    def send(
        self, method: str, key: str, *, headers: dict[str, str], query: str = ""
    ) -> LeanResponse: ...


class LeanS3:
    """Signed requests for one bucket's objects, through the client's credentials and pools."""

    def __init__(self, endpoint: ObjectEndpoint, credentials: Any, http_session: Any) -> None:
        self.endpoint = endpoint
        self._credentials = credentials
        self._http = http_session

    def send(
        self, method: str, key: str, *, headers: dict[str, str], query: str = ""
    ) -> LeanResponse:
        """Send one signed request; botocore's transport errors propagate (callers translate
        them as for any botocore call)."""
        # imported here: this module is also imported where botocore is not (s3_direct)
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(
            method,
            self.endpoint.url_of(key, query),
            headers={"User-Agent": _USER_AGENT, **headers},
            stream_output=True,
        )
        frozen = self._credentials.get_frozen_credentials()  # refreshes when near expiry
        S3SigV4Auth(frozen, "s3", self.endpoint.region).add_auth(request)
        answer = self._http.send(request.prepare())
        return LeanResponse(int(answer.status_code), answer.headers, answer.raw)


def lean_requests_for(client: Any, listing_request: Any) -> LeanS3 | None:
    """The lean path for the bucket ``listing_request`` (a ListObjectsV2 botocore signed) lists,
    or None when it cannot be reproduced exactly (see the module docstring)."""
    endpoint = endpoint_of_listing(listing_request)
    return None if endpoint is None else lean_requests_at(client, endpoint)


def lean_requests_at(client: Any, endpoint: ObjectEndpoint) -> LeanS3 | None:
    """The lean path to ``endpoint`` with ``client``'s credentials and HTTP session (None when
    the client lacks the expected parts)."""
    credentials = getattr(getattr(client, "_request_signer", None), "_credentials", None)
    http_session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    if credentials is None or http_session is None:
        return None
    if not callable(getattr(credentials, "get_frozen_credentials", None)):
        return None
    if not callable(getattr(http_session, "send", None)):
        return None
    return LeanS3(endpoint, credentials, http_session)
