"""The Hub's metadata API: a branch or tag to its commit, the commit's files to a snapshot.

``GET {endpoint}/api/models/{repo}/revision/{ref}`` turns a branch or tag into its commit sha
(skipped for a 40-hex revision), then ``GET .../tree/{commit}?recursive=true`` (followed through
its ``Link: <...>; rel="next"`` pages) gives every file's size, git blob id and, for LFS files,
the sha256. Each call (its redirects and pages included) is bounded to ``metadata_timeout`` and
retried per the RetryPolicy; an answer that is not the JSON the Hub sends is refused, naming the
URL.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import quote

import urllib3

from prefetch.pipeline.deadline import Alarms, call_with_deadline
from prefetch.pipeline.retry import RetryPolicy, call_with_retries
from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, SourceURI
from prefetch.sources.hf.endpoint import (
    MAX_REDIRECTS,
    REDIRECTS,
    USER_AGENT,
    HubEndpoint,
    http_target,
)
from prefetch.sources.http.transport import discard, redact_url, transport_error
from prefetch.support.errors import (
    InvalidListingError,
    NoMatchingFilesError,
    SourceError,
    TransientSourceError,
)
from prefetch.support.safejson import load_json

T = TypeVar("T")

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: The headers of a metadata call (the token is added per request, on the endpoint's origin only).
_API_HEADERS = {"User-Agent": USER_AGENT, "Accept": "application/json", "Accept-Encoding": "gzip"}
#: A metadata answer larger than this is refused (a page of the tree is ~0.3 MB for 1000 files).
_MAX_API_BODY = _BODY = 64 * 1024 * 1024
_NEXT_LINK = re.compile(r'<([^>]*)>\s*;[^,]*?\brel\s*=\s*"?next"?', re.IGNORECASE)


@dataclass(frozen=True)
class _TreeFile:
    """One file entry of the Hub's tree listing, its values as sent (checked by _remote_file)."""

    path: str
    size: object
    blob_id: object
    lfs_sha256: object = None
    lfs_size: object = None
    lfs: bool = False


class HubApi:
    """The metadata of the repository ``uri`` names, asked of ``hub``."""

    def __init__(
        self, hub: HubEndpoint, uri: SourceURI, *, retry: RetryPolicy, metadata_timeout: float
    ) -> None:
        self._hub = hub
        self._uri = uri
        self._repo = uri.location
        self._retry = retry
        self._metadata_timeout = metadata_timeout
        self._alarms = Alarms(name="hub-deadlines")
        self._api_root = f"{hub.url}/api/models/{quote(self._repo, safe='/')}"
        #: The start of every file's resolve URL (its locator): then the commit and the path.
        self.resolve_prefix = f"{hub.url}/{self._repo}/resolve/"

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
        for _ in range(MAX_REDIRECTS + 1):
            if time.monotonic() >= deadline:
                raise TransientSourceError(f"{what}: no answer within {self._metadata_timeout:g} s")
            resp = self._hub.get(url, _API_HEADERS, what, decode=True)
            if resp.status not in REDIRECTS:
                break
            url = self._hub.redirect_target(url, resp, what)
        else:
            raise SourceError(f"{what}: more than {MAX_REDIRECTS} redirects")
        if resp.status != 200:
            error = self._hub.refusal(resp, url, what, revision=revision)
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
            locator=f"{self.resolve_prefix}{commit}/{quote(path)}",
            described=True,
        )


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
    return http_target(url, str(found.group(1)).strip(), what, "a next page")
