"""The agent's Prometheus metrics, all in one place, on a registry the caller owns.

Names start with ``model_prefetch_``; counters end in ``_total``; units are ``_bytes`` and
``_seconds``; labels are low-cardinality only (``model``, ``source`` = s3|hf, ``reason``,
``state``, ``result``), never a file or a chunk. The engine feeds the transfer metrics through
:class:`MetricsSink`, a :class:`~prefetch.pipeline.progress.ProgressSink`. The metrics (prefix left
out):

* transfer, by model and source: ``downloaded_bytes_total``, ``files_downloaded_total``,
  ``chunks_downloaded_total``, ``retries_total``; ``download_rate_bytes_per_second`` (model, a
  10 s window); ``checksum_failures_total`` (model, reason = download | reverify: caught while
  fetching, or found at rest).
* per model: ``model_state`` (state; 1 = current), ``model_source`` (source_kind = mirror | hub
  | s3; 1 = what served the last sync), ``model_ready``, ``model_required``,
  ``model_size_bytes``, ``model_remaining_bytes``, ``sync_duration_seconds`` (histogram),
  ``sync_failures_total`` (reason), ``last_success_timestamp_seconds``, ``verifications_total``
  (result = ok | failed), ``sync_phase_duration_seconds`` (histogram by phase, one of
  :data:`prefetch.pipeline.sync.SYNC_PHASES`, for each sync that changed the cache),
  ``warmups_total`` (result: a :class:`prefetch.pipeline.warmup.WarmReport` state),
  ``warm_duration_seconds`` and ``warm_bytes`` (the last warm-up).
* the node and its cache: ``all_required_ready``, ``cache_free_bytes``, ``cache_used_bytes``,
  ``evictions_total`` (reason = disk_pressure | gc), ``evicted_bytes_total`` (reason),
  ``node_gate_errors_total``, ``node_progress_writes_total`` (result = ok | failed),
  ``time_to_ready_seconds`` (histogram) and ``ready_after_seconds`` (gauge), both by ``since`` =
  node_creation | agent_start, observed once per process when every required model is first
  ready.
* the agent: ``config_reload_failures_total``, ``config_last_reload_successful``,
  ``events_dropped_total`` (reason = rate_limited | queue_full), ``event_errors_total``; and the
  process collector's ``process_*``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector

from prefetch.agent.metric_families import (
    CacheMetrics,
    HealthMetrics,
    ModelMetrics,
    NodeMetrics,
    SyncMetrics,
    TransferMetrics,
    WarmMetrics,
)
from prefetch.pipeline.sync import SYNC_PHASES
from prefetch.support.constants import METRICS_PREFIX
from prefetch.support.units import format_bytes

log = logging.getLogger(__name__)

#: Every state a model can be in (``model_prefetch_model_state{state=...}``).
MODEL_STATES = ("pending", "syncing", "updating", "verifying", "ready", "failed")
#: The kinds of source a sync can be served by (``ModelSpec.source_kind``): a bounded label.
SOURCE_KINDS = ("mirror", "hub", "s3")
RATE_WINDOW = 10.0
PROGRESS_LOG_INTERVAL = 30.0


class AgentMetrics:
    """Every metric of the agent, by family, on ``registry``; and the download rate windows."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        rate_window: float = RATE_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        p, r = METRICS_PREFIX + "_", registry
        self._adopt(
            TransferMetrics.build(p, r, rate_window),
            ModelMetrics.build(p, r),
            SyncMetrics.build(p, r),
            WarmMetrics.build(p, r),
            CacheMetrics.build(p, r),
            NodeMetrics.build(p, r),
            HealthMetrics.build(p, r),
        )
        with contextlib.suppress(ValueError):  # already there (the global registry has one)
            ProcessCollector(registry=r)
        self._window = rate_window
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: dict[str, collections.deque[tuple[int, int]]] = {}
        self.config_last_reload_successful.set(1)

    def _adopt(
        self,
        t: TransferMetrics,
        m: ModelMetrics,
        s: SyncMetrics,
        w: WarmMetrics,
        c: CacheMetrics,
        n: NodeMetrics,
        h: HealthMetrics,
    ) -> None:
        """Each family's metrics as attributes of their own (the names the agent uses)."""
        # one line a metric: a flat list of names, kept long
        self.downloaded_bytes = t.downloaded_bytes
        self.download_rate = t.download_rate
        self.files_downloaded = t.files_downloaded
        self.chunks_downloaded = t.chunks_downloaded
        self.retries = t.retries
        self.checksum_failures = t.checksum_failures
        self.model_state = m.model_state
        self.model_source = m.model_source
        self.model_ready = m.model_ready
        self.model_required = m.model_required
        self.model_size = m.model_size
        self.remaining_bytes = m.remaining_bytes
        self.sync_duration = s.sync_duration
        self.sync_failures = s.sync_failures
        self.last_success = s.last_success
        self.verifications = s.verifications
        self.sync_phase_duration = s.sync_phase_duration
        self.warmups = w.warmups
        self.warm_duration = w.warm_duration
        self.warm_bytes = w.warm_bytes
        self.cache_free = c.cache_free
        self.cache_used = c.cache_used
        self.evictions = c.evictions
        self.evicted_bytes = c.evicted_bytes
        self.all_required_ready = n.all_required_ready
        self.gate_errors = n.gate_errors
        self.progress_writes = n.progress_writes
        self.time_to_ready = n.time_to_ready
        self.ready_after = n.ready_after
        self.config_reload_failures = h.config_reload_failures
        self.config_last_reload_successful = h.config_last_reload_successful
        self.events_dropped = h.events_dropped
        self.event_errors = h.event_errors

    # -- per model ---------------------------------------------------------------------------

    def sink(self, model: str, source: str) -> MetricsSink:
        """A ProgressSink for one sync of ``model`` from a ``source`` (s3|hf) backend."""
        return MetricsSink(self, model, source)

    def set_state(self, model: str, state: str, *, ready: bool, required: bool) -> None:
        for s in MODEL_STATES:
            self.model_state.labels(model, s).set(1 if s == state else 0)
        self.model_ready.labels(model).set(1 if ready else 0)
        self.model_required.labels(model).set(1 if required else 0)

    def forget_model(self, model: str) -> None:
        """Drop the gauges of a model that left the config (counters stay, as counters do)."""
        for gauge in (
            self.model_ready,
            self.model_required,
            self.model_size,
            self.remaining_bytes,
            self.last_success,
            self.download_rate,
            self.warm_duration,
            self.warm_bytes,
        ):
            _remove(gauge, model)
        for s in MODEL_STATES:
            _remove(self.model_state, model, s)
        for kind in SOURCE_KINDS:
            _remove(self.model_source, model, kind)
        for phase in SYNC_PHASES:
            with contextlib.suppress(KeyError):
                self.sync_phase_duration.remove(model, phase)
        with self._lock:
            self._samples.pop(model, None)

    def set_source(self, model: str, kind: str) -> None:
        """The kind of source (one of :data:`SOURCE_KINDS`) that served ``model``'s last sync."""
        for k in SOURCE_KINDS:
            self.model_source.labels(model, k).set(1 if k == kind else 0)

    def observe_phases(self, model: str, timings: dict[str, float]) -> None:
        """One sync's phase durations (``SyncTimings.to_json()``)."""
        for phase in SYNC_PHASES:
            self.sync_phase_duration.labels(model, phase).observe(timings.get(phase, 0.0))

    def observe_warm(self, model: str, result: str, seconds: float, nbytes: int) -> None:
        """One page-cache warm-up (:class:`prefetch.pipeline.warmup.WarmReport`)."""
        self.warmups.labels(model, result).inc()
        self.warm_duration.labels(model).set(seconds)
        self.warm_bytes.labels(model).set(nbytes)

    def observe_time_to_ready(self, since: str, seconds: float) -> None:
        """A time to ready (``since`` one of :data:`prefetch.agent.metric_families.READY_SINCE`);
        called once per process."""
        self.time_to_ready.labels(since).observe(seconds)
        self.ready_after.labels(since).set(seconds)

    def add_bytes(self, model: str, n: int) -> None:
        second = int(self._clock())
        with self._lock:
            window = self._samples.setdefault(model, collections.deque())
            if window and window[-1][0] == second:
                window[-1] = (second, window[-1][1] + n)
            else:
                window.append((second, n))

    def rate(self, model: str) -> float:
        """Bytes per second over the last ``rate_window`` seconds."""
        now = self._clock()
        with self._lock:
            window = self._samples.get(model)
            if not window:
                return 0.0
            while window and window[0][0] <= now - self._window - 1:
                window.popleft()
            total = sum(n for s, n in window if s > now - self._window - 1)
        return total / self._window

    def update_rates(self) -> None:
        with self._lock:
            models = list(self._samples)
        for model in models:
            self.download_rate.labels(model).set(self.rate(model))


def _remove(metric: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):
        metric.remove(*labels)


class MetricsSink:
    """Feeds one sync's progress into the metrics; thread-safe, cheap per call.

    Also logs one progress line every ``PROGRESS_LOG_INTERVAL`` seconds while bytes flow, and
    keeps ``total``/``done`` so the agent can say how much is left.
    """

    def __init__(self, metrics: AgentMetrics, model: str, source: str) -> None:
        self.model = model
        self._m = metrics
        self._bytes = metrics.downloaded_bytes.labels(model, source)
        self._files = metrics.files_downloaded.labels(model, source)
        self._chunks = metrics.chunks_downloaded.labels(model, source)
        self._retries = metrics.retries.labels(model, source)
        #: bound on start(): a model that never starts shows none
        self._remaining: Gauge | None = None
        self._lock = threading.Lock()
        self.total = 0
        self.done = 0
        self.files_total = 0
        self.files_done = 0
        self._last_log = time.monotonic()

    @property
    def remaining(self) -> int:
        return max(self.total - self.done, 0)

    def start(self, model: str, total_bytes: int, total_files: int) -> None:
        with self._lock:
            self.total, self.done = total_bytes, 0
            self.files_total, self.files_done = total_files, 0
        self._remaining = self._m.remaining_bytes.labels(self.model)
        self._remaining.set(total_bytes)

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            remaining = max(self.total - self.done, 0)
        self._bytes.inc(nbytes)
        if self._remaining is not None:
            self._remaining.set(remaining)
        self._m.add_bytes(self.model, nbytes)
        now = time.monotonic()
        if now - self._last_log >= PROGRESS_LOG_INTERVAL:
            self._last_log = now
            rate = self._m.rate(self.model)
            log.info(
                "%s: %s of %s downloaded, %s/s",
                self.model,
                format_bytes(self.done),
                format_bytes(self.total),
                format_bytes(rate),
                extra={
                    "model": self.model,
                    "phase": "download",
                    "bytes": self.done,
                    "rate": round(rate),
                },
            )

    def chunk_done(self) -> None:
        self._chunks.inc()

    def file_done(self, path: str, size: int) -> None:
        with self._lock:
            self.files_done += 1
        self._files.inc()

    def retry(self, reason: str) -> None:
        self._retries.inc()

    def checksum_failure(self, path: str) -> None:
        self._m.checksum_failures.labels(self.model, "download").inc()

    def finish(self) -> None:
        if self._remaining is not None:
            self._remaining.set(self.remaining)
