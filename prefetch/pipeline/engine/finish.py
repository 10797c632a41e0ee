"""The end of a file's download: flushed to disk and the value of each of its checks computed
(:meth:`FileFinisher.seal`, on a worker), then compared and, when every check agrees, handed to
the layout to publish (:meth:`FileFinisher.finish`, on the coordinator); a file that fails a
check is deleted (the engine fetches it once more).

A check's value is joined from the journal's per-chunk results (CRCs, composite checksums),
finished from a large file's in-order hashers (:class:`prefetch.pipeline.engine.plan.SeqHash`), or
read back, for small files, in one pass for all that remain.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from prefetch.pipeline import verify
from prefetch.pipeline.engine.config import ENGINE_LOGGER, TransferConfig, TransferStats
from prefetch.pipeline.engine.plan import FileJob
from prefetch.pipeline.progress import ProgressSink
from prefetch.pipeline.snapshot import Checksum, RemoteFile
from prefetch.support.errors import ChecksumMismatchError

log = logging.getLogger(ENGINE_LOGGER)

#: publish(file, staged_path, checksums_verified) -> None; called once a file is complete and
#: every one of its checks agreed (an empty tuple: it was checked by size only)
PublishFn = Callable[[RemoteFile, Path, tuple[Checksum, ...]], None]


class FileFinisher:
    """Seals, checks and publishes (or deletes) each downloaded file."""

    def __init__(
        self,
        publish: PublishFn,
        config: TransferConfig,
        stats: TransferStats,
        progress: ProgressSink,
    ) -> None:
        self._publish = publish
        self._config = config
        self._stats = stats
        self._progress = progress

    def seal(self, job: FileJob) -> list[str]:
        """A hash worker's part of finishing a file (an io worker's, for a file fetched whole):
        flush it to disk (its data is durable before it is published, and the coordinator
        never waits on the disk) and compute the value of each of its checks (in
        ``job.checks`` order): joined from the journal, finished from the in-order hashers, or
        read back (small files) in one pass for all that remain."""
        job.partial.fsync()
        job.close()
        values = self._sequential_values(job)
        for i, c in enumerate(job.checks):
            if i not in values and c is job.checksum:
                inline = _inline_value(job)
                if inline is not None:
                    values[i] = inline
        rest = [i for i in range(len(job.checks)) if i not in values]
        if rest:
            read = verify.hash_file_all(job.staged, [job.checks[i] for i in rest])
            values.update(zip(rest, read, strict=True))
        return [values[i] for i in range(len(job.checks))]

    def _sequential_values(self, job: FileJob) -> dict[int, str]:
        """The values of a large file's in-order checks (by index in ``job.checks``), once its
        hashers have read the part of the file not yet hashed."""
        values: dict[int, str] = {}
        if job.seq is None:
            return values
        start = job.chunks[job.seq.next][0] if job.seq.next < len(job.chunks) else job.file.size
        verify.hash_range(job.seq.hasher, job.staged, start, job.file.size, self._config.direct_io)
        digests = {a: h.digest() for a, h in job.seq.hasher.hashers.items()}
        for i, c in enumerate(job.checks):
            if c.algorithm in digests and verify.mode_of(c) == "sequential":
                values[i] = verify.encode(digests[c.algorithm], c.encoding)
        return values

    def finish(self, job: FileJob, actuals: list[str]) -> bool:
        """Compare a sealed file's check values (``actuals``) and publish it. False: a check
        failed on the file's first attempt, it was deleted and must be fetched once more (a
        second failure raises the ChecksumMismatchError)."""
        if job.checks:
            try:
                for checksum, actual in zip(job.checks, actuals, strict=True):
                    verify.check(job.file.path, checksum, actual)
            except ChecksumMismatchError as exc:
                self._stats.checksum_failures += 1
                self._progress.checksum_failure(job.file.path)
                job.delete()
                if job.attempt >= 2:
                    raise
                log.warning("%s; deleted it, downloading the file once more", exc)
                job.attempt += 1
                return False
            counts = self._stats.checksum_algorithms
            for checksum in job.checks:
                counts[checksum.algorithm] = counts.get(checksum.algorithm, 0) + 1
            self._stats.files_verified += 1
        self._publish(job.file, job.staged, job.checks)
        if not job.whole and job.journal is not None:
            job.journal.remove()  # (a whole file's worker removed any journal of it already)
        self._stats.files_downloaded += 1
        self._progress.file_done(job.file.path, job.file.size)
        return True


def _inline_value(job: FileJob) -> str | None:
    """The inline check's value from the journal's per-chunk results (None: it was not
    computed inline, as for the sequential check of a file of several chunks)."""
    assert job.journal is not None and job.checksum is not None
    if verify.mode_of(job.checksum) == "sequential":
        inline = job.journal.done.get(0) if len(job.chunks) == 1 else None
        # a one-chunk file was hashed as it arrived (see verify.ChunkHasher)
        return inline if isinstance(inline, str) else None
    results = [job.journal.done[i] for i in range(len(job.chunks))]
    return verify.finish_inline(job.checksum, results)
