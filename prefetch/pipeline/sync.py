"""The one sync path: ModelSpec -> resolve -> plan -> transfer -> verify -> publish.

A sync has two phases: :func:`prepare` (resolve, take the per-model lock, plan, count the space
needed) and :func:`execute` (transfer, verify, publish, commit). ``prefetch pull`` runs both
through :func:`sync`; the agent calls them itself so it can make room for
``plan.bytes_needed`` in between. ``prefetch verify`` and the agent's re-verification call
:func:`~prefetch.pipeline.verify_at_rest.verify_local`, and the agent deletes what failed with
:func:`~prefetch.pipeline.verify_at_rest.forget_failures`. No entry
point has a private copy of any stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from prefetch.pipeline.deadline import Alarms, call_with_deadline, stop_interrupts
from prefetch.pipeline.engine.partial_file import no_space
from prefetch.pipeline.engine.plan import staged_name
from prefetch.pipeline.engine.transfer import (
    Cancelled,
    PublishFn,
    Transfer,
    TransferConfig,
    TransferStats,
)
from prefetch.pipeline.layout import Layout, model_lock
from prefetch.pipeline.progress import NullProgress, ProgressSink
from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec
from prefetch.sources.base import ReadsLocalTree, RemembersArchives, Source
from prefetch.support.errors import (
    DeadlineExceededError,
    InsufficientSpaceError,
    LayoutError,
    PrefetchError,
)
from prefetch.support.units import format_bytes

log = logging.getLogger(__name__)


class Engine(Protocol):
    """What runs a plan's files: :class:`~prefetch.pipeline.engine.transfer.Transfer` (one process),
    or :class:`~prefetch.pipeline.engine.processes.ProcessEngine` (worker processes,
    ``--processes``)."""

    stats: TransferStats

    def run(self, files: list[RemoteFile]) -> TransferStats: ...


class EngineFactory(Protocol):
    """Makes the :class:`Engine` of one execute (Transfer's constructor is one)."""

    def __call__(
        self,
        source: Source,
        staging_dir: Path,
        publish: PublishFn,
        config: TransferConfig,
        *,
        progress: ProgressSink | None = None,
        stop: threading.Event | None = None,
    ) -> Engine: ...


#: Kept free on the destination's filesystem beyond what a pull needs.
SPACE_MARGIN = 64 * 1024 * 1024


#: The phases of a sync, in order (the ``phase`` label of the phase-duration metric).
SYNC_PHASES = ("resolve", "download", "verify", "publish")


@dataclass
class SyncTimings:
    """Where a sync's wall-clock time went, phase by phase, in seconds.

    The engine hashes and publishes early files while later ones still download, so the phases
    are cut along the sync's critical path, and add up to its ``seconds`` (the agent's making
    room between :func:`prepare` and :func:`execute` is the only time outside them):

    * ``resolve``: listing the source, taking the model's lock, planning (:func:`prepare`);
    * ``download``: from the transfer's start to the last byte received;
    * ``verify``: after the last byte, the hashing that the download did not hide (the time
      in that window not spent publishing);
    * ``publish``: publishing after the last byte, plus the commit (refs, records, deletions).

    So a slow disk or a CPU-bound hash shows as verify or publish time, and a slow link as
    download time: each phase is time the operator waited for, not CPU time.
    """

    resolve: float = 0.0
    download: float = 0.0
    verify: float = 0.0
    publish: float = 0.0

    def to_json(self) -> dict[str, float]:
        return {name: round(getattr(self, name), 3) for name in SYNC_PHASES}


class _PhaseClock:
    """Watches a transfer for :class:`SyncTimings`: it is the progress sink every chunk passes
    through (noting when the last byte arrived, then handing on to the caller's sink) and it
    wraps the publish callback (noting when each publish ran). Cheap enough for the per-chunk
    path: one clock read and one attribute store per call."""

    def __init__(self, progress: ProgressSink) -> None:
        self._progress = progress
        self.last_byte: float | None = None
        self.publishes: list[tuple[float, float]] = []

    def start(self, model: str, total_bytes: int, total_files: int) -> None:
        self._progress.start(model, total_bytes, total_files)

    def advance(self, nbytes: int) -> None:
        self.last_byte = time.monotonic()
        self._progress.advance(nbytes)

    def chunk_done(self) -> None:
        self._progress.chunk_done()

    def file_done(self, path: str, size: int) -> None:
        self._progress.file_done(path, size)

    def retry(self, reason: str) -> None:
        self._progress.retry(reason)

    def checksum_failure(self, path: str) -> None:
        self._progress.checksum_failure(path)

    def finish(self) -> None:
        self._progress.finish()

    def publisher(self, publish: PublishFn) -> PublishFn:
        def timed(file: RemoteFile, staged: Path, checks: tuple[Checksum, ...]) -> None:
            began = time.monotonic()
            try:
                publish(file, staged, checks)
            finally:
                self.publishes.append((began, time.monotonic()))

        return timed

    def timings(self, resolve: float, began: float, ended: float, committed: float) -> SyncTimings:
        """The phases of a transfer that ran from ``began`` to ``ended``, committed at
        ``committed`` (monotonic clock), after ``resolve`` seconds of preparing."""
        last_byte = min(max(self.last_byte or began, began), ended)
        tail_publish = sum(
            max(0.0, min(end, ended) - max(start, last_byte)) for start, end in self.publishes
        )
        tail_publish = min(tail_publish, ended - last_byte)
        return SyncTimings(
            resolve=resolve,
            download=last_byte - began,
            verify=ended - last_byte - tail_publish,
            publish=tail_publish + (committed - ended),
        )


@dataclass
class SyncResult:
    """What a sync did. :func:`sync` fills one in as it goes, so after a failure the caller's
    ``so_far`` says what was done before it (``prefetch pull --json`` prints it)."""

    model: str
    source: str
    revision: str = ""
    path: str = ""
    files: int = 0
    bytes_total: int = 0
    bytes_downloaded: int = 0
    files_downloaded: int = 0
    files_verified: int = 0
    files_unverified: list[str] = field(default_factory=list)
    checksum_algorithms: dict[str, int] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    retries: int = 0
    checksum_failures: int = 0
    resumed_bytes: int = 0
    seconds: float = 0.0
    up_to_date: bool = field(default=False)
    #: The source the snapshot was resolved from: ``source`` itself, or for a Hub model with
    #: mirrors the mirror (``s3://...``) or the Hub (``hf://org/name``) that had it.
    served_by: str = ""
    timings: SyncTimings = field(default_factory=SyncTimings)
    #: bytes the resolve fetched (see Snapshot.fetched_bytes), in ``bytes_downloaded``
    _resolve_bytes: int = field(default=0, repr=False)

    def to_json(self) -> dict[str, Any]:  # the pull command writes into its "timings"
        out = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        return {**out, "timings": self.timings.to_json()}

    def note_snapshot(self, snapshot: Snapshot, layout: Layout) -> None:
        self.served_by = snapshot.source
        self.revision = snapshot.revision_id
        self.path = str(layout.model_path(snapshot))
        self.files = len(snapshot.files)
        self.bytes_total = snapshot.total_bytes
        self._resolve_bytes = snapshot.fetched_bytes

    def note_transfer(self, stats: TransferStats, *, local: int = 0) -> None:
        """The transfer's figures; ``local``: bytes it copied from the source's own staging
        (unpacked archives), which were fetched at resolve, not downloaded again."""
        self.bytes_downloaded = stats.bytes_downloaded - local + self._resolve_bytes
        self.files_downloaded = stats.files_downloaded
        self.files_verified = stats.files_verified
        self.files_unverified = list(stats.unverified)
        self.checksum_algorithms = dict(stats.checksum_algorithms)
        self.retries = stats.retries
        self.checksum_failures = stats.checksum_failures
        self.resumed_bytes = stats.resumed_bytes


def plan(snapshot: Snapshot, layout: Layout) -> list[RemoteFile]:
    """The files of the snapshot that are not already published at this exact version."""
    return [f for f in snapshot.files if not layout.is_current(f)]


def bytes_needed(layout: Layout, files: list[RemoteFile]) -> int:
    """Bytes fetching ``files`` will add to the destination: a partial download already
    preallocated to its full size holds its space, so it counts as held, not needed."""
    staging = layout.staging_dir()
    needed = 0
    for f in files:
        try:
            held = (staging / staged_name(f)).stat().st_size == f.size
        except OSError:
            held = False
        if not held:
            needed += f.size
    return needed


def check_free_space(layout: Layout, needed: int) -> None:
    """Fail before starting when ``needed`` bytes (see :func:`bytes_needed`) cannot fit."""
    staging = layout.staging_dir()
    staging.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(staging).free  # (stdlib: psutil costs start-up, see prefetch/cli)
    if needed + SPACE_MARGIN > free:
        raise InsufficientSpaceError(
            f"not enough free space under {layout.root}: the pull needs "
            f"{format_bytes(needed)} and {format_bytes(free)} is free",
            hint="free some space (prefetch gc), narrow --include, or use a larger volume",
        )


@dataclass
class Plan:
    """What :func:`prepare` found, holding the model's lock until closed (``with plan:``).

    ``files`` are the snapshot's files not yet published at this version; ``bytes_needed`` is
    the one space computation every caller uses (the agent makes room for it; :func:`execute`
    checks it otherwise). The lock is held from planning through publishing, so no other
    process changes what was planned before :func:`execute` acts on it."""

    spec: ModelSpec
    source: Source
    layout: Layout
    snapshot: Snapshot
    files: list[RemoteFile]
    bytes_needed: int
    started: float
    _lock: contextlib.ExitStack = field(repr=False)
    #: Seconds from ``started`` to the plan: resolving (when prepare did), the lock, planning.
    resolve_seconds: float = 0.0

    @property
    def bytes_to_fetch(self) -> int:
        return sum(f.size for f in self.files)

    def close(self) -> None:
        """Release the model's lock (idempotent)."""
        self._lock.close()

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def prepare(
    spec: ModelSpec,
    source: Source,
    layout: Layout,
    *,
    snapshot: Snapshot | None = None,
    lock_timeout: float = 3600.0,
) -> Plan:
    """Phase one of a sync: resolve (unless ``snapshot`` is given), take the per-model lock,
    plan, and count the space the plan needs. The returned :class:`Plan` holds the lock; close
    it (``with prepare(...) as plan:``) after :func:`execute`, or to give up."""
    started = time.monotonic()
    snapshot = snapshot or source.resolve(spec)
    layout.prepare()  # the state directories, refusing symlinks out of the destination
    held = contextlib.ExitStack()
    held.enter_context(model_lock(layout.lock_path(), timeout=lock_timeout))
    try:
        todo = plan(snapshot, layout)
        needed = bytes_needed(layout, todo)
    except BaseException:
        held.close()
        raise
    log.info(
        "%s: %d of %d files to fetch (%s of %s)",
        spec.name, len(todo), len(snapshot.files),
        format_bytes(sum(f.size for f in todo)), format_bytes(snapshot.total_bytes),
    )  # fmt: skip
    return Plan(
        spec, source, layout, snapshot, todo, needed, started, held,
        resolve_seconds=time.monotonic() - started,
    )  # fmt: skip


def execute(
    plan: Plan,
    config: TransferConfig,
    *,
    progress: ProgressSink | None = None,
    stop: threading.Event | None = None,
    delete: bool = False,
    superseded_grace: float = 0.0,
    so_far: SyncResult | None = None,
    check_space: bool = True,
    engine: EngineFactory = Transfer,
) -> SyncResult:
    """Phase two of a sync: transfer the planned files, verify and publish each, then commit
    the snapshot. ``check_space=False`` when the caller already made room for
    ``plan.bytes_needed`` (the agent does, keeping its own margin). ``delete`` and
    ``superseded_grace``: see :func:`sync`. ``engine``: what runs the files (publishing stays
    here, in this process, whatever runs them). Does not release the plan's lock."""
    spec, layout, todo = plan.spec, plan.layout, plan.files
    progress = progress or NullProgress()
    result = so_far if so_far is not None else SyncResult(spec.name, str(spec.source))
    result.note_snapshot(plan.snapshot, layout)
    if todo and check_space:
        check_free_space(layout, plan.bytes_needed)
    clock = _PhaseClock(progress)
    clock.start(spec.name, plan.bytes_to_fetch, len(todo))
    transfer = engine(
        plan.source,
        layout.staging_dir(),
        clock.publisher(layout.publish),
        config,
        progress=clock,
        stop=stop,
    )
    archives = plan.source if isinstance(plan.source, RemembersArchives) else None
    local_before = archives.staged_bytes_read() if archives is not None else 0
    try:
        began = time.monotonic()
        try:
            transfer.run(todo)
        finally:
            local = archives.staged_bytes_read() - local_before if archives is not None else 0
            result.note_transfer(transfer.stats, local=local)
        ended = time.monotonic()
        result.deleted = layout.commit(
            plan.snapshot, spec, delete=delete, superseded_grace=superseded_grace
        )
        result.timings = clock.timings(plan.resolve_seconds, began, ended, time.monotonic())
    except OSError as exc:
        if isinstance(exc, PrefetchError):
            raise
        full = no_space(exc, layout.root)
        if full is None:
            raise _unexpected(exc, layout) from exc
        raise full from exc
    finally:
        progress.finish()
    result.seconds = round(time.monotonic() - plan.started, 3)
    result.up_to_date = not todo and not result.deleted
    return result


def _unexpected(exc: OSError, layout: Layout) -> LayoutError:
    """An OSError nothing expected while fetching into or publishing ``layout`` (DEST deleted
    or moved by another process mid-pull, a read-only remount): one named error saying which
    path and what happened, instead of a bare ``[Errno 2] ...`` line."""
    what = exc.strerror or str(exc)
    if exc.filename is not None and Path(os.fsdecode(exc.filename)) != layout.root:
        what = f"{os.fsdecode(exc.filename)}: {what}"
    hint = None
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        what += " (did another process delete or move the destination?)"
        hint = "run the pull again: what is missing is fetched again"
    return LayoutError(f"cannot write into {layout.root}: {what}", hint=hint)


def sync(
    spec: ModelSpec,
    source: Source,
    layout: Layout,
    config: TransferConfig,
    *,
    progress: ProgressSink | None = None,
    delete: bool = False,
    stop: threading.Event | None = None,
    lock_timeout: float = 3600.0,
    snapshot: Snapshot | None = None,
    superseded_grace: float = 0.0,
    so_far: SyncResult | None = None,
) -> SyncResult:
    """Bring ``layout`` to the snapshot ``spec`` names: :func:`prepare` then :func:`execute`.
    Concurrency-safe (per-model lock).

    ``delete``: remove local files the snapshot no longer has, and snapshots a moved ref left
    behind ``superseded_grace`` seconds ago or more (see ``Layout.commit``). ``so_far``: the
    result to fill in as the sync goes (read it after a failure); returned on success."""
    t0 = time.monotonic()
    result = so_far if so_far is not None else SyncResult(spec.name, str(spec.source))
    if snapshot is None:
        snapshot = resolve_within(
            spec, source, config.deadline, layout=layout, stop=stop, flag="--deadline"
        )
        config = _deadline_left(config, t0)
    result.note_snapshot(snapshot, layout)  # known even if the lock is not had
    result.bytes_downloaded = snapshot.fetched_bytes
    with prepare(spec, source, layout, snapshot=snapshot, lock_timeout=lock_timeout) as ready:
        ready.started = t0  # the resolve counts in the sync's seconds
        ready.resolve_seconds = time.monotonic() - t0
        return execute(
            ready,
            config,
            progress=progress,
            stop=stop,
            delete=delete,
            superseded_grace=superseded_grace,
            so_far=result,
        )


def resolve_within(
    spec: ModelSpec,
    source: Source,
    seconds: float | None,
    *,
    layout: Layout,
    stop: threading.Event | None = None,
    flag: str,
) -> Snapshot:
    """``source.resolve(spec)``, interrupted by ``stop`` (its requests too: their header waits
    and bodies, through the HTTP seam) and, when ``seconds`` is set, by the sync's deadline
    (``flag`` names the setting in the error): a source trickling its metadata cannot hold a
    sync past the deadline the transfer is held to. A source that unpacks archives at resolve
    is told where ``layout`` keeps what it unpacked before, and what is published there; it
    writes its records once the resolve succeeded (a failed one leaves the destination as it
    was)."""
    if isinstance(source, ReadsLocalTree):
        source.refuse_destination((layout.root, layout.lock_path().parent))
    archives = source if isinstance(source, RemembersArchives) else None
    if archives is not None:
        archives.remember_archives(archive_records(layout), layout.is_current)
    with stop_interrupts(stop, lambda: Cancelled("stopped")):
        if seconds is None:
            snapshot = source.resolve(spec)
        else:
            snapshot = call_with_deadline(
                lambda: source.resolve(spec), seconds, what=f"resolving {spec.source}",
                alarms=Alarms(idle=1.0, name="prefetch-resolve"),
                expired=lambda: _resolve_deadline(spec, seconds, flag),
            )  # fmt: skip
    if archives is not None:
        layout.prepare()  # the state folder, refusing symbolic links below the destination
        archives.write_archive_records()
    return snapshot


def archive_records(layout: Layout) -> Path:
    """Where a source that unpacks archives records what each unpacked to (see
    :class:`~prefetch.sources.base.RemembersArchives`): the model's state folder."""
    return layout.lock_path().parent / "archives"


def _resolve_deadline(spec: ModelSpec, seconds: float, flag: str) -> DeadlineExceededError:
    return DeadlineExceededError(
        f"{spec.source}: resolving did not finish within the deadline of {seconds:g}s "
        "(the source answers too slowly)",
        hint=f"try again later, or raise {flag}",
    )


def _deadline_left(config: TransferConfig, started: float) -> TransferConfig:
    """``config`` with its deadline reduced by what the resolve since ``started`` took."""
    if config.deadline is None:
        return config
    left = config.deadline - (time.monotonic() - started)
    stated = config.stated_deadline or config.deadline
    return dataclasses.replace(config, deadline=max(left, 0.001), stated_deadline=stated)
