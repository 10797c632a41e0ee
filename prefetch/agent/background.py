"""The agent loop's background tasks: work that must not stall the loop's heartbeat (the node
gate's writes, usage records, compile cache pushes), at most one task of each name at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine

__all__ = ["BackgroundTasks", "Work"]

#: Starts one piece of background work.
Work = Callable[[], Coroutine[object, object, None]]


class BackgroundTasks:
    """One asyncio task per name (``"gate"``, ``"usage"``, ...); call from the loop."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, name: str, work: Work) -> bool:
        """Start ``work`` as the one background task called ``name``, unless it still runs."""
        task = self._tasks.get(name)
        if task is not None and not task.done():
            return False
        self._tasks[name] = asyncio.create_task(work())
        return True

    def running(self) -> list[asyncio.Task[None]]:
        """The tasks that have not finished."""
        return [t for t in self._tasks.values() if not t.done()]
