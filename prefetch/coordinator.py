"""One coordinator for work spread over thread pools: the pull engine (:class:`prefetch.transfer.
Transfer`) and the mirror's part streamer (:class:`prefetch.mirror.stream.PartStreamer`) run on it.

The owner submits typed tasks (small dataclasses, one per kind of work) to its pools through
:meth:`Coordinator.submit`; :meth:`Coordinator.run` is the one loop that sees each task finish,
on the calling thread, and hands it to the owner's ``done`` (which may submit more). Workers
never decide the outcome: the first error is held here, ``stop`` is set so the other workers end
early, and what finished meanwhile is only reported to ``failed`` (to mark what must be thrown
away), never acted on. A later error replaces the first only when the first was a mere
consequence of stopping (``minor``: Cancelled). The owner cleans up after its pools have shut
down, that is after every worker has stopped.

Per task the loop costs one dict entry and the owner's task object, as the string-tagged tuples
it replaces did.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
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

    def submit(
        self, pool: Executor, task: Task, fn: Callable[[*Args], object], *args: *Args
    ) -> None:
        """Run ``fn(*args)`` on ``pool`` as ``task`` (what it returns goes to ``done``: the
        owner knows each kind of task's result type)."""
        self._running[pool.submit(fn, *args)] = task

    def run(self) -> None:
        """Until no task is left: hand each finished task to ``done`` or ``failed``. Raises the
        first error once every task submitted has ended (or, if the loop itself fails, at once,
        with ``stop`` set and the queued tasks cancelled: the owner's pools wait for the rest)."""
        first_error: BaseException | None = None
        running = self._running
        try:
            while running:
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
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
