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

import hashlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefetch.errors import CompileCacheError
from prefetch.sources.s3 import translate

#: vLLM writes this into a compile cache directory once it is complete.
CACHE_READY = ".cache_ready"
#: Ours, at the top of a published key: the claim (the first write) and the completion marker
#: (the last). Neither is a vLLM file; both are small JSON.
CLAIM = ".prefetch-claim.json"
COMPLETE = ".prefetch-complete.json"
#: The node label GPU feature discovery sets to the GPU product (e.g. NVIDIA-H100-80GB-HBM3).
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
#: How long a push watches the files for changes before uploading.
DEFAULT_SETTLE = 2.0
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
    "CLAIM",
    "COMPLETE",
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


def _stat_all(root: Path, skip: frozenset[str] = frozenset()) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for dirpath, dirs, names in os.walk(root):
        if Path(dirpath) == root:
            dirs[:] = [d for d in dirs if d not in skip]
        for name in names:
            p = Path(dirpath, name)
            st = p.lstat()
            if p.is_symlink() or not p.is_file():
                raise CompileCacheError(
                    f"{p}: not a regular file; a compile cache holds only files"
                )
            out[p.relative_to(root).as_posix()] = (st.st_size, st.st_mtime_ns)
    return out


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
    before = _stat_all(root, skip)
    if not any(Path(p).name == CACHE_READY for p in before):
        raise CompileCacheError(
            f"{root}: no {CACHE_READY} marker: vLLM has not finished writing this cache",
            hint="push after vLLM has started once and finished compiling",
        )
    sleep(settle)
    after = _stat_all(root, skip)
    if after != before:
        changed = sorted(set(before.items()) ^ set(after.items()))
        raise CompileCacheError(
            f"{root}: files changed while checking (e.g. {changed[0][0]}): still being written"
        )
    return {path: size for path, (size, _mtime) in sorted(after.items())}


def _split(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://") or "/" not in uri[5:].strip("/"):
        raise CompileCacheError(f"{uri!r}: expected s3://bucket/prefix/<key>")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix.strip("/") + "/"


def _exists_error(exc: Exception) -> bool:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return False
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = response.get("Error", {}).get("Code")
    # 412: the object exists; 409: another conditional write to it is in progress
    return status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict")


def _put_new(client: Any, bucket: str, key: str, body: Any) -> bool:
    """PUT only if nothing is there (``If-None-Match: *``): False when something is."""
    try:
        client.put_object(
            Bucket=bucket, Key=key, Body=body, IfNoneMatch="*", ChecksumAlgorithm="SHA256"
        )
    except Exception as exc:
        if _exists_error(exc):
            return False
        raise translate(exc, f"s3://{bucket}/{key}") from exc
    return True


def push(
    client: Any,
    root: Path,
    uri: str,
    *,
    key: CacheKey | None = None,
    settle: float = DEFAULT_SETTLE,
    sleep: Callable[[float], None] = time.sleep,
    extra_dirs: Iterable[str] | None = None,
) -> PushResult:
    """Publish the finished cache at ``root`` under ``uri`` (s3://bucket/prefix/<key>/), unless
    something is there already (first writer wins). With ``extra_dirs`` (``extraDirs`` names),
    the JIT cache directories of :data:`EXTRA_DIRS` not named are left out."""
    bucket, prefix = _split(uri)
    skip = left_out(extra_dirs) if extra_dirs is not None else frozenset()
    files = finished_files(root, settle=settle, sleep=sleep, skip=skip)
    claim = {
        "host": socket.gethostname(),
        "claimed_at": time.time(),
        "files": len(files),
        "bytes": sum(files.values()),
        **({"key": key.fields()} if key is not None else {}),
    }
    if not _put_new(client, bucket, prefix + CLAIM, json.dumps(claim).encode()):
        return PushResult(uri, uploaded=False, reason="exists: another writer published this key")
    for rel, _size in files.items():
        with open(root / rel, "rb") as fh:
            if not _put_new(client, bucket, prefix + rel, fh):
                raise CompileCacheError(
                    f"s3://{bucket}/{prefix}{rel}: exists although this push claimed the key",
                    hint="another tool writes under this prefix; give each cache its own key",
                )
    manifest = {"files": files, "completed_at": time.time()}
    _put_new(client, bucket, prefix + COMPLETE, json.dumps(manifest).encode())
    return PushResult(uri, uploaded=True, files=len(files), bytes=sum(files.values()))


def is_published(client: Any, uri: str) -> bool:
    """Whether ``uri`` holds a complete published cache (its :data:`COMPLETE` marker)."""
    bucket, prefix = _split(uri)
    try:
        client.head_object(Bucket=bucket, Key=prefix + COMPLETE)
    except Exception as exc:
        response = getattr(exc, "response", None)
        if (
            isinstance(response, dict)
            and response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404
        ):
            return False
        raise translate(exc, f"s3://{bucket}/{prefix}{COMPLETE}") from exc
    return True
