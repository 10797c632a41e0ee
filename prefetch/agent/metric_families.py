"""The agent's metric families, declared: each family a frozen dataclass of the metrics that
describe one thing (what the engine fetched, each model's state, its syncs, its warm-ups, the
cache, the node's readiness, the agent's own health) and a builder registering them. Names, help
texts, labels and buckets are what the dashboards and alerts in deploy/ read:
:mod:`prefetch.agent.metrics` lists them and wires them together."""

# The builders are flat lists of declarations, one metric each: kept long on purpose.

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Sync durations from seconds (up to date) to many hours (a large model over a slow link).
SYNC_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 57600)
#: Phase and time-to-ready durations: a tenth of a second (a resolve) to four hours (a cold
#: start over a slow link); longer lands in +Inf, which an alert should catch long before.
PHASE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400)
#: What a time to ready is counted from (``since`` label).
READY_SINCE = ("node_creation", "agent_start")


@dataclass(frozen=True)
class TransferMetrics:
    """What the engine fetched for each model, by source (fed by
    :class:`prefetch.agent.metrics.MetricsSink`)."""

    downloaded_bytes: Counter
    download_rate: Gauge
    files_downloaded: Counter
    chunks_downloaded: Counter
    retries: Counter
    checksum_failures: Counter

    @classmethod
    def build(cls, p: str, r: CollectorRegistry, rate_window: float) -> TransferMetrics:
        return cls(
            downloaded_bytes=Counter(
                p + "downloaded_bytes",
                "Bytes downloaded from sources.",
                ["model", "source"],
                registry=r,
            ),
            download_rate=Gauge(
                p + "download_rate_bytes_per_second",
                f"Download rate over the last {rate_window:.0f} seconds.",
                ["model"],
                registry=r,
            ),
            files_downloaded=Counter(
                p + "files_downloaded",
                "Files downloaded and verified.",
                ["model", "source"],
                registry=r,
            ),
            chunks_downloaded=Counter(
                p + "chunks_downloaded",
                "Ranged requests the engine completed (a run of chunks, or a small file).",
                ["model", "source"],
                registry=r,
            ),
            retries=Counter(
                p + "retries",
                "Ranged reads retried after a transient failure.",
                ["model", "source"],
                registry=r,
            ),
            checksum_failures=Counter(
                p + "checksum_failures",
                "Files whose bytes did not match the checksum (download: while fetching; "
                "reverify: at rest).",
                ["model", "reason"],
                registry=r,
            ),
        )


@dataclass(frozen=True)
class ModelMetrics:
    """Each model's place in the cache: its state, its source, its size, what is left."""

    model_state: Gauge
    model_source: Gauge
    model_ready: Gauge
    model_required: Gauge
    model_size: Gauge
    remaining_bytes: Gauge

    @classmethod
    def build(cls, p: str, r: CollectorRegistry) -> ModelMetrics:
        return cls(
            model_state=Gauge(
                p + "model_state",
                "1 for the state the model is in.",
                ["model", "state"],
                registry=r,
            ),
            model_source=Gauge(
                p + "model_source",
                "1 for the kind of source (mirror, hub, s3) that served the model's last sync.",
                ["model", "source_kind"],
                registry=r,
            ),
            model_ready=Gauge(
                p + "model_ready",
                "1 when a verified copy of the model is in the cache.",
                ["model"],
                registry=r,
            ),
            model_required=Gauge(
                p + "model_required", "1 when the model gates readiness.", ["model"], registry=r
            ),
            model_size=Gauge(
                p + "model_size_bytes", "Size of the model's resolved files.", ["model"], registry=r
            ),
            remaining_bytes=Gauge(
                p + "model_remaining_bytes",
                "Bytes still to download for the model.",
                ["model"],
                registry=r,
            ),
        )


@dataclass(frozen=True)
class SyncMetrics:
    """Each model's syncs and re-verifications: how long, how they failed, their phases."""

    sync_duration: Histogram
    sync_failures: Counter
    last_success: Gauge
    verifications: Counter
    sync_phase_duration: Histogram

    @classmethod
    def build(cls, p: str, r: CollectorRegistry) -> SyncMetrics:
        return cls(
            sync_duration=Histogram(
                p + "sync_duration_seconds",
                "Duration of successful syncs.",
                ["model"],
                buckets=SYNC_BUCKETS,
                registry=r,
            ),
            sync_failures=Counter(
                p + "sync_failures", "Failed syncs, by error kind.", ["model", "reason"], registry=r
            ),
            last_success=Gauge(
                p + "last_success_timestamp_seconds",
                "Unix time of the model's last successful sync.",
                ["model"],
                registry=r,
            ),
            verifications=Counter(
                p + "verifications",
                "Re-verifications of cached files at rest.",
                ["model", "result"],
                registry=r,
            ),
            sync_phase_duration=Histogram(
                p + "sync_phase_duration_seconds",
                "Wall-clock seconds of each phase of a sync that changed the cache.",
                ["model", "phase"],
                buckets=PHASE_BUCKETS,
                registry=r,
            ),
        )


@dataclass(frozen=True)
class WarmMetrics:
    """Each model's page-cache warm-ups."""

    warmups: Counter
    warm_duration: Gauge
    warm_bytes: Gauge

    @classmethod
    def build(cls, p: str, r: CollectorRegistry) -> WarmMetrics:
        return cls(
            warmups=Counter(
                p + "warmups",
                "Page-cache warm-ups of a model (warmPageCache), by how they ended.",
                ["model", "result"],
                registry=r,
            ),
            warm_duration=Gauge(
                p + "warm_duration_seconds",
                "Seconds the model's last page-cache warm-up took.",
                ["model"],
                registry=r,
            ),
            warm_bytes=Gauge(
                p + "warm_bytes",
                "Bytes the model's last page-cache warm-up read into the page cache.",
                ["model"],
                registry=r,
            ),
        )


@dataclass(frozen=True)
class CacheMetrics:
    """The cache filesystem: its free and used bytes and the evictions that free them."""

    cache_free: Gauge
    cache_used: Gauge
    evictions: Counter
    evicted_bytes: Counter

    @classmethod
    def build(cls, p: str, r: CollectorRegistry) -> CacheMetrics:
        return cls(
            cache_free=Gauge(
                p + "cache_free_bytes", "Free bytes on the cache filesystem.", registry=r
            ),
            cache_used=Gauge(p + "cache_used_bytes", "Bytes used by cached models.", registry=r),
            evictions=Counter(
                p + "evictions", "Models evicted from the cache.", ["reason"], registry=r
            ),
            evicted_bytes=Counter(
                p + "evicted_bytes", "Bytes freed by evictions.", ["reason"], registry=r
            ),
        )


@dataclass(frozen=True)
class NodeMetrics:
    """The node's readiness: the gate, the progress annotation, the time to ready."""

    all_required_ready: Gauge
    gate_errors: Counter
    progress_writes: Counter
    time_to_ready: Histogram
    ready_after: Gauge

    @classmethod
    def build(cls, p: str, r: CollectorRegistry) -> NodeMetrics:
        node = cls(
            all_required_ready=Gauge(
                p + "all_required_ready", "1 when every required model is ready.", registry=r
            ),
            gate_errors=Counter(
                p + "node_gate_errors",
                "Failed attempts to update the node's labels and taint.",
                registry=r,
            ),
            progress_writes=Counter(
                p + "node_progress_writes",
                "Writes of the progress annotation on the node.",
                ["result"],
                registry=r,
            ),
            time_to_ready=Histogram(
                p + "time_to_ready_seconds",
                "Seconds from node creation or agent start until every required model was first "
                "ready (once per agent process).",
                ["since"],
                buckets=PHASE_BUCKETS,
                registry=r,
            ),
            ready_after=Gauge(
                p + "ready_after_seconds",
                "The time to ready this agent process observed, by what it counts from.",
                ["since"],
                registry=r,
            ),
        )
        for since in READY_SINCE:
            node.time_to_ready.labels(since)  # zero from the start: increase() sees the first
        for result in ("ok", "failed"):
            node.progress_writes.labels(result)
        return node


@dataclass(frozen=True)
class HealthMetrics:
    """The agent's own health: config reloads and the Kubernetes Events it sends."""

    config_reload_failures: Counter
    config_last_reload_successful: Gauge
    events_dropped: Counter
    event_errors: Counter

    @classmethod
    def build(cls, p: str, r: CollectorRegistry) -> HealthMetrics:
        return cls(
            config_reload_failures=Counter(
                p + "config_reload_failures",
                "Config reloads rejected (the last good config keeps running).",
                registry=r,
            ),
            config_last_reload_successful=Gauge(
                p + "config_last_reload_successful",
                "0 while the config file on disk is rejected.",
                registry=r,
            ),
            events_dropped=Counter(
                p + "events_dropped",
                "Kubernetes Events not sent: rate_limited (the node's token bucket was empty) or "
                "queue_full (the sender fell behind).",
                ["reason"],
                registry=r,
            ),
            event_errors=Counter(
                p + "event_errors",
                "Kubernetes Event writes that failed (API error or unreachable API server).",
                registry=r,
            ),
        )
