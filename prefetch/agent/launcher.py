"""Starting the agent's jobs: which of the due jobs get one of the ``parallelModels`` slots (a
stalled sync gives its slot up while it goes on), when a warming episode begins, and each job's
asyncio task (a :class:`~prefetch.agent.jobs.SyncJob` or
:class:`~prefetch.agent.jobs.VerifyJob` running in a worker thread)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from prefetch.agent.config_values import AgentConfig
from prefetch.agent.jobs import JobParts, SyncJob, VerifyJob
from prefetch.agent.metrics import AgentMetrics
from prefetch.agent.scheduler import Intervals, Job, JobKind, ModelState, Scheduler
from prefetch.agent.warming import WarmingStory

# Its lines keep the logger name they have always had, so log queries keep matching.
log = logging.getLogger("prefetch.agent.loop")

__all__ = ["JobLauncher"]


class JobLauncher:
    """Starts the due jobs in the free slots and keeps their tasks (for shutdown).

    ``parts()`` gives what a job works with; ``publish`` shows a model's new phase; ``stop`` is
    the agent's: a job started after it is set starts stopped."""

    def __init__(
        self,
        scheduler: Scheduler,
        metrics: AgentMetrics,
        warming: WarmingStory,
        parts: Callable[[], JobParts],
        publish: Callable[[ModelState], None],
        stop: threading.Event,
    ) -> None:
        self._scheduler = scheduler
        self._metrics = metrics
        self._warming_story = warming
        self._parts = parts
        self._publish = publish
        self._stop = stop
        self._tasks: set[asyncio.Task[None]] = set()
        self._warming = False  # a warming episode began; until every required model is ready

    def running(self) -> list[asyncio.Task[None]]:
        """The jobs' tasks that have not finished."""
        return [t for t in self._tasks if not t.done()]

    def start_due(self, now: float, config: AgentConfig) -> None:
        if self._stop.is_set():
            return
        running = len(self.running())
        intervals = Intervals(config.resolve_interval, config.verify_interval)
        slots = config.parallel_models - running + self.stalled_syncs(now, config)
        due = self._scheduler.due_jobs(now, intervals, slots)
        self._announce_warming(due)
        for ms, kind in due:
            self._start(ms, kind)

    def stalled_syncs(self, now: float, config: AgentConfig) -> int:
        """How many running syncs made no progress for ``stallTimeout`` (fewer bytes than
        ``minRate`` delivers in half of it): they do not count against ``parallelModels``, so
        one trickling source cannot keep the other models waiting. The stalled sync goes on
        (its ranges are retried by the engine's stall rule, and it may recover); while it is
        stalled one more model may run. Chosen over ending the attempt after repeated stalls:
        an ended attempt comes back after its backoff and holds the slot again, and a source
        that recovers would have lost its progress to a restart."""
        enough = max(1, int(config.min_rate * config.stall_timeout / 2))
        stalled = 0
        for ms in self._scheduler.states():
            if not ms.stalled(now, config.stall_timeout, enough):
                continue
            stalled += 1
            if not ms.slot_given_up:
                ms.slot_given_up = True
                log.warning(
                    "%s: no progress for %.0fs: its parallelModels slot goes to a waiting "
                    "model while it goes on",
                    ms.spec.name,
                    now - ms.progress_mark[0],
                    extra={"model": ms.spec.name, "phase": "sync"},
                )
                self._warming_story.stalled(ms.spec.name)  # no one waits for its size either
        return stalled

    def _announce_warming(self, due: list[tuple[ModelState, JobKind]]) -> None:
        """A warming episode begins when syncs start while a required model is not ready (once,
        until every required model is ready again); WarmingStory tells it when they resolved."""
        if self._scheduler.all_required_ready():
            self._warming = False
            return
        if self._warming or not any(kind is JobKind.SYNC for _, kind in due):
            return
        self._warming = True
        cold = [ms for ms in self._scheduler.states() if not ms.ready]
        starting = [ms.spec.name for ms, kind in due if kind is JobKind.SYNC and not ms.ready]
        known = {ms.spec.name: n for ms in cold if (n := ms.bytes_total) is not None}
        self._warming_story.begin([ms.spec.name for ms in cold], starting, known)

    def _start(self, ms: ModelState, kind: JobKind) -> None:
        stop = threading.Event()
        if self._stop.is_set():
            stop.set()
        job_type = SyncJob if kind is JobKind.SYNC else VerifyJob
        coro = job_type(self._parts()).run(ms, stop)
        task = asyncio.create_task(coro, name=f"{kind}:{ms.spec.name}")
        job = Job(kind, task, stop, time.monotonic())
        if kind is JobKind.SYNC:
            spec = ms.spec
            ms.start_sync(
                job,
                self._metrics.sink(spec.name, spec.source.scheme),
            )
        else:
            ms.start_verify(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._publish(ms)
