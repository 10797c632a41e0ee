"""Streams files from a source into S3 objects, part by part, through memory only.

Each file becomes one object. A part is read from the source by a ranged request into a pooled
buffer (the engine's rules apply: retries from the last byte, the stall rule, the deadline and
stop, through :class:`prefetch.pipeline.deadline.Watchdog`), CRC64NVME'd, and uploaded as a part of
a FULL_OBJECT CRC64NVME multipart upload (files of one part are one PutObject instead, sent only
after they were checked). The file's own checks (the Hub's sha256 or git blob sha1, a mirror's
recorded ids) need the bytes in file order while parts finish in any order: a part that lands
before its turn keeps its buffer until the parts before it are hashed. Only when every check
agrees is the upload completed (with the whole object's CRC, which S3 checks against the
parts'), so a corrupt byte from the source never becomes an object; a mismatch aborts the upload.

Resume (:mod:`prefetch.publish.s3_mirror.upload_resume`): a multipart upload left by a killed mirror
for the same key is found again (ListMultipartUploads, ListParts); its parts whose size fits the
plan are kept, re-read from the source for hashing only and compared with the part's stored
CRC64NVME (or, where ListParts states none, as SeaweedFS does, with its MD5 ETag); a part that does
not match is uploaded again. Other uploads of the key (older duplicates, another part size) are
aborted.

Why pooled buffers and not streaming bodies: an UploadPart needs its length and checksum before
its body, and the in-order hash needs the bytes after their part is read, so each part is held
once in memory; buffers are reused, so memory does not grow with the model.
"""

from __future__ import annotations

import base64
import logging
import mmap
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import cast

from prefetch.pipeline import verify
from prefetch.pipeline.deadline import Watchdog
from prefetch.pipeline.engine.config import TransferConfig
from prefetch.pipeline.engine.coordinator import Coordinator
from prefetch.pipeline.engine.watched_read import (
    Filled,
    connection_closed,
    engine_watchdog,
    fill_watched,
    open_watched,
    read_slice,
    retry_read,
)
from prefetch.pipeline.progress import NullProgress, ProgressSink
from prefetch.pipeline.snapshot import Checksum, RemoteFile
from prefetch.publish.s3_mirror.upload import (
    MAX_PART_SIZE,
    MAX_PARTS,
    MIN_PART_SIZE,
    S3Prefix,
    UploadedPart,
    crc64nvme_b64,
    crc64nvme_of,
)
from prefetch.publish.s3_mirror.upload_resume import UploadResumer, same_bytes
from prefetch.sources.base import Source
from prefetch.support.errors import (
    Cancelled,
    ChecksumMismatchError,
    ConfigError,
    DeadlineExceededError,
    SourceError,
    TransferError,
    TransientSourceError,
)

log = logging.getLogger(__name__)
MiB = 1024 * 1024
DEFAULT_PART_SIZE = 16 * MiB


@dataclass(frozen=True)
class MirrorConfig:
    """How a mirror streams.

    Peak memory is about ``transfer.concurrency * part_size`` bytes: a part is read into one of
    ``concurrency`` pooled buffers and its buffer is handed back only once the part is uploaded
    and hashed in file order (so the reorder window of the in-order hash is the pool itself, and
    a slow early part holds back reads, never memory). ``part_size`` grows, for a file that
    would need more than S3's 10,000 parts, to the smallest MiB multiple that fits, and the pool's
    buffers with it. ``transfer`` gives the concurrency, the retries, the stall rule and the
    deadline, with the meanings they have for a pull (its chunk and buffer sizes are not used).
    """

    transfer: TransferConfig = field(default_factory=TransferConfig)
    part_size: int = DEFAULT_PART_SIZE

    def __post_init__(self) -> None:
        if not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            raise ConfigError(
                f"part size: must be between 5MiB and 5GiB (S3's limits), got {self.part_size}"
            )


#: The whole-object CRC64NVME as S3 states it, joined from the parts' CRCs.
_WHOLE_CRC = Checksum("crc64nvme", "", encoding="base64")


def streamable_checks(checksums: tuple[Checksum, ...]) -> tuple[Checksum, ...]:
    """The checks a streamed file can be held to before its object is made: every one
    :func:`prefetch.pipeline.verify.checks_for` picks that needs the bytes in order (sha256, sha1,
    git blob sha1, MD5 of a single-part object) or is a whole-object CRC64NVME (joined from the
    parts' CRCs); composite checksums and other CRCs are not computed while streaming."""
    return tuple(
        c
        for c in verify.checks_for(checksums)
        if verify.mode_of(c) == "sequential"
        or (verify.mode_of(c) == "crc" and c.algorithm == "crc64nvme")
    )


def part_size_for(size: int, part_size: int) -> int:
    """The part size for a file of ``size`` bytes: ``part_size``, or more when that would need
    more than S3's 10,000 parts."""
    if size <= part_size * MAX_PARTS:
        return part_size
    return -(-size // (MAX_PARTS * MiB)) * MiB  # the fewest whole MiB per part that fit


def plan_parts(size: int, part_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + part_size, size)) for s in range(0, size, part_size)]


@dataclass
class BlobUpload:
    """One object to write: ``file`` read from the source into ``key``, checked against
    ``checks`` (sequential ones, such as the Hub's sha256 and git blob sha1, in file order; a
    whole-object crc64nvme, such as a mirror's recorded one, from the parts' CRCs).
    ``crc64nvme`` is filled in with the object's checksum once it is written."""

    file: RemoteFile
    key: str
    checks: tuple[Checksum, ...]
    crc64nvme: str | None = None


@dataclass
class StreamStats:
    bytes_uploaded: int = 0
    bytes_reused: int = 0  # parts of interrupted uploads kept (re-read for hashing only)
    bytes_read: int = 0
    objects_written: int = 0
    uploads_aborted: int = 0
    retries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, n in amounts.items():
                setattr(self, name, getattr(self, name) + n)


class _Buffer:
    def __init__(self, size: int) -> None:
        self._map = mmap.mmap(-1, size)
        self.view = memoryview(self._map)


class _BufferPool:
    """At most ``limit`` part buffers of ``size`` bytes, made as they are first needed and
    reused (used on the coordinator's thread only)."""

    def __init__(self, limit: int, size: int) -> None:
        self._limit = limit
        self.size = size  # grown by the streamer for files of over 10,000 parts, before use
        self._free: list[_Buffer] = []  # buffers not in use
        self._made = 0

    def take(self) -> _Buffer | None:
        """A free buffer, or None when all ``limit`` are in use."""
        if self._free:
            return self._free.pop()
        if self._made < self._limit:
            self._made += 1
            return _Buffer(self.size)
        return None

    def give_back(self, *bufs: _Buffer) -> None:
        self._free.extend(bufs)


@dataclass
class _Job:
    blob: BlobUpload
    ranges: list[tuple[int, int]]
    hasher: verify.MultiHasher
    multipart: bool
    upload_id: str | None = None
    reusable: dict[int, UploadedPart] = field(default_factory=dict)
    parts: dict[int, UploadedPart] = field(default_factory=dict)
    crcs: dict[int, int] = field(default_factory=dict)
    waiting: dict[int, _Buffer] = field(default_factory=dict)  # read, not hashed yet
    hashed: int = 0  # parts [0, hashed) were fed to the hasher
    hashing: bool = False
    abort: bool = False  # abort its multipart upload once every worker has stopped

    @property
    def path(self) -> str:
        return self.blob.file.path


# -- the coordinator's tasks ---------------------------------------------------------------------


@dataclass(slots=True)
class _Open:
    """Find the file's interrupted upload to continue, or create one (an io worker)."""

    job: _Job


@dataclass(slots=True)
class _Part:
    """Read part ``index`` into ``buf``, CRC it and upload it (an io worker)."""

    job: _Job
    index: int
    buf: _Buffer


@dataclass(slots=True)
class _Hash:
    """Feed the file's hashers the parts up to ``stop``, held in ``bufs`` (a hash worker)."""

    job: _Job
    stop: int
    bufs: list[_Buffer]


@dataclass(slots=True)
class _Finish:
    """Check the file and make its object (an io worker); ``buf`` holds a one-part file."""

    job: _Job
    buf: _Buffer | None


_Task = _Open | _Part | _Hash | _Finish


class PartStreamer:
    """Runs one batch of :class:`BlobUpload` through read -> CRC -> upload -> hash -> complete,
    on the coordinator of :class:`prefetch.pipeline.engine.transfer.Transfer`
    (:mod:`prefetch.pipeline.engine.coordinator`): the calling thread holds the state and the first
    error, the network work runs on ``concurrency`` threads. One streamer runs once.
    """

    def __init__(
        self,
        source: Source,
        dest: S3Prefix,
        config: MirrorConfig,
        *,
        progress: ProgressSink | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self._source = source
        self._dest = dest
        self._config = config
        self._progress = progress or NullProgress()
        self._stop = stop or threading.Event()
        self._watchdog = engine_watchdog(config.transfer, self._stop)
        self.stats = StreamStats()
        self._reader = _PartReader(
            source, self._watchdog, config.transfer, self.stats, self._progress, self._stop
        )
        self._resumer = UploadResumer(dest, self.stats.add)
        concurrency = config.transfer.concurrency
        self._io = ThreadPoolExecutor(concurrency, thread_name_prefix="mirror-io")
        self._hash = ThreadPoolExecutor(min(4, concurrency), thread_name_prefix="mirror-hash")
        self._tasks = Coordinator[_Task](
            self._stop,
            done=self._done,
            failed=self._failed,
            after_round=self._schedule,
            minor=Cancelled,
        )
        self._jobs: list[_Job] = []
        self._buffers = _BufferPool(concurrency, config.part_size)
        self._to_open: deque[_Job] = deque()
        self._opening = 0  # open tasks queued or running
        self._queue: deque[tuple[_Job, int]] = deque()  # parts waiting for a buffer
        self._ran = False

    def run(self, blobs: list[BlobUpload]) -> StreamStats:
        if self._ran:
            raise TransferError("a PartStreamer runs once; make another for the next batch")
        self._ran = True
        self._jobs.extend(self._job(b) for b in sorted(blobs, key=lambda b: b.file.size))
        self._buffers.size = max(
            [self._buffers.size]
            + [part_size_for(j.blob.file.size, self._config.part_size) for j in self._jobs]
        )
        self._to_open.extend(self._jobs)
        self._watchdog.start()
        try:
            with self._io, self._hash:
                self._schedule()
                try:
                    self._tasks.run()
                except Cancelled as exc:
                    if self._watchdog.deadline_passed:
                        raise DeadlineExceededError(
                            f"the mirror did not finish within its deadline of "
                            f"{self._config.transfer.deadline:g}s; the uploads in progress are "
                            "kept",
                            hint="run the mirror again to resume, or raise --deadline",
                        ) from exc
                    raise
        finally:
            self._watchdog.close()
            # every worker has stopped: only now may an upload be aborted
            for job in self._jobs:
                if job.abort and job.upload_id is not None:
                    self._dest.abort_upload(job.blob.key, job.upload_id)
                    self.stats.add(uploads_aborted=1)
        return self.stats

    def _job(self, blob: BlobUpload) -> _Job:
        size = blob.file.size
        part = part_size_for(size, self._config.part_size)
        sequential = {c.algorithm for c in blob.checks if verify.mode_of(c) == "sequential"}
        hashers = {a: verify.new_hasher(a, size=size) for a in sorted(sequential)}
        return _Job(blob, plan_parts(size, part), verify.MultiHasher(hashers), size > part)

    # -- coordinator -----------------------------------------------------------------------------

    def _failed(self, task: _Task, exc: BaseException) -> None:
        """A task failed: an upload whose bytes were refused (a check that did not agree, or S3
        refusing to complete it) is aborted; anything else keeps it for the next run."""
        refused = isinstance(exc, SourceError) and not isinstance(exc, TransientSourceError)
        if isinstance(exc, ChecksumMismatchError) or (isinstance(task, _Finish) and refused):
            task.job.abort = True

    def _done(self, task: _Task, result: object) -> None:
        """A task succeeded (``result``: what its function returned, of its kind's type)."""
        match task:
            case _Part(job=job, index=index, buf=buf):
                crc, part = cast("tuple[int, UploadedPart | None]", result)
                job.crcs[index] = crc
                if part is not None:
                    job.parts[index] = part
                job.waiting[index] = buf
                self._advance_hash(job)
            case _Hash(job=job, stop=stop, bufs=bufs):
                job.hashing, job.hashed = False, stop
                if job.multipart:
                    self._buffers.give_back(*bufs)
                if job.hashed == len(job.ranges):
                    keep = None if job.multipart or not bufs else bufs[0]
                    self._tasks.submit(self._io, _Finish(job, keep), self._finish, job, keep)
                else:
                    self._advance_hash(job)
            case _Open(job=job):
                self._opening -= 1
                job.upload_id, job.reusable = cast("tuple[str, dict[int, UploadedPart]]", result)
                self._queue.extend((job, i) for i in range(len(job.ranges)))
            case _Finish(job=job, buf=buf):
                if buf is not None:
                    self._buffers.give_back(buf)
                self._progress.file_done(job.path, job.blob.file.size)

    def _schedule(self) -> None:
        """Start parts on free buffers, in queue order (so a file's next part to hash always
        has its buffer before the parts after it: the pool cannot deadlock), and open files
        (find or create their uploads) while the queue runs short."""
        limit = self._config.transfer.concurrency
        while self._to_open and self._opening < 2 and len(self._queue) < limit:
            job = self._to_open.popleft()
            if not job.ranges:  # an empty file: nothing to read, one empty PutObject
                self._tasks.submit(self._io, _Finish(job, None), self._finish, job, None)
            elif job.multipart:
                self._tasks.submit(
                    self._io, _Open(job), self._resumer.find, job.blob.key, job.ranges
                )
                self._opening += 1
            else:
                self._queue.append((job, 0))
        while self._queue:
            buf = self._buffers.take()
            if buf is None:
                return
            job, index = self._queue.popleft()
            self._tasks.submit(self._io, _Part(job, index, buf), self._run_part, job, index, buf)

    def _advance_hash(self, job: _Job) -> None:
        """Hand the file's next contiguous run of read parts to a hash worker."""
        if job.hashing:
            return
        stop = job.hashed
        while stop in job.waiting:
            stop += 1
        if stop == job.hashed:
            return
        bufs = [job.waiting.pop(i) for i in range(job.hashed, stop)]
        views = [
            b.view[: end - start]
            for b, (start, end) in zip(bufs, job.ranges[job.hashed : stop], strict=True)
        ]
        job.hashing = True
        self._tasks.submit(self._hash, _Hash(job, stop, bufs), self._feed, job.hasher, views)

    @staticmethod
    def _feed(hasher: verify.MultiHasher, views: list[memoryview]) -> None:
        for view in views:
            hasher.update(view)

    # -- workers ---------------------------------------------------------------------------------

    def _run_part(self, job: _Job, index: int, buf: _Buffer) -> tuple[int, UploadedPart | None]:
        """Read part ``index`` into ``buf``, CRC it, and upload it (multipart files) unless an
        interrupted upload already holds these exact bytes."""
        start, end = job.ranges[index]
        view = buf.view[: end - start]
        self._reader.read(job.blob.file, start, view)
        crc = crc64nvme_of(view)
        if not job.multipart:
            return crc, None
        assert job.upload_id is not None
        kept = job.reusable.get(index)
        if kept is not None and same_bytes(kept, view, crc):
            self.stats.add(bytes_reused=len(view))
            return crc, UploadedPart(kept.number, kept.size, kept.etag, crc64nvme_b64(crc))
        if kept is not None:
            log.info(
                "%s: part %d differs from the one uploaded before: uploading it again",
                job.blob.key,
                index + 1,
            )
        if self._stop.is_set():
            raise Cancelled("stopped")
        part = self._dest.upload_part(job.blob.key, job.upload_id, index + 1, view, crc)
        self.stats.add(bytes_uploaded=len(view))
        return crc, part

    def _finish(self, job: _Job, buf: _Buffer | None) -> None:
        """Every part is read, uploaded and hashed: check the file, then make the object."""
        file = job.blob.file
        crc = verify.finish_inline(
            _WHOLE_CRC, [[job.crcs[i], end - start] for i, (start, end) in enumerate(job.ranges)]
        )
        digests = {a: h.digest() for a, h in job.hasher.hashers.items()}
        for check in job.blob.checks:
            if verify.mode_of(check) == "sequential":
                actual = verify.encode(digests[check.algorithm], check.encoding)
            else:
                actual = crc if check.encoding == "base64" else base64.b64decode(crc).hex()
            verify.check(file.path, check, actual)
        if self._stop.is_set():
            raise Cancelled("stopped")
        if job.multipart:
            assert job.upload_id is not None
            parts = [job.parts[i] for i in range(len(job.ranges))]
            stated = self._dest.complete_upload(job.blob.key, job.upload_id, parts, crc)
            job.upload_id = None  # completed: nothing left to abort
            if stated != crc:
                # no metadata names it, and the next run replaces it (a blob is skipped only
                # with a CRC64NVME): no DeleteObject needed, so the IAM policy has none
                raise SourceError(
                    f"{self._dest.url(job.blob.key)}: S3 completed the upload with CRC64NVME "
                    f"{stated}, not {crc} (was the upload started without the checksum?)",
                    hint="run the mirror again: it uploads this file afresh",
                )
            job.blob.crc64nvme = crc
        else:
            body = buf.view[: file.size] if buf is not None else b""
            job.blob.crc64nvme = self._dest.put(job.blob.key, body, crc)
            self.stats.add(bytes_uploaded=file.size)
        self.stats.add(objects_written=1)


class _PartReader:
    """Reads a part of a file from the source into a buffer under the engine's rules (retries
    from the last byte received, the stall rule, the deadline, stop); called on io threads."""

    def __init__(
        self,
        source: Source,
        watchdog: Watchdog,
        config: TransferConfig,
        stats: StreamStats,
        progress: ProgressSink,
        stop: threading.Event,
    ) -> None:
        self._source = source
        self._watchdog = watchdog
        self._retry = config.retry
        self._slice = read_slice(config)
        self._stats = stats
        self._progress = progress
        self._stop = stop

    def read(self, file: RemoteFile, start: int, view: memoryview) -> None:
        """Fill ``view`` with the file's bytes from ``start``, retrying transient failures from
        the last byte received, as the pull engine does."""
        at = Filled()
        retry_read(
            lambda: self._read_once(file, start, view, at),
            policy=self._retry,
            stop=self._stop,
            what=file.path,
            position=lambda: start + at.pos,
            on_retry=self._count_retry,
        )

    def _count_retry(self, exc: TransientSourceError) -> None:
        self._stats.add(retries=1)
        self._progress.retry(str(exc))

    def _read_once(self, file: RemoteFile, start: int, view: memoryview, at: Filled) -> None:
        end = start + len(view)
        reader, watch = open_watched(
            self._watchdog, f"{file.path} bytes {start + at.pos}-{end - 1}",
            partial(self._source.open_range, file, start + at.pos, end),
        )  # fmt: skip
        try:
            fill_watched(
                reader, watch, view, at, slice_size=self._slice, stop=self._stop,
                closed=partial(connection_closed, file, start),
                on_bytes=self._received,
            )  # fmt: skip
        finally:
            self._watchdog.unwatch(watch)
            reader.close()

    def _received(self, n: int) -> None:
        self._stats.add(bytes_read=n)
        self._progress.advance(n)
