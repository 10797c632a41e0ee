"""The cache's usage as the agent keeps it fresh: the rate and readiness gauges and the free
space each loop pass, and, every :data:`USAGE_INTERVAL` (or on the pass after a sync ended), the
per-model usage records, with the "still wanted" touch on each ready model that orders eviction
(in the background: it walks the cache)."""

from __future__ import annotations

import asyncio
import contextlib

from prefetch.agent.background import BackgroundTasks
from prefetch.agent.metrics import AgentMetrics
from prefetch.agent.scheduler import Scheduler
from prefetch.agent.space import SpaceManager

#: Record "still wanted" on each cached entry this often (it orders eviction).
TOUCH_INTERVAL = 300.0
#: Refresh the cache usage metrics this often.
USAGE_INTERVAL = 30.0

__all__ = ["TOUCH_INTERVAL", "USAGE_INTERVAL", "UsageRefresher"]


class UsageRefresher:
    """Refreshes the cache gauges each pass (:meth:`refresh`) and the usage records when due."""

    def __init__(
        self,
        scheduler: Scheduler,
        space: SpaceManager,
        metrics: AgentMetrics,
        background: BackgroundTasks,
    ) -> None:
        self._scheduler = scheduler
        self._space = space
        self._metrics = metrics
        self._background = background
        self._next_usage = 0.0

    def changed(self) -> None:
        """A sync ended: the cache usage metrics are refreshed on the next pass."""
        self._next_usage = 0.0

    def refresh(self, now: float) -> None:
        metrics = self._metrics
        metrics.update_rates()
        metrics.all_required_ready.set(1 if self._scheduler.all_required_ready() else 0)
        with contextlib.suppress(OSError):
            metrics.cache_free.set(self._space.store.free_bytes())
        if now < self._next_usage:
            return
        models = list(self._scheduler.table().values())
        touch = [ms for ms in models if ms.ready and now - ms.touched >= TOUCH_INTERVAL]
        space = self._space

        async def record_usage() -> None:
            await asyncio.to_thread(space.record_usage, [ms.spec for ms in touch])

        if self._background.start("usage", record_usage):
            self._next_usage = now + USAGE_INTERVAL
            for ms in touch:
                ms.touched = now
