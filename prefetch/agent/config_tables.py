"""The config file's keys, one :class:`~prefetch.agent.config_fields.Field` line a key, in one
:class:`~prefetch.agent.config_fields.Table` per mapping (the top level, a model, a compile
cache, ``retryBackoff``, ``s3``): the parsers read their keys through them, and docs/config.md
and the chart's values.schema.json are generated from them
(``python -m prefetch.agent.config_schema``)."""

# Kept long on purpose: a flat table of declarations, one line per config key.

from __future__ import annotations

from typing import Any

from prefetch.agent.config_checks import duration, text, uri
from prefetch.agent.config_fields import (
    BOOL,
    DNS_LABEL,
    DURATION,
    ENDPOINT_URL,
    HF_REPO,
    LABEL_PREFIX,
    LISTEN,
    MIRROR_URIS,
    OPT_TEXT,
    PATH,
    PATTERNS,
    POSITIVE_DURATION,
    PROXY,
    S3_URI,
    SHARE,
    SIZE,
    SOURCE_SCHEMES,
    SOURCE_URI,
    TAINT_KEY,
    TEXT,
    Field,
    Kind,
    Table,
    int_kind,
    list_kind,
    mirror_rules,
    names_kind,
    object_kind,
    size_at_least,
    sync_deadline_kind,
)
from prefetch.agent.config_values import DEFAULT_CACHE_DIR, SyncDeadline
from prefetch.pipeline.backends import backend
from prefetch.pipeline.spec import SourceURI
from prefetch.publish.compile_cache import EXTRA_DIRS
from prefetch.support.constants import (
    DEFAULT_LABEL_PREFIX,
    DEFAULT_LISTEN,
    DEFAULT_STARTUP_TAINT_KEY,
)
from prefetch.support.errors import ConfigError

__all__ = ["BACKOFF", "COMPILE_CACHE", "MODEL", "S3", "TOP"]


def _sync_deadline(value: Any, path: str) -> SyncDeadline:
    """``auto`` (scaled with the model), a positive duration, or ``off``/0 (no bound)."""
    if value == "auto":
        return SyncDeadline()
    seconds = duration(value, path)
    return SyncDeadline(off=True) if seconds is None else SyncDeadline(seconds=seconds)


def _target(value: Any, path: str) -> str:
    if text(value, path) != "vllm":
        raise ConfigError(f"{path}: only vllm is supported")
    return "vllm"


def _cache_source(value: Any, path: str) -> SourceURI:
    found: SourceURI = uri(SOURCE_SCHEMES)(value, path)
    if not backend(found.scheme).holds_compile_caches:
        raise ConfigError(f"{path}: expected s3://bucket/prefix/")
    return found


_SYNC_DEADLINE = sync_deadline_kind(_sync_deadline)
_SYNC_DEADLINE_DOC = (
    "bound of one sync attempt: auto (10m, or the bytes to fetch at 4 MiB/s if longer), "
    "a duration, or off"
)
BACKOFF = Table((
    Field("initial", POSITIVE_DURATION, "10s", "delay after a model's first failed sync (doubles)"),
    Field("max", POSITIVE_DURATION, "10m", "longest delay (not shorter than initial)"),
))  # fmt: skip
S3 = Table((
    Field("endpointUrl", ENDPOINT_URL, "AWS_ENDPOINT_URL, else AWS", "S3 endpoint (MinIO, ...)"),
))  # fmt: skip
MODEL = Table((
    Field("name", DNS_LABEL, "", "the model's name, in its node label",
          missing=" (a DNS label, used in the node label)"),
    Field("source", SOURCE_URI, "", "where the files come from",
          missing=" (s3://bucket/prefix or hf://org/name)"),
    Field("revision", OPT_TEXT, "main (hf)", "hf: branch, tag or commit; oci: tag or digest; "
          "s3, gs, az, file with hfRepo: the 40-hex commit to publish under"),
    Field("include", PATTERNS, "everything", "files to fetch (globs)"),
    Field("exclude", PATTERNS, "nothing", "files to leave out (globs)"),
    Field("required", BOOL, "true", "gates /readyz and the startup taint"),
    Field("hfRepo", HF_REPO, "", "s3, oci, gs, az, file: publish in the Hub layout under this repo "
          "id"),
    Field("pin", BOOL, "false", "never evicted, even after leaving the config"),
    Field("proxy", PROXY, "", "this model's sources through this proxy (none: direct; default "
          "HTTP(S)_PROXY)"),
    Field("mirrors", MIRROR_URIS, "", "hf: S3 mirror prefixes; oci: registries; tried first"),
    Field("hubFallback", BOOL, "true", "hf with mirrors: then the Hub"),
    Field("syncDeadline", _SYNC_DEADLINE, "the top-level one", _SYNC_DEADLINE_DOC),
    Field("warmPageCache", BOOL, "false", "read the files into the page cache once published"),
    Field("gateOnWarm", BOOL, "false", "ready only after that warm-up (implies warmPageCache)"),
    Field("caBundle", PATH, "the top-level one", "PEM file of the CAs this model's sources use"),
), rules=mirror_rules)  # fmt: skip
COMPILE_CACHE = Table((
    Field("name", DNS_LABEL, "", "the cache's name (its directory under models/)", missing=""),
    Field("source", Kind(_cache_source, S3_URI.schema, S3_URI.doc), "",
          "prefix the key is appended to", missing=""),
    Field("target", Kind(_target, lambda: {"const": "vllm"}, "vllm"), "vllm", "the engine"),
    Field("vllm", TEXT, "", "the vLLM image (digest or version)", missing=""),
    Field("model", TEXT, "", "the model's Hub repo id", missing=""),
    Field("revision", TEXT, "", "the model's commit", missing=""),
    Field("tensorParallelSize", int_kind(1, 1024), "1", "vLLM's tensor parallel size"),
    Field("gpuProduct", OPT_TEXT, "the node's nvidia.com/gpu.product", "GPU product in the key"),
    Field("torch", OPT_TEXT, "", "torch version in the key"),
    Field("cuda", OPT_TEXT, "", "CUDA version in the key"),
    Field("required", BOOL, "false", "the gate waits for this pull"),
    Field("push", BOOL, "false", "publish this cache from pushFrom once vLLM finished it"),
    Field("pushFrom", OPT_TEXT, "", "absolute host directory vLLM writes the cache into"),
    Field("extraDirs", names_kind(tuple(EXTRA_DIRS)), "[]", "JIT caches published with it"),
))  # fmt: skip
TOP = Table((
    Field("cacheDir", TEXT, DEFAULT_CACHE_DIR, "the cache (= HF_HOME for vLLM)"),
    Field("labelPrefix", LABEL_PREFIX, DEFAULT_LABEL_PREFIX, "node labels PREFIX/MODEL=ready"),
    Field("startupTaint", TAINT_KEY, DEFAULT_STARTUP_TAINT_KEY, "key of the startup taint"),
    Field("listen", LISTEN, DEFAULT_LISTEN, "/healthz, /readyz, /metrics"),
    Field("concurrency", int_kind(1, 512), "16", "ranged requests in flight per model sync"),
    Field("chunkSize", size_at_least(64 * 1024, "64KiB"), "64MiB", "bytes per ranged request"),
    Field("minRate", SIZE, "64KiB", "bytes/s a request must keep over stallTimeout (0: off)"),
    Field("stallTimeout", POSITIVE_DURATION, "30s", "window of the minRate rule"),
    Field("parallelModels", int_kind(1, 16), "2", "models synced at the same time"),
    Field("verifyInterval", DURATION, "off", "re-hash cached files this often"),
    Field("verifyReadRate", SIZE, "200MB", "bytes/s bound for those reads (0: unbounded)"),
    Field("resolveInterval", DURATION, "10m", "re-resolve branches and S3 listings this often"),
    Field("supersededGrace", DURATION, "10m", "keep a moved branch's old snapshot this long"),
    Field("retryBackoff", object_kind(BACKOFF, "mapping"), "", "per-model backoff after failures"),
    Field("syncDeadline", _SYNC_DEADLINE, "auto", _SYNC_DEADLINE_DOC),
    Field("minFreeSpace", SIZE, "1GiB", "kept free on the cache filesystem"),
    Field("warmMemoryShare", SHARE, "0.5", "a warm-up fills at most this share of free memory"),
    Field("warmReadRate", SIZE, "2GB", "bytes/s bound for warm-up reads (0: unbounded)"),
    Field("caBundle", PATH, "the system's", "PEM file of the CAs the sources use"),
    Field("s3", object_kind(S3, "mapping or null", nullable=True), "", "S3 settings"),
    Field("models", list_kind(MODEL, "list"), "[]", "the models to have on the node"),
    Field("compileCaches", list_kind(COMPILE_CACHE, "list"), "[]", "vLLM compile caches"),
))  # fmt: skip
