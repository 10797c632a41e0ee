"""An io task's first part of each file: describe and plan it and, for a file that fits one
write, fetch it too (:meth:`DescribeWorker.batch`, one task for a batch of small files), so the
coordinator (:mod:`prefetch.pipeline.engine.transfer`) sees a small file once, ready to check
and publish. A small file whose describe brought its bytes (a source with
:class:`~prefetch.sources.base.DescribesWhole`) is checked and written from them
(:mod:`prefetch.pipeline.engine.whole`); any other small file by one ranged read.
"""

from __future__ import annotations

import functools
import threading

from prefetch.pipeline.deadline import StallRule
from prefetch.pipeline.engine.fetch import ChunkFetcher
from prefetch.pipeline.engine.finish import FileFinisher
from prefetch.pipeline.engine.partial_file import DIRECT_MIN_SIZE
from prefetch.pipeline.engine.plan import FileJob, FilePlanner, fits_one_write
from prefetch.pipeline.engine.resume import Resumer, prepare_whole
from prefetch.pipeline.engine.watched_read import call_watched
from prefetch.pipeline.engine.whole import BodyBudget, WholeWriter, body_time_limit
from prefetch.pipeline.snapshot import RemoteFile
from prefetch.sources.base import DescribesWhole, Source
from prefetch.support.errors import Cancelled


class DescribeWorker:
    """The io tasks that describe files (and fetch the small ones); thread-safe."""

    def __init__(
        self,
        source: Source,
        planner: FilePlanner,
        resumer: Resumer,
        fetcher: ChunkFetcher,
        finisher: FileFinisher,
        writer: WholeWriter,
        stop: threading.Event,
        stall: StallRule,
    ) -> None:
        self._planner = planner
        self._resumer = resumer
        self._fetcher = fetcher
        self._finisher = finisher
        self._writer = writer
        self._stop = stop
        self._stall = stall  #: the stall rule a small file's whole GET is held to
        #: the whole-object path, for a source that has it; the bodies it holds are bounded
        self._whole = source if isinstance(source, DescribesWhole) else None
        self._budget = BodyBudget()

    def batch(self, files: list[RemoteFile]) -> list[tuple[FileJob, list[str] | None]]:
        """An io task: :meth:`_describe` each of ``files`` in turn (the stop is looked at
        between them). A failure fails the batch: the files it already wrote are deleted (the
        coordinator never sees them; no run resumes a file of one write)."""
        done: list[tuple[FileJob, list[str] | None]] = []
        try:
            for file in files:
                if self._stop.is_set():
                    raise Cancelled("stopped")
                done.append(self._describe(file))
        except BaseException:
            for job, actuals in done:
                if actuals is not None:  # (not a file only described: it may hold a resume)
                    job.delete()
            raise
        return done

    def _describe(self, file: RemoteFile) -> tuple[FileJob, list[str] | None]:
        """Describe and plan a file and, when it fits one write, fetch it too, so
        the coordinator sees a small file once, ready to check and publish (handing it back to
        the coordinator in between cost each small file a second round trip through it, behind
        the io threads for the GIL). A small file whose describe brought its bytes (a source
        with DescribesWhole) is checked and written from them (:meth:`_describe_whole`); any
        other by one ranged read (:meth:`fetch_whole`). Returns the job and, for a file
        fetched here, the value of each of its checks (None: the coordinator starts the file's
        chunks)."""
        whole = self._whole
        if (
            whole is not None
            and 0 < file.size < DIRECT_MIN_SIZE
            and self._budget.reserve(file.size)
        ):
            return self._describe_whole(whole, file)
        return self._fetch_described(self._planner.describe(file))

    def _describe_whole(
        self, source: DescribesWhole, file: RemoteFile
    ) -> tuple[FileJob, list[str] | None]:
        """Describe a small file with its bytes (its size reserved in the budget, given back
        once they are written) and check and write them (:class:`WholeWriter`); a file the
        source described without them goes the generic way."""
        try:
            within = body_time_limit(self._stall, file.size)
            described, body = call_watched(
                self._planner.watchdog,
                file.path,
                functools.partial(source.describe_whole, within=within),
                file,
            )
            job = self._planner.plan(described)
            if body is not None and fits_one_write(job):
                try:
                    return job, self._writer.write(job, body)
                except BaseException as exc:
                    job.fail(exc)
                    job.clean_up()
                    raise
        finally:
            self._budget.release(file.size)
        return self._fetch_described(job)

    def _fetch_described(self, job: FileJob) -> tuple[FileJob, list[str] | None]:
        """A described file: fetched here by one ranged read when it fits one write."""
        if not fits_one_write(job):
            return job, None
        prepare_whole(job)
        try:
            return job, self.fetch_whole(job)
        except BaseException as exc:
            # the coordinator never sees this job: close (or, if its bytes cannot be trusted,
            # delete) what it left; no other thread uses a whole file's descriptor
            job.fail(exc)
            job.clean_up()
            raise

    def fetch_whole(self, job: FileJob) -> list[str]:
        """Everything a small file needs before it can be published, on one io worker: the
        partial file created empty, the one ranged read written and hashed as it arrives, then
        sealed (fsync, the value of every check). Returns what :meth:`FileFinisher.seal`
        returns."""
        self._resumer.start_whole(job)
        if job.chunks:
            self._fetcher.fetch(job, [0])
        return self._finisher.seal(job)
