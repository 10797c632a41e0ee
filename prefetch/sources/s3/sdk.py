"""What stays on botocore when the credentials are not plain static keys (a profile, IRSA / web
identity, SSO, instance roles...): the listing, and the signer of every object request.

* **addressing** (the URL of a key: path-style or virtual-hosted, custom endpoint, FIPS or
  dual-stack, after a region redirect) is taken from the ListObjectsV2 request botocore itself
  prepared and signed for the bucket: the object URL is the listing's URL without its query,
  plus the quoted key (:func:`endpoint_of_listing`);
* **signing** is :class:`BotocoreSigner`: the client's request signer, handed to the public
  ``before-sign`` event, asked per request for its signer (``RequestSigner.get_auth_instance``,
  which freezes the credentials then, so refreshable ones keep refreshing as under botocore),
  whose credentials sign with botocore's public ``S3SigV4Auth``;
* **sending** is the transport seam (:mod:`prefetch.sources.http.transport`), like every other
request.

Anything this cannot reproduce (no SigV4 on the listing, another signing service such as S3
Outposts or Object Lambda, S3 Express session auth, a CA bundle of botocore's own) leaves
:func:`botocore_signed_endpoint` returning None, and :class:`BotocoreObjects` sends the object
requests through the client itself (so do keys with "." or ".." segments: see
``s3_direct.sends_as_signed``). No private botocore attribute is read.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypedDict, cast
from urllib.parse import quote, urlsplit

from prefetch.sources.http.transport import Response, ResponseBody

#: ``Credential=<key id>/<date>/<region>/<service>/aws4_request`` of a SigV4 Authorization header.
_SIGV4_SCOPE = re.compile(r"^AWS4-HMAC-SHA256 Credential=[^/]+/\d{8}/([^/]+)/([^/]+)/aws4_request")
_SENT_ID = "prefetch-capture-listing-request"
_SIGNER_ID = "prefetch-capture-listing-signer"


class AnswerMetadata(TypedDict, total=False):
    """The ``ResponseMetadata`` of a botocore answer (and of a ``ClientError``'s response)."""

    HTTPStatusCode: int
    HTTPHeaders: dict[str, str]  #: lowercased names


class ObjectAnswer(TypedDict, total=False):
    """What is read of botocore's answer to ``head_object`` / ``get_object``."""

    ResponseMetadata: AnswerMetadata
    Body: ResponseBody  #: botocore's ``StreamingBody`` (a GET only)


class S3Client(Protocol):
    """What the S3 source calls on a boto3 S3 client (botocore's arguments and answers; boto3
    publishes no types: its clients are built at run time from the service model)."""

    def list_objects_v2(self, **kwargs: object) -> Mapping[str, object]: ...
    def head_object(self, **kwargs: object) -> ObjectAnswer: ...
    def get_object(self, **kwargs: object) -> ObjectAnswer: ...


class RequestSigner(Protocol):
    """botocore's ``RequestSigner`` as the ``before-sign`` event hands it over: its public
    ``get_auth_instance`` gives the signer (and credentials) it would use."""

    def get_auth_instance(
        self, signing_name: str, region_name: str, signature_version: str
    ) -> object: ...


@dataclass
class Captured:
    """What botocore prepared for the ListObjectsV2 requests of one block: the signed requests
    and the request signer that signed them."""

    requests: list[object] = field(default_factory=list)  #: botocore's ``AWSPreparedRequest``
    signer: object = None  #: botocore's ``RequestSigner``


class _Capturing(threading.local):
    captured: Captured | None = None


_capture = _Capturing()  # per thread: only the thread inside the block records


def _remember_request(request: object, **_: object) -> None:
    """botocore ``before-send`` hook: keep the prepared request when this thread asked for it."""
    if _capture.captured is not None:
        _capture.captured.requests.append(request)


def _remember_signer(request_signer: object = None, **_: object) -> None:
    """botocore ``before-sign`` hook: keep the request signer when this thread asked for it."""
    if _capture.captured is not None and request_signer is not None:
        _capture.captured.signer = request_signer


@contextlib.contextmanager
def capture_listing_requests(client: object) -> Iterator[Captured]:
    """The ListObjectsV2 requests ``client`` sends from this thread inside the block, as signed
    and about to go out, and their signer. The hooks are registered once per client and record
    only for a thread inside this block, so other users of a shared client are not affected."""
    kept = Captured()
    events = getattr(getattr(client, "meta", None), "events", None)
    if events is None:
        yield kept
        return
    events.register("before-send.s3.ListObjectsV2", _remember_request, unique_id=_SENT_ID)
    events.register("before-sign.s3.ListObjectsV2", _remember_signer, unique_id=_SIGNER_ID)
    previous = _capture.captured
    _capture.captured = kept
    try:
        yield kept
    finally:
        _capture.captured = previous


@dataclass(frozen=True)
class ObjectEndpoint:
    """Where a bucket's objects are and how requests to them are signed."""

    base_url: str  #: ends with "/"; an object's URL is this plus its quoted key
    region: str

    def url_of(self, key: str, query: str = "") -> str:
        url = self.base_url + quote(key, safe="/~")
        return f"{url}?{query}" if query else url


def endpoint_of_listing(request: object) -> ObjectEndpoint | None:
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


class BotocoreSigner:
    """Signs with botocore's credential chain: the client's request signer gives, per request,
    its public ``S3SigV4Auth`` with the credentials frozen now (refreshed when near expiry)."""

    def __init__(self, request_signer: RequestSigner) -> None:
        self._request_signer = request_signer

    def sign(
        self, method: str, url: str, region: str, headers: Mapping[str, str]
    ) -> dict[str, str]:
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        # the signer botocore would use (S3SigV4Auth, or awscrt's twin when installed) carries
        # the credentials it froze just now: signed here with the pure-Python S3SigV4Auth
        chosen = self._request_signer.get_auth_instance("s3", region, "s3v4")
        credentials = getattr(chosen, "credentials", None)
        if credentials is None:
            raise TypeError(f"botocore gave a {type(chosen).__name__} signer without credentials")
        request = AWSRequest(method, url, headers=dict(headers))
        S3SigV4Auth(credentials, "s3", region).add_auth(request)
        return {name.lower(): _text(value) for name, value in request.headers.items()}


def _text(value: str | bytes) -> str:
    return value.decode("ascii") if isinstance(value, bytes) else value


def botocore_signed_endpoint(captured: Captured) -> tuple[ObjectEndpoint, BotocoreSigner] | None:
    """Where the listing went and how to sign like it, or None when it cannot be reproduced."""
    if not captured.requests or captured.signer is None:
        return None
    if not callable(getattr(captured.signer, "get_auth_instance", None)):
        return None
    endpoint = endpoint_of_listing(captured.requests[-1])
    signer = cast("RequestSigner", captured.signer)  # has get_auth_instance: checked above
    return None if endpoint is None else (endpoint, BotocoreSigner(signer))


class BotocoreObjects:
    """The object requests of one bucket sent through botocore's client itself (``get_object``,
    ``head_object``), answered as the seam answers (:class:`Response`): for what the seam cannot
    send as signed (keys with dot segments) or sign (see the module docstring). The body is read
    through botocore's ``StreamingBody`` (its public ``readinto``)."""

    def __init__(self, client: S3Client, bucket: str) -> None:
        self._client = client
        self._bucket = bucket

    def send(
        self, method: str, key: str, *, headers: Mapping[str, str], query: str = ""
    ) -> Response:
        import botocore.exceptions as bce

        params: dict[str, str | int] = {"Bucket": self._bucket, "Key": key}
        for name, value in headers.items():
            lowered = name.lower()
            if lowered == "range":
                params["Range"] = value
            elif lowered == "if-match":
                params["IfMatch"] = value
            elif lowered == "x-amz-checksum-mode":
                params["ChecksumMode"] = value
        if query.startswith("partNumber="):
            params["PartNumber"] = int(query.removeprefix("partNumber="))
        operation = self._client.head_object if method == "HEAD" else self._client.get_object
        try:
            resp = operation(**params)
        except bce.ClientError as exc:
            meta = exc.response.get("ResponseMetadata", {})
            err = exc.response.get("Error", {})
            status = int(meta.get("HTTPStatusCode") or 0)
            code = str(err.get("Code") or status)
            return Response(
                status, _Headers(meta.get("HTTPHeaders", {})), None,
                error=(code, str(err.get("Message") or code)),
            )  # fmt: skip
        meta = resp.get("ResponseMetadata", {})
        return Response(
            int(meta.get("HTTPStatusCode") or 0),
            _Headers(meta.get("HTTPHeaders", {})),
            resp.get("Body"),
        )


class _Headers(Mapping[str, str]):
    """botocore's lowercased header dict, read case-insensitively as urllib3's."""

    def __init__(self, headers: Mapping[str, str]) -> None:
        self._headers = headers

    def __getitem__(self, key: str) -> str:
        return self._headers[key.lower()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._headers)

    def __len__(self) -> int:
        return len(self._headers)
