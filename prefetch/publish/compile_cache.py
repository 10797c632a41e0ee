"""Compile caches as models: the key that decides reuse, and publishing a finished cache once.

vLLM's ``torch.compile`` and CUDA-graph work is cached under ``VLLM_CACHE_ROOT``; vLLM's design
doc allows copying that directory between machines that would compile the same thing. What
decides "the same thing" is :class:`CacheKey`: the vLLM build (image digest, else version), the
model and its revision, the tensor-parallel size, the GPU product, and the torch/CUDA versions
when given. Any change makes a new key (a new S3 prefix), so a node never reads a cache compiled
for something else; an absent optional field leaves the key as it was.

Publishing (``prefetch cache push``) refuses a cache that vLLM is still writing (no
``.cache_ready`` marker anywhere in it, or files that change while it looks), and never
overwrites: every object is written with ``If-None-Match: *``, starting with a claim object, so
of two nodes pushing one key exactly one wins and the other leaves the prefix alone. The
winner's last write is :data:`COMPLETE`; a reader treats a prefix without it as absent (a push
in progress or one that died), so it never pulls half a cache.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import io
import json
import logging
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefetch.publish.compile_cache_claim import COMPLETE, Claim, exists, put, put_new, split_uri
from prefetch.support.errors import CompileCacheError, CompileCacheRefused, PrefetchError

#: vLLM writes this into a compile cache directory once it is complete.
CACHE_READY = ".cache_ready"
#: The node label GPU feature discovery sets to the GPU product (e.g. NVIDIA-H100-80GB-HBM3).
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
#: How long a push watches the files for changes before uploading.
DEFAULT_SETTLE = 2.0
#: How long a claim holds a key without being renewed (a push renews it as it goes): a push
#: killed after its claim blocks the key this long at most, then another writer takes it over.
DEFAULT_LEASE = 10 * 60.0
#: A file up to this size is copied into memory and the copy uploaded; a larger one is uploaded
#: from the file with its SHA-256 for the store to check (see ``_upload_file``).
IN_MEMORY = 16 * 1024 * 1024
COPY_BLOCK = 1024 * 1024

log = logging.getLogger(__name__)
#: Opt-in JIT caches that live beside vLLM's own under VLLM_CACHE_ROOT, by the name a
#: ``compileCaches`` entry's ``extraDirs`` gives them: (the environment variable the library
#: reads, the subdirectory of the cache root it is pointed at). FlashInfer keeps its JIT
#: workspace under ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/`` (flashinfer/jit/env.py);
#: DeepGEMM its kernels under ``$DG_JIT_CACHE_DIR/cache/`` (csrc/jit/compiler.hpp).
EXTRA_DIRS: dict[str, tuple[str, str]] = {
    "flashinfer": ("FLASHINFER_WORKSPACE_BASE", "flashinfer"),
    "deepgemm": ("DG_JIT_CACHE_DIR", "deep_gemm"),
}

__all__ = [
    "CACHE_READY",
    "DEFAULT_LEASE",
    "EXTRA_DIRS",
    "GPU_PRODUCT_LABEL",
    "CacheKey",
    "PushResult",
    "extra_env",
    "finished_files",
    "is_published",
    "left_out",
    "push",
]


@dataclass(frozen=True)
class CacheKey:
    """What a compiled artefact depends on. ``key`` is stable for equal fields, different for
    any change; ``torch``/``cuda`` left out (None) do not count."""

    vllm: str  # the image digest (sha256:...), else the vLLM version
    model: str  # the model's name or repo id
    revision: str  # the model's commit/revision
    tensor_parallel: int = 1
    gpu_product: str = ""  # the node label nvidia.com/gpu.product, or configured
    torch: str | None = None
    cuda: str | None = None

    def __post_init__(self) -> None:
        for name in ("vllm", "model", "revision", "gpu_product"):
            if not str(getattr(self, name)).strip():
                raise CompileCacheError(f"compile cache key: {name} is empty")
        if self.tensor_parallel < 1:
            raise CompileCacheError(
                f"compile cache key: tensor_parallel must be >= 1, got {self.tensor_parallel}"
            )

    def fields(self) -> dict[str, str | int]:
        out: dict[str, str | int] = {
            "vllm": self.vllm.strip(),
            "model": self.model.strip(),
            "revision": self.revision.strip(),
            "tensor_parallel": self.tensor_parallel,
            "gpu_product": self.gpu_product.strip(),
        }
        for name in ("torch", "cuda"):
            value = getattr(self, name)
            if value is not None and value.strip():
                out[name] = value.strip()
        return out

    @property
    def key(self) -> str:
        """``v1-<32 hex>``: a digest of :meth:`fields` as canonical JSON (a prefix-safe name;
        the fields themselves are in the published claim, for people)."""
        text = json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))
        return "v1-" + hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class PushResult:
    """``uploaded``: this push won the key; otherwise ``reason`` says why it left it alone."""

    uri: str
    uploaded: bool
    files: int = 0
    bytes: int = 0
    reason: str = ""
    #: Not uploaded because another writer's live claim holds the key: that push may still die,
    #: so a later push may take the key over once the claim's lease runs out.
    pending: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "extra"} | self.extra


def extra_env(root: str, names: Iterable[str]) -> dict[str, str]:
    """The environment a vLLM pod sets for the ``extraDirs`` ``names`` with its
    VLLM_CACHE_ROOT at ``root``: each library's variable -> its subdirectory of ``root``."""
    out: dict[str, str] = {}
    for name in names:
        if name not in EXTRA_DIRS:
            known = ", ".join(sorted(EXTRA_DIRS))
            raise CompileCacheError(f"unknown extra cache directory {name!r} (known: {known})")
        env, sub = EXTRA_DIRS[name]
        out[env] = f"{root.rstrip('/')}/{sub}"
    return out


def left_out(extra_dirs: Iterable[str]) -> frozenset[str]:
    """The top-level subdirectories a push leaves out: those of the JIT caches not opted in."""
    wanted = set(extra_dirs)
    return frozenset(sub for name, (_env, sub) in EXTRA_DIRS.items() if name not in wanted)


#: What a listing records of a file, to tell it was not swapped or changed when it is opened:
#: (device, inode, size, mtime in ns).
_Stamp = tuple[int, int, int, int]
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO swapped in is opened without waiting for a writer (fstat then refuses it)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _stamp(st: os.stat_result) -> _Stamp:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class _Root:
    """The cache directory, opened once: every listing and every open of a push goes through
    this descriptor and then one path component at a time with ``O_NOFOLLOW``, so a symlink
    (to a file or a directory) put anywhere under it, even after the listing, is never
    followed. The directory itself is opened as configured (it may be a symlink the operator
    made); a vLLM pod writes under it, it cannot replace its own mount point."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise CompileCacheError(f"{path}: not a directory ({exc.strerror or exc})") from exc

    def __enter__(self) -> _Root:
        return self

    def __exit__(self, *_exc: object) -> None:
        os.close(self.fd)

    def listing(self, skip: frozenset[str]) -> dict[str, _Stamp]:
        """Every file under the root (relative path -> stamp), but for the top-level
        directories in ``skip``; CompileCacheRefused for anything not a file or directory."""
        out: dict[str, _Stamp] = {}
        self._walk(self.fd, "", out, skip)
        return out

    def _walk(self, dir_fd: int, prefix: str, out: dict[str, _Stamp], skip: frozenset[str]) -> None:
        with os.scandir(dir_fd) as entries:
            names = sorted(e.name for e in entries)
        for name in names:
            rel = prefix + name
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if prefix or name not in skip:
                    sub = self._open_dir(dir_fd, name, rel)
                    try:
                        self._walk(sub, rel + "/", out, skip)
                    finally:
                        os.close(sub)
            elif stat.S_ISREG(st.st_mode):
                out[rel] = _stamp(st)
            else:
                raise CompileCacheRefused(
                    f"{self.path / rel}: not a regular file; a compile cache holds only files"
                )

    def _open_dir(self, dir_fd: int, name: str, rel: str) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            raise self._refused(rel, exc) from exc

    def _refused(self, rel: str, exc: OSError) -> CompileCacheError:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return CompileCacheRefused(
                f"{self.path / rel}: became a symlink after the check; not followed"
            )
        return CompileCacheError(f"{self.path / rel}: {exc.strerror or exc}")

    def open_file(self, rel: str) -> int:
        """``rel`` opened read-only without following a link at any component."""
        *dirs, name = rel.split("/")
        fd, opened = self.fd, []
        try:
            for i, part in enumerate(dirs):
                fd = self._open_dir(fd, part, "/".join(dirs[: i + 1]))
                opened.append(fd)
            try:
                return os.open(name, _FILE_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise self._refused(rel, exc) from exc
        finally:
            for d in opened:
                os.close(d)


def _stat_all(root: Path, skip: frozenset[str] = frozenset()) -> dict[str, _Stamp]:
    with _Root(root) as tree:
        return tree.listing(skip)


def _settled(
    tree: _Root, settle: float, sleep: Callable[[float], None], skip: frozenset[str]
) -> dict[str, _Stamp]:
    """The files of ``tree`` once they did not change for ``settle`` seconds (see
    :func:`finished_files`)."""
    root = tree.path
    before = tree.listing(skip)
    if not any(Path(p).name == CACHE_READY for p in before):
        raise CompileCacheError(
            f"{root}: no {CACHE_READY} marker: vLLM has not finished writing this cache",
            hint="push after vLLM has started once and finished compiling",
        )
    sleep(settle)
    after = tree.listing(skip)
    if after != before:
        changed = sorted(set(before.items()) ^ set(after.items()))
        raise CompileCacheError(
            f"{root}: files changed while checking (e.g. {changed[0][0]}): still being written"
        )
    return after


def finished_files(
    root: Path,
    *,
    settle: float = DEFAULT_SETTLE,
    sleep: Callable[[float], None] = time.sleep,
    skip: frozenset[str] = frozenset(),
) -> dict[str, int]:
    """The files of a finished cache under ``root`` (relative path -> size), but for the
    top-level directories in ``skip``; CompileCacheError when there is no ``.cache_ready``
    marker, or a file appears, goes or changes in ``settle`` seconds (still being written)."""
    if not root.is_dir():
        raise CompileCacheError(f"{root}: not a directory")
    with _Root(root) as tree:
        files = _settled(tree, settle, sleep, skip)
    return {path: stamp[2] for path, stamp in sorted(files.items())}


class _Window:
    """The first ``size`` bytes of an open file (``pread``: no shared offset), as an upload's
    body: what botocore needs of one (read, seek, tell), nothing past the size checked."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd, self._size, self._pos = fd, size, 0

    def read(self, n: int | None = -1) -> bytes:
        left = self._size - self._pos
        n = left if n is None or n < 0 else min(n, left)
        chunk = os.pread(self._fd, n, self._pos) if n > 0 else b""
        self._pos += len(chunk)
        return chunk

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        self._pos = min(max(base + offset, 0), self._size)
        return self._pos

    def tell(self) -> int:
        return self._pos


def _check(tree: _Root, rel: str, fd: int, listed: _Stamp, when: str) -> None:
    """CompileCacheRefused unless the open file ``fd`` is the regular file listed, unchanged."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or _stamp(st) != listed:
        raise CompileCacheRefused(f"{tree.path / rel}: {when} ({_what_changed(st, listed)})")


def _hash(fd: int, size: int, copy: io.BytesIO | None) -> str | None:
    """The SHA-256 of the first ``size`` bytes of ``fd`` (kept in ``copy`` when given); None
    when the file has fewer."""
    digest, pos = hashlib.sha256(), 0
    while pos < size:
        chunk = os.pread(fd, min(size - pos, COPY_BLOCK), pos)
        if not chunk:
            return None
        digest.update(chunk)
        if copy is not None:
            copy.write(chunk)
        pos += len(chunk)
    return digest.hexdigest()


def _upload_file(client: Any, bucket: str, key: str, tree: _Root, rel: str, listed: _Stamp) -> str:
    """Upload the file ``rel`` as listed to ``key`` (only if nothing is there) and give its
    SHA-256: the object holds exactly the bytes hashed. A file up to :data:`IN_MEMORY` is
    copied and the copy uploaded; a larger one is read in place, and the upload carries the
    SHA-256 (``x-amz-checksum-sha256``), which the store checks against what it receives, so
    bytes that change between the hash and the upload are refused by the store (BadDigest)
    and by the checks around it. CompileCacheRefused when the file opened is not the one
    listed (swapped, grown, shrunk or rewritten after the check) or changes meanwhile."""
    fd = tree.open_file(rel)
    try:
        _check(tree, rel, fd, listed, "not the file checked")
        size = listed[2]
        copy = io.BytesIO() if size <= IN_MEMORY else None
        digest = _hash(fd, size, copy)
        _check(tree, rel, fd, listed, "changed while it was read")
        if digest is None:
            raise CompileCacheRefused(f"{tree.path / rel}: shorter than when checked")
        body: Any = copy if copy is not None else _Window(fd, size)
        body.seek(0)
        checksum = base64.b64encode(bytes.fromhex(digest)).decode()
        try:
            etag = put(client, bucket, key, body, checksum=checksum, IfNoneMatch="*")
        except PrefetchError:  # e.g. BadDigest: the bytes read for the upload were others
            _check(tree, rel, fd, listed, "changed while it was uploaded")
            raise
        if etag is None:
            raise CompileCacheError(
                f"s3://{bucket}/{key}: exists although this push claimed the key",
                hint="another tool writes under this prefix; give each cache its own key",
            )
        _check(tree, rel, fd, listed, "changed while it was uploaded")
    finally:
        os.close(fd)
    return digest


def _what_changed(st: os.stat_result, listed: _Stamp) -> str:
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if (st.st_dev, st.st_ino) != listed[:2]:
        return "another file"
    if st.st_size != listed[2]:
        return f"{listed[2]} bytes when checked, {st.st_size} now"
    return "rewritten"


def push(
    client: Any,
    root: Path,
    uri: str,
    *,
    key: CacheKey | None = None,
    settle: float = DEFAULT_SETTLE,
    sleep: Callable[[float], None] = time.sleep,
    extra_dirs: Iterable[str] | None = None,
    lease: float = DEFAULT_LEASE,
    clock: Callable[[], float] = time.time,
) -> PushResult:
    """Publish the finished cache at ``root`` under ``uri`` (s3://bucket/prefix/<key>/), unless
    it is published or a live claim holds it (first writer wins; a claim whose ``lease``
    seconds ran out without completion is taken over). With ``extra_dirs`` (``extraDirs``
    names), the JIT cache directories of :data:`EXTRA_DIRS` not named are left out.

    Each file is opened without following links, checked to be the file listed, hashed and
    uploaded as hashed (see ``_upload_file``): the object, its size and the SHA-256 in
    :data:`COMPLETE` are the same bytes. A file swapped or changed after the check ends the
    push (CompileCacheRefused) before :data:`COMPLETE`, and the claim is given up."""
    bucket, prefix = split_uri(uri)
    skip = left_out(extra_dirs) if extra_dirs is not None else frozenset()
    if not root.is_dir():
        raise CompileCacheError(f"{root}: not a directory")
    with _Root(root) as tree:
        files = _settled(tree, settle, sleep, skip)
        fields = {
            "host": socket.gethostname(),
            "token": secrets.token_hex(8),
            "files": len(files),
            "bytes": sum(stamp[2] for stamp in files.values()),
            **({"key": key.fields()} if key is not None else {}),
        }
        claim = Claim(client, bucket, prefix, fields, lease, clock)
        refused = claim.take()
        if refused is not None:
            return PushResult(uri, uploaded=False, pending=refused.pending, reason=refused.reason)
        try:
            digests = _upload(client, bucket, prefix, tree, files, claim)
            claim.renew(force=True)  # still this push's key, right before it completes it
        except BaseException:
            claim.release()
            raise
    sizes = {rel: stamp[2] for rel, stamp in sorted(files.items())}
    manifest = {"files": sizes, "sha256": digests, "completed_at": clock()}
    if not put_new(client, bucket, prefix + COMPLETE, json.dumps(manifest).encode()):
        raise CompileCacheError(f"s3://{bucket}/{prefix}{COMPLETE}: written by another writer")
    extra = {"took_over": True} if claim.took_over else {}
    return PushResult(uri, uploaded=True, files=len(files), bytes=sum(sizes.values()), extra=extra)


def _upload(
    client: Any, bucket: str, prefix: str, tree: _Root, files: dict[str, _Stamp], claim: Claim
) -> dict[str, str]:
    """Upload each file as checked (see :func:`_upload_file`): relative path -> its SHA-256."""
    digests: dict[str, str] = {}
    for rel, listed in sorted(files.items()):
        claim.renew()
        digests[rel] = _upload_file(client, bucket, prefix + rel, tree, rel, listed)
    return digests


def is_published(client: Any, uri: str) -> bool:
    """Whether ``uri`` holds a complete published cache (its :data:`COMPLETE` marker)."""
    bucket, prefix = split_uri(uri)
    return exists(client, bucket, prefix + COMPLETE)
