"""One coordinator for work spread over thread pools: the pull engine
(:class:`prefetch.pipeline.engine.transfer. Transfer`) and the mirror's part streamer
(:class:`prefetch.publish.s3_mirror.stream.PartStreamer`) run on it.

The owner submits typed tasks (small dataclasses, one per kind of work) to its pools through
:meth:`Coordinator.submit`; :meth:`Coordinator.run` is the one loop that sees each task finish,
on the calling thread, and hands it to the owner's ``done`` (which may submit more). Workers
never decide the outcome: the first error is held here, ``stop`` is set so the other workers end
early, and what finished meanwhile is only reported to ``failed`` (to mark what must be thrown
away), never acted on. A later error replaces the first only when the first was a mere
consequence of stopping (``minor``: Cancelled). The owner cleans up after its pools have shut
down, that is after every worker has stopped.

Per task the loop costs one dict entry, the owner's task object and one put on a queue of
finished futures (the future's done callback, on the worker). That queue replaced
``concurrent.futures.wait(FIRST_COMPLETED)``, which installs and removes a waiter on every
future in flight each time it is called: with 16 tasks in flight and one task per small file,
that was ~16 lock round trips per file on the coordinator (issue 33).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Generic, TypeVar, TypeVarTuple

Task = TypeVar("Task")
Args = TypeVarTuple("Args")


class Coordinator(Generic[Task]):
    """Holds the tasks in flight (each future with its typed task) and the first error."""

    def __init__(
        self,
        stop: threading.Event,
        *,
        done: Callable[[Task, object], None],
        failed: Callable[[Task, BaseException], None],
        after_round: Callable[[], None] | None = None,
        minor: type[BaseException] | tuple[type[BaseException], ...] = (),
    ) -> None:
        """``done(task, result)`` runs on the calling thread for each task that succeeded while
        no error is held; ``failed(task, error)`` for each that failed; ``after_round()`` after
        each batch of finished tasks while no error is held (to start what became possible)."""
        self._stop = stop
        self._done = done
        self._failed = failed
        self._after_round = after_round
        self._minor = minor
        self._running: dict[Future[object], Task] = {}
        self._finished: queue.SimpleQueue[Future[object]] = queue.SimpleQueue()

    def submit(
        self, pool: Executor, task: Task, fn: Callable[[*Args], object], *args: *Args
    ) -> None:
        """Run ``fn(*args)`` on ``pool`` as ``task`` (what it returns goes to ``done``: the
        owner knows each kind of task's result type)."""
        future = pool.submit(fn, *args)
        self._running[future] = task
        future.add_done_callback(self._finished.put)

    def run(self) -> None:
        """Until no task is left: hand each finished task to ``done`` or ``failed``. Raises the
        first error once every task submitted has ended (or, if the loop itself fails, at once,
        with ``stop`` set and the queued tasks cancelled: the owner's pools wait for the rest)."""
        first_error: BaseException | None = None
        running = self._running
        try:
            while running:
                for fut in self._next_finished():
                    task = running.pop(fut)
                    try:
                        result = fut.result()
                    except BaseException as exc:
                        self._failed(task, exc)
                        if first_error is None or isinstance(first_error, self._minor):
                            first_error = exc
                        self._stop.set()
                        continue
                    if first_error is None:
                        self._done(task, result)
                if first_error is None and self._after_round is not None:
                    self._after_round()
        except BaseException:
            self._stop.set()
            for fut in running:
                fut.cancel()
            raise
        if first_error is not None:
            raise first_error

    def _next_finished(self) -> list[Future[object]]:
        """The tasks that finished since the last call: waits for one, then takes every other
        one already there (a round, as ``after_round`` sees it)."""
        finished = [self._finished.get()]
        with contextlib.suppress(queue.Empty):
            while True:
                finished.append(self._finished.get_nowait())
        return finished
