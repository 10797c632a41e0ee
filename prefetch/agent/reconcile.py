"""The agent's reconcile loop: the config says which models the node should hold, the Store says
what it holds, and the loop closes the gap through :func:`prefetch.sync.sync`.

One asyncio task ticks every second (its heartbeat is what ``/healthz`` checks). Each tick it
applies a reloaded config, starts the jobs that are due, keeps the node gate in line with the
ready set, and refreshes metrics. Jobs run in worker threads (``asyncio.to_thread``), at most
``parallelModels`` at a time:

* **sync**: resolve the model at its source, make room (evict least-recently-used models that no
  longer are in the config and are not pinned; or fail with a clear reason rather than fill the
  disk), then :func:`~prefetch.sync.sync` it. Due when the model has no verified copy yet (after
  its backoff, when it failed), every ``resolveInterval`` for a moved branch or a changed S3
  listing, and right after a re-verification found damage. Syncs run with delete: files gone from
  the source go, and so does a snapshot a moved branch left behind, ``supersededGrace`` after.
* **verify**: every ``verifyInterval``, re-hash the cached files with
  :func:`~prefetch.sync.verify_local` at ``verifyReadRate``. On a mismatch the model first leaves
  the ready set *and the node gate is applied without it*; then the bad files are deleted and a
  sync fetches them again.

A model is *ready* while a complete, verified copy of it is in the cache: after a successful sync,
or at start-up when the copy recorded by an earlier run is still whole (sizes checked). A failed
refresh of a ready model keeps it ready (the copy is still there) and shows the error. One model's
failure never holds up another: each has its own state and exponential backoff
(``retryBackoff``), and a source that trickles or goes silent fails by the engine's stall rule
(``minRate`` over ``stallTimeout``, each attempt) instead of holding a ``parallelModels`` slot,
so the slot passes to the next due model while the stalled one backs off. SIGTERM sets every
job's stop event (the engine starts no new chunk, interrupts reads in flight and leaves
resumable partials), closes the server and returns within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from prefetch.agent.config import AgentConfig, load_config, parse_config, spec_digest
from prefetch.agent.server import HealthServer
from prefetch.agent.watch import ConfigWatcher
from prefetch.errors import (
    AccessDeniedError,
    ConfigError,
    InsufficientSpaceError,
    LayoutError,
    LockTimeoutError,
    NotFoundError,
    PrefetchError,
    SourceChangedError,
    SourceError,
    TransferError,
    TransientSourceError,
    VerifyError,
)
from prefetch.layout import Layout, RecordedFile
from prefetch.logjson import scrub
from prefetch.metrics import AgentMetrics, MetricsSink
from prefetch.sources import open_source
from prefetch.sources.base import Source
from prefetch.spec import ModelSpec
from prefetch.store import Store
from prefetch.sync import SPACE_MARGIN, SyncResult, VerifyReport, plan, sync, verify_local
from prefetch.transfer import Cancelled, staged_name
from prefetch.units import format_bytes

log = logging.getLogger(__name__)

#: Seconds without a completed loop pass after which /healthz fails.
HEALTH_STALE_AFTER = 60.0
#: Seconds SIGTERM waits for running jobs before the process exits anyway.
SHUTDOWN_GRACE = 20.0
#: Re-read the config file this often even without a watchdog event (belt and braces).
CONFIG_POLL_INTERVAL = 30.0
#: Wait this long after a config change event before reading (kubelet swaps in a few steps).
CONFIG_DEBOUNCE = 0.3
#: Re-apply the node gate this often even when nothing changed (repairs foreign edits).
GATE_REFRESH_INTERVAL = 60.0
GATE_RETRY_INTERVAL = 10.0
#: Record "still wanted" on each cached entry this often (it orders eviction).
TOUCH_INTERVAL = 300.0
#: Refresh the cache usage metrics this often.
USAGE_INTERVAL = 30.0
#: How long a sync waits for another process (prefetch pull/gc) holding the model's lock.
LOCK_TIMEOUT = 60.0

_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (InsufficientSpaceError, "insufficient_space"),
    (NotFoundError, "not_found"),
    (AccessDeniedError, "access_denied"),
    (TransientSourceError, "transient"),
    (SourceChangedError, "source_changed"),
    (SourceError, "source"),
    (VerifyError, "verify"),
    (LockTimeoutError, "locked"),
    (LayoutError, "layout"),
    (TransferError, "transfer"),
    (ConfigError, "config"),
    (PrefetchError, "error"),
)

GateFactory = Callable[[AgentConfig], Any]  # -> NodeGate | None


def failure_reason(exc: BaseException) -> str:
    """A small fixed vocabulary for the ``reason`` label of failures."""
    for cls, reason in _REASONS:
        if isinstance(exc, cls):
            return reason
    return "internal"


@dataclass
class _Job:
    kind: str  # "sync" | "verify"
    task: asyncio.Task[None]
    stop: threading.Event
    started: float


@dataclass
class _Reservation:
    """Disk space a running sync will still take (so parallel syncs do not both count it)."""

    needed: int
    sink: MetricsSink

    @property
    def remaining(self) -> int:
        return max(self.needed - self.sink.done, 0)


@dataclass
class ModelState:
    """What the agent knows about one configured model (mutated on the loop only)."""

    spec: ModelSpec
    digest: str
    index: int = 0
    state: str = "pending"
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
    job: _Job | None = None
    sink: MetricsSink | None = None


class Agent:
    """The node agent. ``await run()`` until :meth:`request_stop` (or SIGTERM when handled)."""

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
        s3_client: Any = None,
        hub: Any = None,
        tick: float = 1.0,
        handle_signals: bool = False,
        exit_on_stuck: bool = False,
    ) -> None:
        if config_path is None and config is None:
            raise ValueError("give config_path or config")
        self.config_path = config_path
        self._initial = config
        self._cache_override = cache_dir
        self._listen_override = listen
        self._serve = serve
        self._gate_factory = gate_factory or (lambda cfg: None)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = AgentMetrics(self.registry)
        self._s3_client = s3_client
        self._s3_clients: dict[tuple[str | None, int], Any] = {}
        self._hub = hub
        self._tick = tick
        self._handle_signals = handle_signals
        self._exit_on_stuck = exit_on_stuck
        #: Set on shutdown; every job's own stop event is set with it.
        self.stop = threading.Event()
        self.config: AgentConfig = AgentConfig()
        self.store: Store = Store(Path("."))
        self.server: HealthServer | None = None
        self._models: dict[str, ModelState] = {}
        self._lock = threading.Lock()  # guards _models' structure for the HTTP thread
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._gate: Any = None
        self._gate_lock: asyncio.Lock | None = None
        self._gate_applied: tuple[tuple[str, ...], bool] | None = None
        self._gate_at = float("-inf")
        self._gate_error: str | None = None
        self._gate_retry_at = 0.0
        self._seen_digest = ""
        self._config_error: str | None = None
        self._config_loaded_at: float | None = None
        self._reload_at: float | None = None
        self._next_poll = 0.0
        self._next_usage = 0.0
        self._usage_task: asyncio.Task[None] | None = None
        self._gate_task: asyncio.Task[None] | None = None
        self._space_lock = threading.Lock()
        self._reserved: dict[str, _Reservation] = {}
        self._busy: dict[str, int] = {}
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

    def readiness(self) -> tuple[int, dict[str, Any]]:
        body = self.status()
        return (200 if body["ready"] else 503), body

    def status(self) -> dict[str, Any]:
        """What /readyz shows: overall readiness and, per model, what is missing and why."""
        now = time.monotonic()
        with self._lock:
            states = sorted(self._models.values(), key=lambda m: m.index)
        models = [self._model_status(ms, now) for ms in states]
        required = [m for m in models if m["required"]]
        missing = [m["name"] for m in required if not m["ready"]]
        ready = self._config_loaded_at is not None and not missing
        if ready:
            summary = "all required models are ready"
        elif missing:
            summary = f"waiting for {len(missing)} required model(s): {', '.join(missing)}"
        else:
            summary = "starting"
        return {
            "ready": ready,
            "summary": summary,
            "models": models,
            "config": {
                "path": str(self.config_path) if self.config_path else None,
                "digest": self.config.digest[:12] or None,
                "last_reload_error": self._config_error,
            },
            "gate": {"enabled": self._gate is not None, "last_error": self._gate_error},
        }

    def _model_status(self, ms: ModelState, now: float) -> dict[str, Any]:
        sink = ms.sink
        remaining: int | None
        if sink is not None and ms.job is not None and ms.job.kind == "sync":
            remaining = sink.remaining
            files_left: int | None = max(sink.files_total - sink.files_done, 0)
        else:
            remaining = 0 if ms.ready else None
            files_left = 0 if ms.ready else None
        if ms.ready:
            detail = "verified copy in the cache"
            if ms.state == "updating":
                detail += f"; updating: {format_bytes(remaining or 0)} to fetch"
            elif ms.last_error:
                detail += f"; last refresh failed: {ms.last_error}"
        elif ms.state == "syncing":
            detail = (
                f"downloading: {format_bytes(remaining)} left in {files_left} file(s)"
                if remaining is not None and sink is not None and sink.total
                else "resolving the source"
            )
        elif ms.state == "failed":
            wait = math.ceil(max(ms.next_attempt - now, 0.0))
            when = f"next try in {wait}s" if wait else "retrying now"
            detail = f"failed ({ms.error_reason}): {ms.last_error}; {when}"
        elif ms.state == "verifying":
            detail = "re-verifying cached files"
        else:
            detail = "not synced yet"
        return {
            "name": ms.spec.name,
            "source": str(ms.spec.source),
            "required": ms.spec.required,
            "pinned": ms.spec.pin,
            "state": ms.state,
            "ready": ms.ready,
            "detail": detail,
            "revision": ms.revision,
            "bytes_total": ms.bytes_total
            if ms.bytes_total is not None or sink is None or not sink.total
            else sink.total,
            "bytes_remaining": remaining,
            "files_remaining": files_left,
            "last_error": ms.last_error,
            "error_reason": ms.error_reason,
            "failures": ms.failures,
            "last_success": _iso(ms.last_success),
        }

    # -- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._gate_lock = asyncio.Lock()
        config = self._initial if self._initial is not None else self._read_initial_config()
        self._adopt_first(config)
        if self._handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._on_signal, sig)
        watcher: ConfigWatcher | None = None
        try:
            if self.config_path is not None:
                watcher = ConfigWatcher(self.config_path, self._config_event)
                watcher.start()
            self._gate = self._gate_factory(self.config)
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
        if self._gate_task is None or self._gate_task.done():
            # in the background: a slow API server must not stall the loop's heartbeat
            self._gate_task = asyncio.create_task(self._apply_gate())
        self._refresh_metrics(now)
        self.passes += 1
        self._beat = time.monotonic()

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
        for ms in self._models.values():
            if ms.job is not None:
                ms.job.stop.set()
        self._poke()

    async def _shutdown(self) -> None:
        self._running = False
        self.stop.set()
        self._stop_jobs()
        if self.server is not None:
            self.server.stop()
        tasks = [t for t in self._tasks if not t.done()]
        tasks += [t for t in (self._usage_task, self._gate_task) if t is not None and not t.done()]
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

    def _read_initial_config(self) -> AgentConfig:
        assert self.config_path is not None
        config = load_config(self.config_path)
        self._seen_digest = config.digest
        return config

    def _overridden(self, config: AgentConfig) -> AgentConfig:
        return config.with_overrides(cache_dir=self._cache_override, listen=self._listen_override)

    def _adopt_first(self, config: AgentConfig) -> None:
        config = self._overridden(config)
        self.config = config
        self.store = Store(config.cache_dir)
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
        if self.config_path is None:
            return
        try:
            data = await asyncio.to_thread(self.config_path.read_bytes)
        except OSError as exc:
            message = f"{self.config_path}: cannot read: {exc.strerror or exc}"
            self._reject_config(message, "unreadable:" + message)
            return
        try:
            new = parse_config(data, path=self.config_path)
        except ConfigError as exc:
            self._reject_config(str(exc), hashlib.sha256(data).hexdigest())
            return
        if new.digest == self._seen_digest:
            return
        self._seen_digest = new.digest
        new = self._overridden(new)
        old = self.config
        if new.cache_dir != old.cache_dir or new.listen != old.listen:
            log.warning(
                "cacheDir and listen changes take effect after a restart; keeping %s, %s",
                old.cache_dir,
                old.listen,
                extra={"phase": "config"},
            )
            new = dataclasses.replace(new, cache_dir=old.cache_dir, listen=old.listen)
        self._config_error = None
        self.metrics.config_last_reload_successful.set(1)
        if (new.label_prefix, new.startup_taint) != (old.label_prefix, old.startup_taint):
            await self._replace_gate(new)
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

    def _reject_config(self, message: str, digest: str) -> None:
        if digest == self._seen_digest:
            return  # already rejected these very bytes (or this very error)
        self._seen_digest = digest
        self._config_error = message
        self.metrics.config_reload_failures.inc()
        self.metrics.config_last_reload_successful.set(0)
        log.error(
            "config reload rejected, the last good config keeps running: %s",
            message,
            extra={"phase": "config", "error": message},
        )

    async def _replace_gate(self, new: AgentConfig) -> None:
        old_gate = self._gate
        if old_gate is not None:
            try:  # take our labels off under the old prefix; the taint is never put back
                await asyncio.to_thread(old_gate.apply, [], False)
            except Exception as exc:
                log.warning("could not remove the labels under the old prefix: %s", exc)
        self._gate = self._gate_factory(new)
        self._gate_applied = None

    def _set_models(self, config: AgentConfig) -> None:
        """Make the model table match ``config``: add, drop (cancelling jobs), re-spec."""
        new_states: dict[str, ModelState] = {}
        for index, spec in enumerate(config.models):
            digest = spec_digest(spec)
            ms = self._models.get(spec.name)
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
                self._cancel(ms)
            new_states[spec.name] = self._new_state(spec, digest, index)
        for name, ms in self._models.items():
            if name not in new_states:
                log.info(
                    "%s: removed from the config; it may be evicted when space is needed",
                    name,
                    extra={"model": name, "phase": "config"},
                )
                self._cancel(ms)
                self.metrics.forget_model(name)
        with self._lock:
            self._models = new_states
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
            ms.ready = True
            ms.state = "ready"
            ms.revision = rec.get("revision")
            ms.bytes_total = rec.get("bytes")
            ms.last_success = rec.get("synced_at")
            log.info(
                "%s: a verified copy is in the cache (revision %s); confirming it with the source",
                spec.name,
                ms.revision,
                extra={"model": spec.name, "phase": "start"},
            )
        return ms

    def _cancel(self, ms: ModelState) -> None:
        if ms.job is not None:
            ms.job.stop.set()

    # -- scheduling -----------------------------------------------------------------------------

    def _due(self, ms: ModelState, now: float) -> str | None:
        if ms.job is not None:
            return None
        cfg = self.config
        if ms.refetch:
            return "sync"
        if not ms.ready or ms.last_error is not None:
            return "sync" if now >= ms.next_attempt else None
        if ms.last_resolved is None:
            return "sync"  # a copy found at start-up: confirm it with the source
        if cfg.resolve_interval and now - ms.last_resolved >= cfg.resolve_interval:
            return "sync"
        since = ms.last_verified if ms.last_verified is not None else ms.last_resolved
        if cfg.verify_interval and now - since >= cfg.verify_interval:
            return "verify"
        return None

    def _start_due_jobs(self, now: float) -> None:
        if self.stop.is_set():
            return
        running = sum(1 for t in self._tasks if not t.done())
        slots = self.config.parallel_models - running
        if slots <= 0:
            return
        due = [(ms, kind) for ms in self._models.values() if (kind := self._due(ms, now))]
        # required models first, then those without a copy, then in config order
        due.sort(key=lambda d: (not d[0].spec.required, d[0].ready, d[0].index))
        for ms, kind in due[:slots]:
            self._start(ms, kind)

    def _start(self, ms: ModelState, kind: str) -> None:
        stop = threading.Event()
        if self.stop.is_set():
            stop.set()
        if kind == "sync":
            ms.state = "updating" if ms.ready else "syncing"
            coro = self._sync_job(ms, stop)
        else:
            ms.state = "verifying"
            coro = self._verify_job(ms, stop)
        task = asyncio.create_task(coro, name=f"{kind}:{ms.spec.name}")
        ms.job = _Job(kind, task, stop, time.monotonic())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._publish(ms)

    def _current(self, ms: ModelState) -> bool:
        return self._models.get(ms.spec.name) is ms

    # -- sync -----------------------------------------------------------------------------------

    async def _sync_job(self, ms: ModelState, stop: threading.Event) -> None:
        spec, config = ms.spec, self.config
        sink = self.metrics.sink(spec.name, spec.source.scheme, chunk_size=config.chunk_size)
        ms.sink = sink
        try:
            result = await asyncio.to_thread(self._sync_blocking, ms, config, sink, stop)
        except Cancelled:
            log.info(
                "%s: sync stopped; the partial download resumes next time",
                spec.name,
                extra={"model": spec.name, "phase": "sync"},
            )
            if self._current(ms):
                ms.state = "ready" if ms.ready else "pending"
        except Exception as exc:
            if self._current(ms):
                self._sync_failed(ms, exc)
        else:
            if self._current(ms):
                self._sync_ok(ms, result)
        finally:
            ms.job = None
            if self._current(ms):
                self._publish(ms)
            self._next_usage = 0.0
            self._poke()

    def _sync_blocking(
        self, ms: ModelState, config: AgentConfig, sink: MetricsSink, stop: threading.Event
    ) -> SyncResult:
        """In a worker thread: resolve, make room, sync."""
        spec = ms.spec
        key = self.store.entry_key(spec)
        with self._space_lock:
            self._busy[key] = self._busy.get(key, 0) + 1
        try:
            layout = self.store.layout(spec)
            source = self._open_source(spec, config)
            snapshot = source.resolve(spec)
            if stop.is_set():
                raise Cancelled("stopped")
            if ms.ready and not self.store.copy_intact(spec, ms.digest):
                self._in_loop(self._drop_ready(ms, "cached files are missing or truncated"))
            todo = plan(snapshot, layout)
            needed = _bytes_needed(layout, todo)
            self._make_room(spec, needed, config, sink)
            try:
                result = sync(
                    spec,
                    source,
                    layout,
                    config.transfer_config(),
                    progress=sink,
                    delete=True,
                    stop=stop,
                    lock_timeout=LOCK_TIMEOUT,
                    snapshot=snapshot,
                    superseded_grace=config.superseded_grace,
                )
            finally:
                with self._space_lock:
                    self._reserved.pop(spec.name, None)
            self.store.record_sync(
                spec,
                digest=ms.digest,
                revision=result.revision,
                files=result.files,
                bytes_total=result.bytes_total,
            )
            return result
        finally:
            with self._space_lock:
                self._busy[key] -= 1
                if not self._busy[key]:
                    del self._busy[key]

    def _open_source(self, spec: ModelSpec, config: AgentConfig) -> Source:
        if spec.source.scheme != "s3":
            return open_source(spec, hub=self._hub, concurrency=config.concurrency)
        client = self._s3_client
        if client is None:
            endpoint = config.s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
            pool = config.concurrency * config.parallel_models + 8
            client = self._s3_clients.get((endpoint, pool))
            if client is None:
                from prefetch.sources.s3 import make_s3_client

                client = make_s3_client(endpoint_url=endpoint, max_pool_connections=pool)
                self._s3_clients[(endpoint, pool)] = client
        return open_source(spec, s3_client=client, concurrency=config.concurrency)

    def _make_room(
        self, spec: ModelSpec, needed: int, config: AgentConfig, sink: MetricsSink
    ) -> None:
        """Ensure ``needed`` bytes fit while keeping ``minFreeSpace`` free, evicting LRU unwanted
        entries if that makes it fit; otherwise raise InsufficientSpaceError and evict nothing."""
        if needed <= 0:
            return
        keep = max(config.min_free_space, SPACE_MARGIN)
        with self._space_lock:
            others = sum(r.remaining for k, r in self._reserved.items() if k != spec.name)

            def available() -> int:
                return self.store.free_bytes() - others

            free = available()
            if needed + keep <= free:
                self._reserved[spec.name] = _Reservation(needed, sink)
                return
            candidates = self.store.eviction_candidates(config.models, busy=set(self._busy))
            evictable = sum(c.size for c in candidates)
            if needed + keep > free + evictable:
                raise InsufficientSpaceError(
                    f"{spec.name}: not enough disk space: needs {format_bytes(needed)} and keeps "
                    f"{format_bytes(keep)} free (minFreeSpace), but {format_bytes(max(free, 0))} "
                    f"is free and evicting all {len(candidates)} unwanted, unpinned model(s) "
                    f"would free only {format_bytes(evictable)} more",
                    hint="use a larger cache volume, drop models from the config, or unpin "
                    "models no longer needed",
                )
            for entry in candidates:
                try:
                    freed = self.store.evict(entry, lock_timeout=5.0)
                except LockTimeoutError:
                    log.info("skipping eviction of %s: it is locked", entry.key)
                    continue
                self.metrics.evictions.labels("disk_pressure").inc()
                self.metrics.evicted_bytes.labels("disk_pressure").inc(freed)
                log.info(
                    "evicted %s (%s, last used %s) to make room for %s",
                    entry.key,
                    format_bytes(entry.size),
                    _iso(entry.last_used),
                    spec.name,
                    extra={"model": spec.name, "phase": "evict", "bytes": freed},
                )
                free = available()
                if needed + keep <= free:
                    break
            if needed + keep > free:
                raise InsufficientSpaceError(
                    f"{spec.name}: not enough disk space even after evicting: needs "
                    f"{format_bytes(needed)} and keeps {format_bytes(keep)} free, "
                    f"{format_bytes(max(free, 0))} is free",
                    hint="files held open by running pods free their space only when closed",
                )
            self._reserved[spec.name] = _Reservation(needed, sink)

    def _sync_ok(self, ms: ModelState, result: SyncResult) -> None:
        now = time.monotonic()
        spec = ms.spec
        ms.ready = True
        ms.state = "ready"
        ms.revision = result.revision
        ms.bytes_total = result.bytes_total
        ms.failures = 0
        ms.last_error = ms.error_reason = None
        ms.refetch = False
        ms.last_resolved = now
        if ms.last_verified is None:
            ms.last_verified = now
        ms.last_success = time.time()
        ms.touched = now
        self.metrics.last_success.labels(spec.name).set(ms.last_success)
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
        now = time.monotonic()
        spec = ms.spec
        ms.failures += 1
        delay = self.config.retry_backoff.delay(ms.failures) * random.uniform(0.9, 1.1)
        ms.next_attempt = now + delay
        ms.last_error = scrub(str(exc))
        ms.error_reason = failure_reason(exc)
        ms.state = "ready" if ms.ready else "failed"
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
                _verify_files, layout, self.config.verify_read_rate, stop
            )
            if report is None:  # stopped
                return
            if report.ok:
                self.metrics.verifications.labels(spec.name, "ok").inc()
                await asyncio.to_thread(self.store.record_verify, spec, ok=True)
                ms.last_verified = time.monotonic()
                log.info(
                    "%s: re-verified %d file(s) at rest",
                    spec.name,
                    len(report.checked),
                    extra={"model": spec.name, "phase": "verify"},
                )
                return
            self.metrics.verifications.labels(spec.name, "failed").inc()
            mismatches = [f for f in report.failures if getattr(f, "path", None)]
            if mismatches:
                self.metrics.checksum_failures.labels(spec.name, "reverify").inc(len(mismatches))
            reason = "; ".join(str(f) for f in report.failures[:3])
            log.error(
                "%s: re-verification failed, re-fetching: %s",
                spec.name,
                reason,
                extra={"model": spec.name, "phase": "verify", "error": reason},
            )
            if self._current(ms):
                await self._drop_ready(ms, f"re-verification failed: {reason}")
            await asyncio.to_thread(_forget_failures, layout, report)
            await asyncio.to_thread(self.store.record_verify, spec, ok=False)
            ms.refetch = True
        except Exception as exc:
            self.metrics.verifications.labels(spec.name, "failed").inc()
            log.error(
                "%s: re-verification could not run: %s",
                spec.name,
                exc,
                extra={"model": spec.name, "phase": "verify", "error": str(exc)},
            )
            if self._current(ms):
                await self._drop_ready(ms, f"re-verification could not run: {exc}")
            ms.refetch = True
        finally:
            ms.job = None
            ms.last_verified = time.monotonic()
            if self._current(ms):
                if ms.state == "verifying":
                    ms.state = "ready" if ms.ready else "pending"
                self._publish(ms)
            self._poke()

    async def _drop_ready(self, ms: ModelState, reason: str) -> None:
        """Take a model out of the ready set and out of the node's labels before touching it."""
        ms.ready = False
        ms.last_error = reason
        ms.error_reason = "verify"
        ms.last_verified = None
        self._publish(ms)
        log.warning(
            "%s: no longer ready: %s",
            ms.spec.name,
            reason,
            extra={"model": ms.spec.name, "phase": "verify", "error": reason},
        )
        await self._apply_gate(force=True)

    def _in_loop(self, coro: Any) -> Any:
        """From a worker thread: run ``coro`` on the loop and wait for it."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=300)

    # -- the node gate --------------------------------------------------------------------------

    async def _apply_gate(self, *, force: bool = False) -> None:
        if self._gate is None or self._gate_lock is None:
            return
        async with self._gate_lock:
            now = time.monotonic()
            ready = tuple(sorted(n for n, ms in self._models.items() if ms.ready))
            all_required = all(ms.ready for ms in self._models.values() if ms.spec.required)
            key = (ready, all_required)
            if not force:
                if self._gate_error is not None and now < self._gate_retry_at:
                    return
                if key == self._gate_applied and now - self._gate_at < GATE_REFRESH_INTERVAL:
                    return
            gate = self._gate
            try:
                await asyncio.to_thread(gate.apply, list(ready), all_required)
            except Exception as exc:
                self.metrics.gate_errors.inc()
                self._gate_error = scrub(str(exc))
                self._gate_retry_at = now + GATE_RETRY_INTERVAL
                log.error(
                    "node gate: %s",
                    self._gate_error,
                    extra={"phase": "gate", "error": self._gate_error},
                )
                return
            self._gate_error = None
            self._gate_applied = key
            self._gate_at = now

    # -- metrics and usage ----------------------------------------------------------------------

    def _publish(self, ms: ModelState) -> None:
        self.metrics.set_state(ms.spec.name, ms.state, ready=ms.ready, required=ms.spec.required)

    def _refresh_metrics(self, now: float) -> None:
        self.metrics.update_rates()
        models = list(self._models.values())
        self.metrics.all_required_ready.set(
            1 if all(ms.ready for ms in models if ms.spec.required) else 0
        )
        with contextlib.suppress(OSError):
            self.metrics.cache_free.set(self.store.free_bytes())
        if now >= self._next_usage and (self._usage_task is None or self._usage_task.done()):
            self._next_usage = now + USAGE_INTERVAL
            touch = [ms.spec for ms in models if ms.ready and now - ms.touched >= TOUCH_INTERVAL]
            for ms in models:
                if ms.spec in touch:
                    ms.touched = now
            self._usage_task = asyncio.create_task(asyncio.to_thread(self._usage_blocking, touch))

    def _usage_blocking(self, touch: list[ModelSpec]) -> None:
        for spec in touch:
            if self.store.entry_dir(spec).is_dir():
                try:
                    self.store.touch(spec)
                except OSError as exc:
                    log.warning("%s: cannot record its use: %s", spec.name, exc)
        try:
            used = sum(e.size for e in self.store.list())
        except OSError as exc:
            log.warning("cannot measure the cache: %s", exc)
            return
        self.metrics.cache_used.set(used)


# -- helpers ----------------------------------------------------------------------------------


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _bytes_needed(layout: Layout, todo: list[Any]) -> int:
    """Bytes the files to fetch will add (a preallocated partial already holds its space)."""
    staging = layout.staging_dir()
    needed = 0
    for f in todo:
        try:
            have = (staging / staged_name(f)).stat().st_size == f.size
        except OSError:
            have = False
        if not have:
            needed += f.size
    return needed


class _OneFile:
    """A view of a layout holding one of its records, so verification can stop between files."""

    def __init__(self, layout: Layout, record: RecordedFile) -> None:
        self.root = layout.root
        self._record = record

    def recorded(self) -> list[RecordedFile]:
        return [self._record]


def _verify_files(
    layout: Layout, read_rate: int | None, stop: threading.Event
) -> VerifyReport | None:
    """:func:`verify_local` file by file, checking ``stop`` in between; None when stopped."""
    records = layout.recorded()
    if not records:
        raise VerifyError(f"nothing recorded under {layout.root}: the copy is gone")
    report = VerifyReport()
    for record in records:
        if stop.is_set():
            return None
        one = verify_local(_OneFile(layout, record), read_rate=read_rate)  # type: ignore[arg-type]
        report.checked += one.checked
        report.unverifiable += one.unverifiable
        report.failures += one.failures
    return report


def _forget_failures(layout: Layout, report: VerifyReport) -> None:
    """Delete the files that failed re-verification so the next sync fetches them again."""
    forget = getattr(layout, "forget", None)
    records = {r.path: r for r in layout.recorded()}
    for failure in report.failures:
        path = getattr(failure, "path", None)
        if path is None or path not in records:
            continue  # missing or truncated files are re-fetched anyway
        if forget is not None:
            forget(path)
            continue
        local = records[path].local
        target = local.resolve()
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
        if local.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                local.unlink()
        log.info("deleted %s (failed re-verification)", path, extra={"phase": "verify"})
