"""Where a file's download starts: its partial file and journal opened, resuming the chunks an
earlier run finished (the journal names them), or created afresh for a file fetched whole.

A file of one chunk has nothing to resume: its journal stays in memory and its partial file is
created empty by the io task that fetches it (:meth:`Resumer.start_whole`); on the coordinator
each system call also waits for the GIL behind the workers (1000 x 100 KiB: the coordinator's
open, ``posix_fallocate`` and two ``stat``s per file were ~3 of the pull's ~6 s).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from prefetch.pipeline import verify
from prefetch.pipeline.engine.config import ENGINE_LOGGER, TransferConfig, TransferStats
from prefetch.pipeline.engine.journal import Journal
from prefetch.pipeline.engine.partial_file import DIRECT_MIN_SIZE
from prefetch.pipeline.engine.plan import FileJob, SeqHash

log = logging.getLogger(ENGINE_LOGGER)


class Resumer:
    """Opens each file's partial download for its chunks, resuming what earlier runs left in the
    staging folder (the model's lock keeps other writers out)."""

    def __init__(self, staging: Path, config: TransferConfig, stats: TransferStats) -> None:
        self._staging = staging
        self._config = config
        self._stats = stats
        #: what earlier runs left in the staging folder: a small file removes a stale journal
        #: only if there is one, not an unlink each
        self.left_over: set[str] = set()

    def scan(self) -> None:
        """Note what the staging folder holds (before any file of this run is written)."""
        self.left_over.update(os.listdir(self._staging))

    def open(self, job: FileJob) -> None:
        """Open the file's journal (keeping the chunks it records when the partial file is
        there, of the full size) and its partial file, preallocated; and a fresh sequential
        hasher for a large file's in-order checks."""
        header = journal_header(job)
        exists = job.staged.exists() and job.staged.stat().st_size == job.file.size
        path = journal_path(job)
        try:
            job.journal = Journal.open(
                path, header, partial_exists=exists, persist=len(job.chunks) > 1
            )
        except OSError as exc:
            raise job.partial.write_failed(path, exc) from exc
        if not job.partial.open_preallocated(
            keep=bool(job.journal.done), direct=self._config.direct_io
        ):
            job.journal.close()  # (kept as it was: without fallocate the journal is not written)
        job.seq = None
        large = job.file.size >= DIRECT_MIN_SIZE
        sequential = {c.algorithm for c in job.checks if verify.mode_of(c) == "sequential"}
        if sequential and large:
            hashers = {a: verify.new_hasher(a, size=job.file.size) for a in sorted(sequential)}
            job.seq = SeqHash(verify.MultiHasher(hashers))

    def missing(self, job: FileJob) -> list[int]:
        """The chunks an opened file still needs (counting and logging what it resumes)."""
        journal = job.journal
        assert journal is not None  # open() opened it
        todo = [i for i in range(len(job.chunks)) if i not in journal.done]
        resumed = sum(e - s for i, (s, e) in enumerate(job.chunks) if i not in todo)
        if resumed:
            self._stats.resumed_bytes += resumed
            log.info(
                "resuming %s: %d of %d bytes already on disk", job.file.path, resumed, job.file.size
            )
        return todo

    def start_whole(self, job: FileJob) -> None:
        """An io worker's start of a file fetched whole: the partial file created empty
        (whatever an earlier run left there: one chunk has nothing to resume), and a journal an
        earlier plan of the file left (another chunk size) removed."""
        assert job.journal is not None
        if job.journal.path.name in self.left_over:
            job.journal.remove()
        job.partial.create_empty()


def prepare_whole(job: FileJob) -> None:
    """Set a small file up to be fetched by one io task: a file of one chunk has nothing to
    resume, so it needs no journal on disk and no preallocation."""
    job.whole = True
    job.journal = Journal(journal_path(job), journal_header(job))  # in memory only
    job.seq = None
    job.pending = 1


def journal_path(job: FileJob) -> Path:
    return job.staged.with_suffix(".journal")


def journal_header(job: FileJob) -> dict[str, object]:
    """What a journal is for: a journal whose header differs is not resumed from."""
    return {
        "path": job.file.path,
        "version": job.file.version,
        "size": job.file.size,
        "chunks": job.chunks,
        "checksum": job.checksum.to_json() if job.checksum else None,
    }
