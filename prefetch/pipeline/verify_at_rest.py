"""Verification at rest: re-hash what a layout recorded against every checksum it passed at
download time (``prefetch verify``, the agent's re-verification), and forget what failed so the
next sync fetches it again."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import overload

from prefetch.pipeline import verify
from prefetch.pipeline.layout import Layout, RecordedFile
from prefetch.support.errors import ChecksumMismatchError, VerifyError

log = logging.getLogger("prefetch.pipeline.sync")  # the name its lines had


@dataclass
class VerifyReport:
    """What :func:`verify_local` found: files checked, files with no checksum, failures."""

    checked: list[str] = field(default_factory=list)
    unverifiable: list[str] = field(default_factory=list)
    failures: list[VerifyError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def mismatched_paths(self) -> list[str]:
        """The files whose content failed a checksum (not the missing or truncated ones)."""
        return [f.path for f in self.failures if isinstance(f, ChecksumMismatchError)]

    def merge(self, other: VerifyReport) -> None:
        self.checked += other.checked
        self.unverifiable += other.unverifiable
        self.failures += other.failures

    def to_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "checked": len(self.checked),
            "unverifiable": list(self.unverifiable),
            "failures": [str(e) for e in self.failures],
        }


@overload
def verify_local(
    layout: Layout, *, read_rate: float | None = None, stop: None = None
) -> VerifyReport: ...


@overload
def verify_local(
    layout: Layout, *, read_rate: float | None = None, stop: threading.Event
) -> VerifyReport | None: ...


def verify_local(
    layout: Layout, *, read_rate: float | None = None, stop: threading.Event | None = None
) -> VerifyReport | None:
    """Re-hash every recorded file on disk against each of its recorded checksums (one read
    per file), so a file that passed a served CRC and a sidecar's sha256 is held to both.

    ``read_rate`` (bytes/s) bounds the read rate, for background re-verification on a busy node.
    ``stop`` is checked between files: once set, the check ends and returns None (a partial
    report would pass for a clean one).
    """
    report = VerifyReport()
    records = layout.recorded()
    if not records:
        raise VerifyError(f"nothing recorded under {layout.root}: no model was pulled there")
    limiter = _RateLimiter(read_rate) if read_rate else None
    for rec in records:
        if stop is not None and stop.is_set():
            return None
        _verify_one(rec, report, limiter)
    return report


def verify_layouts(layouts: Iterable[Layout], *, into: VerifyReport | None = None) -> VerifyReport:
    """:func:`verify_local` each layout, one report for all (``into``: the report to fill in as
    it goes, so a caller reading it after a failure sees what was checked before)."""
    report = into if into is not None else VerifyReport()
    for layout in layouts:
        report.merge(verify_local(layout))
    return report


def forget_failures(layout: Layout, report: VerifyReport) -> list[str]:
    """Delete, through ``layout.forget``, each recorded file whose checksum failed, so the next
    sync fetches it again; returns their paths. Missing or truncated files need nothing: the
    next sync fetches them anyway."""
    recorded = {r.path for r in layout.recorded()}
    forgotten = []
    for path in report.mismatched_paths():
        if path in recorded:
            layout.forget(path)
            forgotten.append(path)
            log.info("deleted %s (failed re-verification)", path, extra={"phase": "verify"})
    return forgotten


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
