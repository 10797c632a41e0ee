"""Hugging Face Hub source: metadata through huggingface_hub, bytes through our own ranged GETs.

* ``resolve``: ``HfApi.model_info`` turns a branch or tag into its commit sha (skipped for a
  40-hex revision), then ``HfApi.list_repo_tree(recursive=True)`` at that commit gives every
  file's size, git blob id and, for LFS files, the sha256. A file's ``version`` and ``blob_id`` are
  the name huggingface_hub gives its blob (sha256 for LFS files, git blob sha1 otherwise) and its
  checksum is that same id (``sha256`` or ``git-sha1``), so every published blob is verified.
* ``open_range``: ``GET {endpoint}/{repo}/resolve/{commit}/{path}`` with ``Range``, redirects
  followed here rather than by the HTTP client, so that the token (``Authorization: Bearer``) goes
  only to the endpoint's own origin (scheme, host, port) and never to a CDN. The final location of
  each file is cached until its signature expires, so chunks after the first skip the redirect;
  a 403/404/410 from a cached location re-resolves once. Every response is pinned: on the Hub's
  origin ``X-Repo-Commit`` and ``X-Linked-Etag``/``ETag`` must match the commit and blob id;
  everywhere ``Content-Range`` (and ``Content-Length``) must be exactly the range asked for out of
  the size the listing stated, and ranged requests must get 206.

Bodies are read with ``readinto`` straight into the engine's buffer (one copy from the socket).
huggingface_hub reads its environment at import, so the endpoint and token are always passed to it
explicitly. Errors are translated to :mod:`prefetch.errors`; the token never appears in a message,
and neither do the signed query strings of CDN URLs.
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import http.client
import logging
import os
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs, quote, urljoin, urlsplit

import urllib3

from prefetch import __version__
from prefetch.errors import (
    AccessDeniedError,
    InvalidListingError,
    NoMatchingFilesError,
    NotFoundError,
    PrefetchError,
    RepoNotFoundError,
    RevisionNotFoundError,
    SourceChangedError,
    SourceError,
    TransientSourceError,
)
from prefetch.retry import RetryPolicy, call_with_deadline, call_with_retries
from prefetch.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.sources.base import shutdown_socket_of
from prefetch.spec import ModelSpec, SourceURI

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_ENDPOINT = "https://huggingface.co"
USER_AGENT = f"model-prefetch/{__version__}"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_REDIRECTS = (301, 302, 303, 307, 308)
_MAX_REDIRECTS = 5
_DRAIN_LIMIT = 64 * 1024
_TOKEN_HINT = "pass --token, set HF_TOKEN, or log in with `hf auth login` (token file in HF_HOME)"


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
    http: Any = None
    pool_size: int = 32
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    metadata_timeout: float = 120.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    redirect_ttl: float = 600.0


def open_hub_source(spec: ModelSpec, hub: HubOptions | None = None) -> HubSource:
    """The HubSource for ``spec`` (an ``hf://`` URI), filling defaults from the environment."""
    options = hub or HubOptions()
    endpoint = (options.endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    token: str | None
    if options.token is None or options.token is True:
        from huggingface_hub import get_token

        token = get_token()
    else:
        token = options.token or None
    http = options.http or shared_http_pool(options.pool_size)
    return HubSource(
        spec.source,
        endpoint=endpoint,
        token=token,
        http=http,
        retry=options.retry,
        timeout=urllib3.Timeout(connect=options.connect_timeout, read=options.read_timeout),
        redirect_ttl=options.redirect_ttl,
        metadata_timeout=options.metadata_timeout,
    )


# ---- HTTP client -------------------------------------------------------------------------------

_SHARED_POOLS: dict[int, Any] = {}
_SHARED_LOCK = threading.Lock()


def shared_http_pool(size: int = 32) -> Any:
    """One pooled client per process and pool size (the agent reuses connections across syncs)."""
    with _SHARED_LOCK:
        pool = _SHARED_POOLS.get(size)
        if pool is None:
            pool = _SHARED_POOLS[size] = make_http_pool(size)
        return pool


def make_http_pool(size: int = 32) -> Any:
    """A urllib3 pool for ranged GETs: no urllib3 retries or redirects (done by the caller), and
    the environment's HTTP(S)_PROXY / NO_PROXY honoured per host."""
    kwargs: dict[str, Any] = {"num_pools": 8, "maxsize": size, "block": False, "retries": False}
    proxies = {k: v for k, v in urllib.request.getproxies().items() if k in ("http", "https")}
    if not proxies:
        return urllib3.PoolManager(**kwargs)
    return _ProxyRouter(urllib3.PoolManager(**kwargs), proxies, kwargs)


class _ProxyRouter:
    """Sends each request directly or through the scheme's proxy, as the environment says."""

    def __init__(self, direct: Any, proxies: Mapping[str, str], kwargs: dict[str, Any]) -> None:
        self._direct = direct
        self._proxied = {s: urllib3.ProxyManager(url, **kwargs) for s, url in proxies.items()}

    def request(self, method: str, url: str, **kwargs: Any) -> Any:
        parts = urlsplit(url)
        manager = self._proxied.get(parts.scheme)
        if manager is None or urllib.request.proxy_bypass(parts.hostname or ""):
            manager = self._direct
        return manager.request(method, url, **kwargs)


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or (443 if scheme == "https" else 80)
    return scheme, (parts.hostname or "").lower(), port


def _redact(url: str) -> str:
    """A URL fit for messages: no query string (CDN URLs carry signatures), no credentials."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return f"{parts.scheme}://{netloc}{parts.path}"


def _normalize_etag(value: str | None) -> str | None:
    if not value:
        return None
    return value.strip().removeprefix("W/").strip('"').lower() or None


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delay-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value.strip()))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


# ---- errors ------------------------------------------------------------------------------------


@functools.cache
def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP library errors of huggingface_hub worth retrying (httpx2 in 2.x, httpx in 1.x,
    requests before). Looked up on the first error, not at import: importing requests alone
    costs 40 ms of every pull's start-up."""
    found: list[type[BaseException]] = []
    for name in ("httpx2", "httpx"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        found += [module.TimeoutException, module.NetworkError, module.RemoteProtocolError]
    try:
        import requests
    except ImportError:
        pass
    else:
        found += [requests.ConnectionError, requests.Timeout]
    return tuple(found)


def translate_api_error(
    exc: BaseException, what: str, *, repo: str, revision: str, has_token: bool
) -> Exception:
    """A huggingface_hub exception as the package's error (raise it ``from exc``)."""
    from huggingface_hub import errors as hf

    if isinstance(exc, hf.OfflineModeIsEnabled):
        return SourceError(
            f"{what}: HF_HUB_OFFLINE is set, so huggingface_hub refuses to reach the Hub",
            hint="unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) for prefetch; "
            "vLLM keeps it to read the warmed cache",
        )
    if isinstance(exc, hf.GatedRepoError):
        why = "the token has no access to it" if has_token else "no token was given"
        return AccessDeniedError(
            f"{what}: {repo} is a gated repository and {why}",
            hint="accept the repo's conditions on its page with the token's account, then "
            + _TOKEN_HINT,
        )
    status = _status_of(exc)
    if isinstance(exc, hf.RepositoryNotFoundError):
        if not has_token and status == 401:
            return AccessDeniedError(
                f"{what}: the Hub refused {repo} without a token: it is private, gated, "
                "or does not exist",
                hint=_TOKEN_HINT,
            )
        if has_token:
            return RepoNotFoundError(
                f"{what}: repository {repo} not found, or the token has no access to it",
                hint="check the repo id (org/name) and that the token's account can read it",
            )
        return RepoNotFoundError(
            f"{what}: repository {repo} not found",
            hint="check the repo id (org/name); for a private repo, " + _TOKEN_HINT,
        )
    if isinstance(exc, hf.RevisionNotFoundError):
        return RevisionNotFoundError(
            f"{what}: revision {revision!r} not found in {repo}",
            hint="give a branch, a tag or a full 40-hex commit sha",
        )
    if isinstance(exc, hf.HfHubHTTPError) and status is not None:
        headers = exc.response.headers
        server = (headers.get("X-Error-Message") or "").strip()[:200]
        detail = f" ({server})" if server else ""
        if status == 401:
            if has_token:
                return AccessDeniedError(
                    f"{what}: the Hub rejected the token (401: invalid or expired){detail}",
                    hint="check the token; create one at https://huggingface.co/settings/tokens",
                )
            return AccessDeniedError(f"{what}: the Hub asks for a token (401)", hint=_TOKEN_HINT)
        if status == 403:
            return AccessDeniedError(
                f"{what}: the token lacks permission for {repo} (403){detail}",
                hint="use a token with read access to the repository",
            )
        if status == 429:
            return TransientSourceError(
                f"{what}: rate limited by the Hub (429)",
                retry_after=parse_retry_after(headers.get("Retry-After")),
            )
        if status == 408 or status >= 500:
            return TransientSourceError(f"{what}: the Hub answered {status}{detail}")
        return SourceError(f"{what}: the Hub answered {status}{detail}")
    if isinstance(exc, _transport_errors()):
        return TransientSourceError(f"{what}: {type(exc).__name__}: {exc}")
    if isinstance(exc, ConnectionError | TimeoutError):
        return TransientSourceError(f"{what}: {type(exc).__name__}: {exc}")
    return SourceError(f"{what}: {type(exc).__name__}: {exc}")


def _status_of(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return int(status) if status is not None else None


def _read_error(exc: BaseException, what: str) -> Exception:
    """An exception from sending a request or reading a body, as the package's error."""
    if isinstance(exc, urllib3.exceptions.SSLError):
        return SourceError(f"{what}: TLS error: {exc}")
    if isinstance(exc, urllib3.exceptions.ProxyError):
        return TransientSourceError(f"{what}: proxy error: {exc}")
    if isinstance(exc, urllib3.exceptions.HTTPError | http.client.HTTPException | OSError):
        return TransientSourceError(f"{what}: {type(exc).__name__}: {exc}")
    return SourceError(f"{what}: {type(exc).__name__}: {exc}")


# ---- the source --------------------------------------------------------------------------------


class HubSource:
    """One Hub repository (``hf://org/name``); a file's path is its path in the repo."""

    def __init__(
        self,
        uri: SourceURI,
        *,
        endpoint: str,
        token: str | None,
        http: Any,
        retry: RetryPolicy | None = None,
        timeout: Any = None,
        redirect_ttl: float = 600.0,
        metadata_timeout: float = 120.0,
        api: Any = None,
    ) -> None:
        if uri.scheme != "hf":
            raise ValueError(f"not a Hub URI: {uri}")
        self._uri = uri
        self._repo = uri.location
        self._endpoint = endpoint.rstrip("/")
        self._origin = _origin(self._endpoint)
        self._token = token
        self._http = http
        self._retry = retry or RetryPolicy()
        self._timeout = timeout or urllib3.Timeout(connect=10.0, read=60.0)
        self._redirect_ttl = redirect_ttl
        self._metadata_timeout = metadata_timeout
        self._locations: dict[str, tuple[str, float]] = {}
        self._resolve_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi(
                endpoint=self._endpoint,
                token=token or False,
                library_name="model-prefetch",
                library_version=__version__,
            )
        self._api = api
        self._resolve_prefix = f"{self._endpoint}/{self._repo}/resolve/"

    # -- resolve -----------------------------------------------------------------------------

    def _call(self, what: str, revision: str, fn: Callable[[], T]) -> T:
        def translated() -> T:
            try:
                return fn()
            except PrefetchError:
                raise  # already ours (a malformed listing): not an API error to translate
            except Exception as exc:
                raise translate_api_error(
                    exc, what, repo=self._repo, revision=revision, has_token=bool(self._token)
                ) from exc

        def once() -> T:
            # list_repo_tree takes no timeout (see call_with_deadline)
            return call_with_deadline(translated, self._metadata_timeout, what=what)

        return call_with_retries(once, self._retry, what=what)

    def resolve(self, spec: ModelSpec) -> Snapshot:
        from huggingface_hub.hf_api import RepoFile

        repo = self._repo
        revision = spec.revision or "main"
        if _COMMIT.match(revision):
            commit = revision  # immutable: nothing to resolve (the listing checks it exists)
        else:
            info = self._call(
                f"resolving {repo}@{revision}",
                revision,
                lambda: self._api.model_info(
                    repo, revision=revision, expand=["sha"], timeout=self._timeout.read_timeout
                ),
            )
            commit = str(getattr(info, "sha", "") or "")
            if not _COMMIT.match(commit):
                raise SourceError(f"resolving {repo}@{revision}: the Hub gave no commit sha")
        listing = f"listing {repo}@{commit[:12]}"
        entries = self._call(listing, revision, lambda: self._list_tree(commit, listing))
        repo_files = [e for e in entries if isinstance(e, RepoFile)]
        if not repo_files:
            raise NoMatchingFilesError(f"{repo}@{commit[:12]} has no files")
        files = [self._remote_file(e, commit) for e in repo_files if spec.wants(e.path)]
        if not files:
            raise NoMatchingFilesError(
                f"no file of {repo}@{commit[:12]} matches the include/exclude patterns",
                hint=f"include={list(spec.include)} exclude={list(spec.exclude)}",
            )
        files.sort(key=lambda f: f.path)
        return Snapshot(
            source=str(self._uri),
            revision_id=commit,
            files=tuple(files),
            requested_revision=None if revision == commit else revision,
            repo_id=repo,
            extra={"endpoint": self._endpoint},
        )

    def _list_tree(self, commit: str, what: str) -> list[Any]:
        """Every entry of the repo at ``commit``. huggingface_hub builds each entry as the pages
        arrive; one it cannot build (no ``oid``, an ``lfs`` block without its fields) is the
        server's error: refused at once, not retried, with what was wrong."""
        try:
            return list(self._api.list_repo_tree(self._repo, recursive=True, revision=commit))
        except (KeyError, TypeError, AttributeError) as exc:
            raise InvalidListingError(
                f"{what}: the Hub sent a malformed tree entry ({type(exc).__name__}: {exc})"
            ) from exc

    def _remote_file(self, entry: Any, commit: str) -> RemoteFile:
        path, size = str(entry.path), entry.size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidListingError(
                f"{self._repo}: {path!r}: the Hub gave an invalid size {size!r}"
            )
        lfs = entry.lfs
        if lfs is not None:
            blob = str(lfs.sha256 if hasattr(lfs, "sha256") else lfs["sha256"]).lower()
            algorithm = "sha256"
            if not _SHA256.match(blob):
                raise InvalidListingError(
                    f"{self._repo}: {path!r}: the Hub gave a malformed sha256 {blob!r}"
                )
            lfs_size = lfs.size if hasattr(lfs, "size") else lfs.get("size")
            if lfs_size != size:
                raise InvalidListingError(
                    f"{self._repo}: {path!r}: the Hub gave two sizes, {size!r} and {lfs_size!r}"
                )
        else:
            blob = str(entry.blob_id).lower()
            algorithm = "git-sha1"
            if not _COMMIT.match(blob):
                raise InvalidListingError(
                    f"{self._repo}: {path!r}: the Hub gave a malformed blob id {blob!r}"
                )
        return RemoteFile(
            path=path,
            size=size,
            version=blob,
            checksums=(Checksum(algorithm, blob, origin="hub"),),
            blob_id=blob,
            locator=f"{self._resolve_prefix}{commit}/{quote(path)}",
            described=True,
        )

    def describe(self, file: RemoteFile) -> RemoteFile:
        return file  # the listing has it all: size, blob id, checksum

    # -- read --------------------------------------------------------------------------------

    def open_range(self, file: RemoteFile, start: int, end: int) -> _HubRangeReader:
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
        resp = self._get(cached, headers, what)
        if resp.status not in (403, 404, 410, *_REDIRECTS):
            return self._reader(file, resp, cached, start, end, what)
        # an expired signature or a moved object: forget the location and resolve again
        _discard(resp)
        self._forget_location(file)
        with self._resolving(file):
            return self._open_via_hub(file, headers, start, end, what)

    def _open_via_hub(
        self, file: RemoteFile, headers: dict[str, str], start: int, end: int, what: str
    ) -> _HubRangeReader:
        """GET the resolve URL and follow its redirects; cache where the bytes came from."""
        url = file.locator
        for _ in range(_MAX_REDIRECTS + 1):
            resp = self._get(url, headers, what)
            if resp.status not in _REDIRECTS:
                break
            self._check_pins(file, resp, url, what)
            location = resp.headers.get("Location")
            _release_redirect(resp)
            if not location:
                raise SourceError(f"{what}: redirect without a Location from {_redact(url)}")
            url = urljoin(url, location)
            if urlsplit(url).scheme.lower() not in ("http", "https"):
                raise SourceError(
                    f"{what}: refusing a redirect to {_redact(url)!r}: not an HTTP(S) location"
                )
        else:
            raise SourceError(f"{what}: more than {_MAX_REDIRECTS} redirects")
        reader = self._reader(file, resp, url, start, end, what)
        if url != file.locator:
            self._remember_location(file, url)
        return reader

    def _get(self, url: str, headers: dict[str, str], what: str) -> Any:
        if self._token and _origin(url) == self._origin:
            headers = {**headers, "Authorization": f"Bearer {self._token}"}
        try:
            return self._http.request(
                "GET",
                url,
                headers=headers,
                redirect=False,
                retries=False,
                preload_content=False,
                decode_content=False,
                timeout=self._timeout,
            )
        except Exception as exc:
            raise _read_error(exc, what) from exc

    def _check_pins(self, file: RemoteFile, resp: Any, url: str, what: str) -> None:
        """The response (a redirect or the bytes) is for the commit and blob we listed."""
        h = resp.headers
        hub = _origin(url) == self._origin
        commit = h.get("X-Repo-Commit")
        expected_commit = file.locator[len(self._resolve_prefix) :].split("/", 1)[0]
        if commit and commit.strip().lower() != expected_commit:
            _discard(resp)
            raise SourceChangedError(
                f"{what}: the Hub served commit {commit.strip()[:12]}, expected "
                f"{expected_commit[:12]}"
            )
        # Off the Hub's origin only the Hub's own header counts: a CDN's ETag is its own business.
        etag = _normalize_etag(h.get("X-Linked-Etag") or (h.get("ETag") if hub else None))
        if etag and file.version and etag != file.version:
            _discard(resp)
            raise SourceChangedError(
                f"{what}: the server's blob id {etag[:16]} is not the listed {file.version[:16]}"
            )
        linked = h.get("X-Linked-Size")
        if linked and linked.strip().isdigit() and int(linked) != file.size:
            _discard(resp)
            raise SourceChangedError(
                f"{what}: the server says {int(linked)} bytes, the listing said {file.size}"
            )

    def _reader(
        self, file: RemoteFile, resp: Any, url: str, start: int, end: int, what: str
    ) -> _HubRangeReader:
        status = resp.status
        if status != 206:
            error = self._status_error(file, resp, url, what)
            _discard(resp)
            raise error
        self._check_pins(file, resp, url, what)
        h = resp.headers
        expected = f"bytes {start}-{end - 1}/{file.size}"
        content_range = (h.get("Content-Range") or "").strip()
        if content_range != expected:
            _discard(resp)
            raise SourceChangedError(
                f"{what}: the server answered Content-Range {content_range!r}, expected "
                f"{expected!r} (the file is not the size the listing stated)"
            )
        length = h.get("Content-Length")
        if length is not None and length.strip() != str(end - start):
            _discard(resp)
            raise SourceChangedError(
                f"{what}: the body is {length.strip()} bytes, the range is {end - start}"
            )
        encoding = (h.get("Content-Encoding") or "identity").strip().lower()
        if encoding != "identity":
            _discard(resp)
            raise SourceError(f"{what}: the server sent a {encoding}-encoded body")
        return _HubRangeReader(resp, what, end - start, length_known=length is not None)

    def _status_error(self, file: RemoteFile, resp: Any, url: str, what: str) -> Exception:
        status = resp.status
        h = resp.headers
        code = (h.get("X-Error-Code") or "").strip()
        server = (h.get("X-Error-Message") or "").strip()[:200]
        detail = f" ({server})" if server else ""
        where = "the Hub" if _origin(url) == self._origin else _redact(url)
        if status == 200:
            return SourceError(f"{what}: {where} ignored the Range header (200, not 206)")
        if status == 416:
            return SourceChangedError(
                f"{what}: {where} says the range is not satisfiable: the file is shorter than "
                f"the {file.size} bytes the listing stated"
            )
        if status == 429:
            return TransientSourceError(
                f"{what}: rate limited by {where} (429)",
                retry_after=parse_retry_after(h.get("Retry-After")),
            )
        if status == 408 or status >= 500:
            return TransientSourceError(f"{what}: {where} answered {status}{detail}")
        has_token = bool(self._token)
        if code == "GatedRepo":
            why = "the token has no access to it" if has_token else "no token was given"
            return AccessDeniedError(
                f"{what}: {self._repo} is a gated repository and {why}",
                hint="accept the repo's conditions on its page, then " + _TOKEN_HINT,
            )
        if code == "RepoNotFound" or (status == 401 and not has_token):
            if status == 401 and not has_token:
                return AccessDeniedError(
                    f"{what}: the Hub refused {self._repo} without a token", hint=_TOKEN_HINT
                )
            return RepoNotFoundError(f"{what}: repository {self._repo} not found{detail}")
        if code == "RevisionNotFound":
            return RevisionNotFoundError(f"{what}: the commit is gone from {self._repo}{detail}")
        if status == 401:
            return AccessDeniedError(
                f"{what}: {where} rejected the token (401: invalid or expired)",
                hint="check the token; create one at https://huggingface.co/settings/tokens",
            )
        if status == 403:
            return AccessDeniedError(f"{what}: {where} refused the download (403){detail}")
        if status in (404, 410):
            return NotFoundError(f"{what}: {where} has no such file ({status}){detail}")
        return SourceError(f"{what}: {where} answered {status}{detail}")

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


def _discard(resp: Any) -> None:
    """Drop a response whose body we do not want, closing its connection (never a blocking
    read: the connection may be the one that just failed)."""
    try:
        resp.close()
    finally:
        resp.release_conn()


def _release_redirect(resp: Any) -> None:
    """Finish a redirect: read its small body so the connection goes back to the pool."""
    try:
        length = int(resp.headers.get("Content-Length") or -1)
    except ValueError:
        length = -1
    if not 0 <= length <= _DRAIN_LIMIT:
        _discard(resp)
        return
    try:
        resp.drain_conn()
    finally:
        resp.release_conn()


class _HubRangeReader:
    """The body of one 206: ``readinto`` straight from the socket into the caller's buffer."""

    def __init__(self, resp: Any, what: str, length: int, *, length_known: bool) -> None:
        self._resp = resp
        fp = getattr(resp, "_fp", None)
        # urllib3's own readinto reads into a new bytes object and copies it; http.client's
        # readinto fills our buffer directly (half the client CPU per byte, measured).
        self._fp = fp if isinstance(fp, http.client.HTTPResponse) else None
        self._what = what
        self._left = length
        self._length_known = length_known
        self._clean = False
        self._aborted = False

    def readinto(self, buf: memoryview, /) -> int:
        if self._left <= 0:
            return 0
        view = buf[: self._left] if len(buf) > self._left else buf
        try:
            n = self._fp.readinto(view) if self._fp is not None else self._resp.readinto(view)
        except Exception as exc:
            raise _read_error(exc, self._what) from exc
        self._left -= n
        if self._left == 0:
            self._finish()
        return n

    def _finish(self) -> None:
        """The range is complete: a body without Content-Length must end here too."""
        if self._length_known:
            self._clean = True
            return
        try:
            extra = self._fp.read(1) if self._fp is not None else self._resp.read(1)
        except Exception as exc:
            raise _read_error(exc, self._what) from exc
        if extra:
            raise SourceChangedError(f"{self._what}: the body is longer than the range")
        self._clean = True

    def abort(self) -> None:
        """Make a read blocked in another thread return now (see RangeReader); the connection
        is then discarded, never handed back to the pool."""
        self._aborted = True
        shutdown_socket_of(self._fp if self._fp is not None else self._resp)

    def close(self) -> None:
        if self._clean and not self._aborted:
            self._resp.release_conn()
        else:
            _discard(self._resp)


__all__ = [
    "DEFAULT_ENDPOINT",
    "HubOptions",
    "HubSource",
    "make_http_pool",
    "open_hub_source",
    "parse_retry_after",
    "shared_http_pool",
    "translate_api_error",
]
