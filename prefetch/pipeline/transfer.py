"""The chunk engine: ranged reads of many files under one concurrency limit, resumable, verified.

Per file: describe it (S3: a HEAD for checksums and part layout), plan its chunks (aligned to the
upload's parts when its checksum is composite), preallocate ``<name>.incomplete``, run every
missing chunk on one pool of ``concurrency`` threads (``readinto`` a reusable buffer, ``pwrite``,
hash inline, journal), then verify and let the layout publish it. A file of one chunk below the
O_DIRECT size skips preallocation and journal: the io task that described it also writes, hashes
and fsyncs it (``Transfer._describe_task``). Chunks (at most ``piece_size``) are the unit of
resume; one ranged request covers a run of missing chunks up to ``chunk_size``.

Large files are written with ``O_DIRECT`` from page-aligned buffers: no copy into the page cache,
which on a 2-core machine is most of a buffered download's CPU time (bench/README.md), and the
fsync before publishing is cheap. Unaligned writes, small files and filesystems without O_DIRECT
use the buffered descriptor. A sequential checksum (sha256 of a Hub LFS file) is computed while
the file downloads, by a hash worker reading back each newly contiguous run of chunks.

One watchdog (:class:`prefetch.pipeline.deadline.Watchdog`) enforces the stall rule (under
``min_rate`` bytes/s over ``stall_window``: retried from the last byte written), the ``deadline``
(then a DeadlineExceededError, partials kept) and a stop. Why not short socket timeouts: a timed-out
socket file cannot be read again (``SocketIO`` refuses, http.client's buffer state is lost), and
a timeout shorter than a healthy server's pauses turns slow servers into errors;
``shutdown(SHUT_RDWR)`` from another thread wakes a blocked ``recv`` at once, covers the wait for
the headers too, and leaves the healthy path free of polling. Reads ask for at most
:func:`read_slice` bytes so the rule sees bytes as they arrive.

Why threads and not asyncio: the hot path is ``readinto`` a preallocated buffer, ``pwrite``, and a
CRC/hash update, all of which release the GIL; threads do it without the extra copy asyncio
streams make, and the agent's event loop simply runs a sync in a worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import cast

from prefetch.pipeline import verify
from prefetch.pipeline.coordinator import Coordinator
from prefetch.pipeline.deadline import Watch, Watchdog, watching
from prefetch.pipeline.journal import Journal
from prefetch.pipeline.progress import NullProgress, ProgressSink
from prefetch.pipeline.retry import RetryPolicy, gave_up
from prefetch.pipeline.snapshot import Checksum, RemoteFile
from prefetch.sources.base import RangeReader, Source
from prefetch.support.errors import (
    Cancelled,
    ChecksumMismatchError,
    ConfigError,
    DeadlineExceededError,
    InsufficientSpaceError,
    MissingChecksumError,
    PrefetchError,
    SourceChangedError,
    TransferError,
    TransientSourceError,
)
from prefetch.support.logjson import inherit_context

log = logging.getLogger(__name__)
MiB = 1024 * 1024
#: O_DIRECT needs offsets, lengths and buffer addresses aligned to the device's logical block size.
DIRECT_ALIGN = 4096
#: Files below this size are written through the page cache (too small for O_DIRECT to pay).
DIRECT_MIN_SIZE = 8 * MiB


@dataclass(frozen=True)
class TransferConfig:
    """How the engine runs.

    Peak memory of the engine is about ``concurrency * buffer_size`` (each worker thread owns one
    read buffer: 16 x 1 MiB by default) plus ``hash_workers`` 4 MiB read buffers and the HTTP
    connections' socket buffers, whatever the file or chunk size. ``chunk_size`` is the size of
    each ranged request; ``piece_size`` (or the chunk size, if smaller) the granularity of resume:
    a killed pull re-fetches at most ``concurrency * piece_size`` bytes. ``direct_io`` writes
    large files with O_DIRECT (buffered writes where the filesystem refuses it).

    ``min_rate`` and ``stall_window``: a ranged request that delivers fewer than ``min_rate``
    bytes/s over any ``stall_window`` seconds (also a server that sends nothing) is abandoned
    and retried from its last byte like a connection reset; ``min_rate=0`` turns this off.
    ``deadline``: seconds the whole transfer may take (None: no limit); when it passes the
    transfer stops, keeps its partial files and raises DeadlineExceededError.
    """

    concurrency: int = 16
    chunk_size: int = 64 * MiB
    buffer_size: int = 1 * MiB
    #: Threads that finish files (fsync, checksum read-back). More than the cores: a large file's
    #: sequential hash can only follow its download, so with fewer workers than large files in
    #: flight, a file that finished downloading waits for a worker (Hub 2 GiB, 3 shards: 2 workers
    #: 2.6 s, 4 workers 2.3 s). Each reads with a 4 MiB buffer.
    hash_workers: int = 4
    verify: bool = True
    require_checksum: bool = False
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    piece_size: int = 8 * MiB
    direct_io: bool = True
    min_rate: int = 64 * 1024
    stall_window: float = 30.0
    deadline: float | None = None
    #: The deadline as the user set it, for messages, when ``deadline`` is what is left of it
    #: after resolving (None: ``deadline`` itself).
    stated_deadline: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.concurrency <= 512:
            raise ConfigError(f"concurrency: must be between 1 and 512, got {self.concurrency}")
        if self.chunk_size < 64 * 1024:
            raise ConfigError(f"chunk size: must be at least 64KiB, got {self.chunk_size}")
        if not 4096 <= self.buffer_size <= self.chunk_size:
            raise ConfigError("buffer size: must be between 4KiB and the chunk size")
        if self.hash_workers < 1:
            raise ConfigError("hash workers: must be at least 1")
        if self.piece_size < 64 * 1024:
            raise ConfigError(f"piece size: must be at least 64KiB, got {self.piece_size}")
        if self.min_rate < 0:
            raise ConfigError(f"min rate: must be 0 (off) or more, got {self.min_rate}")
        if not self.stall_window > 0:
            raise ConfigError(f"stall timeout: must be positive, got {self.stall_window}")
        if self.deadline is not None and not self.deadline > 0:
            raise ConfigError(f"deadline: must be positive, got {self.deadline}")


@dataclass
class TransferStats:
    bytes_downloaded: int = 0
    files_downloaded: int = 0
    files_verified: int = 0
    #: files checked with each algorithm (a file with a sidecar counts under two)
    checksum_algorithms: dict[str, int] = field(default_factory=dict)
    unverified: list[str] = field(default_factory=list)
    retries: int = 0
    chunks_downloaded: int = 0  # ranged requests completed (a run of chunks, or a small file)
    checksum_failures: int = 0
    resumed_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_downloaded += n


#: publish(file, staged_path, checksums_verified) -> None; called once a file is complete and
#: every one of its checks agreed (an empty tuple: it was checked by size only)
PublishFn = Callable[[RemoteFile, Path, tuple[Checksum, ...]], None]


@dataclass
class _FileJob:
    file: RemoteFile
    staged: Path
    checksum: Checksum | None  # the check computed per range (verify.inline_check), if any
    chunks: list[tuple[int, int]]
    checks: tuple[Checksum, ...] = ()  # every check the file must pass (verify.checks_for)
    journal: Journal | None = None
    fd: int = -1
    dfd: int = -1  # the same file opened with O_DIRECT, or -1
    direct_refused: bool = False  # a write through dfd failed with EINVAL: stop using it
    pending: int = 0
    attempt: int = 1
    discard: bool = False
    seq: _SeqHash | None = None  # a large file's sequential checksum, computed as chunks land
    whole: bool = False  # fetched, written and sealed by one worker task (_fetch_whole)
    unverified: bool = False  # verification is on but the source states no checksum for it


@dataclass
class _SeqHash:
    """A large file's sequential checksums (sha256, git-sha1, md5 of one part; one hasher per
    algorithm) fed in file order while the download goes on: a hash worker reads back each newly
    contiguous run of finished chunks, once for all of them, so only the last run is left to
    hash when the download ends."""

    hasher: verify.MultiHasher
    next: int = 0  # first chunk not hashed yet
    busy: bool = False  # a hash worker is feeding the hasher
    seal_when_idle: bool = False  # the download ended while busy: seal after this feed


def plan_chunks(size: int, chunk_size: int, checksum: Checksum | None) -> list[tuple[int, int]]:
    """Byte ranges [start, end) covering the file; aligned to parts for composite checksums."""
    if size == 0:
        return []
    if checksum is not None and checksum.part_sizes is not None:
        chunks: list[tuple[int, int]] = []
        start = pos = 0
        for _, end in verify.part_bounds(checksum.part_sizes):
            pos = end
            if pos - start >= chunk_size:
                chunks.append((start, pos))
                start = pos
        if start < size:
            chunks.append((start, size))
        return chunks
    return [(s, min(s + chunk_size, size)) for s in range(0, size, chunk_size)]


def staged_name(file: RemoteFile) -> str:
    """Name of a file's partial download: stable per (path, version), flat, filesystem-safe."""
    digest = hashlib.sha256(f"{file.path}\0{file.version}".encode()).hexdigest()[:32]
    return f"{digest}.incomplete"


# -- the coordinator's tasks (each names the work and what it is for) -------------------------


@dataclass(slots=True)
class _Describe:
    """Describe and plan a file (an io worker; a small file is fetched whole by the same task)."""

    file: RemoteFile


@dataclass(slots=True)
class _FetchRange:
    """Fetch a run of consecutive chunks with one ranged request (an io worker)."""

    job: _FileJob
    indices: list[int]


@dataclass(slots=True)
class _FetchWhole:
    """Fetch a small file again, whole, after a check failed (an io worker)."""

    job: _FileJob


@dataclass(slots=True)
class _HashAhead:
    """Feed a large file's sequential hashers up to chunk ``stop`` (a hash worker)."""

    job: _FileJob
    stop: int


@dataclass(slots=True)
class _Seal:
    """Flush a finished file and compute the value of each of its checks (a hash worker)."""

    job: _FileJob


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
        self._source = source
        self._staging = staging_dir
        self._publish = publish
        self._config = config
        self._progress = progress or NullProgress()
        self._stop = stop or threading.Event()
        self._local = threading.local()
        self.stats = TransferStats()
        self._watchdog = engine_watchdog(config, self._stop)
        self._slice = read_slice(config)
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
        self._jobs: list[_FileJob] = []  # every file described, for the cleanup
        self._to_describe: deque[RemoteFile] = deque()
        self._describing = 0  # describe tasks queued or running
        #: what earlier runs left in the staging folder (the model's lock keeps other writers
        #: out): a small file removes a stale journal only if there is one, not an unlink each
        self._left_over: set[str] = set()
        self._ran = False

    # -- public ------------------------------------------------------------------------------

    def run(self, files: list[RemoteFile]) -> TransferStats:
        """Fetch, check and publish ``files`` (once per Transfer)."""
        if self._ran:
            raise TransferError("a Transfer runs once; make another for the next batch")
        self._ran = True
        self._staging.mkdir(parents=True, exist_ok=True)
        self._left_over.update(os.listdir(self._staging))
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
                if job.discard:
                    self._discard(job)
                else:
                    self._close(job)
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
                job, actuals = cast("tuple[_FileJob, list[str] | None]", result)
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
            self._abort_file(task.job, exc)

    def _describe_more(self) -> None:
        """Keep at most ``concurrency`` describes queued or running: a describe may hold a small
        object's body in memory (S3) until it is written, by the same task for a file that fits
        one write (:meth:`_describe_task`), by a chunk task otherwise; and a window (instead of
        every file queued up front) lets each large file's download start right behind its
        describe. (A window of twice as many saved no CPU on 1000 small files.)"""
        while self._to_describe and self._describing < self._config.concurrency:
            f = self._to_describe.popleft()
            self._tasks.submit(self._io, _Describe(f), self._describe_task, f)
            self._describing += 1

    def _described(self, job: _FileJob, actuals: list[str] | None) -> None:
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

    def _plan(self, file: RemoteFile) -> _FileJob:
        """How a described file is fetched and checked: every check it must pass, the one
        computed per range, its chunks. Raises MissingChecksumError when a checksum is required
        and the source states none."""
        checks = verify.checks_for(file.checksums) if self._config.verify else ()
        checksum = verify.inline_check(checks)
        unverified = checksum is None and self._config.verify
        if unverified and self._config.require_checksum:
            raise MissingChecksumError(
                f"{file.path}: the source states no checksum for it and --require-checksum is set",
                hint="upload with a checksum algorithm (e.g. CRC64NVME) or add a SHA256SUMS "
                "sidecar next to the model",
            )
        staged = self._staging / staged_name(file)
        piece = min(self._config.piece_size, self._config.chunk_size)
        chunks = plan_chunks(file.size, piece, checksum)
        return _FileJob(file, staged, checksum, chunks, checks, unverified=unverified)

    def _start_file(self, job: _FileJob) -> None:
        """A file of several chunks (or too large for one buffered write): open its partial and
        journal (resuming what an earlier run finished) and queue its missing chunks."""
        file = job.file
        self._open_job(job)
        journal = job.journal
        assert journal is not None  # _open_job opened it
        todo = [i for i in range(len(job.chunks)) if i not in journal.done]
        resumed = sum(e - s for i, (s, e) in enumerate(job.chunks) if i not in todo)
        if resumed:
            self.stats.resumed_bytes += resumed
            log.info("resuming %s: %d of %d bytes already on disk", file.path, resumed, file.size)
        if not todo:
            self._file_complete(job)
            return
        self._submit(job, todo)
        self._advance_hash(job)  # a resumed file: hash what is already there

    def _submit(self, job: _FileJob, todo: list[int]) -> None:
        """One task per run of consecutive missing chunks, each run up to ``chunk_size``."""
        requests = group_chunks(job.chunks, todo, self._config.chunk_size)
        job.pending = len(requests)
        for indices in requests:
            self._tasks.submit(self._io, _FetchRange(job, indices), self._run_chunk, job, indices)

    def _submit_whole(self, job: _FileJob) -> None:
        """A small file fetched again (its first copy failed a check): one io task fetches,
        writes, fsyncs and hashes it (:meth:`_fetch_whole`), as its describe task did."""
        _prepare_whole(job)
        self._tasks.submit(self._io, _FetchWhole(job), self._fetch_whole, job)

    def _open_job(self, job: _FileJob) -> None:
        header = _journal_header(job)
        exists = job.staged.exists() and job.staged.stat().st_size == job.file.size
        journal_path = _journal_path(job)
        try:
            job.journal = Journal.open(
                journal_path, header, partial_exists=exists, persist=len(job.chunks) > 1
            )
        except OSError as exc:
            raise _write_failed(job, journal_path, exc) from exc
        fd = os.open(job.staged, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not job.journal.done:
                os.ftruncate(fd, 0)
            if job.file.size:
                os.posix_fallocate(fd, 0, job.file.size)
        except OSError as exc:
            os.close(fd)
            job.journal.close()
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # (no fallocate here)
                raise _write_failed(job, job.staged, exc) from exc
            fd = os.open(job.staged, os.O_RDWR)
            os.ftruncate(fd, job.file.size)
        job.fd = fd
        large = job.file.size >= DIRECT_MIN_SIZE
        if self._config.direct_io and large:
            try:
                job.dfd = os.open(job.staged, os.O_WRONLY | os.O_DIRECT)
            except (OSError, AttributeError) as exc:
                log.debug("no O_DIRECT for %s (%s): buffered writes", job.staged, exc)
        job.seq = None
        sequential = {c.algorithm for c in job.checks if verify.mode_of(c) == "sequential"}
        if sequential and large:
            hashers = {a: verify.new_hasher(a, size=job.file.size) for a in sorted(sequential)}
            job.seq = _SeqHash(verify.MultiHasher(hashers))

    def _file_complete(self, job: _FileJob) -> None:
        if job.seq is not None and job.seq.busy:
            job.seq.seal_when_idle = True  # _hashed_ahead seals it
            return
        self._tasks.submit(self._hashing, _Seal(job), self._seal, job)

    def _advance_hash(self, job: _FileJob) -> None:
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

    def _hashed_ahead(self, job: _FileJob, stop: int) -> None:
        seq = job.seq
        assert seq is not None
        seq.busy, seq.next = False, stop
        if seq.seal_when_idle:
            seq.seal_when_idle = False
            self._tasks.submit(self._hashing, _Seal(job), self._seal, job)
        else:
            self._advance_hash(job)

    def _seal(self, job: _FileJob) -> list[str]:
        """A hash worker's part of finishing a file (an io worker's, for a file fetched whole):
        flush it to disk (its data is durable before it is published, and the coordinator
        never waits on the disk) and compute the value of each of its checks (in
        ``job.checks`` order): joined from the journal, finished from the in-order hashers, or
        read back (small files) in one pass for all that remain."""
        try:
            os.fsync(job.fd)
        except OSError as exc:
            raise _write_failed(job, job.staged, exc) from exc
        self._close(job)
        values: dict[int, str] = {}
        if job.seq is not None:
            start = job.chunks[job.seq.next][0] if job.seq.next < len(job.chunks) else job.file.size
            verify.hash_range(
                job.seq.hasher, job.staged, start, job.file.size, self._config.direct_io
            )
            digests = {a: h.digest() for a, h in job.seq.hasher.hashers.items()}
            for i, c in enumerate(job.checks):
                if c.algorithm in digests and verify.mode_of(c) == "sequential":
                    values[i] = verify.encode(digests[c.algorithm], c.encoding)
        for i, c in enumerate(job.checks):
            if i not in values and c is job.checksum:
                inline = self._inline_value(job)
                if inline is not None:
                    values[i] = inline
        rest = [i for i in range(len(job.checks)) if i not in values]
        if rest:
            read = verify.hash_file_all(job.staged, [job.checks[i] for i in rest])
            values.update(zip(rest, read, strict=True))
        return [values[i] for i in range(len(job.checks))]

    def _inline_value(self, job: _FileJob) -> str | None:
        """The inline check's value from the journal's per-chunk results (None: it was not
        computed inline, as for the sequential check of a file of several chunks)."""
        assert job.journal is not None and job.checksum is not None
        if verify.mode_of(job.checksum) == "sequential":
            inline = job.journal.done.get(0) if len(job.chunks) == 1 else None
            # a one-chunk file was hashed as it arrived (see verify.ChunkHasher)
            return inline if isinstance(inline, str) else None
        results = [job.journal.done[i] for i in range(len(job.chunks))]
        return verify.finish_inline(job.checksum, results)

    def _finish_verified(self, job: _FileJob, actuals: list[str]) -> None:
        assert job.journal is not None
        if job.checks:
            try:
                for checksum, actual in zip(job.checks, actuals, strict=True):
                    verify.check(job.file.path, checksum, actual)
            except ChecksumMismatchError as exc:
                self.stats.checksum_failures += 1
                self._progress.checksum_failure(job.file.path)
                self._discard(job)
                if job.attempt >= 2:
                    raise
                log.warning("%s; deleted it, downloading the file once more", exc)
                job.attempt += 1
                self._restart(job)
                return
            counts = self.stats.checksum_algorithms
            for checksum in job.checks:
                counts[checksum.algorithm] = counts.get(checksum.algorithm, 0) + 1
            self.stats.files_verified += 1
        self._publish(job.file, job.staged, job.checks)
        if not job.whole:  # (the worker of a whole file removed its journal's path already)
            job.journal.remove()
        self.stats.files_downloaded += 1
        self._progress.file_done(job.file.path, job.file.size)

    def _restart(self, job: _FileJob) -> None:
        if job.whole:
            self._submit_whole(job)
            return
        self._open_job(job)  # also starts a fresh sequential hasher
        if not job.chunks:
            job.pending = 0
            self._file_complete(job)
            return
        self._submit(job, list(range(len(job.chunks))))

    def _discard(self, job: _FileJob) -> None:
        self._close(job)
        if job.journal is not None:
            job.journal.remove()
        with contextlib.suppress(FileNotFoundError):
            job.staged.unlink()

    def _abort_file(self, job: _FileJob, exc: BaseException) -> None:
        """A file failed: keep resumable state unless its bytes can no longer be trusted."""
        if isinstance(exc, SourceChangedError | ChecksumMismatchError):
            job.discard = True

    def _close(self, job: _FileJob) -> None:
        if job.dfd >= 0:
            with contextlib.suppress(OSError):
                os.close(job.dfd)
            job.dfd = -1
        if job.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(job.fd)
            job.fd = -1
        if job.journal is not None:
            job.journal.close()

    # -- workers (io threads) ----------------------------------------------------------------

    def _buffer(self) -> memoryview:
        view = getattr(self._local, "view", None)
        if view is None:
            # anonymous mmap: page-aligned, as O_DIRECT writes need
            view = memoryview(mmap.mmap(-1, self._config.buffer_size))
            self._local.view = view
        return view

    def _describe_task(self, file: RemoteFile) -> tuple[_FileJob, list[str] | None]:
        """An io task: describe and plan a file and, when it fits one write, fetch it too
        (:meth:`_fetch_whole`), so the coordinator sees a small file once, ready to check and
        publish. A small file's describe often is its whole download (S3 keeps the body of a
        small object's GET in memory for the read that follows); handing the file back to the
        coordinator in between cost each small file a second round trip through it, behind the
        io threads for the GIL. Returns the job and, for a file fetched here, what ``_seal``
        returns (None: the coordinator starts the file's chunks)."""
        job = self._plan(call_watched(self._watchdog, file.path, self._source.describe, file))
        if not _fits_one_write(job):
            return job, None
        _prepare_whole(job)
        try:
            return job, self._fetch_whole(job)
        except BaseException as exc:
            # the coordinator never sees this job: close (or, if its bytes cannot be trusted,
            # delete) what it left; no other thread uses a whole file's descriptor
            self._abort_file(job, exc)
            if job.discard:
                self._discard(job)
            else:
                self._close(job)
            raise

    def _fetch_whole(self, job: _FileJob) -> list[str]:
        """Everything a small file needs before it can be published, on one io worker: the
        partial file created empty (whatever an earlier run left there: one chunk has nothing
        to resume), the one ranged read written and hashed as it arrives, then :meth:`_seal`
        (fsync, the value of every check). Returns what ``_seal`` returns."""
        assert job.journal is not None
        if job.journal.path.name in self._left_over:
            job.journal.remove()  # one an earlier plan of this file left (other chunk size)
        try:
            job.fd = os.open(job.staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as exc:
            raise _write_failed(job, job.staged, exc) from exc
        if job.chunks:
            self._run_chunk(job, [0])
        return self._seal(job)

    def _run_chunk(self, job: _FileJob, indices: list[int]) -> None:
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

    def _count_retry(self, exc: TransientSourceError) -> None:
        self.stats.retries += 1
        self._progress.retry(str(exc))

    def _read_range(self, job: _FileJob, cursor: _Cursor, end: int, view: memoryview) -> None:
        """Read [cursor.pos, end) into the file; cursor.pos always marks what is written and
        hashed, also when this raises, so a retry continues from exactly there. The watchdog may
        abort the read (stop, stall, deadline): the blocked ``readinto`` then returns or fails at
        once and the reason it gives replaces whatever the reader said."""
        reader, watch = open_watched(
            self._watchdog, f"{job.file.path} bytes {cursor.pos}-{end - 1}",
            partial(self._source.open_range, job.file, cursor.pos, end),
        )  # fmt: skip
        try:
            while cursor.pos < end:
                if self._stop.is_set():
                    raise Cancelled("stopped")
                # fill the buffer (full buffers keep O_DIRECT writes aligned), never past a chunk
                want = min(len(view), job.chunks[cursor.indices[cursor.k]][1] - cursor.pos)
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

    def _write(self, job: _FileJob, data: memoryview, cursor: _Cursor) -> None:
        """Write, hash and count ``data`` at cursor.pos; journal each chunk it completes."""
        _pwrite_all(job, data, cursor.pos)
        assert cursor.hasher is not None and job.journal is not None
        cursor.hasher.feed(data)
        cursor.pos += len(data)
        self.stats.add_bytes(len(data))
        self._progress.advance(len(data))
        index = cursor.indices[cursor.k]
        if cursor.pos == job.chunks[index][1]:
            job.journal.record(index, cursor.hasher.result())
            cursor.k += 1
            if cursor.k < len(cursor.indices):
                cursor.hasher = verify.ChunkHasher(
                    job.checksum, *job.chunks[cursor.indices[cursor.k]], job.file.size
                )


@dataclass
class _Cursor:
    """Where one request is: the next byte to write, and the chunk (of its run) it belongs to."""

    pos: int
    indices: list[int]
    k: int = 0
    hasher: verify.ChunkHasher | None = None


def read_slice(config: TransferConfig) -> int:
    """Most bytes one ``readinto`` asks for. A socket file's ``readinto`` returns only when the
    slice is full, so the stall rule sees a request's bytes a slice at a time. Slices of half
    what a window must deliver (at most the buffer) mean a request averaging 1.5 x ``min_rate``
    or more is never judged by a half-filled slice, while a trickle is caught in one window.
    Smaller slices cost throughput: with the defaults, 240 KiB slices instead of ~1 MiB made a
    2 GiB S3 pull 8% slower here (bench/run.py with ``--prefetch-variant`` ``--min-rate 0``)."""
    if not config.min_rate:
        return config.buffer_size
    wanted = int(config.min_rate * config.stall_window / 2)
    return max(16 * 1024, min(config.buffer_size, wanted))


@dataclass
class Filled:
    """How much of a view :func:`fill_watched` has filled; it stays right when the read fails,
    so the caller keeps what arrived and a retry starts after it."""

    pos: int = 0


def retry_read(
    read: Callable[[], None],
    *,
    policy: RetryPolicy,
    stop: threading.Event,
    what: str,
    position: Callable[[], int],
    on_retry: Callable[[TransientSourceError], None],
) -> None:
    """Run ``read`` (one ranged request that resumes from ``position()`` when called again)
    until it succeeds, retrying transient failures with the policy's backoff. The one retry loop
    of every driver of ranged reads (the pull engine, the mirror); unlike
    :func:`prefetch.pipeline.retry.call_with_retries` a stop during the wait is :class:`Cancelled`
    (the pull or mirror is resumable), not the transient error."""
    attempt = 1
    while True:
        if stop.is_set():
            raise Cancelled("stopped")
        try:
            read()
            return
        except TransientSourceError as exc:
            if policy.gives_up(attempt, exc):
                raise gave_up(what, attempt, exc) from exc
            on_retry(exc)
            delay = policy.delay(attempt, exc.retry_after)
            log.info("retrying %s at byte %d in %.2fs: %s", what, position(), delay, exc)
            if stop.wait(delay):
                raise Cancelled("stopped") from exc
            attempt += 1


def connection_closed(file: RemoteFile, start: int, filled: int) -> str:
    """The message for a body that ended ``filled`` bytes into a read starting at ``start``."""
    return f"{file.path}: connection closed at byte {start + filled} of {file.size}"


def engine_watchdog(config: TransferConfig, stop: threading.Event) -> Watchdog:
    """The stall/deadline/stop watchdog of a driver of ranged reads (the pull engine, the
    mirror's part streamer): a stop aborts each read with Cancelled."""
    return Watchdog(config, stop, cancelled=lambda: Cancelled("stopped"))


def open_watched(
    watchdog: Watchdog, what: str, open_range: Callable[[], RangeReader]
) -> tuple[RangeReader, Watch]:
    """Open a ranged read under a new watch of ``watchdog``: the wait for the response headers
    is watched too (the HTTP seam attaches the socket), so a stop, a stall or the deadline
    interrupts it; the reader's ``abort()`` (if any) is attached for the body."""
    watch = watchdog.watch(what)
    try:
        with watching(watch):
            reader = open_range()
    except Exception:
        watchdog.unwatch(watch)
        watch.raise_if_aborted()
        raise
    abort = getattr(reader, "abort", None)
    if abort is not None:
        watch.attach(abort)
    return reader, watch


def call_watched(
    watchdog: Watchdog, what: str, fn: Callable[[RemoteFile], RemoteFile], file: RemoteFile
) -> RemoteFile:
    """``fn(file)`` (a describe: a HEAD, or a small object's whole GET) under a new watch of
    ``watchdog``: a stop or the deadline interrupts its requests (the stall rule does not: its
    bytes are not counted)."""
    watch = watchdog.watch(f"describing {what}", stalls=False)
    try:
        with watching(watch):
            try:
                return fn(file)
            except Exception:
                watch.raise_if_aborted()
                raise
    finally:
        watchdog.unwatch(watch)


def fill_watched(
    reader: RangeReader,
    watch: Watch,
    view: memoryview,
    filled: Filled,
    *,
    slice_size: int,
    stop: threading.Event,
    closed: Callable[[int], str],
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Read ``reader`` into ``view[filled.pos:]`` until it is full, ``slice_size`` bytes per
    ``readinto`` so the watchdog sees bytes arrive. The one read loop of every driver of ranged
    reads (the pull engine, the mirror): a read the watchdog aborted (stop, stall, deadline)
    raises the watchdog's reason rather than whatever the reader said; a closed connection is
    a TransientSourceError with the message ``closed(filled.pos)``."""
    while filled.pos < len(view):
        if stop.is_set():
            raise Cancelled("stopped")
        try:
            n = reader.readinto(view[filled.pos : min(len(view), filled.pos + slice_size)])
        except PrefetchError:
            watch.raise_if_aborted()
            raise
        watch.raise_if_aborted()
        if n <= 0:
            raise TransientSourceError(closed(filled.pos))
        filled.pos += n
        watch.received += n
        if on_bytes is not None:
            on_bytes(n)


def _fits_one_write(job: _FileJob) -> bool:
    """A file of at most one chunk, below the O_DIRECT size: fetched whole by one worker task
    (``Transfer._describe_task``)."""
    return len(job.chunks) <= 1 and job.file.size < DIRECT_MIN_SIZE


def _prepare_whole(job: _FileJob) -> None:
    """Set a small file up to be fetched by one io task (:meth:`Transfer._fetch_whole`): a file
    of one chunk has nothing to resume, so it needs no journal on disk and no preallocation, and
    every system call it costs runs on a worker, in parallel: on the coordinator each one also
    waits for the GIL behind the workers (1000 x 100 KiB: the coordinator's open,
    ``posix_fallocate`` and two ``stat``s per file were ~3 of the pull's ~6 s)."""
    job.whole = True
    job.journal = Journal(_journal_path(job), _journal_header(job))  # in memory only
    job.seq = None
    job.pending = 1


def _journal_path(job: _FileJob) -> Path:
    return job.staged.with_suffix(".journal")


def _journal_header(job: _FileJob) -> dict[str, object]:
    """What a journal is for: a journal whose header differs is not resumed from."""
    return {
        "path": job.file.path,
        "version": job.file.version,
        "size": job.file.size,
        "chunks": job.chunks,
        "checksum": job.checksum.to_json() if job.checksum else None,
    }


def group_chunks(
    chunks: list[tuple[int, int]], todo: list[int], request_size: int
) -> list[list[int]]:
    """Runs of consecutive chunk indices from ``todo``, each spanning at most ``request_size``
    bytes (or one chunk, when a chunk alone is larger)."""
    runs: list[list[int]] = []
    size = 0
    for i in sorted(todo):
        start, end = chunks[i]
        if runs and runs[-1][-1] == i - 1 and size + (end - start) <= request_size:
            runs[-1].append(i)
            size += end - start
        else:
            runs.append([i])
            size = end - start
    return runs


def _pwrite_all(job: _FileJob, data: memoryview, offset: int) -> None:
    while len(data):
        direct = (
            job.dfd >= 0
            and not job.direct_refused
            and offset % DIRECT_ALIGN == 0
            and len(data) % DIRECT_ALIGN == 0
        )
        try:
            written = os.pwrite(job.dfd if direct else job.fd, data, offset)
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                # the filesystem opened O_DIRECT but refuses this write: buffered from now on
                # (the descriptor stays open until the file is closed: other threads may use it)
                log.debug("O_DIRECT write refused for %s: buffered writes", job.staged)
                job.direct_refused = True
                continue
            raise _write_failed(job, job.staged, exc) from exc
        data = data[written:]
        offset += written


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


def _write_failed(job: _FileJob, path: Path, exc: OSError) -> PrefetchError:
    """A write for ``job`` to ``path`` failed: out of space, or another reason."""
    writing = f"{job.file.path} ({job.file.size} bytes)"
    full = no_space(exc, job.staged.parent, writing)
    return full or TransferError(f"cannot write {path}: {exc.strerror}")


__all__ = [
    "Cancelled",
    "Filled",
    "Transfer",
    "TransferConfig",
    "TransferStats",
    "call_watched",
    "connection_closed",
    "engine_watchdog",
    "fill_watched",
    "group_chunks",
    "no_space",
    "open_watched",
    "plan_chunks",
    "read_slice",
    "retry_read",
]
