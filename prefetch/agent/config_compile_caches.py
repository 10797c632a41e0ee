"""The config file's ``compileCaches``: each entry (its keys read through the
``COMPILE_CACHE`` table) a :class:`~prefetch.agent.config_values.CompileCacheEntry`, a plain
model at its ``source`` + its key + ``/``; duplicate names and a ``push`` without an absolute
``pushFrom`` rejected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefetch.agent.config_checks import kind_of
from prefetch.agent.config_tables import COMPILE_CACHE
from prefetch.agent.config_values import CompileCacheEntry
from prefetch.publish.compile_cache import CacheKey
from prefetch.support.errors import ConfigError, PrefetchError

__all__ = ["parse_compile_caches"]

#: Stands for the node's GPU product in an entry that has no ``gpuProduct`` (never in a key).
_NODE_GPU = "<node>"


def parse_compile_caches(value: Any, path: str) -> tuple[CompileCacheEntry, ...]:
    """``compileCaches``: each entry a plain model at ``source`` + the entry's key + ``/``."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of compile caches, got {kind_of(value)}")
    entries: list[CompileCacheEntry] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(value):
        entry = _compile_cache(item, f"{path}[{i}]")
        if entry.name in seen:  # one directory, models/<name>, for both
            raise ConfigError(
                f"{path}[{i}].name: duplicate compile cache name {entry.name!r} "
                f"(also {path}[{seen[entry.name]}])"
            )
        seen[entry.name] = i
        entries.append(entry)
    return tuple(entries)


def _compile_cache(value: Any, where: str) -> CompileCacheEntry:
    e = COMPILE_CACHE.check(value, where)

    def field_(key: str, default: Any) -> Any:
        return COMPILE_CACHE.get(e, key, where, default)

    field_("target", "vllm")
    gpu = field_("gpuProduct", None)
    try:
        key = CacheKey(
            vllm=field_("vllm", ""),
            model=field_("model", ""),
            revision=field_("revision", ""),
            tensor_parallel=field_("tensorParallelSize", 1),
            gpu_product=gpu or _NODE_GPU,
            torch=field_("torch", None),
            cuda=field_("cuda", None),
        )
    except PrefetchError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    source = field_("source", None)
    name = field_("name", "")
    required = field_("required", False)
    push_from = field_("pushFrom", None)
    if not field_("push", False):
        push_from = None
    elif not push_from or not push_from.startswith("/"):
        raise ConfigError(
            f"{where}.pushFrom: push: true needs the absolute path of the directory the "
            "vLLM pod writes this compile cache into (its VLLM_CACHE_ROOT on the host)"
        )
    where_from = Path(push_from) if push_from else None
    extra = field_("extraDirs", ())
    return CompileCacheEntry(name, str(source), key, bool(gpu), required, where_from, extra)
