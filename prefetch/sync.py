"""The one sync path: ModelSpec -> resolve -> plan -> transfer -> verify -> publish.

Every entry point (``prefetch pull``, the agent's reconcile loop) calls :func:`sync`; ``prefetch
verify`` calls :func:`verify_local`. Neither has a private copy of any stage.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from prefetch import verify
from prefetch.errors import (
    ChecksumMismatchError,
    InsufficientSpaceError,
    PrefetchError,
    VerifyError,
)
from prefetch.layout import Layout, RecordedFile, model_lock
from prefetch.progress import NullProgress, ProgressSink
from prefetch.snapshot import RemoteFile, Snapshot
from prefetch.sources.base import Source
from prefetch.spec import ModelSpec
from prefetch.transfer import Transfer, TransferConfig, TransferStats, staged_name
from prefetch.units import format_bytes

log = logging.getLogger(__name__)
#: Kept free on the destination's filesystem beyond what a pull needs.
SPACE_MARGIN = 64 * 1024 * 1024


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

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def note_snapshot(self, snapshot: Snapshot, layout: Layout) -> None:
        self.source = snapshot.source
        self.revision = snapshot.revision_id
        self.path = str(layout.model_path(snapshot))
        self.files = len(snapshot.files)
        self.bytes_total = snapshot.total_bytes

    def note_transfer(self, stats: TransferStats) -> None:
        self.bytes_downloaded = stats.bytes_downloaded
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


def check_free_space(layout: Layout, files: list[RemoteFile]) -> None:
    """Fail before starting when the files to fetch cannot fit (partials already count)."""
    staging = layout.staging_dir()
    staging.mkdir(parents=True, exist_ok=True)
    needed = 0
    for f in files:
        partial = staging / staged_name(f)
        if not (partial.exists() and partial.stat().st_size == f.size):
            needed += f.size
    free = psutil.disk_usage(str(staging)).free
    if needed + SPACE_MARGIN > free:
        raise InsufficientSpaceError(
            f"not enough free space under {layout.root}: the pull needs "
            f"{format_bytes(needed)} and {format_bytes(free)} is free",
            hint="free some space (prefetch gc), narrow --include, or use a larger volume",
        )


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
    """Bring ``layout`` to the snapshot ``spec`` names. Concurrency-safe (per-model lock).

    ``delete``: remove local files the snapshot no longer has, and snapshots a moved ref left
    behind ``superseded_grace`` seconds ago or more (see ``Layout.commit``). ``so_far``: the
    result to fill in as the sync goes (read it after a failure); returned on success."""
    progress = progress or NullProgress()
    t0 = time.monotonic()
    result = so_far if so_far is not None else SyncResult(spec.name, str(spec.source))
    snapshot = snapshot or source.resolve(spec)
    result.note_snapshot(snapshot, layout)
    layout.prepare()  # the state directories, refusing symlinks out of the destination
    with model_lock(layout.lock_path(), timeout=lock_timeout):
        todo = plan(snapshot, layout)
        todo_bytes = sum(f.size for f in todo)
        log.info(
            "%s: %d of %d files to fetch (%s of %s)",
            spec.name, len(todo), len(snapshot.files),
            format_bytes(todo_bytes), format_bytes(snapshot.total_bytes),
        )  # fmt: skip
        if todo:
            check_free_space(layout, todo)
        progress.start(spec.name, todo_bytes, len(todo))
        transfer = Transfer(
            source, layout.staging_dir(), layout.publish, config, progress=progress, stop=stop
        )
        try:
            try:
                transfer.run(todo)
            finally:
                result.note_transfer(transfer.stats)
            result.deleted = layout.commit(
                snapshot, spec, delete=delete, superseded_grace=superseded_grace
            )
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or isinstance(exc, PrefetchError):
                raise
            raise InsufficientSpaceError(
                f"no space left under {layout.root}: {exc}",
                hint="free some space (prefetch gc); finished files and partial downloads are "
                "kept and the next pull resumes",
            ) from exc
        finally:
            progress.finish()
    result.seconds = round(time.monotonic() - t0, 3)
    result.up_to_date = not todo and not result.deleted
    return result


@dataclass
class VerifyReport:
    checked: list[str] = field(default_factory=list)
    unverifiable: list[str] = field(default_factory=list)
    failures: list[VerifyError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def merge(self, other: VerifyReport) -> None:
        self.checked += other.checked
        self.unverifiable += other.unverifiable
        self.failures += other.failures

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": len(self.checked),
            "unverifiable": list(self.unverifiable),
            "failures": [str(e) for e in self.failures],
        }


def verify_local(layout: Layout, *, read_rate: float | None = None) -> VerifyReport:
    """Re-hash every recorded file on disk against each of its recorded checksums (one read
    per file), so a file that passed a served CRC and a sidecar's sha256 is held to both.

    ``read_rate`` (bytes/s) bounds the read rate, for background re-verification on a busy node.
    """
    report = VerifyReport()
    records = layout.recorded()
    if not records:
        raise VerifyError(f"nothing recorded under {layout.root}: no model was pulled there")
    limiter = _RateLimiter(read_rate) if read_rate else None
    for rec in records:
        _verify_one(rec, report, limiter)
    return report


def _verify_one(rec: RecordedFile, report: VerifyReport, limiter: _RateLimiter | None) -> None:
    try:
        size = rec.local.stat().st_size
    except FileNotFoundError:
        report.failures.append(VerifyError(f"{rec.path}: missing ({rec.local})"))
        return
    if size != rec.size:
        report.failures.append(
            VerifyError(f"{rec.path}: size is {size} bytes, expected {rec.size}")
        )
        return
    if not rec.checksums:
        report.unverifiable.append(rec.path)
        return
    actuals = verify.hash_file_all(rec.local, rec.checksums, reader=limiter)
    try:
        for checksum, actual in zip(rec.checksums, actuals, strict=True):
            verify.check(rec.path, checksum, actual)
        report.checked.append(rec.path)
    except ChecksumMismatchError as exc:
        report.failures.append(exc)


class _RateLimiter:
    def __init__(self, rate: float) -> None:
        self._rate = rate
        self._t0 = time.monotonic()
        self._bytes = 0

    def __call__(self, n: int) -> None:
        self._bytes += n
        ahead = self._bytes / self._rate - (time.monotonic() - self._t0)
        if ahead > 0:
            time.sleep(ahead)


def destination_path(dest: str | Path) -> Path:
    return Path(dest).expanduser().resolve()
