"""What the chunk engine does with one file: the describe (a HEAD for checksums and part layout),
the checks it must pass, its chunks (aligned to the upload's parts when its checksum is
composite) and its partial file, held in a :class:`FileJob` the engine's other parts share.

Chunks (at most ``piece_size``) are the unit of resume; one ranged request covers a run of
missing chunks (:func:`group_chunks`) up to ``chunk_size``. A file of one chunk below the O_DIRECT
size (:func:`fits_one_write`) is fetched whole by the io task that described it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from prefetch.pipeline import verify
from prefetch.pipeline.deadline import Watchdog
from prefetch.pipeline.engine.config import TransferConfig
from prefetch.pipeline.engine.journal import Journal
from prefetch.pipeline.engine.partial_file import DIRECT_MIN_SIZE, PartialFile
from prefetch.pipeline.engine.watched_read import call_watched
from prefetch.pipeline.snapshot import Checksum, RemoteFile
from prefetch.sources.base import Source
from prefetch.support.errors import ChecksumMismatchError, MissingChecksumError, SourceChangedError


@dataclass
class SeqHash:
    """A large file's sequential checksums (sha256, git-sha1, md5 of one part; one hasher per
    algorithm) fed in file order while the download goes on: a hash worker reads back each newly
    contiguous run of finished chunks, once for all of them, so only the last run is left to
    hash when the download ends."""

    hasher: verify.MultiHasher
    next: int = 0  # first chunk not hashed yet
    busy: bool = False  # a hash worker is feeding the hasher
    seal_when_idle: bool = False  # the download ended while busy: seal after this feed


@dataclass
class FileJob:
    """One file on its way through the engine: its plan, its partial file and journal, and
    where its download stands (the coordinator's state of it)."""

    file: RemoteFile
    partial: PartialFile
    checksum: Checksum | None  # the check computed per range (verify.inline_check), if any
    chunks: list[tuple[int, int]]
    checks: tuple[Checksum, ...] = ()  # every check the file must pass (verify.checks_for)
    journal: Journal | None = None
    pending: int = 0
    attempt: int = 1
    discard: bool = False
    seq: SeqHash | None = None  # a large file's sequential checksum, computed as chunks land
    whole: bool = False  # fetched, written and sealed by one worker task
    unverified: bool = False  # verification is on but the source states no checksum for it

    @property
    def staged(self) -> Path:
        return self.partial.path

    def fail(self, exc: BaseException) -> None:
        """The file failed: keep resumable state unless its bytes can no longer be trusted."""
        if isinstance(exc, SourceChangedError | ChecksumMismatchError):
            self.discard = True

    def close(self) -> None:
        self.partial.close()
        if self.journal is not None:
            self.journal.close()

    def delete(self) -> None:
        """Close and delete the partial file and its journal."""
        self.close()
        if self.journal is not None:
            self.journal.remove()
        self.partial.delete()

    def clean_up(self) -> None:
        """Once no worker uses the file: delete it if its bytes cannot be trusted, else close
        it (kept for the next run to resume)."""
        if self.discard:
            self.delete()
        else:
            self.close()


class FilePlanner:
    """Describes a file and plans how it is fetched and checked (an io worker's first step)."""

    def __init__(
        self, source: Source, watchdog: Watchdog, staging: Path, config: TransferConfig
    ) -> None:
        self._source = source
        self.watchdog = watchdog
        self._staging = staging
        self._config = config

    def describe(self, file: RemoteFile) -> FileJob:
        """The source's description of ``file`` (under the watchdog: a stop or the deadline
        interrupts it), planned."""
        return self.plan(call_watched(self.watchdog, file.path, self._source.describe, file))

    def plan(self, file: RemoteFile) -> FileJob:
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
        partial = PartialFile(self._staging / staged_name(file), file)
        piece = min(self._config.piece_size, self._config.chunk_size)
        chunks = plan_chunks(file.size, piece, checksum)
        return FileJob(file, partial, checksum, chunks, checks, unverified=unverified)


def fits_one_write(job: FileJob) -> bool:
    """A file of at most one chunk, below the O_DIRECT size: fetched whole by one worker task
    (:class:`~prefetch.pipeline.engine.describing.DescribeWorker`)."""
    return len(job.chunks) <= 1 and job.file.size < DIRECT_MIN_SIZE


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


def staged_name(file: RemoteFile) -> str:
    """Name of a file's partial download: stable per (path, version), flat, filesystem-safe."""
    digest = hashlib.sha256(f"{file.path}\0{file.version}".encode()).hexdigest()[:32]
    return f"{digest}.incomplete"
