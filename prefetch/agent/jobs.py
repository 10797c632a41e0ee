"""The bodies of the agent's two jobs, each run for one model in a worker thread.

* :class:`SyncJob`: plan under the model's lock, make room, execute the plan, record the result
  (or the failure and its backoff) on the model's state.
* :class:`VerifyJob`: re-hash the cached files; on damage, take the model out of the ready set
  *and the node gate* first, then delete the bad files so that a sync fetches them again.

They live apart from :class:`~prefetch.agent.loop.Agent` so that the Agent keeps only the
loop, config reloads, starting jobs and shutdown. Everything a job touches is handed to it in
:class:`JobParts`; it never reaches back into the Agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterator

from prefetch.agent.config_models import render_spec_error
from prefetch.agent.config_values import AgentConfig
from prefetch.agent.event_recorder import EventRecorder
from prefetch.agent.events import (
    checksum_failed,
    compile_cache_not_published,
    compile_cache_pulled,
    model_ready,
    reverify_failed,
    sync_failed,
    warm_up_finished,
    warm_up_started,
)
from prefetch.agent.gate_driver import GateDriver
from prefetch.agent.metrics import AgentMetrics
from prefetch.agent.scheduler import ModelState, Scheduler
from prefetch.agent.space import SpaceManager
from prefetch.agent.warming import WarmingStory
from prefetch.pipeline.compose import Hooks, Pipeline
from prefetch.pipeline.compose import warm as warm_up
from prefetch.pipeline.engine.transfer import Cancelled, TransferConfig
from prefetch.pipeline.layout import Layout
from prefetch.pipeline.spec import ModelSpec
from prefetch.pipeline.store import Store
from prefetch.pipeline.sync import Plan, SyncResult
from prefetch.pipeline.verify_at_rest import VerifyReport, forget_failures, verify_local
from prefetch.pipeline.warmup import WarmReport
from prefetch.publish.compile_cache_claim import COMPLETE
from prefetch.sources.base import Source
from prefetch.support.errors import (
    ChecksumMismatchError,
    DeadlineExceededError,
    NoMatchingFilesError,
    PrefetchError,
)
from prefetch.support.logjson import scrub, sync_context
from prefetch.support.units import format_bytes

# The jobs' lines keep the logger name they have always had, so log queries keep matching.
log = logging.getLogger("prefetch.agent.loop")

#: How long a sync waits for another process (prefetch pull/gc) holding the model's lock.
LOCK_TIMEOUT = 60.0

#: Opens a model's Source under the agent's config: the Agent's
#: :class:`~prefetch.agent.source_opener.SourceOpener`.
OpenSource = Callable[[ModelSpec, AgentConfig], Source]

__all__ = ["LOCK_TIMEOUT", "JobParts", "OpenSource", "SyncJob", "VerifyJob", "model_pipeline"]


@dataclasses.dataclass(frozen=True)
class JobParts:
    """What a job works with. The Agent owns all of it and hands it over when it starts a job."""

    scheduler: Scheduler
    store: Store
    space: SpaceManager
    metrics: AgentMetrics
    gate: GateDriver
    open_source: OpenSource
    #: The config in force now (a reload may replace it while a job runs).
    config: Callable[[], AgentConfig]
    #: Show a model's phase and readiness in the metrics.
    publish: Callable[[ModelState], None]
    #: Wake the loop: a job ended, so a slot is free and the gate may need applying.
    wake: Callable[[], None]
    #: A sync changed what the cache holds: refresh the usage metrics on the next pass.
    usage_changed: Callable[[], None]
    #: The agent's loop, for the steps a worker thread must run there.
    loop: asyncio.AbstractEventLoop
    #: The node's story: Kubernetes Events and their JSON log lines.
    events: EventRecorder
    #: Tells WarmingStarted once the syncs that begin warming have resolved their models.
    warming: WarmingStory

    def in_loop(self, coro: Coroutine[object, object, None]) -> None:
        """From a worker thread: run ``coro`` on the loop and wait for it."""
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=300)

    async def drop_ready(self, ms: ModelState, reason: str) -> None:
        """Take a model out of the ready set and out of the node's labels before touching it."""
        ms.drop_ready(reason)
        self.publish(ms)
        log.warning(
            "%s: no longer ready: %s",
            ms.spec.name,
            reason,
            extra={"model": ms.spec.name, "phase": "verify", "error": reason},
        )
        await self.gate.apply(force=True)


class SyncJob:
    """Brings one model's cached copy in line with its source, and records how that went."""

    def __init__(self, parts: JobParts) -> None:
        self._parts = parts

    async def run(self, ms: ModelState, stop: threading.Event) -> None:
        # one id for every line of this attempt, also from its worker threads
        with sync_context():
            await self._run(ms, stop)

    async def _run(self, ms: ModelState, stop: threading.Event) -> None:
        parts = self._parts
        spec, config = ms.spec, parts.config()
        try:
            result = await asyncio.to_thread(self._settled_after, ms, config, stop)
        except Cancelled:
            log.info(
                "%s: sync stopped; the partial download resumes next time",
                spec.name,
                extra={"model": spec.name, "phase": "sync"},
            )
            if parts.scheduler.current(ms):
                ms.sync_cancelled()
        except Exception as exc:
            if parts.scheduler.current(ms):
                if _nothing_published(ms, exc, parts.config()):
                    self._nothing_published(ms)
                else:
                    self._failed(ms, exc)
        else:
            if parts.scheduler.current(ms):
                ms.nothing_published = False
                self._ok(ms, result)
                if self._wants_warm(ms, result, parts.config()):  # reported, not gating
                    parts.publish(ms)
                    await asyncio.to_thread(self._warm, ms, result, parts.config(), stop)
        finally:
            ms.job = None
            if parts.scheduler.current(ms):
                parts.publish(ms)
            parts.usage_changed()
            parts.wake()

    def _settled_after(
        self, ms: ModelState, config: AgentConfig, stop: threading.Event
    ) -> SyncResult:
        """:meth:`_blocking`, then tell the warming story this sync is over (before the loop
        hears how it went, so WarmingStarted is told before the model's ModelReady)."""
        try:
            result = self._blocking(ms, config, stop)
            if ms.spec.name in config.gate_on_warm and self._wants_warm(ms, result, config):
                self._warm(ms, result, config, stop)  # before the model is ready: gating
            return result
        finally:
            self._parts.warming.settled(ms.spec.name, stop)

    @staticmethod
    def _wants_warm(ms: ModelState, result: SyncResult, config: AgentConfig) -> bool:
        """``warmPageCache`` models warm once per revision and agent process."""
        return ms.spec.name in config.warm_page_cache and ms.warmed_revision != result.revision

    def _warm(
        self, ms: ModelState, result: SyncResult, config: AgentConfig, stop: threading.Event
    ) -> None:
        """In a worker thread: read the model's published files into the page cache. A failed
        or skipped warm-up is reported (log, /readyz, metrics), never a sync failure."""
        parts, name = self._parts, ms.spec.name
        ms.warming = True

        def started(total: int) -> None:
            parts.events.emit(warm_up_started(name, total, revision=result.revision))

        try:
            report = warm_up(
                parts.store.layout(ms.spec), result, config.warm_limits(), stop=stop,
                model=name, on_start=started,
            )  # fmt: skip
        except (OSError, PrefetchError) as exc:  # the records could not be read
            report = WarmReport("failed", reason=str(exc))
            log.warning("%s: page-cache warm-up failed: %s", name, exc,
                        extra={"model": name, "phase": "warm", "error": str(exc)})  # fmt: skip
        finally:
            ms.warming = False
        ms.warm = report
        if report.state != "stopped":
            ms.warmed_revision = result.revision
            parts.events.emit(
                warm_up_finished(
                    name,
                    report.state,
                    bytes_read=report.bytes_read,
                    seconds=report.seconds,
                    reason=report.reason,
                    revision=result.revision,
                )
            )
        parts.metrics.observe_warm(name, report.state, report.seconds, report.bytes_read)

    def _blocking(self, ms: ModelState, config: AgentConfig, stop: threading.Event) -> SyncResult:
        """In a worker thread: the pipeline (resolve and plan under the model's lock, make
        room, sync) with the agent's steps as hooks (:class:`_AgentSteps`), all within the
        attempt's ``syncDeadline``, counted from here (see :func:`_bounded`)."""
        began = time.monotonic()
        parts = self._parts
        store, space = parts.store, parts.space
        spec = ms.spec
        assert ms.sink is not None  # start_sync gave the job its sink
        with space.busy(spec):
            deadline = config.deadline_for(spec.name)
            pipeline = model_pipeline(
                spec,
                parts.open_source(spec, config),
                store,
                hooks=_AgentSteps(parts, ms, config, stop, began),
            )
            # a stop or the attempt's deadline (before the bytes are known: its least) ends a
            # resolve whose source trickles
            _, result = pipeline.run(
                config.transfer_config(),
                progress=ms.sink,
                stop=stop,
                delete=True,
                superseded_grace=config.superseded_grace,
                lock_timeout=LOCK_TIMEOUT,
                resolve_seconds=deadline.for_bytes(0),
            )
            store.record_sync(
                spec,
                digest=ms.digest,
                revision=result.revision,
                files=result.files,
                bytes_total=result.bytes_total,
            )
            return result

    def _ok(self, ms: ModelState, result: SyncResult) -> None:
        metrics = self._parts.metrics
        spec = ms.spec
        became_ready = not ms.ready or ms.revision != result.revision
        ms.sync_succeeded(result, time.monotonic())
        self._tell_ok(ms, result, became_ready=became_ready)
        metrics.last_success.labels(spec.name).set(ms.last_success or 0.0)
        metrics.model_size.labels(spec.name).set(result.bytes_total)
        metrics.remaining_bytes.labels(spec.name).set(0)
        metrics.set_source(spec.name, spec.source_kind(result.served_by))
        if result.up_to_date:
            log.debug("%s: up to date at %s", spec.name, result.revision)
            return
        metrics.sync_duration.labels(spec.name).observe(result.seconds)
        metrics.observe_phases(spec.name, result.timings.to_json())
        rate = result.bytes_downloaded / result.seconds if result.seconds else 0.0
        removed = f"; removed {len(result.deleted)} file(s)" if result.deleted else ""
        served_by = _served_by(result, spec)
        log.info(
            "%s: synced revision %s from %s: %d file(s), %s downloaded in %.1fs%s",
            spec.name,
            result.revision[:12],
            served_by,
            result.files_downloaded,
            format_bytes(result.bytes_downloaded),
            result.seconds,
            removed,
            extra={
                "model": spec.name,
                "phase": "sync",
                "bytes": result.bytes_downloaded,
                "rate": round(rate),
                "source": served_by,
            },
        )

    def _nothing_published(self, ms: ModelState) -> None:
        """A compile cache whose key has nothing complete published: not a failure (the first
        node of its kind compiles and publishes); looked for again at the next resolve."""
        spec = ms.spec
        ms.sync_succeeded(SyncResult(model=spec.name, source=str(spec.source), up_to_date=True),
                          time.monotonic())  # fmt: skip
        if not ms.nothing_published:  # told once, not at every resolve
            key = self._parts.config().compile_cache_key(spec.name)
            self._parts.events.emit(
                compile_cache_not_published(spec.name, key, source=scrub(str(spec.source)))
            )
        ms.nothing_published = True
        log.info(
            "%s: no compile cache published at %s yet; vLLM compiles from scratch",
            spec.name,
            scrub(str(spec.source)),
            extra={"model": spec.name, "phase": "sync"},
        )

    def _tell_ok(self, ms: ModelState, result: SyncResult, *, became_ready: bool) -> None:
        """The events of a successful sync: checksum failures it recovered from, and the model
        becoming ready (or ready at a new revision)."""
        events, spec = self._parts.events, ms.spec
        source = _served_by(result, spec)
        if result.checksum_failures:
            detail = f"{result.checksum_failures} file(s) failed their checksum while downloading"
            events.emit(checksum_failed(spec.name, detail, source=source, sync_failed=False))
        config = self._parts.config()
        if became_ready and config.is_compile_cache(spec.name):
            key = config.compile_cache_key(spec.name)
            events.emit(
                compile_cache_pulled(spec.name, key, bytes_total=result.bytes_total, source=source)
            )
        if became_ready:
            events.emit(
                model_ready(
                    spec.name,
                    bytes_total=result.bytes_total,
                    downloaded=result.bytes_downloaded,
                    seconds=result.seconds,
                    source=source,
                    revision=result.revision,
                )
            )

    def _failed(self, ms: ModelState, exc: BaseException) -> None:
        parts = self._parts
        spec = ms.spec
        delay = ms.sync_failed(exc, time.monotonic(), parts.config().retry_backoff)
        source = scrub(str(spec.source))
        message = ms.last_error or type(exc).__name__
        if isinstance(exc, ChecksumMismatchError):
            parts.events.emit(checksum_failed(spec.name, message, source=source, sync_failed=True))
        else:
            reason = ms.error_reason or "internal"
            parts.events.emit(sync_failed(spec.name, reason, message, source=source))
        parts.metrics.sync_failures.labels(spec.name, ms.error_reason).inc()
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


class VerifyJob:
    """Re-hashes one model's cached files at rest; damage sends the model back to a sync."""

    def __init__(self, parts: JobParts) -> None:
        self._parts = parts

    async def run(self, ms: ModelState, stop: threading.Event) -> None:
        parts = self._parts
        spec = ms.spec
        try:
            layout = parts.store.layout(spec)
            report = await asyncio.to_thread(
                verify_local, layout, read_rate=parts.config().verify_read_rate, stop=stop
            )
            if report is None:  # stopped
                return
            if report.ok:
                await self._verified(ms, report)
            else:
                await self._found_damage(ms, layout, report)
        except Exception as exc:
            parts.metrics.verifications.labels(spec.name, "failed").inc()
            log.error(
                "%s: re-verification could not run: %s",
                spec.name,
                exc,
                extra={"model": spec.name, "phase": "verify", "error": str(exc)},
            )
            parts.events.emit(reverify_failed(spec.name, scrub(f"could not run: {exc}")))
            if parts.scheduler.current(ms):
                await parts.drop_ready(ms, f"re-verification could not run: {exc}")
            ms.refetch = True
        finally:
            current = parts.scheduler.current(ms)
            ms.verify_finished(time.monotonic(), current=current)
            if current:
                parts.publish(ms)
            parts.wake()

    async def _verified(self, ms: ModelState, report: VerifyReport) -> None:
        parts = self._parts
        spec = ms.spec
        parts.metrics.verifications.labels(spec.name, "ok").inc()
        await asyncio.to_thread(parts.store.record_verify, spec, ok=True)
        ms.verify_passed(time.monotonic())
        log.info(
            "%s: re-verified %d file(s) at rest",
            spec.name,
            len(report.checked),
            extra={"model": spec.name, "phase": "verify"},
        )

    async def _found_damage(self, ms: ModelState, layout: Layout, report: VerifyReport) -> None:
        """Out of the ready set (and the node gate) first, then delete the bad files and sync."""
        parts = self._parts
        spec = ms.spec
        parts.metrics.verifications.labels(spec.name, "failed").inc()
        mismatches = report.mismatched_paths()
        if mismatches:
            parts.metrics.checksum_failures.labels(spec.name, "reverify").inc(len(mismatches))
        reason = "; ".join(str(f) for f in report.failures[:3])
        log.error(
            "%s: re-verification failed, re-fetching: %s",
            spec.name,
            reason,
            extra={"model": spec.name, "phase": "verify", "error": reason},
        )
        parts.events.emit(reverify_failed(spec.name, scrub(reason)))
        if parts.scheduler.current(ms):
            await parts.drop_ready(ms, f"re-verification failed: {reason}")
        await asyncio.to_thread(forget_failures, layout, report)
        await asyncio.to_thread(parts.store.record_verify, spec, ok=False)
        ms.refetch = True


def model_pipeline(
    spec: ModelSpec, source: Source, store: Store, *, hooks: Hooks | None = None
) -> Pipeline:
    """The pipeline of one model's sync in the agent: into the Store's layout for the spec; an
    S3 mirror prefix is published in the Hub's layout only under the repo id the config names
    (its ``hfRepo``), as ``prefetch gc`` and eviction find the model's copy from the config
    alone (the cache index is read offline)."""
    return Pipeline(
        spec,
        source,
        lambda s, _kind: store.layout(s),
        repo_from_mirror=False,
        flag="syncDeadline",
        hooks=hooks,
        refused=lambda exc: render_spec_error(exc, f"{spec.name}: "),
    )


class _AgentSteps(Hooks):
    """The agent's steps in a sync's pipeline: once planned, report the plan, stop when told,
    refuse half a compile cache and drop a damaged copy's readiness; make room keeping
    ``minFreeSpace``; bound the transfer by what is left of the ``syncDeadline``."""

    def __init__(
        self,
        parts: JobParts,
        ms: ModelState,
        config: AgentConfig,
        stop: threading.Event,
        began: float,
    ) -> None:
        self._parts, self._ms, self._config = parts, ms, config
        self._stop, self._began = stop, began
        self._bound: float | None = None

    def planned(self, plan: Plan) -> None:
        parts, ms, spec = self._parts, self._ms, self._ms.spec
        parts.warming.planned(spec.name, plan.snapshot.total_bytes, plan.bytes_to_fetch)
        if self._stop.is_set():
            raise Cancelled("stopped")
        if self._config.is_compile_cache(spec.name) and not any(
            f.path == COMPLETE for f in plan.snapshot.files
        ):  # a push in progress (or one that died): never pull half a cache
            raise _NothingPublished(f"{spec.source}: no {COMPLETE}")
        if ms.ready and not parts.store.copy_intact(spec, ms.digest):
            parts.in_loop(parts.drop_ready(ms, "cached files are missing or truncated"))

    def make_room(self, plan: Plan, room: contextlib.ExitStack) -> bool:
        assert self._ms.sink is not None
        room.enter_context(
            self._parts.space.reserved(
                self._ms.spec,
                plan.bytes_needed,
                wanted=self._config.models,
                min_free=self._config.min_free_space,
                sink=self._ms.sink,
            )
        )
        return True  # room was made, keeping minFreeSpace

    def transfer_config(self, plan: Plan, config: TransferConfig) -> TransferConfig:
        # nothing to fetch (a refresh that finds the copy current): nothing to bound
        deadline = self._config.deadline_for(self._ms.spec.name)
        self._bound = deadline.for_bytes(plan.bytes_to_fetch) if plan.files else None
        return _bounded(config, self._bound, self._began)

    @contextlib.contextmanager
    def executing(self) -> Iterator[None]:
        try:
            yield
        except DeadlineExceededError as exc:
            if self._bound is None:
                raise
            raise _deadline_passed(self._bound) from exc


def _bounded(transfer: TransferConfig, bound: float | None, began: float) -> TransferConfig:
    """``transfer`` with the engine's deadline set to what is left of an attempt that began at
    ``began`` (monotonic) and may run ``bound`` seconds (None: unbounded). The engine stops at
    its deadline as on SIGTERM, keeping what was fetched, and raises DeadlineExceededError."""
    if bound is None:
        return transfer
    left = bound - (time.monotonic() - began)
    if left <= 0:  # resolving, the lock and making room took it all
        raise _deadline_passed(bound)
    return dataclasses.replace(transfer, deadline=left)


def _deadline_passed(bound: float) -> DeadlineExceededError:
    return DeadlineExceededError(
        f"the sync attempt did not finish within its syncDeadline of {_duration(bound)}; "
        "what was fetched is kept and the next attempt resumes from it",
        hint="a source this slow holds a parallelModels slot; raise syncDeadline for a model "
        "that is large for its link",
    )


def _duration(seconds: float) -> str:
    """``2s``, ``10m``, ``9h16m19s``: as the config file writes durations."""
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{n}{unit}" for n, unit in ((hours, "h"), (minutes, "m"), (secs, "s")) if n]
    return "".join(parts) or "0s"


class _NothingPublished(Exception):
    """A compile cache's key holds files but not the push's completion marker."""


def _nothing_published(ms: ModelState, exc: BaseException, config: AgentConfig) -> bool:
    """Whether ``exc`` only says that a compile cache entry has nothing published yet."""
    return config.is_compile_cache(ms.spec.name) and isinstance(
        exc, _NothingPublished | NoMatchingFilesError
    )


def _served_by(result: SyncResult, spec: ModelSpec) -> str:
    """The source that served the sync (a mirror or the Hub), else the model's own source;
    credentials redacted."""
    return scrub(result.served_by or str(spec.source))
