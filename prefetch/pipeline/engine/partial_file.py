"""A download's partial file on disk: opened preallocated (with an ``O_DIRECT`` twin for a large
file) or created empty, written at offsets, flushed, closed and deleted; and :func:`no_space`,
the one error for a write the disk refused for want of space.

Large files are written with ``O_DIRECT`` from page-aligned buffers: no copy into the page cache,
which on a 2-core machine is most of a buffered download's CPU time (bench/README.md), and the
fsync before publishing is cheap. Unaligned writes, small files and filesystems without O_DIRECT
use the buffered descriptor.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
from pathlib import Path

from prefetch.pipeline.engine.config import ENGINE_LOGGER
from prefetch.pipeline.snapshot import RemoteFile
from prefetch.support.errors import InsufficientSpaceError, PrefetchError, TransferError

log = logging.getLogger(ENGINE_LOGGER)
MiB = 1024 * 1024
#: O_DIRECT needs offsets, lengths and buffer addresses aligned to the device's logical block size.
DIRECT_ALIGN = 4096
#: Files below this size are written through the page cache (too small for O_DIRECT to pay).
DIRECT_MIN_SIZE = 8 * MiB
#: The size of a transparent huge page (x86-64, arm64 with 4 KiB pages).
HUGE_PAGE = 2 * MiB


class PageBuffers:
    """Page-aligned read buffers of ``size`` bytes (O_DIRECT writes need the alignment), one per
    io thread, cut ``count`` at a time from one mapping on transparent huge pages where the
    kernel gives them (``MADV_HUGEPAGE``). Each O_DIRECT write pins the buffer's pages and adds
    them to its bio one by one, and the receive copy and the hash miss the TLB once per page:
    2 MiB pages instead of 4 KiB ones cut a 1 GiB pull's CPU by 13%, the write's by half
    (bench/README.md, "the cost of a byte, round 2"). One mapping for all threads, so two 1 MiB
    buffers share a huge page: the memory of the separate buffers of before."""

    def __init__(self, size: int, count: int) -> None:
        self._size = size
        self._stride = -(-size // DIRECT_ALIGN) * DIRECT_ALIGN  # each buffer starts on a page
        self._count = max(1, count)
        self._free: list[memoryview] = []
        self._lock = threading.Lock()

    def take(self) -> memoryview:
        """A buffer of its own for the calling thread (never given back: it lives as long as
        the threads that use it)."""
        with self._lock:
            if not self._free:
                whole = _huge_page_mapping(self._stride * self._count)
                self._free = [
                    whole[k * self._stride : k * self._stride + self._size]
                    for k in reversed(range(self._count))
                ]
            return self._free.pop()


def _huge_page_mapping(size: int) -> memoryview:
    """``size`` bytes of private anonymous memory (page-aligned), advised onto huge pages. Private:
    mmap's default for anonymous memory is shared (shmem, whose huge pages are off by default).
    Linux 6.7+ aligns a mapping of whole huge pages to one, so the size is rounded up to them."""
    rounded = -(-size // HUGE_PAGE) * HUGE_PAGE
    buf = mmap.mmap(-1, rounded, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is not None:
        with contextlib.suppress(OSError):  # (no THP in this kernel: small pages, as before)
            buf.madvise(advise)
    return memoryview(buf)


class PartialFile:
    """The partial download ``path`` of ``file``: its descriptors (``fd`` buffered, ``dfd`` the
    same file opened with O_DIRECT, or -1) and the writes through them. Any thread may write;
    only one closes it, once every writer has stopped."""

    def __init__(self, path: Path, file: RemoteFile) -> None:
        self.path = path
        self._file = file  # named in write errors
        self.fd = -1
        self.dfd = -1
        self.direct_refused = False  # a write through dfd failed with EINVAL: stop using it

    def create_empty(self) -> None:
        """Create (or empty) the file for one write from its start, whatever was there."""
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as exc:
            raise self.write_failed(self.path, exc) from exc

    def open_preallocated(self, *, keep: bool, direct: bool) -> bool:
        """Open the file for writes at any offset with its full size allocated: emptied first
        unless ``keep`` (it holds finished chunks), and with an O_DIRECT descriptor too when
        ``direct`` and the file is large. Returns False when the filesystem cannot preallocate
        (the file is then only truncated to its size)."""
        size = self._file.size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        preallocated = True
        try:
            if not keep:
                os.ftruncate(fd, 0)
            if size:
                os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # (no fallocate here)
                raise self.write_failed(self.path, exc) from exc
            preallocated = False
            fd = os.open(self.path, os.O_RDWR)
            os.ftruncate(fd, size)
        self.fd = fd
        if direct and size >= DIRECT_MIN_SIZE:
            try:
                self.dfd = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
            except (OSError, AttributeError) as exc:
                log.debug("no O_DIRECT for %s (%s): buffered writes", self.path, exc)
        return preallocated

    def pwrite_all(self, data: memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset``: through O_DIRECT where it is aligned."""
        while len(data):
            direct = (
                self.dfd >= 0
                and not self.direct_refused
                and offset % DIRECT_ALIGN == 0
                and len(data) % DIRECT_ALIGN == 0
            )
            try:
                written = os.pwrite(self.dfd if direct else self.fd, data, offset)
            except OSError as exc:
                if direct and exc.errno == errno.EINVAL:
                    # the filesystem opened O_DIRECT but refuses this write: buffered from now on
                    # (the descriptor stays open until the file is closed: other threads use it)
                    log.debug("O_DIRECT write refused for %s: buffered writes", self.path)
                    self.direct_refused = True
                    continue
                raise self.write_failed(self.path, exc) from exc
            data = data[written:]
            offset += written

    def fsync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as exc:
            raise self.write_failed(self.path, exc) from exc

    def close(self) -> None:
        if self.dfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.dfd)
            self.dfd = -1
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def delete(self) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def write_failed(self, path: Path, exc: OSError) -> PrefetchError:
        """A write for this download to ``path`` (the file or its journal) failed: out of space,
        or another reason."""
        writing = f"{self._file.path} ({self._file.size} bytes)"
        full = no_space(exc, self.path.parent, writing)
        return full or TransferError(f"cannot write {path}: {exc.strerror}")


def no_space(exc: OSError, under: Path, writing: str = "") -> InsufficientSpaceError | None:
    """The one error for a write the disk refused for want of space (ENOSPC, or EDQUOT: over
    quota) under ``under``, while writing ``writing``; None for any other OSError."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    return InsufficientSpaceError(
        f"no space left on the device under {under}"
        + (f" while writing {writing}" if writing else "")
        + f": {exc.strerror or exc}",
        hint="free some space (prefetch gc) or point DEST at a larger volume; finished files "
        "and partial downloads are kept and the next pull resumes",
    )
