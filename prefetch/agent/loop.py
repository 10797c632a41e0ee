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
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from prefetch.agent.cache_push import PUSH_POLL, PUSH_SETTLE, CachePusher
from prefetch.agent.config import AgentConfig, spec_digest
from prefetch.agent.config_file import ConfigFile
from prefetch.agent.events import EventRecorder, EventSink, WarmingStory
from prefetch.agent.gate_driver import GateDriver, GateFactory
from prefetch.agent.jobs import LOCK_TIMEOUT, JobParts, SyncJob, VerifyJob
from prefetch.agent.metrics import AgentMetrics
from prefetch.agent.progress_note import Note, ProgressReporter, build_note
from prefetch.agent.ready_clock import ReadyClock
from prefetch.agent.scheduler import (
    Intervals,
    Job,
    JobKind,
    ModelState,
    Scheduler,
    failure_reason,
)
from prefetch.agent.server import HealthServer
from prefetch.agent.source_opener import SourceOpener
from prefetch.agent.space import SpaceManager
from prefetch.agent.status import AgentFacts, JsonObject, readiness_body
from prefetch.agent.watch import ConfigWatcher
from prefetch.pipeline.spec import ModelSpec
from prefetch.pipeline.store import Store
from prefetch.support import settings

if TYPE_CHECKING:
    from prefetch.sources.hf.source import HubOptions

log = logging.getLogger(__name__)

#: Seconds without a completed loop pass after which /healthz fails.
HEALTH_STALE_AFTER = 60.0
#: Seconds SIGTERM waits for running jobs before the process exits anyway.
SHUTDOWN_GRACE = 20.0
#: Re-read the config file this often even without a watchdog event (belt and braces).
CONFIG_POLL_INTERVAL = 30.0
#: Wait this long after a config change event before reading (kubelet swaps in a few steps).
CONFIG_DEBOUNCE = 0.3
#: Record "still wanted" on each cached entry this often (it orders eviction).
TOUCH_INTERVAL = 300.0
#: Refresh the cache usage metrics this often.
USAGE_INTERVAL = 30.0

__all__ = ["HEALTH_STALE_AFTER", "LOCK_TIMEOUT", "SHUTDOWN_GRACE", "Agent", "failure_reason"]


class Agent:
    """The node agent. ``await run()`` until :meth:`request_stop` (or SIGTERM when handled).

    It wires the parts: the :class:`Scheduler` (the model table), the :class:`SpaceManager`
    (room for syncs), the :class:`GateDriver` (the node's labels), the /readyz body
    (:mod:`prefetch.agent.status`) and the jobs (:class:`SyncJob`, :class:`VerifyJob`, handed
    their collaborators in :class:`JobParts`); it owns the loop, config reloads, starting the
    jobs' threads and shutdown."""

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
        self._warming = False  # a warming episode began; until every required model is ready
        self._config_file = ConfigFile(
            config_path, self.metrics, cache_dir=cache_dir, listen=listen, gpu_product=gpu_product
        )
        self._sources = SourceOpener(s3_client, hub)
        self._s3_client = s3_client
        self._push_client: object | None = None
        self.pusher = CachePusher(self.events, self._pusher_client, settle=push_settle)
        self._push_poll = push_poll
        self._next_push = 0.0
        self._tick = tick
        self._handle_signals = handle_signals
        self._exit_on_stuck = exit_on_stuck
        #: Set on shutdown; every job's own stop event is set with it.
        self.stop = threading.Event()
        self.config: AgentConfig = AgentConfig()
        self.store: Store = Store(Path("."))
        self.server: HealthServer | None = None
        self.scheduler = Scheduler()
        self.space = SpaceManager(self.store, self.metrics, self.events)
        self.gate = GateDriver(
            gate_factory or (lambda cfg: None), self.metrics, self._ready_state, self.events
        )
        self.progress = ProgressReporter(self._progress_note, lambda: self.gate.gate, self.metrics)
        self.ready_clock = ReadyClock(self.metrics, started=time.time())
        self._tasks: set[asyncio.Task[None]] = set()
        self._background: dict[str, asyncio.Task[None]] = {}  # "gate", "usage": one each
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._config_loaded_at: float | None = None
        self._reload_at: float | None = None
        self._next_poll = 0.0
        self._next_usage = 0.0
        self._beat = time.monotonic()
        self._running = False
        self.passes = 0

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
        if (self._reload_at is not None and now >= self._reload_at) or now >= self._next_poll:
            self._reload_at = None
            self._next_poll = now + CONFIG_POLL_INTERVAL
            await self._reload()
        self._start_due_jobs(now)
        if now >= self._next_push and self.config.push_targets():
            self._next_push = now + self._push_poll
            self._in_background("push", self._push_caches)
        # in the background: a slow API server must not stall the loop's heartbeat
        self._in_background("gate", self._write_node)
        if self.ready_clock.on_pass(self.scheduler.all_required_ready()):
            clock, gate = self.ready_clock, self.gate.gate
            self._in_background("ready-clock", lambda: clock.observe_node(gate))
        self._refresh_metrics(now)
        self.passes += 1
        self._beat = time.monotonic()

    def _in_background(
        self, name: str, work: Callable[[], Coroutine[object, object, None]]
    ) -> bool:
        """Start ``work`` as the one background task called ``name``, unless it still runs."""
        task = self._background.get(name)
        if task is not None and not task.done():
            return False
        self._background[name] = asyncio.create_task(work())
        return True

    async def _sleep(self) -> None:
        assert self._wake is not None
        timeout = self._tick
        if self._reload_at is not None:
            timeout = max(0.0, min(timeout, self._reload_at - time.monotonic()))
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
            _cancel(ms)
        self._poke()

    async def _shutdown(self) -> None:
        self._running = False
        self.stop.set()
        self._stop_jobs()
        if self.server is not None:
            self.server.stop()
        tasks = [t for t in self._tasks if not t.done()]
        tasks += [t for t in self._background.values() if not t.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=SHUTDOWN_GRACE)
            if pending:
                log.warning(
                    "%d job(s) did not stop within %.0fs; exiting anyway (partials resume)",
                    len(pending),
                    SHUTDOWN_GRACE,
                    extra={"phase": "shutdown"},
                )
                if self._exit_on_stuck:
                    logging.shutdown()
                    os._exit(0)
        await asyncio.to_thread(self.events.close)  # what is queued goes out, briefly
        log.info("agent stopped", extra={"phase": "shutdown"})

    # -- config ---------------------------------------------------------------------------------

    def _adopt_first(self, config: AgentConfig) -> None:
        config = self._config_file.overridden(config)
        self.config = config
        self.store = Store(config.cache_dir)
        self.space = SpaceManager(self.store, self.metrics, self.events)
        config.cache_dir.mkdir(parents=True, exist_ok=True)
        self.store.empty_trash()
        self._config_loaded_at = time.monotonic()
        self._next_poll = time.monotonic() + CONFIG_POLL_INTERVAL
        self._set_models(config)

    def _config_event(self) -> None:
        """Called from the watchdog thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._schedule_reload)

    def _schedule_reload(self) -> None:
        self._reload_at = time.monotonic() + CONFIG_DEBOUNCE
        self._poke()

    async def _reload(self) -> None:
        new = await self._config_file.read_changed()
        if new is None:
            return
        old = self.config
        if new.cache_dir != old.cache_dir or new.listen != old.listen:
            log.warning(
                "cacheDir and listen changes take effect after a restart; keeping %s, %s",
                old.cache_dir,
                old.listen,
                extra={"phase": "config"},
            )
            new = dataclasses.replace(new, cache_dir=old.cache_dir, listen=old.listen)
        self._config_file.accepted()
        if (new.label_prefix, new.startup_taint) != (old.label_prefix, old.startup_taint):
            await self.gate.replace(new)
        before = {m.name for m in old.models}
        after = {m.name for m in new.models}
        self.config = new
        self._config_loaded_at = time.monotonic()
        self._set_models(new)
        log.info(
            "config reloaded: %d model(s); added %s, removed %s",
            len(new.models),
            sorted(after - before) or "none",
            sorted(before - after) or "none",
            extra={"phase": "config"},
        )

    def _set_models(self, config: AgentConfig) -> None:
        """Make the model table match ``config``: add, drop (cancelling jobs), re-spec."""
        old_states = self.scheduler.table()
        new_states: dict[str, ModelState] = {}
        for index, spec in enumerate(config.models):
            digest = spec_digest(spec)
            ms = old_states.get(spec.name)
            if ms is not None and ms.digest == digest:
                if ms.spec.fetch_route != spec.fetch_route:
                    log.info(
                        "%s: its sources changed; confirming the copy with them",
                        spec.name,
                        extra={"model": spec.name, "phase": "config"},
                    )
                    ms.reconfirm()
                ms.spec = spec  # required/pin/sources may change without touching the copy
                ms.index = index
                new_states[spec.name] = ms
                continue
            if ms is not None:
                log.info(
                    "%s: its source or filters changed; syncing it again",
                    spec.name,
                    extra={"model": spec.name, "phase": "config"},
                )
                _cancel(ms)
            new_states[spec.name] = self._new_state(spec, digest, index)
        for name, ms in old_states.items():
            if name not in new_states:
                log.info(
                    "%s: removed from the config; it may be evicted when space is needed",
                    name,
                    extra={"model": name, "phase": "config"},
                )
                _cancel(ms)
                self.metrics.forget_model(name)
        self.scheduler.replace(new_states)
        self._record_pins(config)
        for ms in new_states.values():
            self._publish(ms)
        self._poke()

    def _record_pins(self, config: AgentConfig) -> None:
        """Write each cached model's pin (or unpin) from ``config`` now: a pin changed on a model
        already in the cache starts no sync, and it must hold even if the model leaves the
        config before the next one."""
        for spec in config.models:
            try:
                if self.store.record_pin(spec):
                    log.info(
                        "%s: recorded %s",
                        spec.name,
                        "pinned" if spec.pin else "not pinned",
                        extra={"model": spec.name, "phase": "config"},
                    )
            except OSError as exc:
                log.warning("%s: cannot record its pin: %s", spec.name, exc)

    def _new_state(self, spec: ModelSpec, digest: str, index: int) -> ModelState:
        ms = ModelState(spec=spec, digest=digest, index=index)
        if self.store.copy_intact(spec, digest):
            rec = self.store.usage(spec)
            ms.found_copy(rec.get("revision"), rec.get("bytes"), rec.get("synced_at"))
            log.info(
                "%s: a verified copy is in the cache (revision %s); confirming it with the source",
                spec.name,
                ms.revision,
                extra={"model": spec.name, "phase": "start"},
            )
        return ms

    # -- jobs -----------------------------------------------------------------------------------

    def _start_due_jobs(self, now: float) -> None:
        if self.stop.is_set():
            return
        running = sum(1 for t in self._tasks if not t.done())
        intervals = Intervals(self.config.resolve_interval, self.config.verify_interval)
        slots = self.config.parallel_models - running + self._stalled_syncs(now)
        due = self.scheduler.due_jobs(now, intervals, slots)
        self._announce_warming(due)
        for ms, kind in due:
            self._start(ms, kind)

    def _stalled_syncs(self, now: float) -> int:
        """How many running syncs made no progress for ``stallTimeout`` (fewer bytes than
        ``minRate`` delivers in half of it): they do not count against ``parallelModels``, so
        one trickling source cannot keep the other models waiting. The stalled sync goes on
        (its ranges are retried by the engine's stall rule, and it may recover); while it is
        stalled one more model may run. Chosen over ending the attempt after repeated stalls:
        an ended attempt comes back after its backoff and holds the slot again, and a source
        that recovers would have lost its progress to a restart."""
        config = self.config
        enough = max(1, int(config.min_rate * config.stall_timeout / 2))
        stalled = 0
        for ms in self.scheduler.states():
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
                self.warming.stalled(ms.spec.name)  # no one waits for its size either
        return stalled

    def _announce_warming(self, due: list[tuple[ModelState, JobKind]]) -> None:
        """A warming episode begins when syncs start while a required model is not ready (once,
        until every required model is ready again); WarmingStory tells it when they resolved."""
        if self.scheduler.all_required_ready():
            self._warming = False
            return
        if self._warming or not any(kind is JobKind.SYNC for _, kind in due):
            return
        self._warming = True
        cold = [ms for ms in self.scheduler.states() if not ms.ready]
        starting = [ms.spec.name for ms, kind in due if kind is JobKind.SYNC and not ms.ready]
        known = {ms.spec.name: n for ms in cold if (n := ms.bytes_total) is not None}
        self.warming.begin([ms.spec.name for ms in cold], starting, known)

    def _start(self, ms: ModelState, kind: JobKind) -> None:
        stop = threading.Event()
        if self.stop.is_set():
            stop.set()
        parts = self._job_parts()
        job_type = SyncJob if kind is JobKind.SYNC else VerifyJob
        coro = job_type(parts).run(ms, stop)
        task = asyncio.create_task(coro, name=f"{kind}:{ms.spec.name}")
        job = Job(kind, task, stop, time.monotonic())
        if kind is JobKind.SYNC:
            spec = ms.spec
            ms.start_sync(
                job,
                self.metrics.sink(spec.name, spec.source.scheme),
            )
        else:
            ms.start_verify(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._publish(ms)

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
            usage_changed=self._usage_changed,
            loop=self._loop,
            events=self.events,
            warming=self.warming,
        )

    async def _push_caches(self) -> None:
        """One look at the ``push: true`` compile caches (:class:`CachePusher`)."""
        await asyncio.to_thread(self.pusher.run, self.config, self.scheduler, self.stop)

    def _pusher_client(self, config: AgentConfig) -> object:
        """The S3 client compile caches are published with (the tests' own, else one made on
        first use, for the config's endpoint)."""
        if self._s3_client is not None:
            return self._s3_client
        if self._push_client is None:
            from prefetch.sources.s3.source import make_s3_client

            self._push_client = make_s3_client(
                endpoint_url=config.s3_endpoint_url or settings.aws_endpoint_url(),
                ca_bundle=config.ca_bundle,
            )
        return self._push_client

    def _usage_changed(self) -> None:
        """A sync ended: the cache usage metrics are refreshed on the next pass."""
        self._next_usage = 0.0

    # -- the node gate, metrics and usage -------------------------------------------------------

    def _ready_state(self) -> tuple[tuple[str, ...], bool]:
        return self.scheduler.ready_names(), self.scheduler.all_required_ready()

    async def _write_node(self) -> None:
        """The gate, then the progress note: one after the other, so the note's PATCH never
        lands between the gate's GET and its guarded PATCH (which would make it retry)."""
        await self.gate.apply()
        await self.progress.maybe_write()

    def _progress_note(self) -> Note:
        return build_note(
            self.scheduler.states(),
            self.metrics.rate,
            all_ready=self.scheduler.all_required_ready(),
            prefix=self.config.label_prefix,
            taint=self.config.startup_taint,
            now=time.time(),
            compile_caches=frozenset(name for name, _key in self.config.compile_caches),
        )

    def _publish(self, ms: ModelState) -> None:
        self.metrics.set_state(
            ms.spec.name, ms.phase.value, ready=ms.ready, required=ms.spec.required
        )

    def _refresh_metrics(self, now: float) -> None:
        self.metrics.update_rates()
        self.metrics.all_required_ready.set(1 if self.scheduler.all_required_ready() else 0)
        with contextlib.suppress(OSError):
            self.metrics.cache_free.set(self.store.free_bytes())
        if now < self._next_usage:
            return
        models = list(self.scheduler.table().values())
        touch = [ms for ms in models if ms.ready and now - ms.touched >= TOUCH_INTERVAL]
        space = self.space

        async def record_usage() -> None:
            await asyncio.to_thread(space.record_usage, [ms.spec for ms in touch])

        if self._in_background("usage", record_usage):
            self._next_usage = now + USAGE_INTERVAL
            for ms in touch:
                ms.touched = now


def _cancel(ms: ModelState) -> None:
    """Set the stop event of the model's running job, if any."""
    if ms.job is not None:
        ms.job.stop.set()
