"""The chunk engine's hot path: one ranged request for a run of a file's chunks, read into the
worker's reusable buffer, written with ``pwrite``, hashed inline and journalled chunk by chunk.

Each io thread owns one page-aligned read buffer (as O_DIRECT writes need), on huge pages
where the kernel has them (:class:`prefetch.pipeline.engine.partial_file.PageBuffers`). A
request that fails part way is retried from its last byte written
(:func:`prefetch.pipeline.engine.watched_read.retry_read`); the watchdog aborts a read that stalls,
outlives the deadline or is stopped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from prefetch.pipeline import verify
from prefetch.pipeline.deadline import Watch, Watchdog
from prefetch.pipeline.engine.config import TransferConfig, TransferStats
from prefetch.pipeline.engine.partial_file import PageBuffers
from prefetch.pipeline.engine.plan import FileJob
from prefetch.pipeline.engine.watched_read import (
    Filled,
    connection_closed,
    fill_watched,
    open_watched,
    read_slice,
    retry_read,
)
from prefetch.pipeline.progress import ProgressSink
from prefetch.sources.base import Source
from prefetch.support.errors import Cancelled, PrefetchError, TransientSourceError


@dataclass
class _Cursor:
    """Where one request is: the next byte to write, and the chunk (of its run) it belongs to."""

    pos: int
    indices: list[int]
    k: int = 0
    hasher: verify.ChunkHasher | None = None


class ChunkFetcher:
    """Fetches runs of a file's chunks into its partial file (called on the io threads)."""

    def __init__(
        self,
        source: Source,
        watchdog: Watchdog,
        config: TransferConfig,
        stats: TransferStats,
        progress: ProgressSink,
        stop: threading.Event,
    ) -> None:
        self._source = source
        self._watchdog = watchdog
        self._config = config
        self._stats = stats
        self._progress = progress
        self._stop = stop
        self._slice = read_slice(config)
        self._local = threading.local()
        self._buffers = PageBuffers(config.buffer_size, config.concurrency)

    def fetch(self, job: FileJob, indices: list[int]) -> None:
        """Fetch the consecutive chunks ``indices`` with one ranged request (more on retry)."""
        end = job.chunks[indices[-1]][1]
        view = self._buffer()
        cursor = _Cursor(job.chunks[indices[0]][0], indices)
        cursor.hasher = verify.ChunkHasher(job.checksum, *job.chunks[indices[0]], job.file.size)
        retry_read(
            lambda: self._read_range(job, cursor, end, view),
            policy=self._config.retry,
            stop=self._stop,
            what=job.file.path,
            position=lambda: cursor.pos,
            on_retry=self._count_retry,
        )
        # on a retry the hasher has seen exactly [chunk start, cursor.pos): it continues there

    def _buffer(self) -> memoryview:
        view = getattr(self._local, "view", None)
        if view is None:
            view = self._buffers.take()
            self._local.view = view
        return view

    def _count_retry(self, exc: TransientSourceError) -> None:
        self._stats.retries += 1
        self._progress.retry(str(exc))

    def _read_range(self, job: FileJob, cursor: _Cursor, end: int, view: memoryview) -> None:
        """Read [cursor.pos, end) into the file; cursor.pos always marks what is written and
        hashed, also when this raises, so a retry continues from exactly there. The watchdog may
        abort the read (stop, stall, deadline): the blocked ``readinto`` then returns or fails at
        once and the reason it gives replaces whatever the reader said."""
        reader, watch = open_watched(
            self._watchdog, f"{job.file.path} bytes {cursor.pos}-{end - 1}",
            partial(self._source.open_range, job.file, cursor.pos, end),
        )  # fmt: skip
        assert cursor.hasher is not None
        # a local file's reader copies in the kernel when no hash needs the bytes on the way
        copy = None if cursor.hasher.needs_bytes else getattr(reader, "copy_to", None)
        try:
            while cursor.pos < end:
                if self._stop.is_set():
                    raise Cancelled("stopped")
                # fill the buffer (full buffers keep O_DIRECT writes aligned), never past a chunk
                want = min(len(view), job.chunks[cursor.indices[cursor.k]][1] - cursor.pos)
                if copy is not None:
                    if self._copy(job, copy, watch, want, cursor):
                        continue
                    copy = None  # the kernel cannot copy here: read and write instead
                got = Filled()
                try:
                    fill_watched(
                        reader, watch, view[:want], got, slice_size=self._slice, stop=self._stop,
                        closed=partial(connection_closed, job.file, cursor.pos),
                    )  # fmt: skip
                finally:
                    if got.pos:  # also on errors: keep what arrived, the retry starts after it
                        self._write(job, view[: got.pos], cursor)
        finally:
            self._watchdog.unwatch(watch)
            reader.close()

    def _copy(
        self,
        job: FileJob,
        copy: Callable[[int, int, int], int | None],
        watch: Watch,
        want: int,
        cursor: _Cursor,
    ) -> bool:
        """Copy the next ``want`` bytes of the range into the partial file in the kernel
        (``RangeReader.copy_to``: a local file, no hash needing its bytes), and count them;
        False when the reader cannot copy here."""
        try:
            copied = copy(job.partial.fd, cursor.pos, want)
        except PrefetchError:
            watch.raise_if_aborted()
            raise
        except OSError as exc:  # (the reader's own errors are PrefetchErrors: the write side)
            raise job.partial.write_failed(job.partial.path, exc) from exc
        if copied is None:
            return False
        watch.raise_if_aborted()
        watch.received += copied
        self._landed(job, copied, cursor)
        return True

    def _write(self, job: FileJob, data: memoryview, cursor: _Cursor) -> None:
        """Write, hash and count ``data`` at cursor.pos; journal each chunk it completes."""
        job.partial.pwrite_all(data, cursor.pos)
        assert cursor.hasher is not None
        cursor.hasher.feed(data)
        self._landed(job, len(data), cursor)

    def _landed(self, job: FileJob, n: int, cursor: _Cursor) -> None:
        """``n`` bytes written (and hashed) at cursor.pos: count them, journal each chunk they
        complete."""
        assert cursor.hasher is not None and job.journal is not None
        cursor.pos += n
        self._stats.add_bytes(n)
        self._progress.advance(n)
        index = cursor.indices[cursor.k]
        if cursor.pos == job.chunks[index][1]:
            job.journal.record(index, cursor.hasher.result())
            cursor.k += 1
            if cursor.k < len(cursor.indices):
                cursor.hasher = verify.ChunkHasher(
                    job.checksum, *job.chunks[cursor.indices[cursor.k]], job.file.size
                )
