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
import contextvars
import functools
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs, quote, urljoin, urlsplit

import urllib3

from prefetch import __version__, settings
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
from prefetch.sources._http import (
    BodyReader,
    HttpClient,
    discard,
    error_class,
    http_client_response,
    redact_url,
    release_small_body,
    shared_http_pool,
    status_error,
    transport_error,
)
from prefetch.spec import ModelSpec, SourceURI

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_ENDPOINT = "https://huggingface.co"
USER_AGENT = f"model-prefetch/{__version__}"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_REDIRECTS = (301, 302, 303, 307, 308)
_MAX_REDIRECTS = 5
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
    token: str | None
    if options.token is None or options.token is True:
        from huggingface_hub import get_token

        token = get_token()
    else:
        token = options.token or None
    proxies = settings.proxies(override=spec.proxy)
    http = options.http or shared_http_pool(options.pool_size, proxies)
    return HubSource(
        spec.source,
        endpoint=endpoint,
        token=token,
        http=http,
        proxies=proxies,
        retry=options.retry,
        timeout=urllib3.Timeout(connect=options.connect_timeout, read=options.read_timeout),
        redirect_ttl=options.redirect_ttl,
        metadata_timeout=options.metadata_timeout,
    )


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or (443 if scheme == "https" else 80)
    return scheme, (parts.hostname or "").lower(), port


def _normalize_etag(value: str | None) -> str | None:
    if not value:
        return None
    return value.strip().removeprefix("W/").strip('"').lower() or None


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


#: huggingface_hub's exceptions for the Hub's ``X-Error-Code`` values (gated first: it is a
#: subclass of RepositoryNotFoundError).
_API_ERROR_CODES = (
    ("GatedRepoError", "GatedRepo"),
    ("RepositoryNotFoundError", "RepoNotFound"),
    ("RevisionNotFoundError", "RevisionNotFound"),
)


@dataclass(frozen=True)
class HubRefusal:
    """One error answer from the Hub (or the CDN it redirected to), as :func:`hub_error` needs
    it. ``reading``: the answer to a ranged read of a file of ``size`` bytes, not to a metadata
    call; ``where``: "the Hub" or the redacted URL that answered."""

    what: str
    status: int
    repo: str
    revision: str
    has_token: bool
    where: str = "the Hub"
    error_code: str = ""
    server_message: str = ""
    retry_after: str | None = None
    reading: bool = False
    size: int | None = None


def hub_error(r: HubRefusal) -> SourceError:
    """The package's error for an answer of the Hub: the class from the one status table
    (:func:`prefetch.sources._http.error_class`), the words and hint from here."""
    message, hint = _hub_wording(r)
    return status_error(
        r.status,
        f"{r.what}: {message}",
        error_code=r.error_code,
        credentials=r.has_token,
        retry_after=r.retry_after,
        hint=hint,
    )


def _hub_wording(r: HubRefusal) -> tuple[str, str | None]:
    """What to tell the user about ``r`` (message without the ``what:`` prefix, and a hint)."""
    cls = error_class(r.status, r.error_code, credentials=r.has_token)
    detail = f" ({r.server_message})" if r.server_message else ""
    if cls is TransientSourceError:
        if r.status == 429:
            return f"rate limited by {r.where} (429)", None
        return f"{r.where} answered {r.status}{detail}", None
    if cls is AccessDeniedError:
        return _access_denied_wording(r, detail)
    if cls is RepoNotFoundError:
        if r.has_token:
            return (
                f"repository {r.repo} not found, or the token has no access to it{detail}",
                "check the repo id (org/name) and that the token's account can read it",
            )
        return (
            f"repository {r.repo} not found{detail}",
            "check the repo id (org/name); for a private repo, " + _TOKEN_HINT,
        )
    if cls is RevisionNotFoundError:
        return (
            f"revision {r.revision!r} not found in {r.repo}{detail}",
            "give a branch, a tag or a full 40-hex commit sha",
        )
    if cls is NotFoundError and r.reading:
        return f"{r.where} has no such file ({r.status}){detail}", None
    if cls is SourceChangedError and r.status == 416:
        return (
            f"{r.where} says the range is not satisfiable: the file is shorter than the "
            f"{r.size} bytes the listing stated",
            None,
        )
    if r.status == 200 and r.reading:
        return f"{r.where} ignored the Range header (200, not 206)", None
    return f"{r.where} answered {r.status}{detail}", None


def _access_denied_wording(r: HubRefusal, detail: str) -> tuple[str, str | None]:
    if r.error_code == "GatedRepo":
        why = "the token has no access to it" if r.has_token else "no token was given"
        return (
            f"{r.repo} is a gated repository and {why}",
            "accept the repo's conditions on its page with the token's account, then "
            + _TOKEN_HINT,
        )
    if r.status == 401 and not r.has_token:
        return (
            f"{r.where} refused {r.repo} without a token (401): it is private, gated, "
            "or does not exist",
            _TOKEN_HINT,
        )
    if r.status == 401:
        return (
            f"{r.where} rejected the token (401: invalid or expired){detail}",
            "check the token; create one at https://huggingface.co/settings/tokens",
        )
    refused = "the download" if r.reading else f"access to {r.repo}"
    return (
        f"{r.where} refused {refused} ({r.status}){detail}",
        "use a token with read access to the repository",
    )


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
    code = next((c for name, c in _API_ERROR_CODES if isinstance(exc, getattr(hf, name))), "")
    status = _status_of(exc)
    if code or (isinstance(exc, hf.HfHubHTTPError) and status is not None):
        response = getattr(exc, "response", None)
        headers: Mapping[str, str] = getattr(response, "headers", None) or {}
        return hub_error(
            HubRefusal(
                what,
                status or 0,
                repo=repo,
                revision=revision,
                has_token=has_token,
                error_code=code,
                server_message=(headers.get("X-Error-Message") or "").strip()[:200],
                retry_after=headers.get("Retry-After"),
            )
        )
    if isinstance(exc, _transport_errors()):
        return TransientSourceError(f"{what}: {type(exc).__name__}: {exc}")
    if isinstance(exc, ConnectionError | TimeoutError):
        return TransientSourceError(f"{what}: {type(exc).__name__}: {exc}")
    return SourceError(f"{what}: {type(exc).__name__}: {exc}")


def _status_of(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return int(status) if status is not None else None


# ---- metadata requests: the same proxy rule as the bytes ----------------------------------------

#: The proxy settings of the source whose metadata call runs in this context (None: the
#: environment's); set around each huggingface_hub call, in the thread that makes it.
_METADATA_PROXIES: contextvars.ContextVar[settings.Proxies | None] = contextvars.ContextVar(
    "prefetch_hub_metadata_proxies", default=None
)


_ROUTING_LOCK = threading.Lock()


def route_metadata_through_proxy_rule() -> bool:
    """Install :func:`_install_proxy_rule_client` once per process (sources may be opened from
    several threads at once; a second install would close the session the first one made)."""
    with _ROUTING_LOCK:
        return _install_proxy_rule_client()


@functools.cache
def _install_proxy_rule_client() -> bool:
    """Make huggingface_hub's shared client route each request by our proxy rule.

    huggingface_hub sends its metadata calls (revision lookup, file listing) through one
    process-wide httpx client that reads the environment's proxies its own way and knows no
    per-source setting. Its client factory is replaced (once) by one whose transport asks
    :meth:`prefetch.settings.Proxies.proxy_for` per request, with the calling source's settings
    (``_METADATA_PROXIES``), so a model's ``proxy`` and NO_PROXY mean the same for its listing
    as for its bytes. False when this huggingface_hub has no client factory (before 1.0,
    requests reads the environment itself; a per-source proxy then covers the bytes only)."""
    import huggingface_hub

    set_factory = getattr(huggingface_hub, "set_client_factory", None)
    httpx: Any = None
    for name in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError):
            httpx = __import__(name)
            break
    if set_factory is None or httpx is None:
        return False
    from huggingface_hub.utils import _http as hf_http

    hook = getattr(hf_http, "hf_request_event_hook", None)
    transports: dict[str | None, Any] = {}
    lock = threading.Lock()

    class ProxyRuleTransport(httpx.BaseTransport):  # type: ignore[misc]
        def handle_request(self, request: Any) -> Any:
            proxies = _METADATA_PROXIES.get() or settings.proxies()
            proxy = proxies.proxy_for(str(request.url))
            with lock:
                transport = transports.get(proxy)
                if transport is None:
                    transport = transports[proxy] = httpx.HTTPTransport(proxy=proxy)
            return transport.handle_request(request)

    def client() -> Any:
        return httpx.Client(
            event_hooks={"request": [hook]} if hook else {},
            follow_redirects=True,
            timeout=None,
            transport=ProxyRuleTransport(),
        )

    set_factory(client)
    return True


# ---- the source --------------------------------------------------------------------------------


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
        api: Any = None,
        proxies: settings.Proxies | None = None,
    ) -> None:
        if uri.scheme != "hf":
            raise ValueError(f"not a Hub URI: {uri}")
        #: The proxy rule for huggingface_hub's metadata requests (None: the environment's);
        #: the bytes go through ``http``, built for the same rule by open_hub_source.
        self._proxies = proxies
        route_metadata_through_proxy_rule()
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
            proxied = _METADATA_PROXIES.set(self._proxies)
            try:
                return fn()
            except PrefetchError:
                raise  # already ours (a malformed listing): not an API error to translate
            except Exception as exc:
                raise translate_api_error(
                    exc, what, repo=self._repo, revision=revision, has_token=bool(self._token)
                ) from exc
            finally:
                _METADATA_PROXIES.reset(proxied)

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
        resp = self._get(cached, headers, what)
        if resp.status not in (403, 404, 410, *_REDIRECTS):
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
        for _ in range(_MAX_REDIRECTS + 1):
            resp = self._get(url, headers, what)
            if resp.status not in _REDIRECTS:
                break
            self._check_pins(file, resp, url, what)
            location = resp.headers.get("Location")
            release_small_body(resp)
            if not location:
                raise SourceError(f"{what}: redirect without a Location from {redact_url(url)}")
            url = urljoin(url, location)
            if urlsplit(url).scheme.lower() not in ("http", "https"):
                raise SourceError(
                    f"{what}: refusing a redirect to {redact_url(url)!r}: not an HTTP(S) location"
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
            raise transport_error(exc, what) from exc

    def _check_pins(self, file: RemoteFile, resp: Any, url: str, what: str) -> None:
        """The response (a redirect or the bytes) is for the commit and blob we listed."""
        h = resp.headers
        hub = _origin(url) == self._origin
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
        self, file: RemoteFile, resp: Any, url: str, start: int, end: int, what: str
    ) -> BodyReader:
        status = resp.status
        if status != 206:
            error = self._status_error(file, resp, url, what)
            discard(resp)
            raise error
        self._check_pins(file, resp, url, what)
        h = resp.headers
        expected = f"bytes {start}-{end - 1}/{file.size}"
        content_range = (h.get("Content-Range") or "").strip()
        if content_range != expected:
            discard(resp)
            raise SourceChangedError(
                f"{what}: the server answered Content-Range {content_range!r}, expected "
                f"{expected!r} (the file is not the size the listing stated)"
            )
        length = h.get("Content-Length")
        if length is not None and length.strip() != str(end - start):
            discard(resp)
            raise SourceChangedError(
                f"{what}: the body is {length.strip()} bytes, the range is {end - start}"
            )
        encoding = (h.get("Content-Encoding") or "identity").strip().lower()
        if encoding != "identity":
            discard(resp)
            raise SourceError(f"{what}: the server sent a {encoding}-encoded body")
        return _body_reader(resp, what, end - start, length_known=length is not None)

    def _status_error(self, file: RemoteFile, resp: Any, url: str, what: str) -> SourceError:
        h = resp.headers
        hub = _origin(url) == self._origin
        return hub_error(
            HubRefusal(
                what,
                resp.status,
                repo=self._repo,
                revision=self._commit_of(file),
                has_token=bool(self._token),
                where="the Hub" if hub else redact_url(url),
                error_code=(h.get("X-Error-Code") or "").strip(),
                server_message=(h.get("X-Error-Message") or "").strip()[:200],
                retry_after=h.get("Retry-After"),
                reading=True,
                size=file.size,
            )
        )

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


def _body_reader(resp: Any, what: str, length: int, *, length_known: bool) -> BodyReader:
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
    "HubRefusal",
    "HubSource",
    "hub_error",
    "open_hub_source",
    "translate_api_error",
]
