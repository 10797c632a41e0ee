"""The agent's config file (YAML, camelCase keys), parsed into frozen values.

::

    cacheDir: /var/cache/model-prefetch   # = HF_HOME for vLLM: hub/ (HF layout) and models/<name>/
    labelPrefix: model-prefetch.io        # node labels <prefix>/<model>=ready
    startupTaint: model-prefetch.io/warming   # key of the startup taint (effect NoSchedule)
    listen: 0.0.0.0:8090                  # /healthz, /readyz, /metrics
    concurrency: 16                       # ranged requests in flight per model sync
    chunkSize: 64MiB
    minRate: 64KiB                        # a request slower than this over stallTimeout is retried
    stallTimeout: 30s                     # (from its last byte; minRate 0: off)
    parallelModels: 2                     # models synced at the same time
    verifyInterval: 0                     # re-hash cached files this often (0/off: never)
    verifyReadRate: 200MB                 # bytes/s bound for those reads (0: unbounded)
    resolveInterval: 10m                  # re-resolve branches / S3 listings this often (0: never)
    retryBackoff: {initial: 10s, max: 10m}    # per-model backoff after a failed sync (doubles)
    syncDeadline: auto                    # bound of one sync attempt (auto: 10m, or the bytes to
                                          # fetch at 4 MiB/s if longer; a duration; off: none)
    minFreeSpace: 1GiB                    # kept free on the cache filesystem
    warmMemoryShare: 0.5                  # a warm-up fills at most this share of free memory
    warmReadRate: 2GB                     # bytes/s bound for warm-up reads (0: unbounded)
    s3: {endpointUrl: null}               # default: AWS_ENDPOINT_URL, else AWS
    caBundle: /etc/ssl/private-ca.pem     # CA bundle (PEM) for TLS to every source (default:
                                          # REQUESTS_CA_BUNDLE, SSL_CERT_FILE, AWS_CA_BUNDLE...)
    models:
      - name: llama-3-70b-awq             # DNS label; used in node labels
        source: hf://org/name             # or s3://bucket/prefix
        revision: main                    # hf: branch/tag/sha; s3 with hfRepo: 40-hex commit
        include: ["*.safetensors", "*.json"]
        exclude: []
        required: true                    # gates /readyz and the startup taint
        hfRepo: org/name                  # s3 only: publish in the HF layout under this id
        pin: false                        # never evicted, even after leaving the config
        proxy: http://proxy:3128          # this model's sources through this proxy ("none":
                                          # direct); default HTTP(S)_PROXY; NO_PROXY applies
        mirrors: [s3://bucket/hf/org/name/]   # hf only: `prefetch mirror` prefixes tried first,
        hubFallback: true                 # in order; then the Hub unless this is false
        syncDeadline: 2h                  # this model's attempts (default: the top-level one)
        warmPageCache: false              # read the files into the page cache once published
        gateOnWarm: false                 # ready only after that warm-up (implies warmPageCache)
        caBundle: /etc/ssl/private-ca.pem # this model's sources' CAs (default: the top-level
                                          # caBundle, else the system's)

Every key, its values and default: docs/config.md, generated (like the chart's values.schema.json)
from the tables at the end of this module (:class:`~prefetch.agent.config_fields.Table`): a key is
one ``Field`` line there, its parser and its schema one :class:`~prefetch.agent.config_fields.Kind`.

One model per Hub repo: two models that publish into the same ``hub/models--org--name`` (two
``hf://`` sources of one repo, whatever their revisions, or an S3 mirror whose ``hfRepo`` is
another model's repo) are rejected, naming both; merge their include patterns into one model.
A model's ``pin`` is written into the cache's records each time the config loads, so pinning (or
unpinning) a model that is already cached takes effect at once, with no download.

Every error is a :class:`~prefetch.support.errors.ConfigError` whose message starts with the file
and the field path (``models[1].source: ...``). Unknown keys and duplicate model names are rejected.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml

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
    check_keys,
    duration,
    get,
    int_kind,
    kind_of,
    list_kind,
    mapping,
    mirror_rules,
    names_kind,
    object_kind,
    size_at_least,
    sync_deadline_kind,
    text,
    uri,
)
from prefetch.agent.config_fields import parse_listen as parse_listen  # re-exported
from prefetch.pipeline.backends import backend
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import (
    ModelSpec,
    SourceURI,
    SpecError,
    parse_source_uri,
    publish_revision,
)
from prefetch.pipeline.transfer import TransferConfig
from prefetch.pipeline.warmup import DEFAULT_MEMORY_SHARE, DEFAULT_READ_RATE, WarmLimits
from prefetch.publish.compile_cache import EXTRA_DIRS, CacheKey
from prefetch.support import settings
from prefetch.support.constants import (
    DEFAULT_LABEL_PREFIX,
    DEFAULT_LISTEN,
    DEFAULT_STARTUP_TAINT_KEY,
)
from prefetch.support.errors import ConfigError, PrefetchError

DEFAULT_CONFIG_PATH = "/etc/model-prefetch/models.yaml"
DEFAULT_CACHE_DIR = "/var/cache/model-prefetch"
MiB = 1024 * 1024
GiB = 1024 * MiB

T = TypeVar("T")
#: The keys of a model in the file, by the ModelSpec field each sets (the others match).
_SPEC_KEYS = {"hf_repo": "hfRepo", "hf_revision": "revision", "hub_fallback": "hubFallback"}


@dataclass(frozen=True)
class Backoff:
    """Per-model delay after failed syncs: ``initial * 2**(failures-1)``, at most ``max``."""

    initial: float = 10.0
    max: float = 600.0

    def delay(self, failures: int) -> float:
        return min(self.max, self.initial * 2.0 ** max(failures - 1, 0))


#: Stands for the node's GPU product in an entry that has no ``gpuProduct`` (never in a key).
_NODE_GPU = "<node>"


@dataclass(frozen=True)
class PushTarget:
    """A ``compileCaches`` entry the agent publishes: its ``name``, the directory vLLM writes
    the cache into (``pushFrom``), the key's ``uri`` (s3://bucket/prefix/<key>/), the ``key``
    and the ``extraDirs`` published with it."""

    name: str
    root: Path
    uri: str
    key: CacheKey
    extra_dirs: tuple[str, ...] = ()


@dataclass(frozen=True)
class CompileCacheEntry:
    """A ``compileCaches`` entry: a plain model at ``prefix`` + its key + ``/``. ``key`` holds
    every field; without ``gpu_configured`` its GPU product is the node's."""

    name: str
    prefix: str
    key: CacheKey
    gpu_configured: bool
    required: bool
    #: ``push: true``: the host directory the vLLM pod writes this cache into (``pushFrom``),
    #: published from there once per key when finished (:mod:`prefetch.agent.cache_push`).
    push_from: Path | None = None
    #: ``extraDirs``: the opt-in JIT caches (:data:`~prefetch.publish.compile_cache.EXTRA_DIRS`)
    #: kept beside vLLM's under its cache root, published with it under the same key.
    extra_dirs: tuple[str, ...] = ()

    def spec(self, node_gpu: str | None) -> tuple[ModelSpec, CacheKey] | None:
        """The entry as a model and its key; None without any GPU product to key it by."""
        key = self.key
        if not self.gpu_configured:
            if not node_gpu or not node_gpu.strip():
                return None
            key = replace(key, gpu_product=node_gpu)
        source = parse_source_uri(f"{self.prefix.rstrip('/')}/{key.key}/")
        return ModelSpec(source=source, name=self.name, required=self.required), key


@dataclass(frozen=True)
class SyncDeadline:
    """How long one sync attempt may run (``syncDeadline``): a fixed number of ``seconds``,
    ``off`` (no bound), or by default scaled with the model: :data:`MINIMUM`, or the bytes the
    attempt has to fetch at :data:`FLOOR_RATE` if that takes longer.

    When it passes, the attempt stops resumably (what was fetched stays for the next one), is
    counted as a failure with reason ``deadline`` and backs off like any failure, so one model
    whose source trickles cannot hold a ``parallelModels`` slot for ever.

    Why these numbers: the floor must sit far below any healthy link, so a large model is
    never cut off while it downloads well: 4 MiB/s (34 Mbit/s) is a tenth of a slow cloud
    node's S3 or Hub throughput (this machine's loopback S3 does ~400 MB/s), and gives a 140 GB
    model 9.3 hours, where 100 MB/s needs 23 minutes. The minimum covers what does not scale
    with bytes (resolving, the lock, many small files, the stall rule's retries of a slow
    request: 6 attempts of 30 s windows), and bounds how long a trickling small model keeps
    the others waiting: 10 minutes. A cut-off attempt loses nothing: the next one resumes.
    """

    #: Fixed seconds per attempt (None: scaled with the bytes to fetch).
    seconds: float | None = None
    off: bool = False

    #: The scaled bound's least value (seconds) and the rate it allows the bytes to fetch.
    MINIMUM: ClassVar[float] = 600.0
    FLOOR_RATE: ClassVar[int] = 4 * MiB

    def for_bytes(self, bytes_to_fetch: int) -> float | None:
        """Seconds an attempt that has ``bytes_to_fetch`` to fetch may run (None: no bound)."""
        if self.off:
            return None
        if self.seconds is not None:
            return self.seconds
        return max(self.MINIMUM, bytes_to_fetch / self.FLOOR_RATE)


@dataclass(frozen=True)
class AgentConfig:
    cache_dir: Path = Path(DEFAULT_CACHE_DIR)
    label_prefix: str = DEFAULT_LABEL_PREFIX
    startup_taint: str = DEFAULT_STARTUP_TAINT_KEY
    listen: str = DEFAULT_LISTEN
    concurrency: int = 16
    chunk_size: int = 64 * MiB
    #: The engine's stall rule (see TransferConfig): one trickling server cannot hold a sync slot.
    min_rate: int = 64 * 1024
    stall_timeout: float = 30.0
    parallel_models: int = 2
    verify_interval: float | None = None
    verify_read_rate: int | None = 200 * 1000 * 1000
    resolve_interval: float | None = 600.0
    #: A snapshot a moved branch left behind is deleted at the first sync this long after the
    #: move (a vLLM that read the old ref just before may still be opening its files); 0: at once.
    superseded_grace: float = 600.0
    retry_backoff: Backoff = field(default_factory=Backoff)
    #: The bound of each sync attempt (``syncDeadline``), and models' own (by model name).
    sync_deadline: SyncDeadline = field(default_factory=SyncDeadline)
    model_deadlines: Mapping[str, SyncDeadline] = field(default_factory=dict)
    min_free_space: int = 1 * GiB
    s3_endpoint_url: str | None = None
    #: ``caBundle``: the CA bundle of every model without its own (``ModelSpec.ca_bundle``) and
    #: of compile-cache pushes; first in :func:`prefetch.support.settings.ca_bundle`'s order.
    ca_bundle: str | None = None
    models: tuple[ModelSpec, ...] = ()
    #: Models whose files are read into the page cache once published (``warmPageCache``), and
    #: those of them whose readiness waits for that warm-up (``gateOnWarm``): by model name.
    warm_page_cache: frozenset[str] = frozenset()
    gate_on_warm: frozenset[str] = frozenset()
    warm_memory_share: float = DEFAULT_MEMORY_SHARE
    warm_read_rate: int | None = DEFAULT_READ_RATE
    #: ``compileCaches`` entries, by name: each is also in ``models`` (its source the entry's
    #: prefix + key), and a sync that finds no published cache there is not a failure.
    compile_caches: tuple[tuple[str, CacheKey], ...] = ()
    #: Every ``compileCaches`` entry as written; those without a ``gpuProduct`` are in
    #: ``models`` only once the node's GPU product is known (:meth:`with_gpu_product`).
    compile_cache_entries: tuple[CompileCacheEntry, ...] = ()
    #: Entries left out for want of a GPU product (no ``gpuProduct``, no node label).
    unkeyed_compile_caches: tuple[str, ...] = ()
    #: The file this came from (None when built in code), and a digest of its bytes.
    path: Path | None = None
    digest: str = ""

    def model(self, name: str) -> ModelSpec | None:
        for m in self.models:
            if m.name == name:
                return m
        return None

    def deadline_for(self, name: str) -> SyncDeadline:
        """The ``syncDeadline`` of model ``name``: its own, else the top-level one."""
        return self.model_deadlines.get(name, self.sync_deadline)

    def ca_bundle_for(self, name: str) -> str | None:
        """The ``caBundle`` of model ``name``: its own, else the top-level one."""
        spec = self.model(name)
        own = spec.ca_bundle if spec is not None else None
        return own or self.ca_bundle

    def with_gpu_product(self, gpu_product: str | None) -> AgentConfig:
        """This config with its compile cache entries keyed: those without a ``gpuProduct``
        of their own take ``gpu_product`` (the node label ``nvidia.com/gpu.product``)."""
        names = {e.name for e in self.compile_cache_entries}
        models = [m for m in self.models if m.name not in names]
        keyed: list[tuple[str, CacheKey]] = []
        unkeyed: list[str] = []
        for entry in self.compile_cache_entries:
            found = entry.spec(gpu_product)
            if found is None:
                unkeyed.append(entry.name)
                continue
            models.append(found[0])
            keyed.append((entry.name, found[1]))
        return replace(
            self,
            models=tuple(models),
            compile_caches=tuple(keyed),
            unkeyed_compile_caches=tuple(unkeyed),
        )

    def is_compile_cache(self, name: str) -> bool:
        return any(n == name for n, _key in self.compile_caches)

    def push_targets(self) -> list[PushTarget]:
        """The keyed ``compileCaches`` entries with ``push: true``."""
        keys = dict(self.compile_caches)
        out: list[PushTarget] = []
        for entry in self.compile_cache_entries:
            key, spec = keys.get(entry.name), self.model(entry.name)
            if entry.push_from is not None and key is not None and spec is not None:
                out.append(
                    PushTarget(entry.name, entry.push_from, str(spec.source), key, entry.extra_dirs)
                )
        return out

    def compile_cache_key(self, name: str) -> str:
        """The key (``v1-<hex>``) of compile cache ``name``; empty when it is not one."""
        return next((key.key for n, key in self.compile_caches if n == name), "")

    def warm_limits(self) -> WarmLimits:
        return WarmLimits(memory_share=self.warm_memory_share, read_rate=self.warm_read_rate)

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(
            concurrency=self.concurrency,
            chunk_size=self.chunk_size,
            buffer_size=min(MiB, self.chunk_size),
            retry=RetryPolicy(),
            min_rate=self.min_rate,
            stall_window=self.stall_timeout,
        )

    def with_overrides(
        self,
        *,
        cache_dir: Path | None = None,
        listen: str | None = None,
        gpu_product: str | None = None,
    ) -> AgentConfig:
        """This config with the command line's ``--cache-dir`` / ``--listen`` applied, and
        its compile caches keyed by ``gpu_product`` (``--gpu-product`` or the node's label)."""
        changes: dict[str, Any] = {}
        if cache_dir is not None:
            changes["cache_dir"] = cache_dir
        if listen is not None:
            parse_listen(listen, field_name="--listen")
            changes["listen"] = listen
        config = replace(self, **changes) if changes else self
        return config.with_gpu_product(gpu_product) if gpu_product else config


def load_config(path: str | Path) -> AgentConfig:
    """Read and validate the config file at ``path``."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{p}: config file not found",
            hint="pass --config (or PREFETCH_CONFIG) pointing at the agent's models.yaml",
        ) from exc
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the config file: {exc.strerror}") from exc
    return parse_config(data, path=p)


def parse_config(data: bytes | str, *, path: Path | None = None) -> AgentConfig:
    """Validate config text; errors name ``<file>: <field path>: <reason>``."""
    where = f"{path}: " if path is not None else ""
    raw = data.encode() if isinstance(data, str) else data
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}not valid YAML{at}: {problem}") from exc
    try:
        config = _parse(doc if doc is not None else {})
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc}", hint=exc.hint) from exc
    return replace(config, path=path, digest=hashlib.sha256(raw).hexdigest())


def spec_digest(spec: ModelSpec) -> str:
    """What decides a model's content: a changed digest means the cached copy is not it.

    Where the bytes come from (``spec.fetch_route``: mirrors, Hub fallback, proxy) is not
    content: a mirror serves the Hub's commit, checked against the Hub's ids, so adding or
    reordering mirrors keeps the copy ready (the agent confirms it with the new sources)."""
    text = "\0".join(
        [
            str(spec.source),
            spec.revision or "",
            ",".join(spec.include),
            ",".join(spec.exclude),
            spec.hf_repo or "",
            spec.hf_revision or "",
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- the file's keys (prefetch/agent/config_fields.py: one line a key) ---------------------------


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
          "s3 with hfRepo: the 40-hex commit to publish under"),
    Field("include", PATTERNS, "everything", "files to fetch (globs)"),
    Field("exclude", PATTERNS, "nothing", "files to leave out (globs)"),
    Field("required", BOOL, "true", "gates /readyz and the startup taint"),
    Field("hfRepo", HF_REPO, "", "s3/oci: publish in the Hub layout under this repo id"),
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


# -- the parser ----------------------------------------------------------------------------------


def _backoff(value: Any, path: str) -> Backoff:
    m = BACKOFF.check(value, path)
    initial = BACKOFF.get(m, "initial", path, Backoff.initial)
    cap = BACKOFF.get(m, "max", path, Backoff.max)
    if cap < initial:
        raise ConfigError(f"{path}.max: must not be shorter than {path}.initial")
    return Backoff(initial=initial, max=cap)


def _per_model(value: Any, path: str, key: str, default: T) -> dict[str, T]:
    """The models' own ``key`` by name, where set (the list was checked by :func:`_models`)."""
    out: dict[str, T] = {}
    for i, item in enumerate(value or ()):
        if key in item:
            out[item["name"]] = MODEL.get(item, key, f"{path}[{i}]", default)
    return out


def _models(value: Any, path: str) -> tuple[ModelSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of models, got {kind_of(value)}")
    specs: list[ModelSpec] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        spec = _model(item, where)
        if spec.name in seen:
            raise ConfigError(
                f"{where}.name: duplicate model name {spec.name!r} (also {path}[{seen[spec.name]}])"
            )
        seen[spec.name] = i
        specs.append(spec)
    _reject_shared_repos(specs, path)
    return tuple(specs)


def _reject_shared_repos(specs: list[ModelSpec], path: str) -> None:
    """One model per Hub repo: models sharing ``hub/models--org--name`` would undo each other.

    Every sync deletes what its own include/exclude patterns leave out of the snapshot, a moved
    branch prunes the snapshots and blobs no ref names, and eviction and re-verification work on
    the whole repo folder. Two models publishing into one repo (two ``hf://`` sources, or an S3
    mirror whose ``hfRepo`` is a Hub model's repo) therefore delete each other's files on every
    resolve and re-download them, both reporting ready. Different revisions do not make it safe:
    a branch can move onto the commit another model asked for, and then both write one snapshot.
    Repo ids are compared as the Hub does, ignoring case. Plain models cannot collide: each has
    its own ``models/<name>`` and names are unique.
    """
    owners: dict[str, int] = {}
    for i, spec in enumerate(specs):
        repo = spec.repo_id
        if repo is None:
            continue
        first = owners.setdefault(repo.casefold(), i)
        if first != i:
            raise ConfigError(
                f"{path}[{i}] ({spec.name}): same Hub repo as {path}[{first}] "
                f"({specs[first].name}) ({repo}); one model per repo: merge their include "
                "patterns",
                hint="list the repo once, with every file pattern its users need",
            )


def _model(value: Any, where: str) -> ModelSpec:
    m = MODEL.check(value, where)
    name = MODEL.get(m, "name", where, "")
    source = MODEL.get(m, "source", where, None)
    revision = MODEL.get(m, "revision", where, None)
    hf_repo = MODEL.get(m, "hfRepo", where, None)
    revision, hf_revision = publish_revision(source, hf_repo, revision)
    try:
        return ModelSpec(
            source=source,
            name=name,
            revision=revision,
            include=MODEL.get(m, "include", where, ()),
            exclude=MODEL.get(m, "exclude", where, ()),
            required=MODEL.get(m, "required", where, True),
            pin=MODEL.get(m, "pin", where, False),
            hf_repo=hf_repo,
            hf_revision=hf_revision,
            proxy=MODEL.get(m, "proxy", where, None),
            ca_bundle=_ca_bundle(MODEL.get(m, "caBundle", where, None), f"{where}.caBundle"),
            mirrors=MODEL.get(m, "mirrors", where, ()),
            hub_fallback=MODEL.get(m, "hubFallback", where, True),
        )
    except SpecError as exc:
        raise render_spec_error(exc, f"{where}.") from exc


def render_spec_error(exc: SpecError, prefix: str) -> ConfigError:
    """``exc`` as the config file's users know its fields (``hfRepo``), after ``prefix``."""
    return ConfigError(exc.render(_SPEC_KEYS, prefix=prefix), hint=exc.hint)


def _ca_bundle(value: str | None, path: str) -> str | None:
    """A ``caBundle``: a PEM file of CA certificates that exists (checked at load, so a wrong
    path is the config's error, not every sync's); None: none."""
    return None if not value else settings.check_ca_bundle(value, path)


def _s3(value: Any, path: str) -> str | None:
    if value is None:
        return None
    url: str | None = S3.get(S3.check(value, path), "endpointUrl", path, None)
    return url


def _parse(doc: Any) -> AgentConfig:
    return _parse_fields(doc).with_gpu_product(None)


def _parse_fields(doc: Any) -> AgentConfig:
    m = mapping(doc, "")
    check_keys(m, TOP.keys, "")
    d = AgentConfig()

    def top(key: str, default: Any) -> Any:
        return TOP.get(m, key, "", default)

    verify_rate = top("verifyReadRate", d.verify_read_rate or 0)
    warm_rate = top("warmReadRate", d.warm_read_rate or 0)
    models = get(m, "models", "", _models, ())
    caches = get(m, "compileCaches", "", _compile_caches, ())
    taken = {spec.name for spec in models}
    for i, entry in enumerate(caches):
        if entry.name in taken:
            raise ConfigError(f"compileCaches[{i}].name: {entry.name!r} is also a model's name")
    listed = m.get("models") if models else None
    ca_bundle = top("caBundle", None)
    return AgentConfig(
        cache_dir=Path(top("cacheDir", str(d.cache_dir))),
        label_prefix=top("labelPrefix", d.label_prefix),
        startup_taint=top("startupTaint", d.startup_taint),
        listen=top("listen", d.listen),
        concurrency=top("concurrency", d.concurrency),
        chunk_size=top("chunkSize", d.chunk_size),
        min_rate=top("minRate", d.min_rate),
        stall_timeout=top("stallTimeout", d.stall_timeout),
        parallel_models=top("parallelModels", d.parallel_models),
        verify_interval=top("verifyInterval", d.verify_interval),
        verify_read_rate=verify_rate or None,
        resolve_interval=top("resolveInterval", d.resolve_interval),
        superseded_grace=top("supersededGrace", d.superseded_grace) or 0.0,
        retry_backoff=get(m, "retryBackoff", "", _backoff, d.retry_backoff),
        sync_deadline=top("syncDeadline", d.sync_deadline),
        model_deadlines=_per_model(listed, "models", "syncDeadline", SyncDeadline()),
        min_free_space=top("minFreeSpace", d.min_free_space),
        s3_endpoint_url=get(m, "s3", "", _s3, None),
        models=models,
        compile_cache_entries=caches,
        warm_page_cache=frozenset(_flagged(m, ("warmPageCache", "gateOnWarm"))),
        gate_on_warm=frozenset(_flagged(m, ("gateOnWarm",))),
        warm_memory_share=top("warmMemoryShare", d.warm_memory_share),
        warm_read_rate=warm_rate or None,
        ca_bundle=_ca_bundle(ca_bundle, "caBundle"),
    )


def _flagged(doc: Mapping[str, Any], keys: tuple[str, ...]) -> list[str]:
    """The names of the models (already validated) with any of the boolean ``keys`` true."""
    entries = doc.get("models") or []
    return [
        str(e["name"])
        for i, e in enumerate(entries)
        if any(MODEL.get(e, k, f"models[{i}]", False) for k in keys)
    ]


def _compile_caches(value: Any, path: str) -> tuple[CompileCacheEntry, ...]:
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


#: The keys of each mapping, as the chart's test and older callers know them.
_TOP_KEYS = TOP.keys
_MODEL_KEYS = MODEL.keys
_COMPILE_CACHE_KEYS = COMPILE_CACHE.keys
_BACKOFF_KEYS = BACKOFF.keys
_S3_KEYS = S3.keys
