"""The chunk engine: ranged reads of many files under one concurrency limit, resumable, verified.

Per file: describe it (S3: a HEAD for checksums and part layout) and plan its chunks
(:mod:`prefetch.pipeline.engine.plan`), open ``<name>.incomplete`` preallocated, resuming what its
journal records (:mod:`prefetch.pipeline.engine.resume`), run every missing chunk on one pool of
``concurrency`` threads (:mod:`prefetch.pipeline.engine.fetch`: ``readinto`` a reusable buffer,
``pwrite``, hash inline, journal), then seal, verify and let the layout publish it
(:mod:`prefetch.pipeline.engine.finish`). A file of one chunk below the O_DIRECT size skips
preallocation and journal: the io task that described it also fetches, hashes, writes and
fsyncs it, from the bytes its describe brought when the source has
:class:`~prefetch.sources.base.DescribesWhole` (S3: :mod:`prefetch.pipeline.engine.whole`),
else by one ranged read; one io task describes a batch of such files
(:mod:`prefetch.pipeline.engine.describing`). This module is the coordinator that takes each
file through those steps; :mod:`prefetch.pipeline.engine.partial_file` writes the partial files
(O_DIRECT for large ones) and :mod:`prefetch.pipeline.engine.watched_read` holds the read and
retry loops the engine shares with the mirror.

A sequential checksum (sha256 of a Hub LFS file) is computed while the file downloads, by a hash
worker reading back each newly contiguous run of chunks.

One watchdog (:class:`prefetch.pipeline.deadline.Watchdog`) enforces the stall rule (under
``min_rate`` bytes/s over ``stall_window``: retried from the last byte written), the ``deadline``
(then a DeadlineExceededError, partials kept) and a stop.

Why threads and not asyncio: the hot path is ``readinto`` a preallocated buffer, ``pwrite``, and a
CRC/hash update, all of which release the GIL; threads do it without the extra copy asyncio
streams make, and the agent's event loop simply runs a sync in a worker thread.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from prefetch.pipeline import verify
from prefetch.pipeline.engine.config import TransferConfig, TransferStats
from prefetch.pipeline.engine.coordinator import Coordinator
from prefetch.pipeline.engine.describing import DescribeWorker
from prefetch.pipeline.engine.fetch import ChunkFetcher
from prefetch.pipeline.engine.finish import FileFinisher, PublishFn
from prefetch.pipeline.engine.partial_file import DIRECT_MIN_SIZE
from prefetch.pipeline.engine.plan import FileJob, FilePlanner, group_chunks
from prefetch.pipeline.engine.resume import Resumer, prepare_whole
from prefetch.pipeline.engine.watched_read import engine_watchdog
from prefetch.pipeline.engine.whole import WholeWriter
from prefetch.pipeline.progress import NullProgress, ProgressSink
from prefetch.pipeline.snapshot import RemoteFile
from prefetch.sources.base import Source
from prefetch.support.errors import Cancelled, DeadlineExceededError, TransferError
from prefetch.support.logjson import inherit_context

#: At most this many small files are described (and fetched) by one io task, one after another.
SMALL_BATCH = 8

# -- the coordinator's tasks (each names the work and what it is for) -------------------------


@dataclass(slots=True)
class _Describe:
    """Describe and plan files, one after another (an io worker; a small file is fetched whole
    by the same task): one file, or a batch of small ones (see _next_batch)."""

    files: list[RemoteFile]


@dataclass(slots=True)
class _FetchRange:
    """Fetch a run of consecutive chunks with one ranged request (an io worker)."""

    job: FileJob
    indices: list[int]


@dataclass(slots=True)
class _FetchWhole:
    """Fetch a small file again, whole, after a check failed (an io worker)."""

    job: FileJob


@dataclass(slots=True)
class _HashAhead:
    """Feed a large file's sequential hashers up to chunk ``stop`` (a hash worker)."""

    job: FileJob
    stop: int


@dataclass(slots=True)
class _Seal:
    """Flush a finished file and compute the value of each of its checks (a hash worker)."""

    job: FileJob


_Task = _Describe | _FetchRange | _FetchWhole | _HashAhead | _Seal


class Transfer:
    """Runs one batch of files through describe -> chunks -> verify -> publish."""

    def __init__(
        self,
        source: Source,
        staging_dir: Path,
        publish: PublishFn,
        config: TransferConfig,
        *,
        progress: ProgressSink | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self._staging = staging_dir
        self._config = config
        self._progress = progress or NullProgress()
        self._stop = stop or threading.Event()
        self.stats = TransferStats()
        self._watchdog = engine_watchdog(config, self._stop)
        self._planner = FilePlanner(source, self._watchdog, staging_dir, config)
        self._resumer = Resumer(staging_dir, config, self.stats)
        self._fetcher = ChunkFetcher(
            source, self._watchdog, config, self.stats, self._progress, self._stop
        )
        self._finisher = FileFinisher(publish, config, self.stats, self._progress)
        self._describer = DescribeWorker(
            source, self._planner, self._resumer, self._fetcher, self._finisher,
            WholeWriter(self.stats, self._progress, self._resumer.left_over), self._stop,
            config,
        )  # fmt: skip
        # the workers' log lines carry the caller's sync id (logjson.inherit_context); the
        # pools start their threads on the first task
        self._io = ThreadPoolExecutor(
            config.concurrency, thread_name_prefix="prefetch-io", initializer=inherit_context()
        )
        self._hashing = ThreadPoolExecutor(
            config.hash_workers, thread_name_prefix="prefetch-hash", initializer=inherit_context()
        )
        self._tasks = Coordinator[_Task](
            self._stop, done=self._done, failed=self._failed, minor=Cancelled
        )
        self._jobs: list[FileJob] = []  # every file described, for the cleanup
        self._to_describe: deque[RemoteFile] = deque()
        self._describing = 0  # describe tasks queued or running
        self._ran = False

    # -- public ------------------------------------------------------------------------------

    def run(self, files: list[RemoteFile]) -> TransferStats:
        """Fetch, check and publish ``files`` (once per Transfer)."""
        if self._ran:
            raise TransferError("a Transfer runs once; make another for the next batch")
        self._ran = True
        self._staging.mkdir(parents=True, exist_ok=True)
        self._resumer.scan()
        self._watchdog.start()
        try:
            with self._io, self._hashing:
                # smallest first: small files finish (and publish) early, under the streams of
                # the large ones, instead of leaving a tail of publishing at the end
                self._to_describe.extend(sorted(files, key=lambda f: f.size))
                self._describe_more()
                try:
                    self._tasks.run()
                except Cancelled as exc:
                    if self._watchdog.deadline_passed:
                        raise DeadlineExceededError(
                            f"the transfer did not finish within its deadline of "
                            f"{self._config.stated_deadline or self._config.deadline:g}s; "
                            "the partial files are kept",
                            hint="run the pull again to resume, or raise --deadline",
                        ) from exc
                    raise
        finally:
            self._watchdog.close()
            # Every worker has stopped: only now is it safe to close descriptors and delete files.
            for job in self._jobs:
                job.clean_up()
        return self.stats

    # -- coordinator (main thread) -----------------------------------------------------------

    def _done(self, task: _Task, result: object) -> None:
        """A task succeeded: take the file its next step (``result``: what the task's function
        returned, of the type its kind states below; ``cast`` costs nothing but a call, and
        no ranged read's task needs one)."""
        match task:
            case _FetchRange(job=job):
                self._count_chunk()
                job.pending -= 1
                if job.pending == 0:
                    self._file_complete(job)
                else:
                    self._advance_hash(job)
            case _HashAhead(job=job, stop=stop):
                self._hashed_ahead(job, stop)
            case _Describe():
                self._describing -= 1
                for job, actuals in cast("list[tuple[FileJob, list[str] | None]]", result):
                    self._described(job, actuals)
            case _Seal(job=job):
                self._finish_verified(job, cast("list[str]", result))
            case _FetchWhole(job=job):
                if job.chunks:
                    self._count_chunk()
                self._finish_verified(job, cast("list[str]", result))

    def _count_chunk(self) -> None:
        """One ranged request completed (the chunks metric counts what the engine fetched)."""
        self.stats.chunks_downloaded += 1
        self._progress.chunk_done()

    def _failed(self, task: _Task, exc: BaseException) -> None:
        if not isinstance(task, _Describe):
            task.job.fail(exc)

    def _describe_more(self) -> None:
        """Keep at most ``concurrency`` describe tasks queued or running (each one file, or a
        batch of small ones): a window (instead of every file queued up front) lets each large
        file's download start right behind its describe. (A window of twice as many saved no
        CPU on 1000 small files.)"""
        while self._to_describe and self._describing < self._config.concurrency:
            batch = self._next_batch()
            self._tasks.submit(self._io, _Describe(batch), self._describer.batch, batch)
            self._describing += 1

    def _next_batch(self) -> list[RemoteFile]:
        """The next file to describe, with up to SMALL_BATCH - 1 more small ones behind it
        when there are enough files left to give every io thread a batch: one task (one
        submit, one hand-off to the coordinator) for several small files."""
        queue = self._to_describe
        batch = [queue.popleft()]
        if batch[0].size >= DIRECT_MIN_SIZE:
            return batch
        k = min(SMALL_BATCH, len(queue) // self._config.concurrency + 1)
        while queue and len(batch) < k and queue[0].size < DIRECT_MIN_SIZE:
            batch.append(queue.popleft())
        return batch

    def _described(self, job: FileJob, actuals: list[str] | None) -> None:
        """A describe task's result: a small file already fetched and sealed (``actuals``, the
        value of each check) is checked and published; any other file starts its chunks."""
        self._jobs.append(job)
        if job.unverified:
            self.stats.unverified.append(job.file.path)
        if actuals is None:
            self._start_file(job)
            self._describe_more()
        else:
            if job.chunks:  # its describe task fetched it, with one ranged read
                self._count_chunk()
            self._describe_more()  # the next describe runs while this file publishes
            self._finish_verified(job, actuals)

    def _start_file(self, job: FileJob) -> None:
        """A file of several chunks (or too large for one buffered write): open its partial and
        journal (resuming what an earlier run finished) and queue its missing chunks."""
        self._resumer.open(job)
        todo = self._resumer.missing(job)
        if not todo:
            self._file_complete(job)
            return
        self._submit(job, todo)
        self._advance_hash(job)  # a resumed file: hash what is already there

    def _submit(self, job: FileJob, todo: list[int]) -> None:
        """One task per run of consecutive missing chunks, each run up to ``chunk_size``."""
        requests = group_chunks(job.chunks, todo, self._config.chunk_size)
        job.pending = len(requests)
        for indices in requests:
            self._tasks.submit(
                self._io, _FetchRange(job, indices), self._fetcher.fetch, job, indices
            )

    def _submit_whole(self, job: FileJob) -> None:
        """A small file fetched again (its first copy failed a check): one io task fetches,
        writes, fsyncs and hashes it (:meth:`DescribeWorker.fetch_whole`) by a ranged read."""
        prepare_whole(job)
        self._tasks.submit(self._io, _FetchWhole(job), self._describer.fetch_whole, job)

    def _file_complete(self, job: FileJob) -> None:
        if job.seq is not None and job.seq.busy:
            job.seq.seal_when_idle = True  # _hashed_ahead seals it
            return
        self._tasks.submit(self._hashing, _Seal(job), self._finisher.seal, job)

    def _advance_hash(self, job: FileJob) -> None:
        """Hand the newly contiguous finished chunks of a sequential checksum to a hash worker."""
        seq = job.seq
        if seq is None or seq.busy or job.journal is None:
            return
        stop = seq.next
        while stop < len(job.chunks) and stop in job.journal.done:
            stop += 1
        if stop > seq.next:
            seq.busy = True
            start, end = job.chunks[seq.next][0], job.chunks[stop - 1][1]
            self._tasks.submit(
                self._hashing,
                _HashAhead(job, stop),
                verify.hash_range,
                seq.hasher,
                job.staged,
                start,
                end,
                self._config.direct_io,
            )

    def _hashed_ahead(self, job: FileJob, stop: int) -> None:
        seq = job.seq
        assert seq is not None
        seq.busy, seq.next = False, stop
        if seq.seal_when_idle:
            seq.seal_when_idle = False
            self._tasks.submit(self._hashing, _Seal(job), self._finisher.seal, job)
        else:
            self._advance_hash(job)

    def _finish_verified(self, job: FileJob, actuals: list[str]) -> None:
        """A sealed file's check values: publish it, or fetch it once more (a check failed)."""
        if not self._finisher.finish(job, actuals):
            self._restart(job)

    def _restart(self, job: FileJob) -> None:
        if job.whole:
            self._submit_whole(job)
            return
        self._resumer.open(job)  # also starts a fresh sequential hasher
        if not job.chunks:
            job.pending = 0
            self._file_complete(job)
            return
        self._submit(job, list(range(len(job.chunks))))


__all__ = [
    "Cancelled",
    "PublishFn",
    "Transfer",
    "TransferConfig",
    "TransferStats",
]
