"""The agent's config as frozen values (:class:`AgentConfig` and the values it holds: the
backoff, a sync's deadline, the compile cache entries), with what the agent asks of them.
:func:`prefetch.agent.config.parse_config` makes one from the file."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from prefetch.agent.config_checks import parse_listen
from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.warmup import DEFAULT_MEMORY_SHARE, DEFAULT_READ_RATE, WarmLimits
from prefetch.publish.compile_cache import CacheKey
from prefetch.support.constants import (
    DEFAULT_LABEL_PREFIX,
    DEFAULT_LISTEN,
    DEFAULT_STARTUP_TAINT_KEY,
)

__all__ = [
    "DEFAULT_CACHE_DIR",
    "DEFAULT_CONFIG_PATH",
    "AgentConfig",
    "Backoff",
    "CompileCacheEntry",
    "PushTarget",
    "SyncDeadline",
]

DEFAULT_CONFIG_PATH = "/etc/model-prefetch/models.yaml"
DEFAULT_CACHE_DIR = "/var/cache/model-prefetch"
MiB = 1024 * 1024
GiB = 1024 * MiB


@dataclass(frozen=True)
class Backoff:
    """Per-model delay after failed syncs: ``initial * 2**(failures-1)``, at most ``max``."""

    initial: float = 10.0
    max: float = 600.0

    def delay(self, failures: int) -> float:
        return min(self.max, self.initial * 2.0 ** max(failures - 1, 0))


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
