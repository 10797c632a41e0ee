"""The whole-object path: a small file whose describe brought its bytes (a source with
:class:`~prefetch.sources.base.DescribesWhole`: S3, one GET of the whole object) is checked
and written by the io task that described it, without a ranged read.

Over the bytes in memory: each check's value in one hash call (:func:`verify.values_of`),
then the partial file ``<name>.incomplete`` created (emptied if an earlier run left one),
written in one ``write``, fsynced and closed. The coordinator compares the values and lets the
layout publish (:meth:`prefetch.pipeline.engine.finish.FileFinisher.finish`), as for any file;
a file that fails a check is fetched once more by the generic path (a ranged read).

Such a file has no journal, on disk or in memory (one write has nothing to resume): a crash
leaves at most its ``.incomplete``, which no run resumes from without a journal and the next
one overwrites; a journal an earlier run left beside it (another plan of the file) is removed.
The bytes a describe holds are bounded by :class:`BodyBudget`: past it, files are described
without their bytes and read in ranges.
"""

from __future__ import annotations

import contextlib
import os
import threading

from prefetch.pipeline import verify
from prefetch.pipeline.deadline import StallRule
from prefetch.pipeline.engine.config import TransferStats
from prefetch.pipeline.engine.plan import FileJob
from prefetch.pipeline.progress import ProgressSink

#: At most this many bytes of small files fetched whole by describe are in memory at any time.
WHOLE_BUDGET = 64 * 1024 * 1024
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC


def body_time_limit(rule: StallRule, size: int) -> float | None:
    """The seconds a small file's whole body (``size`` bytes, fetched by its describe) may take
    to arrive under the stall rule (``--stall-timeout`` plus the time ``--min-rate`` allows for
    its bytes: a ranged read of them would be abandoned by then). None with the rule off (the
    source's own bound then holds)."""
    if not rule.min_rate:
        return None
    return rule.stall_window + size / rule.min_rate


class BodyBudget:
    """Bytes of small files' bodies held in memory, within a budget reserved before the
    describe that fetches them."""

    def __init__(self, budget: int | None = None) -> None:
        self._left = WHOLE_BUDGET if budget is None else budget
        self._lock = threading.Lock()

    def reserve(self, size: int) -> bool:
        """Room for a body of ``size`` bytes, if the budget has it (give it back with
        :meth:`release`)."""
        with self._lock:
            if size > self._left:
                return False
            self._left -= size
            return True

    def release(self, size: int) -> None:
        with self._lock:
            self._left += size


class WholeWriter:
    """Checks and writes small files whose bytes are in memory (called on the io threads)."""

    def __init__(self, stats: TransferStats, progress: ProgressSink, left_over: set[str]) -> None:
        self._stats = stats
        self._progress = progress
        #: what earlier runs left in the staging folder (see Resumer.scan)
        self._left_over = left_over

    def write(self, job: FileJob, data: bytes) -> list[str]:
        """Compute the value of each of ``job.checks`` over ``data`` and write it to the
        file's partial file, durable (fsync) and closed. Returns the values, in
        ``job.checks`` order (what :meth:`FileFinisher.seal` returns for other files)."""
        values = verify.values_of(job.checks, data)
        partial = job.partial
        stale = partial.path.name.removesuffix(".incomplete") + ".journal"
        if stale in self._left_over:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial.path.with_name(stale))
        try:
            fd = os.open(partial.path, _CREATE, 0o644)
        except OSError as exc:
            raise partial.write_failed(partial.path, exc) from exc
        try:
            view = memoryview(data)
            while view:  # (a regular file takes it in one write; a short one continues)
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError as exc:
            job.discard = True  # a partial written in part: the caller deletes it
            raise partial.write_failed(partial.path, exc) from exc
        finally:
            os.close(fd)
        job.whole = True
        self._stats.add_bytes(len(data))
        self._progress.advance(len(data))
        return values
