"""Page-cache warm-up: read a model's published files once so that its first reader hits memory.

The engine writes large files with O_DIRECT, so none of a fresh model is in the page cache when
vLLM opens it; its load then runs at disk speed. :func:`warm_files` reads the verified files
front to back, in the order given (the snapshot's file order), at a bounded rate, and only when
the whole model fits in a share of the memory the kernel reports available (``psutil``): a model
that does not fit is skipped with a log line, because half-warming it would only push out pages
that other processes use and leave the reader to fetch the rest from disk anyway.

What it costs: one reused read buffer (:data:`BLOCK_SIZE`) in the process, and the files' bytes
in the page cache, which the kernel reclaims like any clean cache page.

:func:`resident_bytes` asks the kernel (``mincore``) how much of a file is in the page cache; the
report and the tests use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from prefetch.layout import Layout
from prefetch.units import format_bytes

log = logging.getLogger(__name__)

BLOCK_SIZE = 8 * 1024 * 1024
#: Share of available memory a warm-up may fill, unless configured.
DEFAULT_MEMORY_SHARE = 0.5
#: Read rate (bytes/s) of a warm-up, unless configured: well under an NVMe's, so a node's other
#: readers keep most of the disk.
DEFAULT_READ_RATE = 2 * 1000 * 1000 * 1000

__all__ = [
    "BLOCK_SIZE",
    "DEFAULT_MEMORY_SHARE",
    "DEFAULT_READ_RATE",
    "WarmLimits",
    "WarmReport",
    "available_memory",
    "published_files",
    "resident_bytes",
    "warm_files",
]


@dataclass(frozen=True)
class WarmLimits:
    """How far a warm-up may go: ``memory_share`` of the available memory (0 < share <= 1) and
    ``read_rate`` bytes/s (None: unbounded)."""

    memory_share: float = DEFAULT_MEMORY_SHARE
    read_rate: int | None = DEFAULT_READ_RATE

    def __post_init__(self) -> None:
        if not 0.0 < self.memory_share <= 1.0:
            raise ValueError(f"memory_share must be in (0, 1], got {self.memory_share}")
        if self.read_rate is not None and self.read_rate <= 0:
            raise ValueError(f"read_rate must be positive, got {self.read_rate}")


@dataclass
class WarmReport:
    """What a warm-up did. ``state``: ``warm`` (every byte read), ``skipped`` (the model is
    larger than ``budget``), ``stopped`` (asked to stop) or ``failed`` (a read failed: ``reason``).
    ``budget`` is the bound it kept: ``memory_share`` of ``available`` when it started."""

    state: str
    bytes_total: int = 0
    bytes_read: int = 0
    files: int = 0
    seconds: float = 0.0
    available: int = 0
    budget: int = 0
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "seconds": round(self.seconds, 3)}


def available_memory() -> int:
    """Memory the kernel could give without swapping (MemAvailable), in bytes."""
    return int(psutil.virtual_memory().available)


def published_files(layout: Layout, model_path: Path) -> list[Path]:
    """The verified, published files of the model at ``model_path`` (a sync's ``path``), in the
    layout's record order (the snapshot's file order). A Hugging Face layout records a blob
    shared by two snapshots under the first only; such a file is left out of the newer one's
    list, and its reader loads it from disk."""
    return [rec.local for rec in layout.recorded() if rec.local.is_relative_to(model_path)]


def warm_files(
    paths: Sequence[Path],
    limits: WarmLimits = WarmLimits(),
    *,
    stop: threading.Event | None = None,
    available: Callable[[], int] = available_memory,
    model: str = "",
    on_start: Callable[[int], None] | None = None,
) -> WarmReport:
    """Read ``paths`` in order into the page cache, within ``limits``; never raises for a read
    error (a warm-up is an optimisation: the report says what failed). ``on_start(bytes)`` is
    called once the model is known to fit, before the first read (the agent's WarmUpStarted)."""
    t0 = time.monotonic()
    try:
        total = sum(p.stat().st_size for p in paths)
    except OSError as exc:
        return _failed(WarmReport("failed"), f"{exc.filename}: {exc.strerror or exc}", model)
    free = available()
    budget = int(free * limits.memory_share)
    report = WarmReport("warm", bytes_total=total, available=free, budget=budget)
    name = model or (str(paths[0].parent) if paths else "")
    if total > budget:
        report.state = "skipped"
        report.reason = (
            f"{format_bytes(total)} does not fit in {limits.memory_share:.0%} of the "
            f"{format_bytes(free)} of available memory ({format_bytes(budget)})"
        )
        log.info(
            "%s: page-cache warm-up skipped: %s",
            name,
            report.reason,
            extra={"model": model, "phase": "warm"},
        )
        return report
    if on_start is not None:
        on_start(total)
    pace = _Pace(limits.read_rate, stop)
    buf = bytearray(BLOCK_SIZE)
    view = memoryview(buf)
    try:
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                # a hint that the file is read front to back: the kernel reads ahead further
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                while n := f.readinto(view):
                    report.bytes_read += n
                    if not pace(n):
                        report.state = "stopped"
                        return report
            report.files += 1
    except OSError as exc:
        return _failed(report, f"{path}: {exc.strerror or exc}", model)
    finally:
        report.seconds = time.monotonic() - t0
    log.info(
        "%s: page cache warmed: %s in %d file(s) in %.1fs (bound %s)",
        name,
        format_bytes(report.bytes_read),
        report.files,
        report.seconds,
        format_bytes(budget),
        extra={"model": model, "phase": "warm", "bytes": report.bytes_read},
    )
    return report


def _failed(report: WarmReport, reason: str, model: str) -> WarmReport:
    report.state, report.reason = "failed", reason
    log.warning(
        "%s: page-cache warm-up failed: %s",
        model or "warm-up",
        reason,
        extra={"model": model, "phase": "warm", "error": reason},
    )
    return report


class _Pace:
    """Holds reads to ``rate`` bytes/s on average since the start; a few lines rather than a
    library because it must also wake at once when ``stop`` is set."""

    def __init__(self, rate: int | None, stop: threading.Event | None) -> None:
        self._rate = rate
        self._stop = stop or threading.Event()
        self._t0 = time.monotonic()
        self._bytes = 0

    def __call__(self, n: int) -> bool:
        """Count ``n`` bytes read; wait if ahead of the rate. False: stop."""
        self._bytes += n
        if self._rate is not None:
            ahead = self._bytes / self._rate - (time.monotonic() - self._t0)
            if ahead > 0:
                return not self._stop.wait(ahead)
        return not self._stop.is_set()


def resident_bytes(path: Path) -> int:
    """How many bytes of ``path`` are in the page cache now (whole pages; the last one counts
    in full), by ``mincore(2)`` on a read-only mapping. Python's mmap has no mincore, and no
    maintained package wraps it, so it is called through ctypes."""
    size = path.stat().st_size
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    vec = (ctypes.c_ubyte * pages)()
    # ACCESS_COPY: a private mapping ctypes can take the address of (it needs a writable
    # buffer); nothing is written, so the pages stay the page cache's own
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        start = ctypes.c_char.from_buffer(m)
        try:
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec)
        finally:
            del start  # the mapping cannot close while ctypes holds it
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
    return sum(1 for v in vec if v & 1) * page
