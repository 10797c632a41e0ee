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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from prefetch.pipeline.sync import SYNC_PHASES
from prefetch.support.constants import METRICS_PREFIX
from prefetch.support.units import format_bytes

log = logging.getLogger(__name__)

#: Every state a model can be in (``model_prefetch_model_state{state=...}``).
MODEL_STATES = ("pending", "syncing", "updating", "verifying", "ready", "failed")
#: The kinds of source a sync can be served by (``ModelSpec.source_kind``): a bounded label.
SOURCE_KINDS = ("mirror", "hub", "s3")
#: Sync durations from seconds (up to date) to many hours (a large model over a slow link).
SYNC_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 57600)
#: Phase and time-to-ready durations: a tenth of a second (a resolve) to four hours (a cold
#: start over a slow link); longer lands in +Inf, which an alert should catch long before.
PHASE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400)
#: What a time to ready is counted from (``since`` label).
READY_SINCE = ("node_creation", "agent_start")
RATE_WINDOW = 10.0
PROGRESS_LOG_INTERVAL = 30.0


class AgentMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        rate_window: float = RATE_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        p = METRICS_PREFIX + "_"
        r = registry
        self.downloaded_bytes = Counter(
            p + "downloaded_bytes",
            "Bytes downloaded from sources.",
            ["model", "source"],
            registry=r,
        )
        self.download_rate = Gauge(
            p + "download_rate_bytes_per_second",
            f"Download rate over the last {rate_window:.0f} seconds.",
            ["model"],
            registry=r,
        )
        self.files_downloaded = Counter(
            p + "files_downloaded",
            "Files downloaded and verified.",
            ["model", "source"],
            registry=r,
        )
        self.chunks_downloaded = Counter(
            p + "chunks_downloaded",
            "Ranged requests the engine completed (a run of chunks, or a small file).",
            ["model", "source"],
            registry=r,
        )
        self.retries = Counter(
            p + "retries",
            "Ranged reads retried after a transient failure.",
            ["model", "source"],
            registry=r,
        )
        self.checksum_failures = Counter(
            p + "checksum_failures",
            "Files whose bytes did not match the checksum (download: while fetching; "
            "reverify: at rest).",
            ["model", "reason"],
            registry=r,
        )
        self.model_state = Gauge(
            p + "model_state", "1 for the state the model is in.", ["model", "state"], registry=r
        )
        self.model_source = Gauge(
            p + "model_source",
            "1 for the kind of source (mirror, hub, s3) that served the model's last sync.",
            ["model", "source_kind"],
            registry=r,
        )
        self.model_ready = Gauge(
            p + "model_ready",
            "1 when a verified copy of the model is in the cache.",
            ["model"],
            registry=r,
        )
        self.model_required = Gauge(
            p + "model_required", "1 when the model gates readiness.", ["model"], registry=r
        )
        self.model_size = Gauge(
            p + "model_size_bytes", "Size of the model's resolved files.", ["model"], registry=r
        )
        self.remaining_bytes = Gauge(
            p + "model_remaining_bytes",
            "Bytes still to download for the model.",
            ["model"],
            registry=r,
        )
        self.sync_duration = Histogram(
            p + "sync_duration_seconds",
            "Duration of successful syncs.",
            ["model"],
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.sync_failures = Counter(
            p + "sync_failures", "Failed syncs, by error kind.", ["model", "reason"], registry=r
        )
        self.last_success = Gauge(
            p + "last_success_timestamp_seconds",
            "Unix time of the model's last successful sync.",
            ["model"],
            registry=r,
        )
        self.verifications = Counter(
            p + "verifications",
            "Re-verifications of cached files at rest.",
            ["model", "result"],
            registry=r,
        )
        self.all_required_ready = Gauge(
            p + "all_required_ready", "1 when every required model is ready.", registry=r
        )
        self.cache_free = Gauge(
            p + "cache_free_bytes", "Free bytes on the cache filesystem.", registry=r
        )
        self.cache_used = Gauge(p + "cache_used_bytes", "Bytes used by cached models.", registry=r)
        self.evictions = Counter(
            p + "evictions", "Models evicted from the cache.", ["reason"], registry=r
        )
        self.evicted_bytes = Counter(
            p + "evicted_bytes", "Bytes freed by evictions.", ["reason"], registry=r
        )
        self.config_reload_failures = Counter(
            p + "config_reload_failures",
            "Config reloads rejected (the last good config keeps running).",
            registry=r,
        )
        self.config_last_reload_successful = Gauge(
            p + "config_last_reload_successful",
            "0 while the config file on disk is rejected.",
            registry=r,
        )
        self.gate_errors = Counter(
            p + "node_gate_errors",
            "Failed attempts to update the node's labels and taint.",
            registry=r,
        )
        self.events_dropped = Counter(
            p + "events_dropped",
            "Kubernetes Events not sent: rate_limited (the node's token bucket was empty) or "
            "queue_full (the sender fell behind).",
            ["reason"],
            registry=r,
        )
        self.event_errors = Counter(
            p + "event_errors",
            "Kubernetes Event writes that failed (API error or unreachable API server).",
            registry=r,
        )
        self.sync_phase_duration = Histogram(
            p + "sync_phase_duration_seconds",
            "Wall-clock seconds of each phase of a sync that changed the cache.",
            ["model", "phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.time_to_ready = Histogram(
            p + "time_to_ready_seconds",
            "Seconds from node creation or agent start until every required model was first "
            "ready (once per agent process).",
            ["since"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.ready_after = Gauge(
            p + "ready_after_seconds",
            "The time to ready this agent process observed, by what it counts from.",
            ["since"],
            registry=r,
        )
        self.progress_writes = Counter(
            p + "node_progress_writes",
            "Writes of the progress annotation on the node.",
            ["result"],
            registry=r,
        )
        self.warmups = Counter(
            p + "warmups",
            "Page-cache warm-ups of a model (warmPageCache), by how they ended.",
            ["model", "result"],
            registry=r,
        )
        self.warm_duration = Gauge(
            p + "warm_duration_seconds",
            "Seconds the model's last page-cache warm-up took.",
            ["model"],
            registry=r,
        )
        self.warm_bytes = Gauge(
            p + "warm_bytes",
            "Bytes the model's last page-cache warm-up read into the page cache.",
            ["model"],
            registry=r,
        )
        for since in READY_SINCE:
            self.time_to_ready.labels(since)  # zero from the start: increase() sees the first
        for result in ("ok", "failed"):
            self.progress_writes.labels(result)
        with contextlib.suppress(ValueError):  # already there (the global registry has one)
            ProcessCollector(registry=r)
        self._window = rate_window
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: dict[str, collections.deque[tuple[int, int]]] = {}
        self.config_last_reload_successful.set(1)

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
        """A time to ready (``since`` one of :data:`READY_SINCE`); called once per process."""
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
