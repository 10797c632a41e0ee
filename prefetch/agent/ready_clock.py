"""Time to ready: how long this node took to have every required model ready.

Observed once per agent process, on the first loop pass that finds every required model ready:

* ``agent_start``: from the agent's start. Always observed: it is what an agent restart or a
  DaemonSet rollout costs, as well as the agent's share of a cold start.
* ``node_creation``: from the Node's ``metadata.creationTimestamp`` (read through the node gate:
  one GET, in a worker thread), so it includes booting, joining and pulling the agent's image.
  Observed only when this process had to bring the node to ready, that is when not every
  required model was already ready on its first pass: an agent restarted on a warm node would
  otherwise record the node's age (hours or days) as a cold start. An agent that restarts during
  a cold start (before the node was ready) does record it, from the node's creation.

Both go to the ``model_prefetch_time_to_ready_seconds`` histogram and the
``model_prefetch_ready_after_seconds`` gauge (label ``since``) and to ``/readyz``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from prefetch.agent.metrics import AgentMetrics
from prefetch.support.logjson import scrub

log = logging.getLogger(__name__)


@runtime_checkable
class NodeCreationReader(Protocol):
    """Reads when the agent's node was created (:class:`~prefetch.agent.node.NodeGate` does)."""

    def creation_time(self) -> float | None: ...


class ReadyClock:
    """Observes the time to ready once per process (see the module docstring).

    ``started`` and ``now()`` are Unix time (the node's creation time is one)."""

    def __init__(
        self, metrics: AgentMetrics, started: float, now: Callable[[], float] = time.time
    ) -> None:
        self._metrics = metrics
        self._started = started
        self._now = now
        self._warm_start: bool | None = None
        self._ready_at: float | None = None
        #: What was observed, by ``since`` (for /readyz).
        self.seconds: dict[str, float] = {}

    def on_pass(self, all_ready: bool) -> bool:
        """Called every loop pass; True exactly once, on the first pass with every required
        model ready, when the node's creation time should be read (:meth:`observe_node`)."""
        if self._ready_at is not None:
            return False
        if self._warm_start is None:
            self._warm_start = all_ready
        if not all_ready:
            return False
        self._ready_at = self._now()
        self._observe("agent_start", self._ready_at - self._started)
        return not self._warm_start

    async def observe_node(self, reader: object | None) -> None:
        """Observe node creation to ready, reading the creation time in a worker thread."""
        if self._ready_at is None or not isinstance(reader, NodeCreationReader):
            return
        try:
            created = await asyncio.to_thread(reader.creation_time)
        except Exception as exc:
            log.warning(
                "could not read the node's creation time: %s",
                scrub(str(exc)),
                extra={"phase": "ready"},
            )
            return
        if created is not None:
            self._observe("node_creation", max(self._ready_at - created, 0.0))

    def _observe(self, since: str, seconds: float) -> None:
        self.seconds[since] = round(seconds, 3)
        self._metrics.observe_time_to_ready(since, seconds)
        log.info(
            "every required model ready %.1fs after %s",
            seconds,
            since.replace("_", " "),
            extra={"phase": "ready"},
        )
