"""Keeps the node gate (labels and start-up taint) in line with the agent's ready set.

Owns when the gate is applied and what happens when that fails: it applies on a change of the
ready set, re-applies every ``GATE_REFRESH_INTERVAL`` to repair foreign edits, waits as
``GATE_RETRY`` says after an error before trying again (unless forced: a model leaving the
ready set is applied at once), and keeps the last error for ``/readyz``. What a gate does to
the node is :class:`prefetch.agent.node.NodeGate`'s business; anything with its ``apply`` works
(:class:`NodeGateLike`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from prefetch.agent.config_values import AgentConfig
from prefetch.agent.event_recorder import EventRecorder
from prefetch.agent.events import gate_opened
from prefetch.agent.metrics import AgentMetrics
from prefetch.pipeline.retry import RetryPolicy
from prefetch.support.logjson import scrub

if TYPE_CHECKING:
    from prefetch.agent.node import GateResult

log = logging.getLogger(__name__)

#: Re-apply the node gate this often even when nothing changed (repairs foreign edits).
GATE_REFRESH_INTERVAL = 60.0
#: After failed applies, wait before the next (unforced) try: from 5-10 s after the first
#: failure, doubling up to the refresh interval while the API server keeps failing.
GATE_RETRY = RetryPolicy(base_delay=10.0, max_delay=GATE_REFRESH_INTERVAL, min_delay=5.0)


class NodeGateLike(Protocol):
    """What the agent needs of a node gate (:class:`prefetch.agent.node.NodeGate` is one)."""

    def apply(self, ready_models: Iterable[str], all_required_ready: bool) -> GateResult: ...


#: Builds the gate for a config (its label prefix and taint); None when there is no gate.
GateFactory = Callable[[AgentConfig], NodeGateLike | None]
#: Reads the ready set now: (sorted ready model names, whether every required model is ready).
ReadyState = Callable[[], tuple[tuple[str, ...], bool]]


class GateDriver:
    """Applies the ready set to the node gate, rate-limited, retried after errors."""

    def __init__(
        self,
        factory: GateFactory,
        metrics: AgentMetrics,
        read_state: ReadyState,
        events: EventRecorder | None = None,
    ) -> None:
        self._factory = factory
        self._metrics = metrics
        self._read_state = read_state
        self._events = events
        self._taint = ""
        #: The gate is open: every required model's readiness reached the node (NodeGateOpened
        #: was told); it closes again when a required model leaves the ready set.
        self._opened = False
        self._gate: NodeGateLike | None = None
        self._lock = asyncio.Lock()
        self._applied: tuple[tuple[str, ...], bool] | None = None
        self._applied_at = float("-inf")
        self._retry_at = 0.0
        self._failures = 0  # failed applies in a row
        self.last_error: str | None = None

    @property
    def enabled(self) -> bool:
        return self._gate is not None

    @property
    def gate(self) -> NodeGateLike | None:
        """The gate in use now (the progress note and the ready clock write and read the node
        through it when it can), or None."""
        return self._gate

    def open(self, config: AgentConfig) -> None:
        """Build the gate for ``config`` (at start-up)."""
        self._gate = self._factory(config)
        self._taint = config.startup_taint

    async def apply(self, *, force: bool = False) -> None:
        """Apply the current ready set, unless it was applied recently (``force`` applies now)."""
        if self._gate is None:
            return
        async with self._lock:
            now = time.monotonic()
            key = self._read_state()
            if not force:
                if self.last_error is not None and now < self._retry_at:
                    return
                if key == self._applied and now - self._applied_at < GATE_REFRESH_INTERVAL:
                    return
            gate = self._gate
            ready, all_required = key
            try:
                result = await asyncio.to_thread(gate.apply, list(ready), all_required)
            except Exception as exc:
                self._metrics.gate_errors.inc()
                self.last_error = scrub(str(exc))
                self._failures += 1
                self._retry_at = now + GATE_RETRY.delay(self._failures)
                log.error(
                    "node gate: %s",
                    self.last_error,
                    extra={"phase": "gate", "error": self.last_error},
                )
                return
            self.last_error = None
            self._failures = 0
            self._applied = key
            self._applied_at = now
            self._tell(
                ready, all_required, taint_removed=bool(getattr(result, "taint_removed", False))
            )

    def _tell(self, ready: tuple[str, ...], all_required: bool, *, taint_removed: bool) -> None:
        """NodeGateOpened once each time the node's gate opens (all required models ready)."""
        if not all_required:
            self._opened = False
            return
        if self._opened:
            return
        self._opened = True
        if self._events is not None:
            self._events.emit(gate_opened(ready, self._taint, taint_removed=taint_removed))

    async def replace(self, config: AgentConfig) -> None:
        """The label prefix or taint changed: take our labels off under the old prefix (the
        taint is never put back), then build the gate for ``config``."""
        old_gate = self._gate
        if old_gate is not None:
            try:
                await asyncio.to_thread(old_gate.apply, [], False)
            except Exception as exc:
                log.warning("could not remove the labels under the old prefix: %s", exc)
        self._gate = self._factory(config)
        self._taint = config.startup_taint
        self._applied = None
