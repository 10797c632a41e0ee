"""Page-cache warm-up: read a model's published files once so that its first reader hits memory.

The engine writes large files with O_DIRECT, so none of a fresh model is in the page cache when
vLLM opens it; its load then runs at disk speed. :func:`warm_files` reads the verified files
front to back, in the order given (the snapshot's file order), at a bounded rate, and only when
the whole model fits in its budget: a share of the memory the kernel reports available
(``psutil``) and, in a memory cgroup (a container with a memory limit), the same share of what
that cgroup's limit leaves beside the process's own memory. A model that does not fit is
skipped with a log line, because half-warming it would only push out pages that other processes
use and leave the reader to fetch the rest from disk anyway.

Why the cgroup counts: the kernel charges a page-cache page to the memory cgroup of the task
whose read brought it in, and reclaims a cgroup's own pages when it reaches its limit. So a
warm-up in an agent limited to 512 MiB can never hold more than that: it reads every byte, and
the kernel drops the first ones as it reads the last. ``POSIX_FADV_WILLNEED`` or ``readahead``
do not help: the read-ahead runs for the caller and is charged to the caller's cgroup just the
same. So the budget is bounded by the cgroup, and the agent's memory limit must leave room for
the models it warms (the chart's ``agent.warmPageCacheMemory``; docs/deploy.md). At the end,
:func:`resident_bytes` (``mincore``) measures what stayed: the report says ``warm`` only when
every byte is resident, else ``partial`` with the resident share.

What it costs: one reused read buffer (:data:`BLOCK_SIZE`) in the process, and the files' bytes
in the page cache, which the kernel reclaims like any clean cache page.
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

from prefetch.pipeline.layout import Layout
from prefetch.support.units import format_bytes

log = logging.getLogger(__name__)

BLOCK_SIZE = 8 * 1024 * 1024
#: Share of available memory a warm-up may fill, unless configured.
DEFAULT_MEMORY_SHARE = 0.5
#: Read rate (bytes/s) of a warm-up, unless configured: well under an NVMe's, so a node's other
#: readers keep most of the disk.
DEFAULT_READ_RATE = 2 * 1000 * 1000 * 1000

#: The cgroup file systems' mount point, and where the kernel says which cgroup a process is in.
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
#: cgroup v1 writes "no limit" as the largest page-aligned counter (9223372036854771712 on
#: x86-64); anything this large is no limit.
_V1_UNLIMITED = 1 << 62

__all__ = [
    "BLOCK_SIZE",
    "CGROUP_ROOT",
    "DEFAULT_MEMORY_SHARE",
    "DEFAULT_READ_RATE",
    "CgroupMemory",
    "WarmLimits",
    "WarmReport",
    "available_memory",
    "cgroup_memory",
    "published_files",
    "resident_bytes",
    "share_text",
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
    """What a warm-up did. ``state``: ``warm`` (every byte read and, measured at the end, every
    byte resident), ``partial`` (read, but only ``bytes_resident`` stayed in the page cache:
    ``reason`` says the share), ``skipped`` (the model is larger than ``budget``), ``stopped``
    (asked to stop) or ``failed`` (a read failed: ``reason``). ``budget`` is the bound it kept:
    ``memory_share`` of ``available`` when it started, or of ``cgroup_room`` (what the memory
    cgroup's ``cgroup_limit`` leaves beside the process's own memory) when that is smaller;
    both cgroup fields are 0 outside a memory-limited cgroup."""

    state: str
    bytes_total: int = 0
    bytes_read: int = 0
    files: int = 0
    seconds: float = 0.0
    available: int = 0
    budget: int = 0
    reason: str = ""
    bytes_resident: int = 0
    cgroup_limit: int = 0
    cgroup_room: int = 0

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class CgroupMemory:
    """A memory cgroup's limit and what is charged to it (bytes): ``usage`` in all, of it
    ``cache`` the page cache (reclaimable). ``room`` is what the page cache may hold before the
    kernel reclaims it for the limit: the limit less the memory that is not page cache."""

    limit: int
    usage: int
    cache: int

    @property
    def room(self) -> int:
        return max(0, self.limit - max(0, self.usage - self.cache))


def cgroup_memory(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> CgroupMemory | None:
    """The memory cgroup this process is in, with the tightest limit on its way to the root
    (v2 ``memory.max``, v1 ``memory.limit_in_bytes``); None without a limit or a readable
    cgroup file system.

    Hand-written, and small: psutil reads the machine's memory, not a cgroup's, and no
    maintained package reads both cgroup versions' limits; the files are a few numbers."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            found = _tightest(root, path, ("memory.max", "memory.current", ("file",)))
        elif "memory" in controllers.split(","):
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_cache", "cache"))
            found = _tightest(root / "memory", path, names)
        else:
            continue
        if found is not None:
            return found
    return None


def _tightest(
    mount: Path, path: str, names: tuple[str, str, tuple[str, ...]]
) -> CgroupMemory | None:
    """The limited cgroup with the least room from the process's cgroup ``path`` up to the
    ``mount`` (inside a container the mount is often the container's own cgroup, and ``path``,
    the host's view, is not under it: then the mount itself)."""
    here = mount / path.strip("/")
    if not (here / names[0]).is_file():
        here = mount
    best: CgroupMemory | None = None
    while True:
        found = _read_level(here, names)
        if found is not None and (best is None or found.room < best.room):
            best = found
        if here == mount or not here.is_relative_to(mount):
            return best
        here = here.parent


def _read_level(where: Path, names: tuple[str, str, tuple[str, ...]]) -> CgroupMemory | None:
    limit_file, usage_file, cache_keys = names
    try:
        limit_text = (where / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _V1_UNLIMITED:
            return None
        usage = int((where / usage_file).read_text().strip())
        stat_lines = (where / "memory.stat").read_text().splitlines()
    except (OSError, ValueError):
        return None
    stats = dict(line.split(" ", 1) for line in stat_lines if " " in line)
    cache = next((int(stats[k]) for k in cache_keys if k in stats), 0)
    return CgroupMemory(limit=int(limit_text), usage=usage, cache=cache)


def share_text(share: float) -> str:
    """A share as a percentage for people: ``"<1%"`` rather than a rounded ``"0%"``."""
    if 0 < share < 0.005:
        return "<1%"
    return f"{share:.0%}"


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
    cgroup: Callable[[], CgroupMemory | None] = cgroup_memory,
    model: str = "",
    on_start: Callable[[int], None] | None = None,
) -> WarmReport:
    """Read ``paths`` in order into the page cache, within ``limits`` (and the memory cgroup's
    room, see the module docstring); never raises for a read error (a warm-up is an
    optimisation: the report says what failed). ``on_start(bytes)`` is called once the model
    is known to fit, before the first read (the agent's WarmUpStarted)."""
    t0 = time.monotonic()
    try:
        total = sum(p.stat().st_size for p in paths)
    except OSError as exc:
        return _failed(WarmReport("failed"), f"{exc.filename}: {exc.strerror or exc}", model)
    report = _budget(total, limits, available(), cgroup())
    name = model or (str(paths[0].parent) if paths else "")
    if report.state == "skipped":
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
        report.bytes_resident = sum(min(resident_bytes(p), p.stat().st_size) for p in paths)
    except OSError as exc:
        return _failed(report, f"{path}: {exc.strerror or exc}", model)
    finally:
        report.seconds = time.monotonic() - t0
    if report.bytes_resident < report.bytes_total:
        return _partial(report, name, model)
    log.info(
        "%s: page cache warmed: %s in %d file(s) in %.1fs (bound %s)",
        name,
        format_bytes(report.bytes_read),
        report.files,
        report.seconds,
        format_bytes(report.budget),
        extra={"model": model, "phase": "warm", "bytes": report.bytes_read},
    )
    return report


def _budget(total: int, limits: WarmLimits, free: int, group: CgroupMemory | None) -> WarmReport:
    """The report a warm-up of ``total`` bytes starts with: its budget (``memory_share`` of the
    available memory, or of the cgroup's room when smaller), ``skipped`` when it does not fit."""
    share = share_text(limits.memory_share)
    room, where = free, f"the {format_bytes(free)} of available memory"
    if group is not None and group.room < free:
        room = group.room
        where = (
            f"the {format_bytes(group.room)} its memory cgroup's limit of "
            f"{format_bytes(group.limit)} leaves for the page cache (page cache is charged to "
            "the reader's cgroup: raise the agent's memory limit to warm larger models)"
        )
    budget = int(room * limits.memory_share)
    report = WarmReport("warm", bytes_total=total, available=free, budget=budget)
    if group is not None:
        report.cgroup_limit, report.cgroup_room = group.limit, group.room
    if total > budget:
        report.state = "skipped"
        report.reason = (
            f"{format_bytes(total)} does not fit in {share} of {where} ({format_bytes(budget)})"
        )
    return report


def _partial(report: WarmReport, name: str, model: str) -> WarmReport:
    share = share_text(report.bytes_resident / report.bytes_total)
    why = "memory pressure"
    if report.cgroup_limit:
        why += f", or the memory cgroup's limit of {format_bytes(report.cgroup_limit)}"
    report.state = "partial"
    report.reason = (
        f"only {format_bytes(report.bytes_resident)} of {format_bytes(report.bytes_total)} "
        f"({share}) stayed in the page cache after the warm-up ({why})"
    )
    log.warning(
        "%s: page-cache warm-up partial: %s",
        name,
        report.reason,
        extra={"model": model, "phase": "warm", "bytes": report.bytes_resident},
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


#: ``mincore`` looks at a file through a mapping of at most this much at a time (its answer,
#: one byte per page, is then 256 KiB at most).
_RESIDENT_WINDOW = 1 << 30
#: Bit 0 of each of ``mincore``'s bytes: the page is resident (the others are reserved).
_LOW_BIT = bytes(b & 1 for b in range(256))


def resident_bytes(path: Path) -> int:
    """How many bytes of ``path`` are in the page cache now (whole pages; the last one counts
    in full), by ``mincore(2)`` on read-only mappings of a window at a time. Python's mmap has
    no mincore, and no maintained package wraps it, so it is called through ctypes."""
    size = path.stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    pages = 0
    with open(path, "rb") as f:
        for offset in range(0, size, _RESIDENT_WINDOW):
            pages += _resident_pages(libc, f.fileno(), offset, min(_RESIDENT_WINDOW, size - offset))
    return pages * mmap.PAGESIZE


def _resident_pages(libc: ctypes.CDLL, fd: int, offset: int, length: int) -> int:
    vec = (ctypes.c_ubyte * ((length + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    # ACCESS_COPY: a private mapping ctypes can take the address of (it needs a writable
    # buffer); nothing is written, so the pages stay the page cache's own
    with mmap.mmap(fd, length, access=mmap.ACCESS_COPY, offset=offset) as m:
        start = ctypes.c_char.from_buffer(m)
        try:
            rc = libc.mincore(
                ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(length), vec
            )
        finally:
            del start  # the mapping cannot close while ctypes holds it
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return bytes(vec).translate(_LOW_BIT).count(1)
