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
        caBundle: /etc/ssl/hub-ca.pem     # this model's CA bundle (wins over the top-level one)
        mirrors: [s3://bucket/hf/org/name/]   # hf only: `prefetch mirror` prefixes tried first,
        hubFallback: true                 # in order; then the Hub unless this is false
        syncDeadline: 2h                  # this model's attempts (default: the top-level one)
        warmPageCache: false              # read the files into the page cache once published
        gateOnWarm: false                 # ready only after that warm-up (implies warmPageCache)

One model per Hub repo: two models that publish into the same ``hub/models--org--name`` (two
``hf://`` sources of one repo, whatever their revisions, or an S3 mirror whose ``hfRepo`` is
another model's repo) are rejected, naming both; merge their include patterns into one model.
A model's ``pin`` is written into the cache's records each time the config loads, so pinning (or
unpinning) a model that is already cached takes effect at once, with no download.

Every error is a :class:`~prefetch.errors.ConfigError` whose message starts with the file and the
field path (``models[1].source: ...``). Unknown keys and duplicate model names are rejected.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml

from prefetch import settings
from prefetch.compile_cache import EXTRA_DIRS, CacheKey
from prefetch.constants import DEFAULT_LABEL_PREFIX, DEFAULT_LISTEN, DEFAULT_STARTUP_TAINT_KEY
from prefetch.errors import ConfigError, PrefetchError
from prefetch.retry import RetryPolicy
from prefetch.spec import (
    ModelSpec,
    SourceURI,
    SpecError,
    parse_source_uri,
    publish_revision,
    validate_name,
)
from prefetch.transfer import TransferConfig
from prefetch.units import parse_duration, parse_size
from prefetch.warm import DEFAULT_MEMORY_SHARE, DEFAULT_READ_RATE, WarmLimits

DEFAULT_CONFIG_PATH = "/etc/model-prefetch/models.yaml"
DEFAULT_CACHE_DIR = "/var/cache/model-prefetch"
MiB = 1024 * 1024
GiB = 1024 * MiB

_TOP_KEYS = (
    "cacheDir",
    "labelPrefix",
    "startupTaint",
    "listen",
    "concurrency",
    "chunkSize",
    "minRate",
    "stallTimeout",
    "parallelModels",
    "verifyInterval",
    "verifyReadRate",
    "resolveInterval",
    "supersededGrace",
    "retryBackoff",
    "syncDeadline",
    "minFreeSpace",
    "warmMemoryShare",
    "warmReadRate",
    "s3",
    "caBundle",
    "models",
    "compileCaches",
)
_MODEL_KEYS = (
    "name", "source", "revision", "include", "exclude", "required", "hfRepo", "pin", "proxy",
    "mirrors", "hubFallback", "syncDeadline", "warmPageCache", "gateOnWarm", "caBundle",
)  # fmt: skip
_COMPILE_CACHE_KEYS = (
    "name", "source", "target", "vllm", "model", "revision", "tensorParallelSize", "gpuProduct",
    "torch", "cuda", "required", "push", "pushFrom", "extraDirs",
)  # fmt: skip
_BACKOFF_KEYS = ("initial", "max")
_S3_KEYS = ("endpointUrl",)
#: The keys of a model in the file, by the ModelSpec field each sets (the others match).
_SPEC_KEYS = {"hf_repo": "hfRepo", "hf_revision": "revision", "hub_fallback": "hubFallback"}
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
T = TypeVar("T")
D = TypeVar("D")


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
    #: ``extraDirs``: the opt-in JIT caches (:data:`~prefetch.compile_cache.EXTRA_DIRS`) kept
    #: beside vLLM's under its cache root, published with it under the same key.
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
    #: of compile-cache pushes; first in :func:`prefetch.settings.ca_bundle`'s order.
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


def parse_listen(value: str, *, field_name: str = "listen") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port)."""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\[\]]*):(\d+)", value.strip())
    if m is None:
        raise ConfigError(f"{field_name}: {value!r} is not HOST:PORT (e.g. 0.0.0.0:8090)")
    host = m.group(1) if m.group(1) is not None else m.group(3)
    port = int(m.group(2) or m.group(4))
    if not 0 <= port <= 65535:
        raise ConfigError(f"{field_name}: port {port} is out of range")
    return host or "0.0.0.0", port


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


# -- the parser ----------------------------------------------------------------------------------


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where or 'the file'}: expected a mapping, got {_kind(value)}")
    return value


def _check_keys(value: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in value:
        if key not in known:
            path = f"{where}.{key}" if where else str(key)
            raise ConfigError(f"{path}: unknown key (known keys: {', '.join(known)})")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }.get(type(value), type(value).__name__)


def _get(
    value: Mapping[str, Any], key: str, where: str, convert: Callable[[Any, str], T], default: D
) -> T | D:
    path = f"{where}.{key}" if where else key
    if key not in value:
        return default
    try:
        return convert(value[key], path)
    except ConfigError as exc:
        msg = str(exc)
        if not msg.startswith(path):
            msg = f"{path}: {msg}"
        raise ConfigError(msg, hint=exc.hint) from exc


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{path}: expected a non-empty string, got {_kind(value)}")
    return value.strip()


def _opt_str(value: Any, path: str) -> str | None:
    return None if value is None else _str(value, path)


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {_kind(value)} {value!r}")
    return value


def _int_range(lo: int, hi: int) -> Callable[[Any, str], int]:
    def convert(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected a whole number, got {_kind(value)} {value!r}")
        if not lo <= value <= hi:
            raise ConfigError(f"{path}: must be between {lo} and {hi}, got {value}")
        return value

    return convert


def _size(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{path}: expected a size like 1GiB, got {_kind(value)}")
    return parse_size(value, field=path)


def _duration(value: Any, path: str) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str | None):
        raise ConfigError(f"{path}: expected a duration like 10m, got {_kind(value)}")
    return parse_duration(value, field=path)


def _positive_duration(value: Any, path: str) -> float:
    seconds = _duration(value, path)
    if seconds is None or seconds <= 0:
        raise ConfigError(f"{path}: must be a positive duration like 10s, got {value!r}")
    return seconds


def _patterns(value: Any, path: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of glob patterns, got {_kind(value)}")
    for i, p in enumerate(value):
        if not isinstance(p, str) or not p:
            raise ConfigError(f"{path}[{i}]: expected a non-empty glob pattern, got {_kind(p)}")
    return tuple(value)


def _label_prefix(value: Any, path: str) -> str:
    text = _str(value, path)
    if len(text) > 253 or not _DNS_SUBDOMAIN.match(text):
        raise ConfigError(
            f"{path}: {text!r} is not a DNS subdomain (lowercase a-z, 0-9, '-' and '.')"
        )
    return text


def _taint_key(value: Any, path: str) -> str:
    text = _str(value, path)
    prefix, _, name = text.rpartition("/")
    if (prefix and not _DNS_SUBDOMAIN.match(prefix)) or not _LABEL_NAME.match(name):
        raise ConfigError(f"{path}: {text!r} is not a taint key like example.com/warming")
    return text


def _listen(value: Any, path: str) -> str:
    text = _str(value, path)
    parse_listen(text, field_name=path)
    return text


def _backoff(value: Any, path: str) -> Backoff:
    m = _mapping(value, path)
    _check_keys(m, _BACKOFF_KEYS, path)
    initial = _get(m, "initial", path, _positive_duration, Backoff.initial)
    cap = _get(m, "max", path, _positive_duration, Backoff.max)
    if cap < initial:
        raise ConfigError(f"{path}.max: must not be shorter than {path}.initial")
    return Backoff(initial=initial, max=cap)


def _sync_deadline(value: Any, path: str) -> SyncDeadline:
    """``auto`` (scaled with the model), a positive duration, or ``off``/0 (no bound)."""
    if value == "auto":
        return SyncDeadline()
    seconds = _duration(value, path)
    return SyncDeadline(off=True) if seconds is None else SyncDeadline(seconds=seconds)


def _model_deadlines(value: Any, path: str) -> dict[str, SyncDeadline]:
    """The models' own ``syncDeadline``s by name (the list was checked by :func:`_models`)."""
    out: dict[str, SyncDeadline] = {}
    for i, item in enumerate(value or ()):
        if "syncDeadline" in item:
            where = f"{path}[{i}]"
            out[_str(item["name"], f"{where}.name")] = _get(
                item, "syncDeadline", where, _sync_deadline, SyncDeadline()
            )
    return out


def _models(value: Any, path: str) -> tuple[ModelSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of models, got {_kind(value)}")
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
    m = _mapping(value, where)
    _check_keys(m, _MODEL_KEYS, where)
    if "name" not in m:
        raise ConfigError(f"{where}.name: missing (a DNS label, used in the node label)")
    if "source" not in m:
        raise ConfigError(f"{where}.source: missing (s3://bucket/prefix or hf://org/name)")
    name = _get(m, "name", where, _str, "")
    validate_name(name, field_name=f"{where}.name")
    source = _get(m, "source", where, lambda v, p: parse_source_uri(_str(v, p)), None)
    assert source is not None
    revision = _get(m, "revision", where, _opt_str, None)
    hf_repo = _get(m, "hfRepo", where, _opt_str, None)
    revision, hf_revision = publish_revision(source, hf_repo, revision)
    try:
        return ModelSpec(
            source=source,
            name=name,
            revision=revision,
            include=_get(m, "include", where, _patterns, ()),
            exclude=_get(m, "exclude", where, _patterns, ()),
            required=_get(m, "required", where, _bool, True),
            pin=_get(m, "pin", where, _bool, False),
            hf_repo=hf_repo,
            hf_revision=hf_revision,
            proxy=_get(m, "proxy", where, _proxy, None),
            ca_bundle=_get(m, "caBundle", where, _ca_bundle, None),
            mirrors=_get(m, "mirrors", where, _mirrors, ()),
            hub_fallback=_get(m, "hubFallback", where, _bool, True),
        )
    except SpecError as exc:
        raise render_spec_error(exc, f"{where}.") from exc


def render_spec_error(exc: SpecError, prefix: str) -> ConfigError:
    """``exc`` as the config file's users know its fields (``hfRepo``), after ``prefix``."""
    return ConfigError(exc.render(_SPEC_KEYS, prefix=prefix), hint=exc.hint)


def _proxy(value: Any, path: str) -> str | None:
    """A model's ``proxy``: a URL, or ``none``/"" for direct; null: the environment's."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected a proxy URL or none, got {_kind(value)}")
    return value


def _ca_bundle(value: Any, path: str) -> str | None:
    """A ``caBundle``: a PEM file of CA certificates that exists (checked now); null: none."""
    if value is None:
        return None
    return settings.check_ca_bundle(_str(value, path), path)


def _mirrors(value: Any, path: str) -> tuple[SourceURI, ...]:
    """A model's ``mirrors``: a list of s3:// URIs (one string: a list of one)."""
    if isinstance(value, str):
        value = [value]
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of s3:// URIs, got {_kind(value)}")
    return tuple(_source_uri(v, f"{path}[{i}]") for i, v in enumerate(value))


def _source_uri(value: Any, path: str) -> SourceURI:
    try:
        return parse_source_uri(_str(value, path))
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(path) else f"{path}: {message}") from exc


def _s3(value: Any, path: str) -> str | None:
    if value is None:
        return None
    m = _mapping(value, path)
    _check_keys(m, _S3_KEYS, path)
    url = _get(m, "endpointUrl", path, _opt_str, None)
    if url is not None and not re.match(r"^https?://[^/\s]+", url):
        raise ConfigError(f"{path}.endpointUrl: {url!r} is not an http(s) URL")
    return url


def _parse(doc: Any) -> AgentConfig:
    return _parse_fields(doc).with_gpu_product(None)


def _parse_fields(doc: Any) -> AgentConfig:
    m = _mapping(doc, "")
    _check_keys(m, _TOP_KEYS, "")
    d = AgentConfig()
    verify_rate = _get(m, "verifyReadRate", "", _size, d.verify_read_rate or 0)
    warm_rate = _get(m, "warmReadRate", "", _size, d.warm_read_rate or 0)
    models = _get(m, "models", "", _models, ())
    caches = _get(m, "compileCaches", "", _compile_caches, ())
    taken = {spec.name for spec in models}
    for i, entry in enumerate(caches):
        if entry.name in taken:
            raise ConfigError(f"compileCaches[{i}].name: {entry.name!r} is also a model's name")
    return AgentConfig(
        cache_dir=Path(_get(m, "cacheDir", "", _str, str(d.cache_dir))),
        label_prefix=_get(m, "labelPrefix", "", _label_prefix, d.label_prefix),
        startup_taint=_get(m, "startupTaint", "", _taint_key, d.startup_taint),
        listen=_get(m, "listen", "", _listen, d.listen),
        concurrency=_get(m, "concurrency", "", _int_range(1, 512), d.concurrency),
        chunk_size=_get(m, "chunkSize", "", _chunk_size, d.chunk_size),
        min_rate=_get(m, "minRate", "", _size, d.min_rate),
        stall_timeout=_get(m, "stallTimeout", "", _positive_duration, d.stall_timeout),
        parallel_models=_get(m, "parallelModels", "", _int_range(1, 16), d.parallel_models),
        verify_interval=_get(m, "verifyInterval", "", _duration, d.verify_interval),
        verify_read_rate=verify_rate or None,
        resolve_interval=_get(m, "resolveInterval", "", _duration, d.resolve_interval),
        superseded_grace=_get(m, "supersededGrace", "", _duration, d.superseded_grace) or 0.0,
        retry_backoff=_get(m, "retryBackoff", "", _backoff, d.retry_backoff),
        sync_deadline=_get(m, "syncDeadline", "", _sync_deadline, d.sync_deadline),
        model_deadlines=_get(m, "models", "", _model_deadlines, {}) if models else {},
        min_free_space=_get(m, "minFreeSpace", "", _size, d.min_free_space),
        s3_endpoint_url=_get(m, "s3", "", _s3, None),
        ca_bundle=_get(m, "caBundle", "", _ca_bundle, None),
        models=models,
        compile_cache_entries=caches,
        warm_page_cache=frozenset(_flagged(m, ("warmPageCache", "gateOnWarm"))),
        gate_on_warm=frozenset(_flagged(m, ("gateOnWarm",))),
        warm_memory_share=_get(m, "warmMemoryShare", "", _share, d.warm_memory_share),
        warm_read_rate=warm_rate or None,
    )


def _flagged(doc: Mapping[str, Any], keys: tuple[str, ...]) -> list[str]:
    """The names of the models (already validated) with any of the boolean ``keys`` true."""
    entries = doc.get("models") or []
    return [
        str(e["name"])
        for i, e in enumerate(entries)
        if any(_get(e, k, f"models[{i}]", _bool, False) for k in keys)
    ]


def _compile_caches(value: Any, path: str) -> tuple[CompileCacheEntry, ...]:
    """``compileCaches``: each entry a plain model at ``source`` + the entry's key + ``/``."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of compile caches, got {_kind(value)}")
    out: list[CompileCacheEntry] = []
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        e = _mapping(item, where)
        _check_keys(e, _COMPILE_CACHE_KEYS, where)
        for needed in ("name", "source", "vllm", "model", "revision"):
            if needed not in e:
                raise ConfigError(f"{where}.{needed}: missing")
        if _get(e, "target", where, _str, "vllm") != "vllm":
            raise ConfigError(f"{where}.target: only vllm is supported")
        gpu = _get(e, "gpuProduct", where, _opt_str, None)
        try:
            key = CacheKey(
                vllm=_get(e, "vllm", where, _str, ""),
                model=_get(e, "model", where, _str, ""),
                revision=_get(e, "revision", where, _str, ""),
                tensor_parallel=_get(e, "tensorParallelSize", where, _int_range(1, 1024), 1),
                gpu_product=gpu or _NODE_GPU,
                torch=_get(e, "torch", where, _opt_str, None),
                cuda=_get(e, "cuda", where, _opt_str, None),
            )
        except PrefetchError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
        source = _get(e, "source", where, _source_uri, None)
        assert source is not None
        if source.scheme != "s3":
            raise ConfigError(f"{where}.source: expected s3://bucket/prefix/")
        name = _get(e, "name", where, _str, "")
        validate_name(name, field_name=f"{where}.name")
        required = _get(e, "required", where, _bool, False)
        push_from = _get(e, "pushFrom", where, _opt_str, None)
        if not _get(e, "push", where, _bool, False):
            push_from = None
        elif not push_from or not push_from.startswith("/"):
            raise ConfigError(
                f"{where}.pushFrom: push: true needs the absolute path of the directory the "
                "vLLM pod writes this compile cache into (its VLLM_CACHE_ROOT on the host)"
            )
        where_from = Path(push_from) if push_from else None
        extra = _get(e, "extraDirs", where, _extra_dirs, ())
        out.append(
            CompileCacheEntry(name, str(source), key, bool(gpu), required, where_from, extra)
        )
    return tuple(out)


def _extra_dirs(value: Any, path: str) -> tuple[str, ...]:
    """``extraDirs``: names from :data:`~prefetch.compile_cache.EXTRA_DIRS`, each once."""
    if not isinstance(value, list):
        raise ConfigError(
            f"{path}: expected a list like [flashinfer, deepgemm], got {_kind(value)}"
        )
    for i, name in enumerate(value):
        if name not in EXTRA_DIRS:
            known = ", ".join(sorted(EXTRA_DIRS))
            raise ConfigError(f"{path}[{i}]: {name!r} is not one of {known}")
    if len(set(value)) != len(value):
        raise ConfigError(f"{path}: a directory is named twice")
    return tuple(value)


def _share(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(f"{path}: expected a number in (0, 1], got {value!r}")
    return float(value)


def _chunk_size(value: Any, path: str) -> int:
    size = _size(value, path)
    if size < 64 * 1024:
        raise ConfigError(f"{path}: must be at least 64KiB, got {value!r}")
    return size
