"""The agent's model table: what it knows about each configured model and what is due next.

Owns :class:`ModelState` (one per configured model), its :class:`ModelPhase` and the transitions
between phases, the backoff after failures, :meth:`ModelState.due` (which job, if any, a model
needs now) and :meth:`Scheduler.due_jobs` (which of those start under ``parallelModels``). It
runs nothing itself: the Agent starts the jobs and reports their outcome back through the
transitions. State is mutated on the event loop only; the table's structure is guarded by a
lock so the HTTP thread can read it.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from prefetch.agent.config_values import Backoff
from prefetch.agent.metrics import MetricsSink
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import ModelSpec
from prefetch.pipeline.sync import SyncResult
from prefetch.pipeline.warmup import WarmReport
from prefetch.support.errors import error_reason
from prefetch.support.logjson import scrub


def failure_reason(exc: BaseException) -> str:
    """The ``reason`` label of a failure: the package's one vocabulary
    (``prefetch.support.errors``)."""
    return error_reason(exc)


class ModelPhase(StrEnum):
    """Where a model is; the values are what ``/readyz`` and the ``model_state`` metric show."""

    PENDING = "pending"  # no copy and no job yet (or a job was stopped)
    SYNCING = "syncing"  # fetching a model that has no copy
    UPDATING = "updating"  # refreshing a model whose copy stays in use meanwhile
    READY = "ready"
    FAILED = "failed"  # no copy, and the last sync failed: backing off
    VERIFYING = "verifying"  # re-hashing the cached copy


class JobKind(StrEnum):
    SYNC = "sync"
    VERIFY = "verify"


@dataclass
class Job:
    """A running job of one model: its task and the stop event handed to its worker thread."""

    kind: JobKind
    task: asyncio.Task[None]
    stop: threading.Event
    started: float


@dataclass
class Intervals:
    """How often a ready model is refreshed (``resolveInterval``) and re-hashed
    (``verifyInterval``); None turns either off."""

    resolve: float | None
    verify: float | None


@dataclass
class ModelState:
    """What the agent knows about one configured model. Change it through the transition
    methods, so the phase, readiness and error fields always agree."""

    spec: ModelSpec
    digest: str
    index: int = 0
    phase: ModelPhase = ModelPhase.PENDING
    ready: bool = False
    revision: str | None = None
    bytes_total: int | None = None
    last_error: str | None = None
    error_reason: str | None = None
    failures: int = 0
    next_attempt: float = 0.0
    last_resolved: float | None = None
    last_verified: float | None = None
    last_success: float | None = None  # unix time
    refetch: bool = False
    touched: float = float("-inf")
    job: Job | None = None
    sink: MetricsSink | None = None
    #: The last successful sync that changed the cache (its phase timings go to /readyz).
    last_change: SyncResult | None = None
    #: The source that served the last successful sync (a mirror, the Hub, the S3 prefix).
    served_by: str | None = None
    #: Page-cache warm-up (``warmPageCache``): running now, the last one's report, and the
    #: revision it warmed (once per revision and agent process: a restarted node is cold).
    warming: bool = False
    warm: WarmReport | None = None
    warmed_revision: str | None = None
    #: A ``compileCaches`` entry with nothing published under its key yet (ready all the same).
    nothing_published: bool = False
    #: Publishing its compile cache from this node (``push: true``): ``pushed`` (this node won
    #: the key) or ``published-elsewhere`` (another writer did); None before either.
    cache_push: str | None = None
    #: (monotonic time, bytes downloaded) when the running sync last made progress (see
    #: :meth:`stalled`); set when the sync starts.
    progress_mark: tuple[float, int] = (0.0, 0)
    #: The running sync was found stalled and gave up its ``parallelModels`` slot (told once).
    slot_given_up: bool = False

    @property
    def syncing(self) -> bool:
        return self.job is not None and self.job.kind is JobKind.SYNC

    def stalled(self, now: float, window: float, enough: int) -> bool:
        """Has the running sync moved fewer than ``enough`` bytes in the last ``window``
        seconds (resolving, planning and trickled reads included)? Asked on the loop at every
        pass: the mark moves each time the sync has moved ``enough`` bytes since it."""
        if not self.syncing or self.sink is None:
            return False
        at, mark = self.progress_mark
        done = self.sink.done
        if done < mark:  # the download (re)started its count
            self.progress_mark = at, done
        elif done - mark >= enough:
            self.progress_mark = now, done
            self.slot_given_up = False
            return False
        return now - at >= window

    # -- transitions --------------------------------------------------------------------------

    def found_copy(
        self, revision: str | None, bytes_total: int | None, synced_at: float | None
    ) -> None:
        """At start-up or on a re-spec: an intact copy recorded by an earlier run is ready."""
        self.ready = True
        self.phase = ModelPhase.READY
        self.revision = revision
        self.bytes_total = bytes_total
        self.last_success = synced_at

    def reconfirm(self) -> None:
        """Its sources changed: resolve again as soon as no job runs (a ready copy stays ready;
        a failing model retries now rather than after its backoff)."""
        self.last_resolved = None
        self.next_attempt = 0.0

    def start_sync(self, job: Job, sink: MetricsSink | None = None) -> None:
        self.job = job
        self.sink = sink
        self.progress_mark = job.started, 0
        self.slot_given_up = False
        self.phase = ModelPhase.UPDATING if self.ready else ModelPhase.SYNCING

    def start_verify(self, job: Job) -> None:
        self.job = job
        self.phase = ModelPhase.VERIFYING

    def sync_succeeded(self, result: SyncResult, now: float) -> None:
        self.ready = True
        self.phase = ModelPhase.READY
        self.revision = result.revision
        self.bytes_total = result.bytes_total
        self.failures = 0
        self.last_error = self.error_reason = None
        self.refetch = False
        self.last_resolved = now
        if self.last_verified is None:
            self.last_verified = now
        self.last_success = time.time()
        self.touched = now
        self.served_by = result.served_by or None
        if not result.up_to_date:
            self.last_change = result

    def sync_failed(
        self,
        exc: BaseException,
        now: float,
        backoff: Backoff,
        jitter: Callable[[float, float], float] = random.uniform,
    ) -> float:
        """Count the failure, back off, keep a ready copy ready; returns the delay (seconds)."""
        self.failures += 1
        delay = sync_retry_policy(backoff).delay(self.failures, uniform=jitter)
        self.next_attempt = now + delay
        self.last_error = scrub(str(exc))
        self.error_reason = failure_reason(exc)
        self.phase = ModelPhase.READY if self.ready else ModelPhase.FAILED
        return delay

    def sync_cancelled(self) -> None:
        self.phase = ModelPhase.READY if self.ready else ModelPhase.PENDING

    def verify_passed(self, now: float) -> None:
        self.last_verified = now

    def drop_ready(self, reason: str) -> None:
        """The copy is damaged or gone: not ready, and verified again only after a sync."""
        self.ready = False
        self.last_error = reason
        self.error_reason = "verify_failed"
        self.last_verified = None

    def verify_finished(self, now: float, *, current: bool) -> None:
        """The verify job ended (any outcome); a model still in the config leaves VERIFYING."""
        self.job = None
        self.last_verified = now
        if current and self.phase is ModelPhase.VERIFYING:
            self.phase = ModelPhase.READY if self.ready else ModelPhase.PENDING

    # -- scheduling ---------------------------------------------------------------------------

    def due(self, now: float, intervals: Intervals) -> JobKind | None:
        """The job this model needs now, if any.

        A sync when re-verification found damage, when there is no copy or the last attempt
        failed (after its backoff), to confirm a copy found at start-up, and every resolve
        interval; otherwise a verify every verify interval."""
        if self.job is not None:
            return None
        if self.refetch:
            return JobKind.SYNC
        if not self.ready or self.last_error is not None:
            return JobKind.SYNC if now >= self.next_attempt else None
        if self.last_resolved is None:
            return JobKind.SYNC  # a copy found at start-up: confirm it with the source
        if intervals.resolve and now - self.last_resolved >= intervals.resolve:
            return JobKind.SYNC
        since = self.last_verified if self.last_verified is not None else self.last_resolved
        if intervals.verify and now - since >= intervals.verify:
            return JobKind.VERIFY
        return None


class Scheduler:
    """The table of configured models, in config order, and the choice of what starts next."""

    def __init__(self) -> None:
        self._models: dict[str, ModelState] = {}
        self._lock = threading.Lock()  # guards the table's structure for the HTTP thread

    def get(self, name: str) -> ModelState | None:
        return self._models.get(name)

    def table(self) -> dict[str, ModelState]:
        """A copy of the table by model name (on the loop)."""
        return dict(self._models)

    def replace(self, models: dict[str, ModelState]) -> None:
        with self._lock:
            self._models = models

    def states(self) -> list[ModelState]:
        """The models in config order (safe from any thread)."""
        with self._lock:
            return sorted(self._models.values(), key=lambda m: m.index)

    def current(self, ms: ModelState) -> bool:
        """Is ``ms`` still the table's state for its model (not dropped or re-specced)?"""
        return self._models.get(ms.spec.name) is ms

    def ready_names(self) -> tuple[str, ...]:
        return tuple(sorted(name for name, ms in self._models.items() if ms.ready))

    def all_required_ready(self) -> bool:
        return all(ms.ready for ms in self._models.values() if ms.spec.required)

    def due_jobs(
        self, now: float, intervals: Intervals, slots: int
    ) -> list[tuple[ModelState, JobKind]]:
        """Up to ``slots`` due jobs: required models first, then models without a copy, then
        in config order."""
        if slots <= 0:
            return []
        due = [(ms, kind) for ms in self._models.values() if (kind := ms.due(now, intervals))]
        due.sort(key=lambda d: (not d[0].spec.required, d[0].ready, d[0].index))
        return due[:slots]


def sync_retry_policy(backoff: Backoff) -> RetryPolicy:
    """The wait after a model's failed sync: full jitter up to ``initial * 2**(failures-1)``
    (at most ``max``), never less than half of ``initial``, so a model that fails at once (a
    wrong bucket) is not tried again in a tight loop."""
    return RetryPolicy(
        base_delay=backoff.initial, max_delay=backoff.max, min_delay=backoff.initial / 2
    )
