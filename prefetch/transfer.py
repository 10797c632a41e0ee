"""The chunk engine: ranged reads of many files under one concurrency limit, resumable, verified.

For each file to fetch: describe it (S3: HEAD for checksums and part layout), plan its chunks
(aligned to the upload's parts when its checksum is composite), preallocate ``<name>.incomplete``,
run every missing chunk on a shared pool of ``concurrency`` threads (each ``readinto`` a reusable
buffer, ``os.pwrite``, hash inline, journal), then verify and let the layout publish it.

Why threads and not asyncio: the hot path is ``readinto`` a preallocated buffer, ``pwrite``, and a
CRC/hash update, all of which release the GIL; threads do it without the extra copy asyncio
streams make, and the agent's event loop simply runs a sync in a worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefetch import verify
from prefetch.errors import (
    ChecksumMismatchError,
    ConfigError,
    InsufficientSpaceError,
    MissingChecksumError,
    PrefetchError,
    SourceChangedError,
    TransferError,
    TransientSourceError,
)
from prefetch.journal import Journal
from prefetch.progress import NullProgress, ProgressSink
from prefetch.retry import RetryPolicy
from prefetch.snapshot import Checksum, RemoteFile
from prefetch.sources.base import Source

log = logging.getLogger(__name__)
MiB = 1024 * 1024


@dataclass(frozen=True)
class TransferConfig:
    """How the engine runs.

    Peak memory of the engine is about ``concurrency * buffer_size`` (each worker thread owns one
    read buffer) plus the HTTP connections' socket buffers: 16 x 1 MiB by default, whatever the
    file or chunk size. ``chunk_size`` only sets the granularity of ranged requests and resume.
    """

    concurrency: int = 16
    chunk_size: int = 64 * MiB
    buffer_size: int = 1 * MiB
    hash_workers: int = 2
    verify: bool = True
    require_checksum: bool = False
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        if not 1 <= self.concurrency <= 512:
            raise ConfigError(f"concurrency: must be between 1 and 512, got {self.concurrency}")
        if self.chunk_size < 64 * 1024:
            raise ConfigError(f"chunk size: must be at least 64KiB, got {self.chunk_size}")
        if not 4096 <= self.buffer_size <= self.chunk_size:
            raise ConfigError("buffer size: must be between 4KiB and the chunk size")
        if self.hash_workers < 1:
            raise ConfigError("hash workers: must be at least 1")
        if self.retry.attempts < 1:
            raise ConfigError("attempts: must be at least 1")


@dataclass
class TransferStats:
    bytes_downloaded: int = 0
    files_downloaded: int = 0
    files_verified: int = 0
    checksum_algorithms: dict[str, int] = field(default_factory=dict)
    unverified: list[str] = field(default_factory=list)
    retries: int = 0
    checksum_failures: int = 0
    resumed_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_downloaded += n


class Cancelled(TransferError):
    """The transfer was asked to stop (SIGTERM); resumable state is left on disk."""


#: publish(file, staged_path, checksum_used) -> None; called once a file is complete and verified
PublishFn = Callable[[RemoteFile, Path, Checksum | None], None]


@dataclass
class _FileJob:
    file: RemoteFile
    staged: Path
    checksum: Checksum | None
    chunks: list[tuple[int, int]]
    journal: Journal | None = None
    fd: int = -1
    pending: int = 0
    attempt: int = 1
    discard: bool = False


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

    # -- public ------------------------------------------------------------------------------

    def run(self, files: list[RemoteFile]) -> TransferStats:
        self._staging.mkdir(parents=True, exist_ok=True)
        cfg = self._config
        self._jobs: list[_FileJob] = []
        try:
            with (
                ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="prefetch-io") as io,
                ThreadPoolExecutor(cfg.hash_workers, thread_name_prefix="prefetch-hash") as hsh,
            ):
                self._io, self._hashing = io, hsh
                futures: dict[Future[Any], tuple[str, Any]] = {}
                for f in files:
                    futures[io.submit(self._source.describe, f)] = ("describe", f)
                try:
                    self._drive(futures)
                except BaseException:
                    self._stop.set()
                    for fut in futures:
                        fut.cancel()
                    raise
        finally:
            # Every worker has stopped: only now is it safe to close descriptors and delete files.
            for job in self._jobs:
                if job.discard:
                    self._discard(job)
                else:
                    self._close(job)
        return self.stats

    # -- coordinator (main thread) -----------------------------------------------------------

    def _drive(self, futures: dict[Future[Any], tuple[str, Any]]) -> None:
        first_error: BaseException | None = None
        while futures:
            done, _ = wait(futures, return_when=FIRST_COMPLETED)
            for fut in done:
                kind, item = futures.pop(fut)
                try:
                    result = fut.result()
                except BaseException as exc:
                    if kind != "describe":
                        self._abort_file(item if kind == "hash" else item[0], exc)
                    if first_error is None or isinstance(first_error, Cancelled):
                        first_error = exc
                    self._stop.set()
                    continue
                if first_error is not None:
                    continue
                if kind == "describe":
                    self._start_file(result, futures)
                elif kind == "chunk":
                    job = item[0]
                    job.pending -= 1
                    if job.pending == 0:
                        self._file_complete(job, futures)
                elif kind == "hash":
                    self._finish_verified(item, result, futures)
        if first_error is not None:
            raise first_error

    def _start_file(self, file: RemoteFile, futures: dict[Future[Any], tuple[str, Any]]) -> None:
        checksum = verify.pick(file.checksums) if self._config.verify else None
        if checksum is None and self._config.verify:
            if self._config.require_checksum:
                raise MissingChecksumError(
                    f"{file.path}: the source states no checksum for it and "
                    "--require-checksum is set",
                    hint="upload with a checksum algorithm (e.g. CRC64NVME) or add a SHA256SUMS "
                    "sidecar next to the model",
                )
            self.stats.unverified.append(file.path)
        staged = self._staging / staged_name(file)
        job = _FileJob(file, staged, checksum, plan_chunks(file.size, self._config.chunk_size,
                                                           checksum))  # fmt: skip
        self._jobs.append(job)
        self._open_job(job)
        todo = [i for i in range(len(job.chunks)) if i not in job.journal.done]  # type: ignore[union-attr]
        job.pending = len(todo)
        resumed = sum(e - s for i, (s, e) in enumerate(job.chunks) if i not in todo)
        if resumed:
            self.stats.resumed_bytes += resumed
            log.info("resuming %s: %d of %d bytes already on disk", file.path, resumed, file.size)
        if not todo:
            self._file_complete(job, futures)
            return
        for i in todo:
            futures[self._io.submit(self._run_chunk, job, i)] = ("chunk", (job, i))

    def _open_job(self, job: _FileJob) -> None:
        header = {
            "path": job.file.path,
            "version": job.file.version,
            "size": job.file.size,
            "chunks": job.chunks,
            "checksum": job.checksum.to_json() if job.checksum else None,
        }
        exists = job.staged.exists() and job.staged.stat().st_size == job.file.size
        journal_path = job.staged.with_suffix(".journal")
        try:
            job.journal = Journal.open(journal_path, header, partial_exists=exists)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _no_space(job, exc) from exc
            raise TransferError(f"cannot write {journal_path}: {exc.strerror}") from exc
        fd = os.open(job.staged, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not job.journal.done:
                os.ftruncate(fd, 0)
            if job.file.size:
                os.posix_fallocate(fd, 0, job.file.size)
        except OSError as exc:
            os.close(fd)
            job.journal.close()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _no_space(job, exc) from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise TransferError(f"cannot write {job.staged}: {exc.strerror}") from exc
            fd = os.open(job.staged, os.O_RDWR)
            os.ftruncate(fd, job.file.size)
        job.fd = fd

    def _file_complete(self, job: _FileJob, futures: dict[Future[Any], tuple[str, Any]]) -> None:
        self._close(job)
        assert job.journal is not None
        checksum = job.checksum
        if checksum is None:
            self._finish_verified(job, None, futures)
        elif verify.mode_of(checksum) == "sequential":
            fut = self._hashing.submit(verify.hash_file, job.staged, checksum)
            futures[fut] = ("hash", job)
        else:
            results = [job.journal.done[i] for i in range(len(job.chunks))]
            self._finish_verified(job, verify.finish_inline(checksum, results), futures)

    def _finish_verified(
        self, job: _FileJob, actual: str | None, futures: dict[Future[Any], tuple[str, Any]]
    ) -> None:
        assert job.journal is not None
        if job.checksum is not None and actual is not None:
            try:
                verify.check(job.file.path, job.checksum, actual)
            except ChecksumMismatchError as exc:
                self.stats.checksum_failures += 1
                self._progress.checksum_failure(job.file.path)
                self._discard(job)
                if job.attempt >= 2:
                    raise
                log.warning("%s; deleted it, downloading the file once more", exc)
                job.attempt += 1
                self._restart(job, futures)
                return
            alg = job.checksum.algorithm
            self.stats.checksum_algorithms[alg] = self.stats.checksum_algorithms.get(alg, 0) + 1
            self.stats.files_verified += 1
        self._publish(job.file, job.staged, job.checksum)
        job.journal.remove()
        self.stats.files_downloaded += 1
        self._progress.file_done(job.file.path, job.file.size)

    def _restart(self, job: _FileJob, futures: dict[Future[Any], tuple[str, Any]]) -> None:
        self._open_job(job)
        job.pending = len(job.chunks)
        if not job.chunks:
            self._file_complete(job, futures)
        for i in range(len(job.chunks)):
            futures[self._io.submit(self._run_chunk, job, i)] = ("chunk", (job, i))

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
            view = memoryview(bytearray(self._config.buffer_size))
            self._local.view = view
        return view

    def _run_chunk(self, job: _FileJob, index: int) -> None:
        start, end = job.chunks[index]
        hasher = verify.ChunkHasher(job.checksum, start, end)
        view = self._buffer()
        policy = self._config.retry
        cursor = _Cursor(start)
        attempt = 1
        while True:
            if self._stop.is_set():
                raise Cancelled("stopped")
            try:
                self._read_range(job, cursor, end, view, hasher)
                break
            except TransientSourceError as exc:
                if attempt >= policy.attempts:
                    raise TransientSourceError(
                        f"{job.file.path}: giving up after {attempt} attempts: {exc}"
                    ) from exc
                self.stats.retries += 1
                self._progress.retry(str(exc))
                delay = policy.delay(attempt, exc.retry_after)
                log.info(
                    "retrying %s at byte %d in %.2fs: %s", job.file.path, cursor.pos, delay, exc
                )
                if self._stop.wait(delay):
                    raise Cancelled("stopped") from exc
                attempt += 1
                # the hasher has seen exactly [start, cursor.pos): the retry continues there
        assert job.journal is not None
        job.journal.record(index, hasher.result())

    def _read_range(
        self,
        job: _FileJob,
        cursor: _Cursor,
        end: int,
        view: memoryview,
        hasher: verify.ChunkHasher,
    ) -> None:
        """Read [cursor.pos, end) into the file; cursor.pos always marks what is written and
        hashed, also when this raises, so a retry continues from exactly there."""
        reader = self._source.open_range(job.file, cursor.pos, end)
        try:
            while cursor.pos < end:
                if self._stop.is_set():
                    raise Cancelled("stopped")
                want = min(len(view), end - cursor.pos)
                n = reader.readinto(view[:want])
                if n <= 0:
                    raise TransientSourceError(
                        f"{job.file.path}: connection closed at byte {cursor.pos} "
                        f"of {job.file.size}"
                    )
                _pwrite_all(job, view[:n], cursor.pos)
                hasher.feed(view[:n])
                cursor.pos += n
                self.stats.add_bytes(n)
                self._progress.advance(n)
        finally:
            reader.close()


@dataclass
class _Cursor:
    pos: int


def _pwrite_all(job: _FileJob, data: memoryview, offset: int) -> None:
    while len(data):
        try:
            written = os.pwrite(job.fd, data, offset)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _no_space(job, exc) from exc
            raise TransferError(f"cannot write {job.staged}: {exc.strerror}") from exc
        data = data[written:]
        offset += written


def _no_space(job: _FileJob, exc: OSError) -> InsufficientSpaceError:
    return InsufficientSpaceError(
        f"no space left on the device under {job.staged.parent} while writing "
        f"{job.file.path} ({job.file.size} bytes): {exc.strerror}",
        hint="free some space (prefetch gc) or point DEST at a larger volume; "
        "the partial download is kept and the next pull resumes it",
    )


def total_seconds(t0: float) -> float:
    return round(time.monotonic() - t0, 3)


__all__ = [
    "Cancelled",
    "PrefetchError",
    "Transfer",
    "TransferConfig",
    "TransferStats",
    "plan_chunks",
]
