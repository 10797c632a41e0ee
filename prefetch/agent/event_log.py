"""The JSON-log twin of each Event: every :class:`~prefetch.agent.events.NodeEvent` is one log
line with the Event's fields (``event``, ``model``, ``bytes``, ``seconds``, ``source``,
``node``, ``error``), so a log query finds what ``kubectl`` shows (and a line written inside a
sync carries its ``sync_id``)."""

from __future__ import annotations

import logging

from prefetch.agent.events import NodeEvent

# Its lines keep the logger name they have always had, so log queries keep matching.
log = logging.getLogger("prefetch.agent.events")

__all__ = ["log_event"]


def log_event(event: NodeEvent, node: str | None) -> None:
    """Log ``event`` (a warning when the Event is one) for the node called ``node``."""
    log.log(
        logging.WARNING if event.warning else logging.INFO,
        "%s: %s",
        event.reason.value,
        event.note,
        extra={
            "event": event.reason.value,
            "model": event.model,
            "bytes": event.bytes,
            "seconds": event.seconds,
            "source": event.source,
            "node": node,
            "error": event.error,
        },
    )
