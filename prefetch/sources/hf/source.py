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
copy from the socket). The token is found as huggingface_hub finds it (:func:`hub_token`).
Errors are translated to :mod:`prefetch.support.errors` by one table (:func:`hub_error`); the token
never appears in a message, and neither do the signed query strings of CDN URLs.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import parse_qs, quote, urljoin, urlsplit

import urllib3

from prefetch import __version__
from prefetch.pipeline.deadline import Alarms, call_with_deadline
from prefetch.pipeline.retry import RetryPolicy, call_with_retries
from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, SourceURI
from prefetch.sources.http.status_text import header_problem
from prefetch.sources.http.transport import (
    BodyReader,
    HttpClient,
    check_range_answer,
    discard,
    error_class,
    http_client_response,
    origin_of,
    redact_url,
    release_small_body,
    send,
    shared_http_pool,
    status_error,
    transport_error,
    watched_pools,
)
from prefetch.support import settings
from prefetch.support.errors import (
    AccessDeniedError,
    ConfigError,
    InvalidListingError,
    NoMatchingFilesError,
    NotFoundError,
    RepoNotFoundError,
    RevisionNotFoundError,
    SourceChangedError,
    SourceError,
    TransientSourceError,
)
from prefetch.support.safejson import load_json

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_ENDPOINT = "https://huggingface.co"
USER_AGENT = f"model-prefetch/{__version__}"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_REDIRECTS = (301, 302, 303, 307, 308)
_MAX_REDIRECTS = 5
_TOKEN_HINT = "pass --token, set HF_TOKEN, or log in with `hf auth login` (token file in HF_HOME)"
#: The headers of a metadata call (the token is added per request, on the endpoint's origin only).
_API_HEADERS = {"User-Agent": USER_AGENT, "Accept": "application/json", "Accept-Encoding": "gzip"}
#: A metadata answer larger than this is refused (a page of the tree is ~0.3 MB for 1000 files).
_MAX_API_BODY = _BODY = 64 * 1024 * 1024
_NEXT_LINK = re.compile(r'<([^>]*)>\s*;[^,]*?\brel\s*=\s*"?next"?', re.IGNORECASE)


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
        token=_token_of(options.token),
        http=http,
        retry=options.retry,
        timeout=urllib3.Timeout(connect=options.connect_timeout, read=options.read_timeout),
        redirect_ttl=options.redirect_ttl,
        metadata_timeout=options.metadata_timeout,
    )


def _token_of(option: str | bool | None) -> str | None:
    """The token :attr:`HubOptions.token` asks for: a string is one (empty: none), False is
    none, None or True the one huggingface_hub would find (:func:`hub_token`)."""
    if isinstance(option, str):
        return option or None
    return None if option is False else hub_token()


_origin = origin_of


def _normalize_etag(value: str | None) -> str | None:
    if not value:
        return None
    return value.strip().removeprefix("W/").strip('"').lower() or None


# ---- the token ---------------------------------------------------------------------------------


def hub_token() -> str | None:
    """The token huggingface_hub's ``get_token`` finds, read without importing huggingface_hub
    (~0.3 s of CPU): ``HF_TOKEN`` (else ``HUGGING_FACE_HUB_TOKEN``), then the token file that
    `hf auth login` writes (``HF_TOKEN_PATH``, else ``$HF_HOME/token``); None when neither has one.

    The library is asked only for what it alone does: an OIDC exchange (``HF_OIDC_RESOURCE``),
    a Colab secret, and refreshing the token of a browser (OAuth) login, which it records with a
    ``refresh_token`` in the ``stored_tokens`` file beside the token file.
    """
    if settings.hf_oidc_resource() or "google.colab" in sys.modules:
        return _library_token()
    token = _clean_token(settings.hf_token())
    if token is not None:
        return token
    path = settings.hf_token_path()
    token = _clean_token(_read_token_file(path))
    if token is not None and _may_need_refresh(path):
        return _library_token()
    return token


def _library_token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def _clean_token(text: str | None) -> str | None:
    """A token as huggingface_hub keeps it: no line breaks, no surrounding blanks; None if empty."""
    if text is None:
        return None
    return text.replace("\r", "").replace("\n", "").strip() or None


def _read_token_file(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"the Hub token file {path} cannot be read: {getattr(exc, 'strerror', None) or exc}",
            hint="fix its permissions, or pass --token / set HF_TOKEN",
        ) from exc


def _may_need_refresh(token_path: Path) -> bool:
    """Was the token file written by a browser (OAuth) login, whose token expires and is
    refreshed by huggingface_hub? Such a login leaves a ``refresh_token`` in ``stored_tokens``."""
    try:
        return "refresh_token" in (token_path.parent / "stored_tokens").read_text(errors="replace")
    except OSError:
        return False


# ---- errors ------------------------------------------------------------------------------------


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
    (:func:`prefetch.sources.http.transport.error_class`), the words and hint from here."""
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


# ---- the source --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TreeFile:
    """One file entry of the Hub's tree listing, its values as sent (checked by _remote_file)."""

    path: str
    size: object
    blob_id: object
    lfs_sha256: object = None
    lfs_size: object = None
    lfs: bool = False


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
        self._endpoint = endpoint.rstrip("/")
        self._origin = _origin(self._endpoint)
        self._token = token
        if isinstance(http, urllib3.PoolManager):
            watched_pools(http)  # a deadline or a stop interrupts its header waits too
        self._http = http
        self._alarms = Alarms(name="hub-deadlines")
        self._retry = retry or RetryPolicy()
        self._timeout = timeout or urllib3.Timeout(connect=10.0, read=60.0)
        self._redirect_ttl = redirect_ttl
        self._metadata_timeout = metadata_timeout
        self._locations: dict[str, tuple[str, float]] = {}
        self._resolve_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._api_root = f"{self._endpoint}/api/models/{quote(self._repo, safe='/')}"
        self._resolve_prefix = f"{self._endpoint}/{self._repo}/resolve/"

    # -- resolve -----------------------------------------------------------------------------

    def resolve(self, spec: ModelSpec) -> Snapshot:
        repo = self._repo
        revision = spec.revision or "main"
        # a commit is immutable: nothing to resolve (the listing checks that it exists)
        commit = revision if _COMMIT.match(revision) else self._commit_of_ref(revision)
        listing = f"listing {repo}@{commit[:12]}"
        entries = self._metadata_call(
            listing, lambda deadline: self._list_tree(commit, revision, listing, deadline)
        )
        if not entries:
            raise NoMatchingFilesError(f"{repo}@{commit[:12]} has no files")
        files = [self._remote_file(e, commit) for e in entries if spec.wants(e.path)]
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

    def _commit_of_ref(self, revision: str) -> str:
        """The commit a branch or tag names now (``GET .../revision/{ref}``, its ``sha``)."""
        what = f"resolving {self._repo}@{revision}"
        url = f"{self._api_root}/revision/{quote(revision, safe='')}?expand=sha"
        info, _ = self._metadata_call(
            what, lambda deadline: self._get_json(url, what, revision, deadline)
        )
        commit = info.get("sha") if isinstance(info, dict) else None
        if not isinstance(commit, str) or not _COMMIT.match(commit):
            raise SourceError(f"{what}: the Hub gave no commit sha")
        return commit

    def _metadata_call(self, what: str, fn: Callable[[float], T]) -> T:
        """``fn(deadline)``, bounded to ``metadata_timeout`` seconds in all (redirects and pages
        included: a Hub that accepts the connection and never answers must not hang a resolve),
        retried per the policy. ``fn`` checks the deadline between requests, so a call given up
        on stops at its next request instead of paging on in the background."""

        def once() -> T:
            deadline = time.monotonic() + self._metadata_timeout
            return call_with_deadline(
                lambda: fn(deadline), self._metadata_timeout, what=what, alarms=self._alarms
            )

        return call_with_retries(once, self._retry, what=what)

    def _list_tree(self, commit: str, revision: str, what: str, deadline: float) -> list[_TreeFile]:
        """Every file of the repo at ``commit``, following the listing's pages. A page that is
        not a list of entries, or an entry no file can have, is the server's error: refused at
        once, not retried, with what was wrong."""
        url: str | None = (
            f"{self._api_root}/tree/{quote(commit, safe='')}?recursive=true&expand=false"
        )
        seen: set[str] = set()
        files: list[_TreeFile] = []
        while url is not None:
            if url in seen:
                raise SourceError(f"{what}: the listing's pages loop back to {redact_url(url)}")
            seen.add(url)
            page, next_url = self._get_json(url, what, revision, deadline)
            if not isinstance(page, list):
                raise SourceError(
                    f"{what}: {redact_url(url)} answered {type(page).__name__} JSON, not a list of "
                    "tree entries"
                )
            files += [f for f in (_tree_file(entry, what) for entry in page) if f is not None]
            url = next_url
        return files

    def _get_json(
        self, url: str, what: str, revision: str, deadline: float
    ) -> tuple[object, str | None]:
        """The JSON answer of a metadata GET (redirects followed, the token only on the
        endpoint's origin) and the URL of its next page, if its ``Link`` header names one."""
        for _ in range(_MAX_REDIRECTS + 1):
            if time.monotonic() >= deadline:
                raise TransientSourceError(f"{what}: no answer within {self._metadata_timeout:g} s")
            resp = self._get(url, _API_HEADERS, what, decode=True)
            if resp.status not in _REDIRECTS:
                break
            url = self._redirect_target(url, resp, what)
        else:
            raise SourceError(f"{what}: more than {_MAX_REDIRECTS} redirects")
        if resp.status != 200:
            error = self._refusal(resp, url, what, revision=revision)
            discard(resp)
            raise error
        body = _read_api_body(resp, url, what)
        value = load_json(body, where=f"{what}: the answer of {redact_url(url)}", max_bytes=_BODY)
        return value, _next_page(resp.headers.get("Link"), url, what)

    def _remote_file(self, entry: _TreeFile, commit: str) -> RemoteFile:
        path, size = entry.path, entry.size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidListingError(
                f"{self._repo}: {path!r}: the Hub gave an invalid size {size!r}"
            )
        if entry.lfs:
            blob = str(entry.lfs_sha256).lower()
            algorithm = "sha256"
            if not _SHA256.match(blob):
                raise InvalidListingError(
                    f"{self._repo}: {path!r}: the Hub gave a malformed sha256 {blob!r}"
                )
            if entry.lfs_size != size:
                raise InvalidListingError(
                    f"{self._repo}: {path!r}: the Hub gave two sizes, {size!r} and "
                    f"{entry.lfs_size!r}"
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
            url = self._redirect_target(url, resp, what)
        else:
            raise SourceError(f"{what}: more than {_MAX_REDIRECTS} redirects")
        reader = self._reader(file, resp, url, start, end, what)
        if url != file.locator:
            self._remember_location(file, url)
        return reader

    def _redirect_target(self, url: str, resp: urllib3.BaseHTTPResponse, what: str) -> str:
        """Where a redirect from ``url`` points (its body released): an HTTP(S) URL only."""
        location = resp.headers.get("Location")
        release_small_body(resp)
        if not location:
            raise SourceError(f"{what}: redirect without a Location from {redact_url(url)}")
        return _http_target(url, str(location), what, "a redirect")

    def _get(
        self, url: str, headers: dict[str, str], what: str, *, decode: bool = False
    ) -> urllib3.BaseHTTPResponse:
        """GET ``url`` on the pool (no redirects, no urllib3 retries, the body left unread), the
        token added only on the endpoint's origin; ``decode``: undo a gzip Content-Encoding."""
        token = {"Authorization": f"Bearer {self._token}"} if self._token else None
        try:
            answer = send(
                self._http, "GET", url, headers=headers, timeout=self._timeout, decode=decode,
                credentials=token, credentials_origin=self._endpoint,
            )  # fmt: skip
            resp = answer.raw
        except Exception as exc:
            raise transport_error(exc, what) from exc
        problem = header_problem(resp)
        if problem is not None:  # its body would be read until the server closes
            discard(resp)
            raise SourceError(f"{what}: the answer of {redact_url(url)} {problem}")
        return resp

    def _check_pins(
        self, file: RemoteFile, resp: urllib3.BaseHTTPResponse, url: str, what: str
    ) -> None:
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
        return self._refusal(resp, url, what, revision=self._commit_of(file), file=file)

    def _refusal(
        self,
        resp: urllib3.BaseHTTPResponse,
        url: str,
        what: str,
        *,
        revision: str,
        file: RemoteFile | None = None,
    ) -> SourceError:
        """The error for an answer that is not what was asked: to a metadata call, or to a
        ranged read of ``file``."""
        h = resp.headers
        return hub_error(
            HubRefusal(
                what,
                resp.status,
                repo=self._repo,
                revision=revision,
                has_token=bool(self._token),
                where="the Hub" if _origin(url) == self._origin else redact_url(url),
                error_code=(h.get("X-Error-Code") or "").strip(),
                server_message=(h.get("X-Error-Message") or "").strip()[:200],
                retry_after=h.get("Retry-After"),
                reading=file is not None,
                size=file.size if file is not None else None,
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


def _tree_file(entry: object, what: str) -> _TreeFile | None:
    """The file an entry of the tree listing describes; None for a directory (or any other kind
    of entry). InvalidListingError for an entry without the fields every file has."""

    def malformed(problem: str) -> InvalidListingError:
        return InvalidListingError(f"{what}: the Hub sent a malformed tree entry ({problem})")

    if not isinstance(entry, dict):
        raise malformed(f"a {type(entry).__name__}, not an object")
    kind = entry.get("type")
    if not isinstance(kind, str):
        raise malformed(f"no 'type' in {sorted(entry)}")
    if kind != "file":
        return None
    path = entry.get("path")
    if not isinstance(path, str):
        raise malformed(f"a file without a 'path' string: {path!r}")
    for key in ("size", "oid"):
        if key not in entry:
            raise malformed(f"{path!r} has no {key!r}")
    lfs = entry.get("lfs")
    if lfs is None:
        return _TreeFile(path, entry["size"], entry["oid"])
    if not isinstance(lfs, dict) or "oid" not in lfs or "size" not in lfs:
        raise malformed(f"{path!r} has an 'lfs' block without 'oid' and 'size': {lfs!r}")
    return _TreeFile(path, entry["size"], entry["oid"], lfs["oid"], lfs["size"], lfs=True)


def _read_api_body(resp: urllib3.BaseHTTPResponse, url: str, what: str) -> bytes:
    """The whole body of a metadata answer (decoded), at most _MAX_API_BODY bytes."""
    try:
        body = resp.read(_MAX_API_BODY + 1)
    except Exception as exc:
        discard(resp)
        raise transport_error(exc, what) from exc
    if len(body) > _MAX_API_BODY:
        discard(resp)
        raise SourceError(
            f"{what}: the answer of {redact_url(url)} is larger than {_MAX_API_BODY >> 20} MiB"
        )
    resp.release_conn()
    return bytes(body)


def _next_page(link: str | None, url: str, what: str) -> str | None:
    """The ``rel="next"`` URL of a ``Link`` header (relative to ``url``), if there is one."""
    found = _NEXT_LINK.search(link or "")
    if found is None:
        return None
    return _http_target(url, str(found.group(1)).strip(), what, "a next page")


def _http_target(base: str, reference: str, what: str, kind: str) -> str:
    """``reference`` (a Location or a Link, maybe relative) resolved against ``base``: an
    HTTP(S) URL we can connect to, or one clear SourceError (never a ValueError from parsing)."""
    try:
        target = urljoin(base, reference)
        parts = urlsplit(target)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as exc:
        raise SourceError(
            f"{what}: {kind} from {redact_url(base)} to a malformed URL: {exc}"
        ) from exc
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise SourceError(
            f"{what}: refusing {kind} to {redact_url(target)!r}: not an HTTP(S) location"
        )
    return target


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
    "HubRefusal",
    "HubSource",
    "hub_error",
    "hub_token",
    "open_hub_source",
]
