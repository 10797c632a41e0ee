"""The agent's reconcile loop: the config says which models the node should hold, the Store says
what it holds, and the loop closes the gap with :func:`prefetch.pipeline.sync.prepare` and
:func:`prefetch.pipeline.sync.execute`.

One asyncio task ticks every second (its heartbeat is what ``/healthz`` checks): it applies a
reloaded config, starts the jobs that are due, keeps the node gate in line with the ready set and
refreshes metrics. Jobs run in worker threads, at most ``parallelModels`` at a time:

* **sync**: resolve and plan, make room for ``plan.bytes_needed`` (evict least-recently-used
  models the config no longer wants and are not pinned, or fail with a reason rather than fill
  the disk), execute with delete. Due when there is no verified copy (after backoff), every
  ``resolveInterval``, and right after a re-verification found damage.
* **verify**: every ``verifyInterval``, re-hash at ``verifyReadRate``; on a mismatch the model
  leaves the ready set *and the gate is applied without it* before the bad files go.

A model is *ready* while a complete, verified copy is in the cache; a failed refresh keeps it
ready. Each model has its own state and backoff; a source that trickles or goes silent fails by
the engine's stall rule (``minRate`` over ``stallTimeout``) or, trickling just fast enough, at the
attempt's ``syncDeadline`` (resumably, reason ``deadline``), so its slot passes on. SIGTERM stops
every job (resumable partials), closes the server and returns within the grace period. The parts
(jobs, scheduler, space, gate_driver, status, events, ...) are listed in pyproject.toml's agent
contract; :class:`Agent` here wires them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from prefetch.agent.background import BackgroundTasks
from prefetch.agent.cache_push import PUSH_POLL, PUSH_SETTLE, CachePusher, PushClient
from prefetch.agent.config_file import (
    ConfigFile,
    ReloadTimer,
    keep_restart_fields,
    log_reloaded,
)
from prefetch.agent.config_values import AgentConfig
from prefetch.agent.event_recorder import EventRecorder, EventSink
from prefetch.agent.gate_driver import GateDriver, GateFactory
from prefetch.agent.jobs import LOCK_TIMEOUT, JobParts
from prefetch.agent.launcher import JobLauncher
from prefetch.agent.metrics import AgentMetrics
from prefetch.agent.model_table import ModelTable, cancel
from prefetch.agent.progress_note import Note, ProgressReporter, agent_note
from prefetch.agent.ready_clock import ReadyClock
from prefetch.agent.scheduler import ModelState, Scheduler, failure_reason
from prefetch.agent.server import HealthServer
from prefetch.agent.source_opener import SourceOpener
from prefetch.agent.space import SpaceManager
from prefetch.agent.status import AgentFacts, JsonObject, readiness_body
from prefetch.agent.usage import UsageRefresher
from prefetch.agent.warming import WarmingStory
from prefetch.agent.watch import ConfigWatcher
from prefetch.pipeline.store import Store

if TYPE_CHECKING:
    from prefetch.sources.hf.source import HubOptions

log = logging.getLogger(__name__)

#: Seconds without a completed loop pass after which /healthz fails.
HEALTH_STALE_AFTER = 60.0
#: Seconds SIGTERM waits for running jobs before the process exits anyway.
SHUTDOWN_GRACE = 20.0

__all__ = ["HEALTH_STALE_AFTER", "LOCK_TIMEOUT", "SHUTDOWN_GRACE", "Agent", "failure_reason"]


class Agent:
    """The node agent. ``await run()`` until :meth:`request_stop` (or SIGTERM when handled).

    It wires the parts: the :class:`Scheduler` (the model table, kept in line with the config by
    :class:`ModelTable`), the :class:`JobLauncher` (starting the due jobs, handed their
    collaborators in :class:`JobParts`), the :class:`SpaceManager` (room for syncs), the
    :class:`GateDriver` (the node's labels), the :class:`UsageRefresher` (cache gauges), the
    :class:`CachePusher` and the /readyz body (:mod:`prefetch.agent.status`); it owns the loop,
    config reloads and shutdown."""

    def __init__(
        self,
        config_path: Path | None,
        *,
        config: AgentConfig | None = None,
        cache_dir: Path | None = None,
        listen: str | None = None,
        serve: bool = True,
        gate_factory: GateFactory | None = None,
        event_sink: EventSink | None = None,
        registry: CollectorRegistry | None = None,
        s3_client: object | None = None,
        hub: HubOptions | None = None,
        tick: float = 1.0,
        handle_signals: bool = False,
        exit_on_stuck: bool = False,
        gpu_product: str | None = None,
        push_poll: float = PUSH_POLL,
        push_settle: float = PUSH_SETTLE,
    ) -> None:
        if config_path is None and config is None:
            raise ValueError("give config_path or config")
        self.config_path = config_path
        self._initial = config
        self._serve = serve
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = AgentMetrics(self.registry)
        #: The node's story (Kubernetes Events through ``event_sink``, and JSON log lines).
        self.events = EventRecorder(self.metrics, event_sink)
        self.warming = WarmingStory(self.events)
        self._config_file = ConfigFile(
            config_path, self.metrics, cache_dir=cache_dir, listen=listen, gpu_product=gpu_product
        )
        self._sources = SourceOpener(s3_client, hub)
        self.pusher = CachePusher(
            self.events, PushClient(s3_client), settle=push_settle, poll=push_poll
        )
        self._tick = tick
        self._handle_signals = handle_signals
        self._exit_on_stuck = exit_on_stuck
        #: Set on shutdown; every job's own stop event is set with it.
        self.stop = threading.Event()
        self.config: AgentConfig = AgentConfig()
        self.server: HealthServer | None = None
        self.scheduler = Scheduler()
        self._background = BackgroundTasks()  # "gate", "usage", "push": one each
        self._bind_cache(Store(Path(".")))
        self._bind_node(gate_factory or (lambda cfg: None))
        self.launcher = JobLauncher(
            self.scheduler, self.metrics, self.warming, self._job_parts, self._publish, self.stop
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._config_loaded_at: float | None = None
        self._reloads = ReloadTimer()
        self._beat = time.monotonic()
        self._running = False
        self.passes = 0

    def _bind_node(self, gate_factory: GateFactory) -> None:
        """The parts that write to the node: its gate, its progress note, its ready clock."""
        self.gate = GateDriver(gate_factory, self.metrics, self._ready_state, self.events)
        self.progress = ProgressReporter(self._progress_note, lambda: self.gate.gate, self.metrics)
        self.ready_clock = ReadyClock(self.metrics, started=time.time())

    def _bind_cache(self, store: Store) -> None:
        """The parts that work on the cache directory (known once the config is)."""
        self.store = store
        self.space = SpaceManager(store, self.metrics, self.events)
        self.models = ModelTable(self.scheduler, store, self.metrics)
        self.usage = UsageRefresher(self.scheduler, self.space, self.metrics, self._background)

    # -- public ---------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Thread-safe: stop starting work, cancel running transfers (resumably), and return."""
        self.stop.set()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._stop_jobs)

    def health(self) -> tuple[int, str]:
        age = time.monotonic() - self._beat
        if not self._running:
            return 503, "reconcile loop not running"
        if age > HEALTH_STALE_AFTER:
            return 503, f"reconcile loop stalled: no pass for {age:.0f}s"
        return 200, "ok"

    def readiness(self) -> tuple[int, JsonObject]:
        body = self.status()
        return (200 if body["ready"] else 503), body

    def status(self) -> JsonObject:
        """What /readyz shows: overall readiness and, per model, what is missing and why."""
        facts = AgentFacts(
            config_path=self.config_path,
            config_digest=self.config.digest,
            config_loaded=self._config_loaded_at is not None,
            config_error=self._config_file.last_error,
            gate_enabled=self.gate.enabled,
            gate_error=self.gate.last_error,
            time_to_ready=dict(self.ready_clock.seconds),
            progress_error=self.progress.last_error,
        )
        return readiness_body(self.scheduler.states(), facts, time.monotonic())

    # -- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        config = self._initial if self._initial is not None else self._config_file.load_first()
        self._adopt_first(config)
        if self._handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._on_signal, sig)
        watcher: ConfigWatcher | None = None
        try:
            if self.config_path is not None:
                watcher = ConfigWatcher(self.config_path, self._config_event)
                watcher.start()
            self.gate.open(self.config)
            if self._serve:
                self.server = HealthServer(
                    self.config.listen,
                    health=self.health,
                    ready=self.readiness,
                    registry=self.registry,
                ).start()
            self._running = True
            log.info(
                "agent started: %d model(s), cache %s",
                len(self.config.models),
                self.config.cache_dir,
                extra={"phase": "start"},
            )
            while not self.stop.is_set():
                await self._pass()
                await self._sleep()
        finally:
            if watcher is not None:
                watcher.stop()
            await self._shutdown()

    async def _pass(self) -> None:
        now = time.monotonic()
        self._beat = now
        if self._reloads.due(now):
            self._reloads.read(now)
            await self._reload()
        self.launcher.start_due(now, self.config)
        if self.pusher.due(now, self.config):
            self._background.start("push", self._push_caches)
        # in the background: a slow API server must not stall the loop's heartbeat
        self._background.start("gate", self._write_node)
        if self.ready_clock.on_pass(self.scheduler.all_required_ready()):
            clock, gate = self.ready_clock, self.gate.gate
            self._background.start("ready-clock", lambda: clock.observe_node(gate))
        self.usage.refresh(now)
        self.passes += 1
        self._beat = time.monotonic()

    async def _sleep(self) -> None:
        assert self._wake is not None
        timeout = self._reloads.wait_at_most(self._tick)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
        self._wake.clear()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _on_signal(self, sig: int) -> None:
        log.info(
            "%s received: stopping (partial downloads are kept and resume)",
            signal.Signals(sig).name,
            extra={"phase": "shutdown"},
        )
        self.request_stop()

    def _stop_jobs(self) -> None:
        for ms in self.scheduler.table().values():
            cancel(ms)
        self._poke()

    async def _shutdown(self) -> None:
        self._running = False
        self.stop.set()
        self._stop_jobs()
        if self.server is not None:
            self.server.stop()
        await _wait_out(self.launcher.running() + self._background.running(), self._exit_on_stuck)
        await asyncio.to_thread(self.events.close)  # what is queued goes out, briefly
        log.info("agent stopped", extra={"phase": "shutdown"})

    # -- config ---------------------------------------------------------------------------------

    def _adopt_first(self, config: AgentConfig) -> None:
        config = self._config_file.overridden(config)
        self.config = config
        self._bind_cache(Store(config.cache_dir))
        config.cache_dir.mkdir(parents=True, exist_ok=True)
        self.store.empty_trash()
        self._config_loaded_at = time.monotonic()
        self._reloads.read(time.monotonic())
        self._set_models(config)

    def _config_event(self) -> None:
        """Called from the watchdog thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._schedule_reload)

    def _schedule_reload(self) -> None:
        self._reloads.changed()
        self._poke()

    async def _reload(self) -> None:
        new = await self._config_file.read_changed()
        if new is None:
            return
        old = self.config
        new = keep_restart_fields(old, new)
        self._config_file.accepted()
        if (new.label_prefix, new.startup_taint) != (old.label_prefix, old.startup_taint):
            await self.gate.replace(new)
        self.config = new
        self._config_loaded_at = time.monotonic()
        self._set_models(new)
        log_reloaded(old, new)

    def _set_models(self, config: AgentConfig) -> None:
        """Make the model table match ``config`` (:class:`ModelTable`) and wake the loop."""
        self.models.apply(config)
        self._poke()

    # -- what the parts are handed --------------------------------------------------------------

    def _job_parts(self) -> JobParts:
        """What a job works with: the Agent's parts, and callbacks into its loop."""
        assert self._loop is not None
        return JobParts(
            scheduler=self.scheduler,
            store=self.store,
            space=self.space,
            metrics=self.metrics,
            gate=self.gate,
            open_source=self._sources,
            config=lambda: self.config,
            publish=self._publish,
            wake=self._poke,
            usage_changed=self.usage.changed,
            loop=self._loop,
            events=self.events,
            warming=self.warming,
        )

    async def _push_caches(self) -> None:
        """One look at the ``push: true`` compile caches (:class:`CachePusher`)."""
        await asyncio.to_thread(self.pusher.run, self.config, self.scheduler, self.stop)

    def _ready_state(self) -> tuple[tuple[str, ...], bool]:
        return self.scheduler.ready_names(), self.scheduler.all_required_ready()

    async def _write_node(self) -> None:
        """The gate, then the progress note: one after the other, so the note's PATCH never
        lands between the gate's GET and its guarded PATCH (which would make it retry)."""
        await self.gate.apply()
        await self.progress.maybe_write()

    def _progress_note(self) -> Note:
        return agent_note(self.scheduler, self.metrics.rate, self.config)

    def _publish(self, ms: ModelState) -> None:
        self.models.publish(ms)


async def _wait_out(tasks: list[asyncio.Task[None]], exit_on_stuck: bool) -> None:
    """Wait up to :data:`SHUTDOWN_GRACE` for ``tasks``; with ``exit_on_stuck``, a task that does
    not stop ends the process (its partials resume on the next start)."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=SHUTDOWN_GRACE)
    if not pending:
        return
    log.warning(
        "%d job(s) did not stop within %.0fs; exiting anyway (partials resume)",
        len(pending),
        SHUTDOWN_GRACE,
        extra={"phase": "shutdown"},
    )
    if exit_on_stuck:
        logging.shutdown()
        os._exit(0)
