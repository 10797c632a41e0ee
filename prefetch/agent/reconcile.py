"""The agent's reconcile loop: the config says which models the node should hold, the Store says
what it holds, and the loop closes the gap through :func:`prefetch.sync.prepare` and
:func:`prefetch.sync.execute`.

One asyncio task ticks every second (its heartbeat is what ``/healthz`` checks). Each tick it
applies a reloaded config, starts the jobs that are due, keeps the node gate in line with the
ready set, and refreshes metrics. Jobs run in worker threads (``asyncio.to_thread``), at most
``parallelModels`` at a time:

* **sync**: :func:`~prefetch.sync.prepare` (resolve the model at its source, take its lock,
  plan), make room for ``plan.bytes_needed`` (evict least-recently-used models that no longer
  are in the config and are not pinned; or fail with a clear reason rather than fill the disk),
  then :func:`~prefetch.sync.execute` the plan. Due when the model has no verified copy yet (after
  its backoff, when it failed), every ``resolveInterval`` for a moved branch or a changed S3
  listing, and right after a re-verification found damage. Syncs run with delete: files gone from
  the source go, and so does a snapshot a moved branch left behind, ``supersededGrace`` after.
* **verify**: every ``verifyInterval``, re-hash the cached files with
  :func:`~prefetch.sync.verify_local` at ``verifyReadRate``. On a mismatch the model first leaves
  the ready set *and the node gate is applied without it*; then the bad files are deleted
  (:func:`~prefetch.sync.forget_failures`) and a sync fetches them again.

A model is *ready* while a complete, verified copy of it is in the cache: after a successful sync,
or at start-up when the copy recorded by an earlier run is still whole (sizes checked). A failed
refresh of a ready model keeps it ready (the copy is still there) and shows the error. One model's
failure never holds up another: each has its own state and exponential backoff
(``retryBackoff``), and a source that trickles or goes silent fails by the engine's stall rule
(``minRate`` over ``stallTimeout``, each attempt) instead of holding a ``parallelModels`` slot,
so the slot passes to the next due model while the stalled one backs off. SIGTERM sets every
job's stop event (the engine starts no new chunk, interrupts reads in flight and leaves
resumable partials), closes the server and returns within the grace period.

The parts, one job each: :mod:`~prefetch.agent.scheduler` (the model table, phases, backoff,
what is due), :mod:`~prefetch.agent.space` (reservations and eviction),
:mod:`~prefetch.agent.gate_driver` (the node's labels and taint) and
:mod:`~prefetch.agent.status` (the /readyz body). :class:`Agent` here wires them: the loop,
config reloads, and the jobs' worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from prefetch import settings
from prefetch.agent.config import AgentConfig, load_config, parse_config, spec_digest
from prefetch.agent.gate_driver import GateDriver, GateFactory
from prefetch.agent.scheduler import (
    Intervals,
    Job,
    JobKind,
    ModelState,
    Scheduler,
    failure_reason,
)
from prefetch.agent.server import HealthServer
from prefetch.agent.space import SpaceManager
from prefetch.agent.status import AgentFacts, JsonObject, readiness_body
from prefetch.agent.watch import ConfigWatcher
from prefetch.errors import ConfigError, PrefetchError
from prefetch.layout import Layout
from prefetch.metrics import AgentMetrics
from prefetch.sources import open_source
from prefetch.sources.base import Source
from prefetch.spec import ModelSpec
from prefetch.store import Store
from prefetch.sync import (
    SyncResult,
    VerifyReport,
    execute,
    forget_failures,
    prepare,
    verify_local,
)
from prefetch.transfer import Cancelled
from prefetch.units import format_bytes

if TYPE_CHECKING:
    from prefetch.sources.hf import HubOptions

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
#: How long a sync waits for another process (prefetch pull/gc) holding the model's lock.
LOCK_TIMEOUT = 60.0

__all__ = ["HEALTH_STALE_AFTER", "LOCK_TIMEOUT", "SHUTDOWN_GRACE", "Agent", "failure_reason"]


class Agent:
    """The node agent. ``await run()`` until :meth:`request_stop` (or SIGTERM when handled).

    It wires the parts: the :class:`Scheduler` (the model table), the :class:`SpaceManager`
    (room for syncs), the :class:`GateDriver` (the node's labels) and the /readyz body
    (:mod:`prefetch.agent.status`); it owns the loop, config reloads and the jobs' threads."""

    def __init__(
        self,
        config_path: Path | None,
        *,
        config: AgentConfig | None = None,
        cache_dir: Path | None = None,
        listen: str | None = None,
        serve: bool = True,
        gate_factory: GateFactory | None = None,
        registry: CollectorRegistry | None = None,
        s3_client: object | None = None,
        hub: HubOptions | None = None,
        tick: float = 1.0,
        handle_signals: bool = False,
        exit_on_stuck: bool = False,
    ) -> None:
        if config_path is None and config is None:
            raise ValueError("give config_path or config")
        self.config_path = config_path
        self._initial = config
        self._serve = serve
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = AgentMetrics(self.registry)
        self._config_file = ConfigFile(
            config_path, self.metrics, cache_dir=cache_dir, listen=listen
        )
        self._sources = SourceOpener(s3_client, hub)
        self._tick = tick
        self._handle_signals = handle_signals
        self._exit_on_stuck = exit_on_stuck
        #: Set on shutdown; every job's own stop event is set with it.
        self.stop = threading.Event()
        self.config: AgentConfig = AgentConfig()
        self.store: Store = Store(Path("."))
        self.server: HealthServer | None = None
        self.scheduler = Scheduler()
        self.space = SpaceManager(self.store, self.metrics)
        self.gate = GateDriver(gate_factory or (lambda cfg: None), self.metrics, self._ready_state)
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
        self.stuck = False
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
        # in the background: a slow API server must not stall the loop's heartbeat
        self._in_background("gate", self.gate.apply)
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
                self.stuck = True
                log.warning(
                    "%d job(s) did not stop within %.0fs; exiting anyway (partials resume)",
                    len(pending),
                    SHUTDOWN_GRACE,
                    extra={"phase": "shutdown"},
                )
                if self._exit_on_stuck:
                    logging.shutdown()
                    os._exit(0)
        log.info("agent stopped", extra={"phase": "shutdown"})

    # -- config ---------------------------------------------------------------------------------

    def _adopt_first(self, config: AgentConfig) -> None:
        config = self._config_file.overridden(config)
        self.config = config
        self.store = Store(config.cache_dir)
        self.space = SpaceManager(self.store, self.metrics)
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
                ms.spec = spec  # required/pin may change without touching the copy
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
        slots = self.config.parallel_models - running
        for ms, kind in self.scheduler.due_jobs(now, intervals, slots):
            self._start(ms, kind)

    def _start(self, ms: ModelState, kind: JobKind) -> None:
        stop = threading.Event()
        if self.stop.is_set():
            stop.set()
        coro = self._sync_job(ms, stop) if kind is JobKind.SYNC else self._verify_job(ms, stop)
        task = asyncio.create_task(coro, name=f"{kind}:{ms.spec.name}")
        job = Job(kind, task, stop, time.monotonic())
        if kind is JobKind.SYNC:
            spec = ms.spec
            ms.start_sync(
                job,
                self.metrics.sink(spec.name, spec.source.scheme, chunk_size=self.config.chunk_size),
            )
        else:
            ms.start_verify(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._publish(ms)

    # -- sync -----------------------------------------------------------------------------------

    async def _sync_job(self, ms: ModelState, stop: threading.Event) -> None:
        spec, config = ms.spec, self.config
        try:
            result = await asyncio.to_thread(self._sync_blocking, ms, config, stop)
        except Cancelled:
            log.info(
                "%s: sync stopped; the partial download resumes next time",
                spec.name,
                extra={"model": spec.name, "phase": "sync"},
            )
            if self.scheduler.current(ms):
                ms.sync_cancelled()
        except Exception as exc:
            if self.scheduler.current(ms):
                self._sync_failed(ms, exc)
        else:
            if self.scheduler.current(ms):
                self._sync_ok(ms, result)
        finally:
            ms.job = None
            if self.scheduler.current(ms):
                self._publish(ms)
            self._next_usage = 0.0
            self._poke()

    def _sync_blocking(
        self, ms: ModelState, config: AgentConfig, stop: threading.Event
    ) -> SyncResult:
        """In a worker thread: resolve and plan under the model's lock, make room, sync."""
        spec, sink = ms.spec, ms.sink
        assert sink is not None  # start_sync gave the job its sink
        with self.space.busy(spec):
            layout = self.store.layout(spec)
            source = self._sources(spec, config)
            fresh = not self.store.entry_dir(spec).exists()
            with (
                prepare(spec, source, layout, lock_timeout=LOCK_TIMEOUT) as plan,
                contextlib.ExitStack() as room,
            ):
                try:
                    if stop.is_set():
                        raise Cancelled("stopped")
                    if ms.ready and not self.store.copy_intact(spec, ms.digest):
                        self._in_loop(self._drop_ready(ms, "cached files are missing or truncated"))
                    room.enter_context(
                        self.space.reserved(
                            spec,
                            plan.bytes_needed,
                            wanted=config.models,
                            min_free=config.min_free_space,
                            sink=sink,
                        )
                    )
                except BaseException:
                    if fresh:  # prepare made the entry only to hold its lock: leave no trace
                        shutil.rmtree(self.store.entry_dir(spec), ignore_errors=True)
                    raise
                result = execute(
                    plan,
                    config.transfer_config(),
                    progress=sink,
                    delete=True,
                    stop=stop,
                    superseded_grace=config.superseded_grace,
                    check_space=False,  # room was made, keeping minFreeSpace
                )
            self.store.record_sync(
                spec,
                digest=ms.digest,
                revision=result.revision,
                files=result.files,
                bytes_total=result.bytes_total,
            )
            return result

    def _sync_ok(self, ms: ModelState, result: SyncResult) -> None:
        spec = ms.spec
        ms.sync_succeeded(result, time.monotonic())
        self.metrics.last_success.labels(spec.name).set(ms.last_success or 0.0)
        self.metrics.model_size.labels(spec.name).set(result.bytes_total)
        self.metrics.remaining_bytes.labels(spec.name).set(0)
        if result.up_to_date:
            log.debug("%s: up to date at %s", spec.name, result.revision)
            return
        self.metrics.sync_duration.labels(spec.name).observe(result.seconds)
        rate = result.bytes_downloaded / result.seconds if result.seconds else 0.0
        removed = f"; removed {len(result.deleted)} file(s)" if result.deleted else ""
        log.info(
            "%s: synced revision %s: %d file(s), %s downloaded in %.1fs%s",
            spec.name,
            result.revision[:12],
            result.files_downloaded,
            format_bytes(result.bytes_downloaded),
            result.seconds,
            removed,
            extra={
                "model": spec.name,
                "phase": "sync",
                "bytes": result.bytes_downloaded,
                "rate": round(rate),
            },
        )

    def _sync_failed(self, ms: ModelState, exc: BaseException) -> None:
        spec = ms.spec
        delay = ms.sync_failed(exc, time.monotonic(), self.config.retry_backoff)
        self.metrics.sync_failures.labels(spec.name, ms.error_reason).inc()
        log.warning(
            "%s: sync failed (%s), next try in %.0fs%s: %s",
            spec.name,
            ms.error_reason,
            delay,
            "; the cached copy stays in use" if ms.ready else "",
            ms.last_error,
            exc_info=not isinstance(exc, PrefetchError),
            extra={"model": spec.name, "phase": "sync", "error": ms.last_error},
        )

    # -- re-verification ------------------------------------------------------------------------

    async def _verify_job(self, ms: ModelState, stop: threading.Event) -> None:
        spec = ms.spec
        try:
            layout = self.store.layout(spec)
            report = await asyncio.to_thread(
                verify_local, layout, read_rate=self.config.verify_read_rate, stop=stop
            )
            if report is None:  # stopped
                return
            if report.ok:
                await self._verified(ms, report)
            else:
                await self._verify_found_damage(ms, layout, report)
        except Exception as exc:
            self.metrics.verifications.labels(spec.name, "failed").inc()
            log.error(
                "%s: re-verification could not run: %s",
                spec.name,
                exc,
                extra={"model": spec.name, "phase": "verify", "error": str(exc)},
            )
            if self.scheduler.current(ms):
                await self._drop_ready(ms, f"re-verification could not run: {exc}")
            ms.refetch = True
        finally:
            current = self.scheduler.current(ms)
            ms.verify_finished(time.monotonic(), current=current)
            if current:
                self._publish(ms)
            self._poke()

    async def _verified(self, ms: ModelState, report: VerifyReport) -> None:
        spec = ms.spec
        self.metrics.verifications.labels(spec.name, "ok").inc()
        await asyncio.to_thread(self.store.record_verify, spec, ok=True)
        ms.verify_passed(time.monotonic())
        log.info(
            "%s: re-verified %d file(s) at rest",
            spec.name,
            len(report.checked),
            extra={"model": spec.name, "phase": "verify"},
        )

    async def _verify_found_damage(
        self, ms: ModelState, layout: Layout, report: VerifyReport
    ) -> None:
        """Out of the ready set (and the node gate) first, then delete the bad files and sync."""
        spec = ms.spec
        self.metrics.verifications.labels(spec.name, "failed").inc()
        mismatches = report.mismatched_paths()
        if mismatches:
            self.metrics.checksum_failures.labels(spec.name, "reverify").inc(len(mismatches))
        reason = "; ".join(str(f) for f in report.failures[:3])
        log.error(
            "%s: re-verification failed, re-fetching: %s",
            spec.name,
            reason,
            extra={"model": spec.name, "phase": "verify", "error": reason},
        )
        if self.scheduler.current(ms):
            await self._drop_ready(ms, f"re-verification failed: {reason}")
        await asyncio.to_thread(forget_failures, layout, report)
        await asyncio.to_thread(self.store.record_verify, spec, ok=False)
        ms.refetch = True

    async def _drop_ready(self, ms: ModelState, reason: str) -> None:
        """Take a model out of the ready set and out of the node's labels before touching it."""
        ms.drop_ready(reason)
        self._publish(ms)
        log.warning(
            "%s: no longer ready: %s",
            ms.spec.name,
            reason,
            extra={"model": ms.spec.name, "phase": "verify", "error": reason},
        )
        await self.gate.apply(force=True)

    def _in_loop(self, coro: Coroutine[object, object, None]) -> None:
        """From a worker thread: run ``coro`` on the loop and wait for it."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=300)

    # -- the node gate, metrics and usage -------------------------------------------------------

    def _ready_state(self) -> tuple[tuple[str, ...], bool]:
        return self.scheduler.ready_names(), self.scheduler.all_required_ready()

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


class ConfigFile:
    """The config file as the agent reads it: parsed, with the command line's overrides, and
    each content acted on once (unchanged bytes, or a rejection already reported, are quiet)."""

    def __init__(
        self,
        path: Path | None,
        metrics: AgentMetrics,
        *,
        cache_dir: Path | None = None,
        listen: str | None = None,
    ) -> None:
        self.path = path
        self._metrics = metrics
        self._cache_dir = cache_dir
        self._listen = listen
        self._seen_digest = ""
        #: Why the last reload was rejected (shown on /readyz); None after a good one.
        self.last_error: str | None = None

    def overridden(self, config: AgentConfig) -> AgentConfig:
        return config.with_overrides(cache_dir=self._cache_dir, listen=self._listen)

    def load_first(self) -> AgentConfig:
        """At start-up: the file must load (errors are the process's)."""
        assert self.path is not None
        config = load_config(self.path)
        self._seen_digest = config.digest
        return config

    async def read_changed(self) -> AgentConfig | None:
        """The file's config (overridden) if it parses and differs from the last one seen; None
        when unchanged or rejected (why is in :attr:`last_error`, logged once)."""
        if self.path is None:
            return None
        try:
            data = await asyncio.to_thread(self.path.read_bytes)
        except OSError as exc:
            message = f"{self.path}: cannot read: {exc.strerror or exc}"
            self._reject(message, "unreadable:" + message)
            return None
        try:
            new = parse_config(data, path=self.path)
        except ConfigError as exc:
            self._reject(str(exc), hashlib.sha256(data).hexdigest())
            return None
        if new.digest == self._seen_digest:
            return None
        self._seen_digest = new.digest
        return self.overridden(new)

    def accepted(self) -> None:
        """The config :meth:`read_changed` returned is in use."""
        self.last_error = None
        self._metrics.config_last_reload_successful.set(1)

    def _reject(self, message: str, digest: str) -> None:
        if digest == self._seen_digest:
            return  # already rejected these very bytes (or this very error)
        self._seen_digest = digest
        self.last_error = message
        self._metrics.config_reload_failures.inc()
        self._metrics.config_last_reload_successful.set(0)
        log.error(
            "config reload rejected, the last good config keeps running: %s",
            message,
            extra={"phase": "config", "error": message},
        )


class SourceOpener:
    """Opens each model's Source; S3 models share one client per (endpoint, pool size), sized
    for ``concurrency`` streams of each of ``parallelModels`` syncs."""

    def __init__(self, s3_client: object | None, hub: HubOptions | None) -> None:
        self._s3_client = s3_client
        self._s3_clients: dict[tuple[str | None, int], object] = {}
        self._hub = hub

    def __call__(self, spec: ModelSpec, config: AgentConfig) -> Source:
        if spec.source.scheme != "s3":
            return open_source(spec, hub=self._hub, concurrency=config.concurrency)
        client = self._s3_client
        if client is None:
            endpoint = config.s3_endpoint_url or settings.aws_endpoint_url()
            pool = config.concurrency * config.parallel_models + 8
            client = self._s3_clients.get((endpoint, pool))
            if client is None:
                from prefetch.sources.s3 import make_s3_client

                client = make_s3_client(endpoint_url=endpoint, max_pool_connections=pool)
                self._s3_clients[(endpoint, pool)] = client
        return open_source(spec, s3_client=client, concurrency=config.concurrency)
