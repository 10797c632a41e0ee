"""A Hugging Face Hub-compatible HTTP server for tests and benchmarks (standard library only).

Two listening ports on 127.0.0.1, like the real Hub and its CDN, each speaking HTTPS with the
session's test CA (:mod:`tests.tls`) under its own host name (``hub.prefetch.test``,
``cdn.prefetch.test``), or plain HTTP when no CA is given:

* the **hub** port (``HubServer.endpoint``) answers the JSON API and ``/resolve``; it serves regular
  (non-LFS) files itself and answers ``302`` to the CDN for LFS files;
* the **cdn** port (``HubServer.cdn_endpoint``) serves LFS blobs by sha256 behind a signed-looking
  URL and never asks for a token (so a client that forwards ``Authorization`` there is caught by
  looking at ``HubServer.requests``).

Routes served on the hub port (``{repo}`` is ``namespace/name`` or a bare ``name``; ``{rev}`` is a
branch, a tag, ``refs/heads/X``, ``refs/tags/X``, ``refs/pr/N`` or a 40-hex commit sha, URL-encoded
or not)::

    GET  /api/models/{repo}                          model info at the default branch ("main")
    GET  /api/models/{repo}/revision/{rev}           model info (?blobs=true, expand[]=...)
    GET  /api/models/{repo}/tree/{rev}[/{path}]      ?recursive=true&expand=false, Link-paged
    POST /api/models/{repo}/paths-info/{rev}         form or JSON body: paths=..., expand=...
    GET  /api/models/{repo}/refs                     branches, tags, converts (?include_prs=1)
    HEAD|GET /{repo}/resolve/{rev}/{path}            file bytes (Range) or 302 to the CDN (LFS)
    HEAD|GET /api/resolve-cache/models/{repo}/{sha}/{path}   target of ``small_file_redirect``
    HEAD|GET cdn:/cdn/{sha256}?Expires=..&Signature=..       LFS bytes (Range)

Errors carry ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``,
``GatedRepo``), ``X-Error-Message`` and a JSON body ``{"error": ...}``. No ``X-Xet-*`` header and no
``xetHash`` field is ever sent, so huggingface_hub stays on its HTTP download path (no Xet).

Usage::

    with HubServer(test_ca) as hub:
        sha = make_model_repo(hub, "acme/tiny", tmp_path / "src", seed=1, shard_sizes=(3 << 20,))
        hub.faults.cut(after_bytes=1 << 20, port="cdn")      # next CDN body stops after 1 MiB
        ...  # point HF_ENDPOINT (or our client) at hub.endpoint; hub.env has it and the CA
        assert not [r for r in hub.requests if r.port == "cdn" and r.authorization]

Run standalone for benchmarks: ``python tests/fakes/hubserver.py --repo acme/m --dir DIR`` prints
one JSON line (endpoint, cdn_endpoint, sha) and serves until interrupted. Model files come from
:mod:`prefetch.demo.modelgen`; :func:`make_model_dir` and :func:`write_random_file` here add only
the digest memo that spares the server a re-hash.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import io
import json
import logging
import mimetypes
import os
import re
import secrets
import signal
import socket
import socketserver
import ssl
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

from prefetch.demo import modelgen

if TYPE_CHECKING:
    from tests.tls import TestCA

__all__ = [
    "DEFAULT_LFS_SUFFIXES",
    "DEFAULT_LFS_THRESHOLD",
    "FaultRule",
    "Faults",
    "HubCommit",
    "HubFile",
    "HubRepo",
    "HubServer",
    "LfsRule",
    "Port",
    "RecordedRequest",
    "default_lfs_rule",
    "git_blob_sha1",
    "make_model_dir",
    "make_model_repo",
    "write_random_file",
]

logger = logging.getLogger(__name__)

Port = Literal["hub", "cdn"]
"""Which listening socket received a request."""

LfsRule = int | Callable[[str, int], bool]
"""Decides which files are LFS: a size threshold in bytes (``size >= n``) or ``f(path, size)``."""

DEFAULT_LFS_SUFFIXES = frozenset(
    {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".h5", ".msgpack", ".model"}
)
DEFAULT_LFS_THRESHOLD = 10 * 1024 * 1024
"""The Hub rejects plain git blobs larger than 10 MiB, so bigger files are always LFS."""

_SHA_RE = re.compile(r"[0-9a-f]{40}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_API_KEYWORDS = frozenset({"revision", "tree", "paths-info", "refs"})
_CHUNK = 1 << 20  # read size for the non-sendfile body path
_HANDSHAKE_TIMEOUT = 10.0  # seconds a TLS client has to finish its handshake
_EPOCH = 1_704_067_200  # 2024-01-01T00:00:00Z: commit dates are deterministic


def default_lfs_rule(path: str, size: int) -> bool:
    """LFS for weight-like suffixes (as a typical ``.gitattributes`` says) or >= 10 MiB."""
    return size >= DEFAULT_LFS_THRESHOLD or os.path.splitext(path)[1] in DEFAULT_LFS_SUFFIXES


def _is_lfs(rule: LfsRule, path: str, size: int) -> bool:
    return size >= rule if isinstance(rule, int) else bool(rule(path, size))


# --------------------------------------------------------------------------------------- hashing


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob: ``sha1(b"blob <size>\\0" + data)``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return b"version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize %d\n" % (
        sha256.encode(),
        size,
    )


# (st_dev, st_ino, st_size, st_mtime_ns) -> {"sha256": hex, "git": hex}; hashing a 4 GiB file takes
# seconds, so a file written by write_random_file (which hashes while writing) or served twice is
# hashed once per process.
_DIGESTS: dict[tuple[int, int, int, int], dict[str, str]] = {}
_DIGESTS_LOCK = threading.Lock()


def _stat_key(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _file_digest(path: Path, kind: Literal["sha256", "git"]) -> str:
    key = _stat_key(path)
    with _DIGESTS_LOCK:
        cached = _DIGESTS.get(key, {}).get(kind)
    if cached is not None:
        return cached
    h = hashlib.sha256() if kind == "sha256" else hashlib.sha1(b"blob %d\0" % key[2])
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    with _DIGESTS_LOCK:
        _DIGESTS.setdefault(key, {})[kind] = digest
    return digest


def _remember_digest(path: Path, kind: Literal["sha256", "git"], digest: str) -> None:
    with _DIGESTS_LOCK:
        _DIGESTS.setdefault(_stat_key(path), {})[kind] = digest


# ------------------------------------------------------------------------------------ data model


@dataclass(frozen=True, eq=False)
class HubFile:
    """One file of a commit. Build with :meth:`from_bytes` / :meth:`from_path`.

    ``blob_id`` is what the tree listing calls ``oid``: the git blob sha1 of the content for a
    regular file, of the LFS pointer for an LFS file. ``etag`` is the name huggingface_hub gives the
    blob in its cache: ``blob_id`` for regular files, ``sha256`` for LFS files.
    """

    path: str
    size: int
    is_lfs: bool
    blob_id: str
    sha256: str | None
    source: bytes | Path

    @classmethod
    def from_bytes(cls, path: str, data: bytes, *, lfs: LfsRule = default_lfs_rule) -> HubFile:
        data = bytes(data)
        if _is_lfs(lfs, path, len(data)):
            sha256 = hashlib.sha256(data).hexdigest()
            blob_id = git_blob_sha1(_lfs_pointer(sha256, len(data)))
            return cls(_check_repo_path(path), len(data), True, blob_id, sha256, data)
        return cls(_check_repo_path(path), len(data), False, git_blob_sha1(data), None, data)

    @classmethod
    def from_path(
        cls, path: str, file: str | os.PathLike[str], *, lfs: LfsRule = default_lfs_rule
    ) -> HubFile:
        local = Path(file).resolve()
        size = local.stat().st_size
        if _is_lfs(lfs, path, size):
            sha256 = _file_digest(local, "sha256")
            blob_id = git_blob_sha1(_lfs_pointer(sha256, size))
            return cls(_check_repo_path(path), size, True, blob_id, sha256, local)
        return cls(_check_repo_path(path), size, False, _file_digest(local, "git"), None, local)

    @property
    def etag(self) -> str:
        """Unquoted ETag: sha256 for LFS files, git blob sha1 otherwise."""
        return self.sha256 if self.sha256 is not None else self.blob_id

    @property
    def lfs_pointer(self) -> bytes:
        if self.sha256 is None:
            raise ValueError(f"{self.path} is not an LFS file")
        return _lfs_pointer(self.sha256, self.size)

    def read(self, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset + length)`` of the content (to the end if ``length`` is None)."""
        end = self.size if length is None else min(self.size, offset + length)
        if isinstance(self.source, bytes):
            return self.source[offset:end]
        with open(self.source, "rb") as fh:
            return os.pread(fh.fileno(), end - offset, offset) if end > offset else b""


def _check_repo_path(path: str) -> str:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid path in repo: {path!r}")
    return path


@dataclass(frozen=True)
class HubCommit:
    """An immutable snapshot: ``files`` maps repo paths to files, ``trees`` directory paths
    (``""`` is the root) to their git tree sha1."""

    sha: str
    files: Mapping[str, HubFile]
    trees: Mapping[str, str]
    message: str
    date: datetime
    parent: str | None


@dataclass
class HubRepo:
    """A model repository.

    ``private``: requests without a token from ``allowed_tokens`` get 401 (no token) or 404 (other
    token) with ``X-Error-Code: RepoNotFound``. ``gated``: they get 401 / 403 with
    ``X-Error-Code: GatedRepo``. An empty ``allowed_tokens`` means "the server's ``token``".
    """

    repo_id: str
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    commits: dict[str, HubCommit] = field(default_factory=dict)
    private: bool = False
    gated: bool = False
    allowed_tokens: set[str] = field(default_factory=set)
    created: datetime = field(default_factory=lambda: datetime.fromtimestamp(_EPOCH, UTC))

    @property
    def revisions(self) -> dict[str, str]:
        """Every ref name (branches, then tags) to its commit sha."""
        return {**self.branches, **self.tags}

    def resolve(self, rev: str) -> HubCommit | None:
        """The commit a branch, tag, ``refs/heads/X``, ``refs/tags/X`` or full sha names."""
        sha: str | None
        if rev in self.branches:
            sha = self.branches[rev]
        elif rev in self.tags:
            sha = self.tags[rev]
        elif rev.startswith("refs/heads/"):
            sha = self.branches.get(rev.removeprefix("refs/heads/"))
        elif rev.startswith("refs/tags/"):
            sha = self.tags.get(rev.removeprefix("refs/tags/"))
        else:
            sha = rev if _SHA_RE.fullmatch(rev) else None
        return self.commits.get(sha) if sha is not None else None


def _git_trees(files: Iterable[str], blob_ids: Mapping[str, str]) -> dict[str, str]:
    """Git tree object ids of every directory (real git hashing, regular files mode 100644)."""
    children: dict[str, dict[str, tuple[bool, str]]] = {"": {}}
    for path in files:
        parts = path.split("/")
        for depth in range(len(parts)):
            parent = "/".join(parts[:depth])
            name = parts[depth]
            is_dir = depth < len(parts) - 1
            children.setdefault(parent, {})[name] = (is_dir, path if not is_dir else "")
            if is_dir:
                children.setdefault("/".join(parts[: depth + 1]), {})
    oids: dict[str, str] = {}
    for directory in sorted(children, key=lambda d: -d.count("/") - (d != "")):
        body = b""
        entries = children[directory]
        for name in sorted(entries, key=lambda n: n + "/" if entries[n][0] else n):
            is_dir, file_path = entries[name]
            sub = f"{directory}/{name}" if directory else name
            oid = oids[sub] if is_dir else blob_ids[file_path]
            body += b"%s %s\0" % (b"40000" if is_dir else b"100644", name.encode()) + bytes.fromhex(
                oid
            )
        oids[directory] = hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()
    return oids


# ----------------------------------------------------------------------------------- recording


@dataclass
class RecordedRequest:
    """A request as received. ``headers`` keys are lower-case; ``status`` and ``faults`` are filled
    in when the response starts (``status`` stays None if the handler died first)."""

    port: Port
    method: str
    path: str  # the raw request target, query included
    headers: dict[str, str]
    status: int | None = None
    faults: list[str] = field(default_factory=list)

    @property
    def authorization(self) -> str | None:
        return self.headers.get("authorization")

    @property
    def url_path(self) -> str:
        """The decoded path, without the query."""
        return unquote(urlsplit(self.path).path)


# -------------------------------------------------------------------------------------- faults


@dataclass
class FaultRule:
    """One armed fault. ``remaining`` is None for "until cleared"; ``hits`` counts applications."""

    kind: Literal["fail", "cut", "corrupt", "throttle", "delay", "ignore_range"]
    remaining: int | None
    port: Port | None = None
    method: str | None = None
    path: str | None = None
    file: HubFile | None = None
    status: int = 0
    retry_after: float | None = None
    after_bytes: int = 0
    offset: int = 0
    bytes_per_second: int = 0
    seconds: float = 0.0
    hits: int = 0

    def _matches(self, port: Port, method: str, url_path: str, file: HubFile | None) -> bool:
        return (
            (self.port is None or self.port == port)
            and (self.method is None or self.method == method)
            and (self.path is None or self.path in url_path)
            and (self.file is None or self.file is file)
        )


@dataclass
class _BodyPlan:
    delay: float = 0.0
    cut_after: int | None = None
    bytes_per_second: int | None = None
    corrupt_offsets: list[int] = field(default_factory=list)


class Faults:
    """Fault injection. Every method arms a :class:`FaultRule` and returns it.

    Rules match requests by ``port`` ("hub"/"cdn"), ``method``, ``path`` (a substring of the
    decoded URL path) and ``file`` (the response serves or redirects to that file); unset means any.
    ``count`` is how many matching responses the rule applies to (``None``: until :meth:`clear`).
    Status faults replace the whole response; the others change how its body is sent.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[FaultRule] = []

    @property
    def active(self) -> list[FaultRule]:
        with self._lock:
            return list(self._rules)

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def _arm(self, rule: FaultRule) -> FaultRule:
        if rule.remaining is not None and rule.remaining < 1:
            raise ValueError("count must be >= 1 or None")
        with self._lock:
            self._rules.append(rule)
        return rule

    def fail(
        self,
        status: int,
        *,
        count: int | None = 1,
        retry_after: float | None = None,
        port: Port | None = None,
        method: str | None = None,
        path: str | None = None,
        file: HubFile | None = None,
    ) -> FaultRule:
        """Answer ``status`` (e.g. 500, 503) with a JSON error body instead of the real response."""
        return self._arm(
            FaultRule(
                "fail", count, port, method, path, file, status=status, retry_after=retry_after
            )
        )

    def rate_limit(
        self,
        *,
        count: int | None = 1,
        retry_after: float = 1,
        port: Port | None = None,
        method: str | None = None,
        path: str | None = None,
        file: HubFile | None = None,
    ) -> FaultRule:
        """Answer ``429 Too Many Requests`` with ``Retry-After: <retry_after>``."""
        return self.fail(
            429,
            count=count,
            retry_after=retry_after,
            port=port,
            method=method,
            path=path,
            file=file,
        )

    def cut(
        self,
        after_bytes: int,
        *,
        count: int | None = 1,
        port: Port | None = None,
        method: str | None = None,
        path: str | None = None,
        file: HubFile | None = None,
    ) -> FaultRule:
        """Send the full ``Content-Length`` but close the connection after ``after_bytes`` of the
        body. Only responses whose body is longer than ``after_bytes`` count."""
        return self._arm(
            FaultRule("cut", count, port, method, path, file, after_bytes=max(0, after_bytes))
        )

    def corrupt(self, file: HubFile, *, offset: int = 0, count: int | None = None) -> FaultRule:
        """Flip (XOR 0xFF) the byte at ``offset`` of ``file`` in every body that contains it, on
        either port. Only responses that cover ``offset`` count."""
        if not 0 <= offset < file.size:
            raise ValueError(f"offset {offset} outside {file.path} ({file.size} bytes)")
        return self._arm(FaultRule("corrupt", count, file=file, offset=offset))

    def throttle(
        self,
        bytes_per_second: int,
        *,
        count: int | None = None,
        port: Port | None = None,
        method: str | None = None,
        path: str | None = None,
        file: HubFile | None = None,
    ) -> FaultRule:
        """Send matching bodies at about ``bytes_per_second``."""
        if bytes_per_second < 1:
            raise ValueError("bytes_per_second must be >= 1")
        return self._arm(
            FaultRule(
                "throttle", count, port, method, path, file, bytes_per_second=bytes_per_second
            )
        )

    def delay(
        self,
        seconds: float,
        *,
        count: int | None = 1,
        port: Port | None = None,
        method: str | None = None,
        path: str | None = None,
        file: HubFile | None = None,
    ) -> FaultRule:
        """Wait ``seconds`` before sending the response headers."""
        return self._arm(FaultRule("delay", count, port, method, path, file, seconds=seconds))

    def ignore_range(
        self,
        *,
        count: int | None = 1,
        port: Port | None = None,
        path: str | None = None,
        file: HubFile | None = None,
    ) -> FaultRule:
        """Answer a ranged GET with ``200`` and the whole file, as a server that ignores
        ``Range``. Only responses that would have been ``206`` count."""
        return self._arm(FaultRule("ignore_range", count, port, "GET", path, file))

    # -- applied by the request handler

    def _range_ignored(self, port: Port, method: str, url_path: str, file: HubFile | None) -> bool:
        with self._lock:
            for rule in self._rules:
                if rule.kind == "ignore_range" and rule._matches(port, method, url_path, file):
                    self._take(rule)
                    return True
        return False

    def _take(self, rule: FaultRule) -> None:
        rule.hits += 1
        if rule.remaining is not None:
            rule.remaining -= 1
            if rule.remaining == 0:
                self._rules.remove(rule)

    def _status_fault(
        self, port: Port, method: str, url_path: str, file: HubFile | None
    ) -> FaultRule | None:
        with self._lock:
            for rule in self._rules:
                if rule.kind == "fail" and rule._matches(port, method, url_path, file):
                    self._take(rule)
                    return rule
        return None

    def _body_plan(
        self,
        port: Port,
        method: str,
        url_path: str,
        file: HubFile | None,
        body_range: tuple[int, int] | None,
        body_length: int,
        applied: list[str],
    ) -> _BodyPlan:
        plan = _BodyPlan()
        with self._lock:
            for rule in list(self._rules):
                if not rule._matches(port, method, url_path, file):
                    continue
                if rule.kind == "delay":
                    plan.delay += rule.seconds
                elif method == "HEAD":
                    continue
                elif rule.kind == "cut" and plan.cut_after is None:
                    if body_length <= rule.after_bytes:
                        continue
                    plan.cut_after = rule.after_bytes
                elif rule.kind == "throttle" and plan.bytes_per_second is None:
                    plan.bytes_per_second = rule.bytes_per_second
                elif rule.kind == "corrupt":
                    if body_range is None or not (
                        body_range[0] <= rule.offset < body_range[0] + body_range[1]
                    ):
                        continue
                    plan.corrupt_offsets.append(rule.offset)
                else:
                    continue
                applied.append(rule.kind)
                self._take(rule)
        return plan


# ----------------------------------------------------------------------------------- responses


@dataclass
class _Response:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    file: HubFile | None = None  # the file this response serves or redirects to
    file_range: tuple[int, int] | None = None  # (start, length) of file bytes sent as the body

    @property
    def body_length(self) -> int:
        return self.file_range[1] if self.file_range is not None else len(self.body)


def _whole_file(ranged: _Response) -> _Response:
    """The ``200`` answer with the whole file that a server ignoring ``Range`` sends."""
    assert ranged.file is not None
    headers = [(k, v) for k, v in ranged.headers if k != "Content-Range"]
    return _Response(200, headers, file=ranged.file, file_range=(0, ranged.file.size))


def _json(status: int, payload: object, headers: Sequence[tuple[str, str]] = ()) -> _Response:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return _Response(status, [("Content-Type", "application/json"), *headers], body)


def _error(
    status: int, message: str, code: str | None = None, headers: Sequence[tuple[str, str]] = ()
) -> _Response:
    extra = [("X-Error-Message", message), *headers]
    if code is not None:
        extra.insert(0, ("X-Error-Code", code))
    return _json(status, {"error": message}, extra)


def _iso(ts: datetime) -> str:
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def _parse_range(header: str | None, size: int) -> tuple[int, int] | Literal["invalid"] | None:
    """``(start, length)`` for a single satisfiable byte range, None to serve the whole file
    (no header, a malformed one, or several ranges), ``"invalid"`` for 416."""
    if header is None:
        return None
    m = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if m is None or (m.group(1) == "" and m.group(2) == ""):
        return None
    first, last = m.group(1), m.group(2)
    if first == "":  # suffix range: the last N bytes
        n = int(last)
        if n == 0 or size == 0:
            return "invalid"
        return (max(0, size - n), min(n, size))
    start = int(first)
    end = size - 1 if last == "" else min(int(last), size - 1)
    if last != "" and int(last) < start:
        return None  # syntactically invalid: ignore it (RFC 9110)
    if start >= size:
        return "invalid"
    return (start, end - start + 1)


# ------------------------------------------------------------------------------------- server


class _PortServer(ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True
    request_queue_size = 128
    allow_reuse_address = True

    def __init__(
        self, hub: HubServer, port_name: Port, port: int, tls: ssl.SSLContext | None
    ) -> None:
        self.hub = hub
        self.port_name: Port = port_name
        self.tls = tls
        self.conns: set[socket.socket] = set()
        self.conns_lock = threading.Lock()
        super().__init__(("127.0.0.1", port), _Handler)

    def get_request(self) -> tuple[socket.socket, object]:
        sock, address = super().get_request()
        self.hub._count_connection(self.port_name)
        if self.tls is None:
            return sock, address
        # The handshake is the handler thread's (_Handler.setup): one slow or broken client must
        # not hold up the accept loop.
        return self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

    def server_bind(self) -> None:
        # HTTPServer.server_bind would call socket.getfqdn(), a reverse DNS lookup: skip it.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "127.0.0.1", self.server_address[1]

    def handle_error(self, request: object, client_address: object) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            return  # the client went away (or stop() shut the socket): not a server bug
        self.hub._record_error(traceback.format_exc())


class _Handler(BaseHTTPRequestHandler):
    server: _PortServer
    protocol_version = "HTTP/1.1"
    server_version = "hubserver/1"
    sys_version = ""
    disable_nagle_algorithm = True

    def setup(self) -> None:
        sock = self.request
        with self.server.conns_lock:
            self.server.conns.add(sock)
        try:
            if isinstance(sock, ssl.SSLSocket):
                sock.settimeout(_HANDSHAKE_TIMEOUT)
                sock.do_handshake()
                sock.settimeout(None)
            super().setup()
        except BaseException:
            with self.server.conns_lock:
                self.server.conns.discard(sock)
            raise

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.server.conns_lock:
                self.server.conns.discard(self.connection)

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("%s %s", self.server.port_name, format % args)

    def do_GET(self) -> None:
        self._dispatch()

    do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = io.BytesIO()
            while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                out.write(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return out.getvalue()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _dispatch(self) -> None:
        hub = self.server.hub
        port = self.server.port_name
        method = self.command
        body = self._read_body()
        headers = {k.lower(): v for k, v in self.headers.items()}
        record = RecordedRequest(port, method, self.path, headers)
        hub._record(record)
        url_path = record.url_path
        try:
            response = hub._route(port, method, self.path, headers, body)
        except Exception:
            hub._record_error(traceback.format_exc())
            response = _error(500, "hubserver internal error")
        fault = hub.faults._status_fault(port, method, url_path, response.file)
        if fault is not None:
            record.faults.append("fail")
            extra = []
            if fault.retry_after is not None:
                ra = fault.retry_after
                extra.append(("Retry-After", str(int(ra)) if float(ra).is_integer() else str(ra)))
            message = f"injected fault: {_reason(fault.status)}"
            response = _error(fault.status, message, headers=extra)
        elif response.status == 206 and hub.faults._range_ignored(
            port, method, url_path, response.file
        ):
            record.faults.append("ignore_range")
            response = _whole_file(response)
        plan = hub.faults._body_plan(
            port,
            method,
            url_path,
            response.file,
            response.file_range,
            response.body_length,
            record.faults,
        )
        if plan.delay > 0 and hub._stopping.wait(plan.delay):
            self.close_connection = True
            return
        record.status = response.status
        self._send(response, plan)

    def _send(self, response: _Response, plan: _BodyPlan) -> None:
        length = response.body_length
        head = [f"HTTP/1.1 {response.status} {_reason(response.status)}"]
        head.append(f"Server: {self.server_version}")
        head.append(f"Date: {self.date_time_string()}")
        head.extend(f"{k}: {v}" for k, v in response.headers)
        head.append(f"Content-Length: {length}")
        if self.close_connection or (self.headers.get("Connection", "").lower() == "close"):
            head.append("Connection: close")
            self.close_connection = True
        header_bytes = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        self.log_request(response.status, length)
        if self.command == "HEAD" or length == 0:
            self.wfile.write(header_bytes)
            return
        limit = length if plan.cut_after is None else min(length, plan.cut_after)
        simple = plan.bytes_per_second is None and not plan.corrupt_offsets
        if response.file_range is None:
            data = response.body[:limit]
            if simple:
                self.wfile.write(header_bytes + data)
            else:
                self.wfile.write(header_bytes)
                self._send_chunks(lambda off, n: data[off : off + n], 0, limit, plan)
        else:
            file = response.file
            assert file is not None
            start = response.file_range[0]
            self.wfile.write(header_bytes)
            if isinstance(file.source, bytes):
                data = file.source
                self._send_chunks(lambda off, n: data[off : off + n], start, limit, plan)
            else:
                with open(file.source, "rb") as fh:
                    if simple:
                        sent = self.connection.sendfile(fh, offset=start, count=limit)
                        if sent != limit:
                            raise ConnectionError(f"sendfile sent {sent} of {limit} bytes")
                    else:
                        fd = fh.fileno()
                        self._send_chunks(lambda off, n: os.pread(fd, n, off), start, limit, plan)
        if plan.cut_after is not None and limit < length:
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

    def _send_chunks(
        self, read: Callable[[int, int], bytes], start: int, count: int, plan: _BodyPlan
    ) -> None:
        rate = plan.bytes_per_second
        chunk = _CHUNK if rate is None else max(1024, min(_CHUNK, rate // 20))
        began = time.monotonic()
        sent = 0
        while sent < count:
            if rate is not None:  # pace before each chunk: no idle wait after the last one
                ahead = sent / rate - (time.monotonic() - began)
                if ahead > 0 and self.server.hub._stopping.wait(ahead):
                    raise ConnectionError("server stopping")
            n = min(chunk, count - sent)
            data = read(start + sent, n)
            if not data:
                raise ConnectionError("source shorter than expected")
            if plan.corrupt_offsets:
                buf = bytearray(data)
                for offset in plan.corrupt_offsets:
                    if start + sent <= offset < start + sent + len(buf):
                        buf[offset - start - sent] ^= 0xFF
                data = bytes(buf)
            self.connection.sendall(data)
            sent += len(data)


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


class HubServer:
    """The Hub (and its CDN) on two ephemeral 127.0.0.1 ports. A context manager.

    Args:
        tls: the session's :class:`tests.tls.TestCA`: both ports speak HTTPS with its certificate,
            the hub reached as ``hub.prefetch.test`` and the CDN as ``cdn.prefetch.test`` (two
            host names, as huggingface.co and its CDN are, so "credentials never go to another
            host" is tested across real names). ``None``: plain HTTP on ``127.0.0.1``, only for
            tests that are about plain HTTP (and the standalone benchmark server).
        token: when set, every hub-port request must carry ``Authorization: Bearer <token>``:
            no header gives 401 ``X-Error-Code: RepoNotFound`` (what the Hub says for a private
            repo), another token gives 401 "Invalid credentials in Authorization header".
            The CDN port never checks it.
        tree_page_size: entries per page of ``/tree`` (small, so tests exercise paging).
        small_file_redirect: answer ``/resolve`` of regular files with a same-host ``307`` to
            ``/api/resolve-cache/models/{repo}/{sha}/{path}``, as huggingface.co does for public
            namespaced repos. Off by default.
        cdn_url_ttl: seconds a CDN URL stays valid (403 after that).

    Hostile answers, for tests of what a client must refuse: ``tamper_tree`` (settable) gets
    every ``/tree`` entry and returns what to send instead (a negative size, no ``oid``, an unsafe
    path); ``hostile_redirects`` maps a repo path to the ``Location`` its ``/resolve`` answers
    with (a ``302``), e.g. ``file:///etc/passwd``.
    """

    def __init__(
        self,
        tls: TestCA | None = None,
        *,
        token: str | None = None,
        tree_page_size: int = 50,
        small_file_redirect: bool = False,
        cdn_url_ttl: float = 3600.0,
    ) -> None:
        self.tls = tls
        self.token = token
        self.tree_page_size = tree_page_size
        self.small_file_redirect = small_file_redirect
        self.cdn_url_ttl = cdn_url_ttl
        self.faults = Faults()
        self.tamper_tree: Callable[[dict[str, object]], dict[str, object]] | None = None
        self.hostile_redirects: dict[str, str] = {}
        self._repos: dict[str, HubRepo] = {}
        self._blobs: dict[str, HubFile] = {}  # sha256 -> an LFS file with that content
        self._lock = threading.RLock()
        self._requests: list[RecordedRequest] = []
        self._connections: dict[Port, int] = {}
        self._errors: list[str] = []
        self._secret = secrets.token_bytes(16)
        self._commit_counter = 0
        self._servers: list[_PortServer] = []
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self.endpoint = ""
        self.cdn_endpoint = ""

    # -- lifecycle

    def start(self, *, hub_port: int = 0, cdn_port: int = 0) -> HubServer:
        """Bind both ports (0: any free port) and serve in background threads."""
        if self._servers:
            raise RuntimeError("already started")
        self._stopping.clear()
        context = self.tls.server_context() if self.tls is not None else None
        hub = _PortServer(self, "hub", hub_port, context)
        try:
            cdn = _PortServer(self, "cdn", cdn_port, context)
        except BaseException:
            hub.server_close()
            raise
        self._servers = [hub, cdn]
        self.endpoint = self._url(hub.server_address[1], "hub")
        self.cdn_endpoint = self._url(cdn.server_address[1], "cdn")
        for server in self._servers:
            thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"hubserver-{server.port_name}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        return self

    def _url(self, port: int, role: str) -> str:
        return f"http://127.0.0.1:{port}" if self.tls is None else self.tls.url(port, role)

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs to reach this Hub: ``HF_ENDPOINT`` and, over TLS, the
        variables that make it trust the session CA."""
        return {"HF_ENDPOINT": self.endpoint, **(self.tls.env() if self.tls is not None else {})}

    def stop(self) -> None:
        """Stop serving, drop open (keep-alive) connections and join every thread."""
        self._stopping.set()
        for server in self._servers:
            server.shutdown()
        for server in self._servers:
            with server.conns_lock:
                conns = list(server.conns)
            for conn in conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            server.server_close()  # joins the handler threads
        for thread in self._threads:
            thread.join()
        self._servers.clear()
        self._threads.clear()

    def __enter__(self) -> HubServer:
        return self if self._servers else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- content

    @property
    def repos(self) -> dict[str, HubRepo]:
        with self._lock:
            return dict(self._repos)

    def add_repo(
        self,
        repo_id: str,
        *,
        private: bool = False,
        gated: bool = False,
        allowed_tokens: Iterable[str] = (),
    ) -> HubRepo:
        """Create (or return and reconfigure) a repository."""
        if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", repo_id):
            raise ValueError(f"invalid repo id {repo_id!r}")
        with self._lock:
            repo = self._repos.get(repo_id)
            if repo is None:
                repo = self._repos[repo_id] = HubRepo(repo_id)
            repo.private, repo.gated = private, gated
            repo.allowed_tokens = set(allowed_tokens)
            return repo

    def add_commit(
        self,
        repo_id: str,
        files: Mapping[str, bytes | str | os.PathLike[str] | HubFile] | str | os.PathLike[str],
        *,
        branch: str = "main",
        lfs: LfsRule = default_lfs_rule,
        sha: str | None = None,
        message: str = "Upload files",
        inherit: bool = False,
        delete: Iterable[str] = (),
    ) -> str:
        """Commit ``files`` on ``branch`` (created if needed, with the repo) and return the sha.

        ``files`` maps repo paths to bytes, local file paths (served from disk, never loaded) or
        ready :class:`HubFile` objects; a directory path stands for all files under it. The commit
        holds exactly ``files`` unless ``inherit`` is set, which starts from the branch head and
        overlays ``files`` and removes ``delete``. ``lfs`` picks LFS files (a size threshold or a
        predicate). ``sha`` forces the commit sha (40 hex); by default it is a real git commit
        hash of the tree.
        """
        if isinstance(files, (str, os.PathLike)):
            root = Path(files)
            files = {
                p.relative_to(root).as_posix(): p
                for p in sorted(root.rglob("*"))
                if p.is_file() and ".git" not in p.relative_to(root).parts
            }
        built: dict[str, HubFile] = {}
        for path, value in files.items():
            if isinstance(value, HubFile):
                built[path] = (
                    value
                    if value.path == path
                    else HubFile(
                        _check_repo_path(path),
                        value.size,
                        value.is_lfs,
                        value.blob_id,
                        value.sha256,
                        value.source,
                    )
                )
            elif isinstance(value, (bytes, bytearray, memoryview)):
                built[path] = HubFile.from_bytes(path, bytes(value), lfs=lfs)
            else:
                built[path] = HubFile.from_path(path, value, lfs=lfs)
        if sha is not None and not _SHA_RE.fullmatch(sha):
            raise ValueError(f"sha must be 40 lower-case hex digits, got {sha!r}")
        with self._lock:
            repo = self._repos.get(repo_id) or self.add_repo(repo_id)
            parent = repo.branches.get(branch)
            snapshot: dict[str, HubFile] = {}
            if inherit and parent is not None:
                snapshot.update(repo.commits[parent].files)
            snapshot.update(built)
            for path in delete:
                snapshot.pop(path, None)
            for dir_path in {p.rsplit("/", 1)[0] for p in snapshot if "/" in p}:
                if dir_path in snapshot:
                    raise ValueError(f"{dir_path!r} is both a file and a directory")
            snapshot = dict(sorted(snapshot.items()))
            trees = _git_trees(snapshot, {p: f.blob_id for p, f in snapshot.items()})
            self._commit_counter += 1
            date = datetime.fromtimestamp(_EPOCH + 60 * self._commit_counter, UTC)
            if sha is None:
                stamp = f"hubserver <hubserver@localhost> {int(date.timestamp())} +0000"
                text = f"tree {trees['']}\n"
                text += f"parent {parent}\n" if parent else ""
                text += f"author {stamp}\ncommitter {stamp}\n\n{message}\n"
                raw = text.encode()
                sha = hashlib.sha1(b"commit %d\0" % len(raw) + raw).hexdigest()
            repo.commits[sha] = HubCommit(sha, snapshot, trees, message, date, parent)
            repo.branches[branch] = sha
            for f in snapshot.values():
                if f.sha256 is not None:
                    self._blobs.setdefault(f.sha256, f)
            return sha

    def add_tag(self, repo_id: str, tag: str, revision: str = "main") -> str:
        """Point tag ``tag`` at ``revision``; returns the sha."""
        with self._lock:
            repo = self._repos[repo_id]
            commit = repo.resolve(revision)
            if commit is None:
                raise KeyError(f"unknown revision {revision!r} of {repo_id}")
            repo.tags[tag] = commit.sha
            return commit.sha

    def set_branch(self, repo_id: str, branch: str, revision: str) -> str:
        """Point ``branch`` (e.g. ``refs/pr/1``) at ``revision``; returns the sha."""
        with self._lock:
            repo = self._repos[repo_id]
            commit = repo.resolve(revision)
            if commit is None:
                raise KeyError(f"unknown revision {revision!r} of {repo_id}")
            repo.branches[branch] = commit.sha
            return commit.sha

    def file(self, repo_id: str, path: str, revision: str = "main") -> HubFile:
        """The file at ``path`` in ``revision`` (KeyError if there is none)."""
        with self._lock:
            commit = self._repos[repo_id].resolve(revision)
            if commit is None:
                raise KeyError(f"unknown revision {revision!r} of {repo_id}")
            return commit.files[path]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, HubFile]:
        """All files of ``revision``, by repo path."""
        with self._lock:
            commit = self._repos[repo_id].resolve(revision)
            if commit is None:
                raise KeyError(f"unknown revision {revision!r} of {repo_id}")
            return dict(commit.files)

    # -- recording

    @property
    def requests(self) -> list[RecordedRequest]:
        """A copy of every request received so far, in arrival order."""
        with self._lock:
            return list(self._requests)

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()
            self._connections.clear()

    @property
    def connections(self) -> dict[Port, int]:
        """Connections accepted so far per port (over TLS: one handshake each), cleared with
        :meth:`clear_requests`; a client that reuses its connections opens few."""
        with self._lock:
            return {"hub": self._connections.get("hub", 0), "cdn": self._connections.get("cdn", 0)}

    @property
    def errors(self) -> list[str]:
        """Tracebacks of exceptions raised while handling requests (should stay empty)."""
        with self._lock:
            return list(self._errors)

    def _count_connection(self, port: Port) -> None:
        with self._lock:
            self._connections[port] = self._connections.get(port, 0) + 1

    def _record(self, record: RecordedRequest) -> None:
        with self._lock:
            self._requests.append(record)

    def _record_error(self, text: str) -> None:
        logger.error("hubserver: %s", text)
        with self._lock:
            self._errors.append(text)

    # -- routing

    def _route(
        self, port: Port, method: str, target: str, headers: Mapping[str, str], body: bytes
    ) -> _Response:
        split = urlsplit(target)
        query = parse_qs(split.query, keep_blank_values=True)
        segs = split.path.split("/")[1:]  # still percent-encoded
        if port == "cdn":
            return self._route_cdn(method, segs, query, headers)
        if self.token is not None:
            auth = headers.get("authorization")
            if auth is None:
                return _error(401, "Invalid username or password.", "RepoNotFound")
            if auth != f"Bearer {self.token}":
                return _error(401, "Invalid credentials in Authorization header")
        if segs[:2] == ["api", "models"]:
            return self._route_api(method, segs[2:], query, headers, body)
        if segs[:3] == ["api", "resolve-cache", "models"]:
            return self._route_resolve_cache(method, segs[3:], headers)
        if len(segs) > 2 and segs[2] == "resolve":
            return self._route_resolve(method, segs[:2], segs[3:], headers)
        if len(segs) > 1 and segs[1] == "resolve":
            return self._route_resolve(method, segs[:1], segs[2:], headers)
        return _error(404, "Not Found")

    def _find_repo(
        self, raw: Sequence[str], headers: Mapping[str, str]
    ) -> tuple[HubRepo | None, _Response | None]:
        repo_id = unquote("/".join(raw))
        with self._lock:
            repo = self._repos.get(repo_id)
        if repo is None:
            return None, _error(404, "Repository not found", "RepoNotFound")
        if repo.private or repo.gated:
            allowed = repo.allowed_tokens or ({self.token} if self.token else set())
            auth = headers.get("authorization", "")
            token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
            if token not in allowed:
                if repo.gated:
                    message = f"Access to model {repo_id} is restricted."
                    return None, _error(401 if token is None else 403, message, "GatedRepo")
                return None, _error(
                    401 if token is None else 404, "Repository not found", "RepoNotFound"
                )
        return repo, None

    def _split_repo(self, rest: Sequence[str]) -> int:
        """How many leading segments of an API path name the repo (1 or 2)."""
        with self._lock:
            if len(rest) >= 2 and unquote("/".join(rest[:2])) in self._repos:
                return 2
            if rest and unquote(rest[0]) in self._repos:
                return 1
        return 1 if len(rest) >= 2 and rest[1] in _API_KEYWORDS else min(2, len(rest))

    def _split_rev(self, repo: HubRepo, raw: Sequence[str]) -> tuple[str, str]:
        """``(revision, path)`` from ``{rev}/{path}`` segments, the revision encoded or not."""
        if not raw:
            return "main", ""
        with self._lock:
            for i in range(1, len(raw) + 1):
                candidate = unquote("/".join(raw[:i]))
                if repo.resolve(candidate) is not None:
                    return candidate, unquote("/".join(raw[i:]))
        return unquote(raw[0]), unquote("/".join(raw[1:]))

    def _commit(self, repo: HubRepo, rev: str) -> tuple[HubCommit | None, _Response | None]:
        with self._lock:
            commit = repo.resolve(rev)
        if commit is None:
            return None, _error(
                404, f"Invalid rev id: {rev}", "RevisionNotFound", [("X-Error-Rev", rev)]
            )
        return commit, None

    def _route_api(
        self,
        method: str,
        rest: list[str],
        query: dict[str, list[str]],
        headers: Mapping[str, str],
        body: bytes,
    ) -> _Response:
        if not rest or rest == [""]:
            return _error(404, "Not Found")
        n = self._split_repo(rest)
        repo, err = self._find_repo(rest[:n], headers)
        if repo is None:
            return err or _error(404, "Not Found")
        sub = rest[n:]
        kind = sub[0] if sub else ""
        if kind == "" and method in ("GET", "HEAD"):
            return self._model_info(repo, "main", query)
        if kind == "revision" and method in ("GET", "HEAD") and len(sub) > 1:
            return self._model_info(repo, unquote("/".join(sub[1:])), query)
        if kind == "tree" and method in ("GET", "HEAD"):
            rev, path = self._split_rev(repo, sub[1:])
            return self._tree(repo, rev, path, sub[1:], query)
        if kind == "paths-info" and method == "POST":
            return self._paths_info(repo, unquote("/".join(sub[1:])) or "main", headers, body)
        if kind == "refs" and method in ("GET", "HEAD") and len(sub) == 1:
            return self._refs(repo, query)
        return _error(404, "Not Found")

    def _model_info(self, repo: HubRepo, rev: str, query: dict[str, list[str]]) -> _Response:
        commit, err = self._commit(repo, rev)
        if commit is None:
            return err or _error(404, "Not Found")
        blobs = query.get("blobs", ["false"])[-1].lower() in ("1", "true")
        siblings: list[dict[str, object]] = []
        for f in commit.files.values():
            sibling: dict[str, object] = {"rfilename": f.path}
            if blobs:
                sibling["blobId"] = f.blob_id
                sibling["size"] = f.size
                if f.is_lfs:
                    sibling["lfs"] = {
                        "sha256": f.sha256,
                        "size": f.size,
                        "pointerSize": len(f.lfs_pointer),
                    }
            siblings.append(sibling)
        owner = repo.repo_id.split("/")[0] if "/" in repo.repo_id else None
        info: dict[str, object] = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": owner,
            "sha": commit.sha,
            "lastModified": _iso(commit.date),
            "createdAt": _iso(repo.created),
            "private": repo.private,
            "gated": "auto" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "spaces": [],
            "usedStorage": sum(f.size for f in commit.files.values()),
        }
        if "securityStatus" in query:
            info["securityRepoStatus"] = {"scansDone": True, "filesWithIssues": []}
        expand = query.get("expand[]", []) + query.get("expand", [])
        if expand:
            info = {k: v for k, v in info.items() if k in ("_id", "id") or k in expand}
        return _json(200, info)

    def _entry(self, commit: HubCommit, path: str, expand: bool, is_dir: bool) -> dict[str, object]:
        entry: dict[str, object]
        if is_dir:
            entry = {"type": "directory", "oid": commit.trees[path], "size": 0, "path": path}
        else:
            f = commit.files[path]
            entry = {"type": "file", "oid": f.blob_id, "size": f.size, "path": path}
            if f.is_lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": len(f.lfs_pointer)}
        if expand:
            entry["lastCommit"] = {
                "id": commit.sha,
                "title": commit.message,
                "date": _iso(commit.date),
            }
            if not is_dir:
                entry["securityFileStatus"] = {
                    "status": "safe",
                    "avScan": {"virusFound": False, "virusNames": None},
                    "pickleImportScan": None,
                }
        return entry

    def _tree(
        self,
        repo: HubRepo,
        rev: str,
        path: str,
        raw_rev_path: Sequence[str],
        query: dict[str, list[str]],
    ) -> _Response:
        commit, err = self._commit(repo, rev)
        if commit is None:
            return err or _error(404, "Not Found")
        path = path.strip("/")
        if path and path not in commit.trees:
            return _error(
                404,
                f"Entry not found: {path}",
                "EntryNotFound",
                [("X-Repo-Commit", commit.sha)],
            )
        recursive = query.get("recursive", ["false"])[-1].lower() in ("1", "true")
        expand = query.get("expand", ["false"])[-1].lower() in ("1", "true")
        prefix = f"{path}/" if path else ""
        names = [(d, True) for d in commit.trees if d and d.startswith(prefix)]
        names += [(p, False) for p in commit.files if p.startswith(prefix)]
        if not recursive:
            names = [(p, d) for p, d in names if "/" not in p[len(prefix) :]]
        names.sort()
        offset = 0
        if "cursor" in query:
            try:
                offset = int(json.loads(base64.urlsafe_b64decode(query["cursor"][-1]))["o"])
            except (ValueError, KeyError, TypeError):
                return _error(400, "Invalid cursor")
        page = names[offset : offset + self.tree_page_size]
        entries = [self._entry(commit, p, expand, d) for p, d in page]
        if self.tamper_tree is not None:
            entries = [self.tamper_tree(e) for e in entries]
        headers: list[tuple[str, str]] = []
        if offset + self.tree_page_size < len(names):
            cursor = base64.urlsafe_b64encode(
                json.dumps({"o": offset + self.tree_page_size}).encode()
            ).decode()
            params = {k: v[-1] for k, v in query.items() if k != "cursor"}
            params["cursor"] = cursor
            url = (
                f"{self.endpoint}/api/models/{repo.repo_id}/tree/{'/'.join(raw_rev_path)}"
                f"?{urlencode(params)}"
            )
            headers.append(("Link", f'<{url}>; rel="next"'))
        return _json(200, entries, headers)

    def _paths_info(
        self, repo: HubRepo, rev: str, headers: Mapping[str, str], body: bytes
    ) -> _Response:
        commit, err = self._commit(repo, rev)
        if commit is None:
            return err or _error(404, "Not Found")
        if headers.get("content-type", "").startswith("application/json"):
            try:
                payload = json.loads(body or b"{}")
            except ValueError:
                return _error(400, "Invalid JSON body")
            paths = payload.get("paths", [])
            paths = [paths] if isinstance(paths, str) else list(paths)
            expand = bool(payload.get("expand", False))
        else:
            form = parse_qs(body.decode(), keep_blank_values=True)
            paths = form.get("paths", []) + form.get("paths[]", [])
            expand = form.get("expand", ["false"])[-1].lower() in ("1", "true")
        entries = []
        for p in paths:
            p = p.strip("/")
            if p in commit.files:
                entries.append(self._entry(commit, p, expand, False))
            elif p and p in commit.trees:
                entries.append(self._entry(commit, p, expand, True))
        return _json(200, entries)

    def _refs(self, repo: HubRepo, query: dict[str, list[str]]) -> _Response:
        with self._lock:
            branches = dict(repo.branches)
            tags = dict(repo.tags)
        prs = {k: v for k, v in branches.items() if k.startswith("refs/pr/")}
        payload: dict[str, object] = {
            "branches": [
                {"name": k, "ref": f"refs/heads/{k}", "targetCommit": v}
                for k, v in branches.items()
                if k not in prs
            ],
            "tags": [
                {"name": k, "ref": f"refs/tags/{k}", "targetCommit": v} for k, v in tags.items()
            ],
            "converts": [],
        }
        if query.get("include_prs", ["0"])[-1].lower() in ("1", "true"):
            payload["pullRequests"] = [
                {"name": k.removeprefix("refs/"), "ref": k, "targetCommit": v}
                for k, v in prs.items()
            ]
        return _json(200, payload)

    def _route_resolve(
        self,
        method: str,
        raw_repo: Sequence[str],
        raw_rest: Sequence[str],
        headers: Mapping[str, str],
        *,
        redirect: bool = True,
    ) -> _Response:
        if method not in ("GET", "HEAD"):
            return _error(405, "Method Not Allowed")
        repo, err = self._find_repo(raw_repo, headers)
        if repo is None:
            return err or _error(404, "Not Found")
        rev, path = self._split_rev(repo, raw_rest)
        commit, err = self._commit(repo, rev)
        if commit is None:
            return err or _error(404, "Not Found")
        f = commit.files.get(path)
        if f is None:
            return _error(
                404, f"Entry not found: {path}", "EntryNotFound", [("X-Repo-Commit", commit.sha)]
            )
        common = [("X-Repo-Commit", commit.sha), ("Accept-Ranges", "bytes")]
        hostile = self.hostile_redirects.get(path)
        if hostile is not None:
            return _Response(302, [*common, ("Location", hostile)], file=f)
        if f.is_lfs:
            assert f.sha256 is not None
            expires = int(time.time() + self.cdn_url_ttl)
            params = {
                "response-content-disposition": _content_disposition(f.path),
                "Expires": str(expires),
                "Signature": self._sign(f.sha256, expires),
                "Key-Pair-Id": "HUBSERVERTEST",
            }
            location = f"{self.cdn_endpoint}/cdn/{f.sha256}?{urlencode(params, quote_via=quote)}"
            return _Response(
                302,
                [
                    *common,
                    ("ETag", f'"{f.sha256}"'),
                    ("X-Linked-Etag", f'"{f.sha256}"'),
                    ("X-Linked-Size", str(f.size)),
                    ("Location", location),
                    ("Content-Type", "text/plain; charset=utf-8"),
                ],
                file=f,
            )
        if self.small_file_redirect and redirect:
            etag = urlencode({"etag": f'"{f.blob_id}"'})
            location = (
                f"/api/resolve-cache/models/{repo.repo_id}/{commit.sha}/{quote(f.path)}?{etag}"
            )
            return _Response(
                307,
                [*common, ("ETag", f'"{f.blob_id}"'), ("Location", location)],
                file=f,
            )
        return self._serve_file(f, headers, common)

    def _route_resolve_cache(
        self, method: str, raw: Sequence[str], headers: Mapping[str, str]
    ) -> _Response:
        if method not in ("GET", "HEAD"):
            return _error(405, "Method Not Allowed")
        sha_index = next((i for i, s in enumerate(raw) if _SHA_RE.fullmatch(s)), None)
        if sha_index is None or sha_index == 0:
            return _error(404, "Not Found")
        return self._route_resolve(
            method, raw[:sha_index], raw[sha_index:], headers, redirect=False
        )

    def _serve_file(
        self, f: HubFile, headers: Mapping[str, str], extra: Sequence[tuple[str, str]]
    ) -> _Response:
        base = [
            *extra,
            ("ETag", f'"{f.etag}"'),
            ("Content-Type", mimetypes.guess_type(f.path)[0] or "application/octet-stream"),
        ]
        rng = _parse_range(headers.get("range"), f.size)
        if rng == "invalid":
            return _Response(
                416,
                [*base, ("Content-Range", f"bytes */{f.size}")],
                b"Requested Range Not Satisfiable",
                file=f,
            )
        if rng is None:
            return _Response(200, base, file=f, file_range=(0, f.size))
        start, length = rng
        content_range = f"bytes {start}-{start + length - 1}/{f.size}"
        return _Response(206, [*base, ("Content-Range", content_range)], file=f, file_range=rng)

    def _sign(self, sha256: str, expires: int) -> str:
        return hmac.new(self._secret, f"{sha256}:{expires}".encode(), "sha256").hexdigest()[:40]

    def _route_cdn(
        self,
        method: str,
        segs: Sequence[str],
        query: dict[str, list[str]],
        headers: Mapping[str, str],
    ) -> _Response:
        if method not in ("GET", "HEAD"):
            return _error(405, "Method Not Allowed")
        if len(segs) != 2 or segs[0] != "cdn" or not _SHA256_RE.fullmatch(segs[1]):
            return _error(404, "Not Found")
        sha256 = segs[1]
        try:
            expires = int(query["Expires"][-1])
            signature = query["Signature"][-1]
        except (KeyError, ValueError):
            return _error(403, "Missing signature")
        if not hmac.compare_digest(signature, self._sign(sha256, expires)):
            return _error(403, "SignatureDoesNotMatch")
        if time.time() > expires:
            return _error(403, "Request has expired")
        with self._lock:
            f = self._blobs.get(sha256)
        if f is None:
            return _error(404, "NoSuchKey")
        extra = []
        if "response-content-disposition" in query:
            extra.append(("Content-Disposition", query["response-content-disposition"][-1]))
        return self._serve_file(f, headers, extra)


def _content_disposition(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    return f"inline; filename*=UTF-8''{quote(name)}; filename=\"{name}\";"


# ---------------------------------------------------------------------------- fixture helpers


def write_random_file(
    path: str | os.PathLike[str], size: int, seed: int | str, *, safetensors: bool = False
) -> str:
    """:func:`prefetch.demo.modelgen.write_random_file`, its digests remembered so that serving the
    file costs no re-hash; returns the sha256."""
    digests = modelgen.write_random_file(path, size, seed, safetensors=safetensors)
    _remember_written(Path(path), digests)
    return digests.sha256


def _remember_written(path: Path, digests: modelgen.WrittenDigests) -> None:
    _remember_digest(path, "sha256", digests.sha256)
    if digests.git_sha1 is not None:
        _remember_digest(path, "git", digests.git_sha1)


def make_model_dir(
    directory: str | os.PathLike[str],
    *,
    seed: int = 0,
    shard_sizes: Sequence[int] = (3 << 20, 2 << 20),
    extra_files: Mapping[str, bytes] | None = None,
) -> dict[str, Path]:
    """:func:`prefetch.demo.modelgen.make_model_dir`, the shards' digests remembered for serving."""
    return modelgen.make_model_dir(
        directory,
        seed=seed,
        shard_sizes=shard_sizes,
        extra_files=extra_files,
        on_written=_remember_written,
    )


def make_model_repo(
    server: HubServer,
    repo_id: str,
    directory: str | os.PathLike[str],
    *,
    seed: int = 0,
    shard_sizes: Sequence[int] = (3 << 20, 2 << 20),
    branch: str = "main",
    lfs: LfsRule = default_lfs_rule,
) -> str:
    """:func:`make_model_dir` + :meth:`HubServer.add_commit`; returns the commit sha."""
    files = make_model_dir(directory, seed=seed, shard_sizes=shard_sizes)
    return server.add_commit(repo_id, files, branch=branch, lfs=lfs)


# ------------------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    """Serve a directory as a repo until SIGINT/SIGTERM (for benchmarks and manual testing)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", required=True, help="repo id, e.g. acme/model")
    parser.add_argument("--dir", required=True, type=Path, help="directory to serve as the repo")
    parser.add_argument("--token", help="require this bearer token on the hub port")
    parser.add_argument("--hub-port", type=int, default=0)
    parser.add_argument("--cdn-port", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=1000)
    parser.add_argument("--lfs-threshold", type=int, help="LFS by size only (default: suffix rule)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = HubServer(token=args.token, tree_page_size=args.page_size)
    lfs: LfsRule = args.lfs_threshold if args.lfs_threshold is not None else default_lfs_rule
    sha = server.add_commit(args.repo, args.dir, lfs=lfs)
    with server.start(hub_port=args.hub_port, cdn_port=args.cdn_port):
        print(
            json.dumps(
                {"endpoint": server.endpoint, "cdn_endpoint": server.cdn_endpoint, "sha": sha}
            ),
            flush=True,
        )
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
