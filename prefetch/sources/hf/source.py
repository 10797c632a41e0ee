"""Hugging Face Hub source: metadata and bytes through our own HTTP layer, no huggingface_hub.

* ``resolve``: ``GET {endpoint}/api/models/{repo}/revision/{ref}`` turns a branch or tag into
  its commit sha (skipped for a 40-hex revision), then ``GET .../tree/{commit}?recursive=true``
  (followed through its ``Link: <...>; rel="next"`` pages) gives every file's size, git blob id
  and, for LFS files, the sha256. A file's ``version`` and ``blob_id`` are the name
  huggingface_hub gives its blob (sha256 for LFS files, git blob sha1 otherwise) and its
  checksum is that same id (``sha256`` or ``git-sha1``), so every published blob is verified.
  Each metadata call (its redirects and pages included) is bounded to ``metadata_timeout`` and
  retried per the RetryPolicy; an answer that is not the JSON the Hub sends is refused, naming
  the URL. huggingface_hub is not imported: it costs ~0.3 s of CPU, most of a no-op pull.
* ``open_range``: ``GET {endpoint}/{repo}/resolve/{commit}/{path}`` with ``Range``, redirects
  followed here rather than by the HTTP client, so that the token (``Authorization: Bearer``) goes
  only to the endpoint's own origin (scheme, host, port) and never to a CDN. The final location of
  each file is cached until its signature expires, so chunks after the first skip the redirect;
  a 403/404/410 from a cached location re-resolves once. Every response is pinned: on the Hub's
  origin ``X-Repo-Commit`` and ``X-Linked-Etag``/``ETag`` must match the commit and blob id;
  everywhere ``Content-Range`` (and ``Content-Length``) must be exactly the range asked for out of
  the size the listing stated, and ranged requests must get 206.

Both go through one pool (:mod:`prefetch.sources.http.transport`), so the proxy rule is the same for
the listing as for the bytes, and the token rule too (a next page or redirect off the endpoint's
origin gets no token). Bodies are read with ``readinto`` straight into the engine's buffer (one
copy from the socket). The token is found as huggingface_hub finds it
(:func:`~prefetch.sources.hf.token.hub_token`). Errors are translated to
:mod:`prefetch.support.errors` by one table (:func:`~prefetch.sources.hf.errors.hub_error`); the
token never appears in a message, and neither do the signed query strings of CDN URLs.

The pieces: the endpoint and its token rule (:mod:`~prefetch.sources.hf.endpoint`, the token
found by :mod:`~prefetch.sources.hf.token`, refusals worded by :mod:`~prefetch.sources.hf.errors`),
the metadata API (:mod:`~prefetch.sources.hf.api`); the byte path (ranged reads, CDN redirects
and their cache) is here.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import parse_qs, urlsplit

import urllib3

from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.snapshot import RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, SourceURI
from prefetch.sources.hf.api import HubApi
from prefetch.sources.hf.endpoint import MAX_REDIRECTS, REDIRECTS, USER_AGENT, HubEndpoint
from prefetch.sources.hf.token import token_of
from prefetch.sources.http.transport import (
    BodyReader,
    HttpClient,
    check_range_answer,
    discard,
    http_client_response,
    origin_of,
    shared_http_pool,
)
from prefetch.support import settings
from prefetch.support.errors import SourceChangedError, SourceError

DEFAULT_ENDPOINT = "https://huggingface.co"


@dataclass
class HubOptions:
    """How to reach the Hub. Every field has a default taken from the environment.

    ``endpoint``: the Hub or a mirror (None: ``HF_ENDPOINT``, else https://huggingface.co).
    ``token``: None looks it up the way huggingface_hub does (``HF_TOKEN``, then the token file
    in ``HF_HOME``); False sends none. ``http``: a urllib3 ``PoolManager``-like client (tests pass
    their own); None uses one shared pool per process. ``redirect_ttl``: seconds a CDN location is
    reused at most (less when its ``Expires`` says so). ``metadata_timeout``: seconds one
    metadata call (revision lookup, file listing) may take in all before it is retried.
    """

    endpoint: str | None = None
    token: str | bool | None = None
    http: HttpClient | None = None
    pool_size: int = 32
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    metadata_timeout: float = 120.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    redirect_ttl: float = 600.0


def open_hub_source(spec: ModelSpec, hub: HubOptions | None = None) -> HubSource:
    """The HubSource for ``spec`` (an ``hf://`` URI), filling defaults from the environment."""
    options = hub or HubOptions()
    endpoint = (options.endpoint or settings.hf_endpoint() or DEFAULT_ENDPOINT).rstrip("/")
    proxies = settings.proxies(override=spec.proxy)
    http = options.http or shared_http_pool(
        options.pool_size, proxies, ca_certs=settings.ca_bundle(spec.ca_bundle).path
    )
    return HubSource(
        spec.source,
        endpoint=endpoint,
        token=token_of(options.token),
        http=http,
        retry=options.retry,
        timeout=urllib3.Timeout(connect=options.connect_timeout, read=options.read_timeout),
        redirect_ttl=options.redirect_ttl,
        metadata_timeout=options.metadata_timeout,
    )


def _normalize_etag(value: str | None) -> str | None:
    if not value:
        return None
    return value.strip().removeprefix("W/").strip('"').lower() or None


class HubSource:
    """One Hub repository (``hf://org/name``); a file's path is its path in the repo."""

    def __init__(
        self,
        uri: SourceURI,
        *,
        endpoint: str,
        token: str | None,
        http: HttpClient,
        retry: RetryPolicy | None = None,
        timeout: urllib3.Timeout | None = None,
        redirect_ttl: float = 600.0,
        metadata_timeout: float = 120.0,
    ) -> None:
        if uri.scheme != "hf":
            raise ValueError(f"not a Hub URI: {uri}")
        self._uri = uri
        self._repo = uri.location
        self._hub = HubEndpoint(
            endpoint, repo=self._repo, token=token, http=http,
            timeout=timeout or urllib3.Timeout(connect=10.0, read=60.0),
        )  # fmt: skip
        self._origin = self._hub.origin
        self._api = HubApi(
            self._hub, uri, retry=retry or RetryPolicy(), metadata_timeout=metadata_timeout
        )
        self._redirect_ttl = redirect_ttl
        self._locations: dict[str, tuple[str, float]] = {}
        self._resolve_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._resolve_prefix = self._api.resolve_prefix

    def resolve(self, spec: ModelSpec) -> Snapshot:
        return self._api.resolve(spec)

    def describe(self, file: RemoteFile) -> RemoteFile:
        return file  # the listing has it all: size, blob id, checksum

    # -- read --------------------------------------------------------------------------------

    def open_range(self, file: RemoteFile, start: int, end: int) -> BodyReader:
        what = f"{self._repo}/{file.path} bytes {start}-{end - 1}"
        headers = {
            "Range": f"bytes={start}-{end - 1}",
            "Accept-Encoding": "identity",
            "User-Agent": USER_AGENT,
        }
        cached = self._cached_location(file)
        if cached is None:
            # One chunk of a file resolves (until its response headers arrive); the others
            # wait for it and then use the location it cached instead of each paying a redirect.
            with self._resolving(file):
                cached = self._cached_location(file)
                if cached is None:
                    return self._open_via_hub(file, headers, start, end, what)
        resp = self._hub.get(cached, headers, what)
        if resp.status not in (403, 404, 410, *REDIRECTS):
            return self._reader(file, resp, cached, start, end, what)
        # an expired signature or a moved object: forget the location and resolve again
        discard(resp)
        self._forget_location(file)
        with self._resolving(file):
            return self._open_via_hub(file, headers, start, end, what)

    def _open_via_hub(
        self, file: RemoteFile, headers: dict[str, str], start: int, end: int, what: str
    ) -> BodyReader:
        """GET the resolve URL and follow its redirects; cache where the bytes came from."""
        url = file.locator
        for _ in range(MAX_REDIRECTS + 1):
            resp = self._hub.get(url, headers, what)
            if resp.status not in REDIRECTS:
                break
            self._check_pins(file, resp, url, what)
            url = self._hub.redirect_target(url, resp, what)
        else:
            raise SourceError(f"{what}: more than {MAX_REDIRECTS} redirects")
        reader = self._reader(file, resp, url, start, end, what)
        if url != file.locator:
            self._remember_location(file, url)
        return reader

    def _check_pins(
        self, file: RemoteFile, resp: urllib3.BaseHTTPResponse, url: str, what: str
    ) -> None:
        """The response (a redirect or the bytes) is for the commit and blob we listed."""
        h = resp.headers
        hub = origin_of(url) == self._origin
        commit = h.get("X-Repo-Commit")
        expected_commit = self._commit_of(file)
        if commit and commit.strip().lower() != expected_commit:
            discard(resp)
            raise SourceChangedError(
                f"{what}: the Hub served commit {commit.strip()[:12]}, expected "
                f"{expected_commit[:12]}"
            )
        # Off the Hub's origin only the Hub's own header counts: a CDN's ETag is its own business.
        etag = _normalize_etag(h.get("X-Linked-Etag") or (h.get("ETag") if hub else None))
        if etag and file.version and etag != file.version:
            discard(resp)
            raise SourceChangedError(
                f"{what}: the server's blob id {etag[:16]} is not the listed {file.version[:16]}"
            )
        linked = h.get("X-Linked-Size")
        if linked and linked.strip().isdigit() and int(linked) != file.size:
            discard(resp)
            raise SourceChangedError(
                f"{what}: the server says {int(linked)} bytes, the listing said {file.size}"
            )

    def _reader(
        self,
        file: RemoteFile,
        resp: urllib3.BaseHTTPResponse,
        url: str,
        start: int,
        end: int,
        what: str,
    ) -> BodyReader:
        status = resp.status
        if not 200 <= status < 300:  # a 2xx that is not 206 breaks the range rule, below
            error = self._status_error(file, resp, url, what)
            discard(resp)
            raise error
        self._check_pins(file, resp, url, what)
        h = resp.headers
        length = h.get("Content-Length")
        try:
            check_range_answer(what, start, end, file.size, status, h.get("Content-Range"), length)
        except SourceChangedError:
            discard(resp)
            raise
        encoding = (h.get("Content-Encoding") or "identity").strip().lower()
        if encoding != "identity":
            discard(resp)
            raise SourceError(f"{what}: the server sent a {encoding}-encoded body")
        return _body_reader(resp, what, end - start, length_known=length is not None)

    def _status_error(
        self, file: RemoteFile, resp: urllib3.BaseHTTPResponse, url: str, what: str
    ) -> SourceError:
        return self._hub.refusal(resp, url, what, revision=self._commit_of(file), file=file)

    def _commit_of(self, file: RemoteFile) -> str:
        """The commit a file's resolve URL names (the listing's)."""
        return file.locator[len(self._resolve_prefix) :].split("/", 1)[0]

    # -- redirect cache ------------------------------------------------------------------------

    def _cached_location(self, file: RemoteFile) -> str | None:
        with self._lock:
            hit = self._locations.get(file.locator)
        if hit is None or hit[1] <= time.monotonic():
            return None
        return hit[0]

    def _remember_location(self, file: RemoteFile, url: str) -> None:
        ttl = self._redirect_ttl
        expires = parse_qs(urlsplit(url).query).get("Expires")
        if expires:
            with contextlib.suppress(ValueError):
                # keep a margin: a chunk must finish before the signature runs out
                ttl = min(ttl, float(expires[-1]) - time.time() - 60)
        if ttl <= 0:
            return
        with self._lock:
            self._locations[file.locator] = (url, time.monotonic() + ttl)

    def _forget_location(self, file: RemoteFile) -> None:
        with self._lock:
            self._locations.pop(file.locator, None)

    def _resolving(self, file: RemoteFile) -> threading.Lock:
        with self._lock:
            return self._resolve_locks.setdefault(file.locator, threading.Lock())


def _body_reader(
    resp: urllib3.BaseHTTPResponse, what: str, length: int, *, length_known: bool
) -> BodyReader:
    """The reader of a checked 206: its connection goes back to the pool only when the body
    was read to its end and nothing aborted it."""

    def finish(reusable: bool) -> None:
        if reusable:
            resp.release_conn()
        else:
            discard(resp)

    return BodyReader(
        resp,
        what,
        length,
        raw=http_client_response(resp),
        socket_owner=resp,
        on_close=finish,
        length_known=length_known,
    )


__all__ = [
    "DEFAULT_ENDPOINT",
    "HubOptions",
    "HubSource",
    "hub_source",
    "open_hub_source",
]


class Reach(Protocol):
    """What :func:`hub_source` reads of the front door's settings
    (:class:`prefetch.sources.SourceSettings`, which imports this module's callers)."""

    @property
    def hub(self) -> HubOptions | None: ...
    @property
    def hub_endpoint(self) -> str | None: ...
    @property
    def token(self) -> str | bool | None: ...
    @property
    def pool(self) -> int: ...
    @property
    def retry(self) -> RetryPolicy | None: ...


def _hub_options(reach: Reach) -> HubOptions:
    if reach.hub is not None:
        return reach.hub
    return HubOptions(
        endpoint=reach.hub_endpoint,
        token=reach.token,
        pool_size=reach.pool,
        retry=reach.retry or RetryPolicy(),
    )


def hub_source(spec: ModelSpec, reach: Reach) -> HubSource:
    """The Hub's source for ``spec``, with the options ``reach`` gives (the front door's
    settings)."""
    return open_hub_source(spec, _hub_options(reach))
