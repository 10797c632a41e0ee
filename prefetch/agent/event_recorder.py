"""Sending the node's story (:mod:`prefetch.agent.events`) as Kubernetes Events, deduplicated
and rate limited, and logging each one (:func:`~prefetch.agent.event_log.log_event`).

The Event objects follow what the API server requires of events.k8s.io/v1 for a cluster-scoped
object: ``regarding`` is the Node (uid from one GET of the node, else the node name, as the
kubelet does; ``kubectl describe node`` finds both), the Event lives in namespace ``default``
(the only namespaces besides ``kube-system`` the server accepts for it), ``eventTime`` is set,
``reportingController`` is ``model-prefetch.io/agent`` and ``reportingInstance`` the node name.

Deduplication and rate limiting follow client-go's event machinery:

* **Series.** An occurrence with the same reason, action and key (for a failure: the model and
  the kind of error) within ``SERIES_WINDOW`` of the previous one does not create a new Event:
  it bumps ``series.count`` and ``series.lastObservedTime`` of the first one with a merge PATCH
  (the note stays the first occurrence's: the API server keeps it immutable). The window is 30
  minutes, longer than the longest retry backoff (``retryBackoff.max``, 10 minutes by default),
  so a model failing at its backoff cadence stays one Event whose count climbs; client-go's
  own series end after 6 minutes of quiet, which, once the backoff passes 6 minutes, would
  make every attempt a new Event.
* **A token bucket per node**: 25 Events at once, then one every 5 minutes (client-go's
  spam-filter defaults for one source and object). A cold start needs one per model plus two
  (warming started, gate opened), so a cold start of up to 23 models tells its whole story;
  a node stuck in a loop costs the API server at most 12 writes an hour. Creates and
  series PATCHes both take a token; what finds the bucket empty is dropped and counted in
  ``model_prefetch_events_dropped_total{reason="rate_limited"}`` (a dropped PATCH loses
  nothing: the next one carries the whole count).

Sending never blocks or breaks the agent: :meth:`EventRecorder.emit` only logs, updates the
series table and puts a work item on a bounded queue (full: dropped, counted as
``queue_full``); one daemon thread talks to the API server, and its errors are logged and
counted in ``model_prefetch_event_errors_total``, never raised.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from prefetch.agent.event_log import log_event
from prefetch.agent.events import NodeEvent
from prefetch.agent.metrics import AgentMetrics
from prefetch.support.logjson import scrub

# Its lines keep the logger name they have always had, so log queries keep matching.
log = logging.getLogger("prefetch.agent.events")

__all__ = [
    "BURST",
    "EVENT_NAMESPACE",
    "REFILL_SECONDS",
    "REPORTING_CONTROLLER",
    "SERIES_WINDOW",
    "EventRecorder",
    "EventSink",
    "TokenBucket",
]

#: ``reportingController`` of every Event (a qualified name, as the API server requires).
REPORTING_CONTROLLER = "model-prefetch.io/agent"
#: Where Events about the (cluster-scoped) Node live, as the kubelet's do.
EVENT_NAMESPACE = "default"
#: An occurrence this long after the previous one of its series starts a new Event.
SERIES_WINDOW = 30 * 60.0
#: The token bucket: this many Events at once ...
BURST = 25
#: ... then one more every this many seconds.
REFILL_SECONDS = 5 * 60.0
#: Work items waiting for the sender thread; more are dropped (and counted).
QUEUE_SIZE = 100
#: Longest note (``note``) and ``reportingInstance`` the API server accepts.
NOTE_LIMIT = 1024
INSTANCE_LIMIT = 128


class EventSink(Protocol):
    """Where Event objects go (:class:`KubeEventSink`; tests point it at a stub)."""

    @property
    def node_name(self) -> str: ...

    def node_uid(self) -> str | None:
        """The Node's uid, or None when it cannot be read."""
        ...

    def create(self, namespace: str, body: Mapping[str, object]) -> None: ...

    def patch(self, namespace: str, name: str, body: Mapping[str, object]) -> bool:
        """Merge-patch the Event; False when it no longer exists (its TTL passed)."""
        ...


class TokenBucket:
    """``burst`` tokens, refilled at one per ``refill_seconds``; thread-safe under the caller's
    lock (the recorder holds its own)."""

    def __init__(self, burst: int, refill_seconds: float, clock: Callable[[], float]) -> None:
        self._burst = float(burst)
        self._rate = 1.0 / refill_seconds if refill_seconds > 0 else float("inf")
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


@dataclass
class _Series:
    """One Event on the server (or on its way there) and the occurrences it stands for."""

    event: NodeEvent
    first: float  # wall time of the first occurrence
    last: float  # wall time of the latest
    seen: float  # clock() of the latest, for the window
    count: int = 1
    name: str | None = None  # the Event's name once created
    queued: bool = False  # a work item for it waits in the queue


class EventRecorder:
    """Logs every :class:`NodeEvent` as a JSON line and, with a sink, sends it as an Event.

    :meth:`emit` is safe from any thread and never blocks or raises. ``clock`` (monotonic)
    drives the series window and the token bucket; ``wall`` the times written into the Events.
    """

    def __init__(
        self,
        metrics: AgentMetrics,
        sink: EventSink | None = None,
        *,
        burst: int = BURST,
        refill_seconds: float = REFILL_SECONDS,
        series_window: float = SERIES_WINDOW,
        queue_size: int = QUEUE_SIZE,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._metrics = metrics
        self._sink = sink
        #: In every log line; outside a cluster (no sink) there is no node to name.
        self.node_name = sink.node_name if sink is not None else None
        self._window = series_window
        self._clock = clock
        self._wall = wall
        self._bucket = TokenBucket(burst, refill_seconds, clock)
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str, str], _Series] = {}
        self._queue: queue.Queue[tuple[str, tuple[str, str, str]] | None] = queue.Queue(queue_size)
        self._thread: threading.Thread | None = None
        self._uid: str | None = None
        self._last_name_ns = 0

    def emit(self, event: NodeEvent) -> None:
        """Log ``event`` now; queue its Event (a create, or a PATCH of its series)."""
        try:
            log_event(event, self.node_name)
            if self._sink is not None:
                self._record(event)
        except Exception:  # the story must never break the agent
            log.exception("could not record event %s", event.reason.value)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued Event was sent (or failed); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for at most ``timeout``), then stop the sender thread."""
        thread = self._thread
        if thread is None:
            return
        self.flush(timeout)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            return  # the daemon thread dies with the process
        thread.join(timeout)
        self._thread = None

    # -- on the caller's thread ---------------------------------------------------------------

    def _record(self, event: NodeEvent) -> None:
        key = (event.reason.value, event.action, event.key)
        now, wall = self._clock(), self._wall()
        with self._lock:
            series = self._series.get(key)
            if series is not None and now - series.seen <= self._window:
                series.count += 1
                series.last, series.seen = wall, now
                if series.queued:
                    return  # the queued create or PATCH sends the new count
                work = "patch"
            else:
                series = _Series(event, first=wall, last=wall, seen=now)
                self._series[key] = series
                work = "create"
            self._expire(now)
            if not self._bucket.take():
                self._drop(key, series, "rate_limited")
                return
            try:
                self._queue.put_nowait((work, key))
            except queue.Full:
                self._drop(key, series, "queue_full")
                return
            series.queued = True
            self._start_sender()

    def _drop(self, key: tuple[str, str, str], series: _Series, why: str) -> None:
        """(Lock held.) A dropped create forgets its series: the next occurrence tries again.
        A dropped PATCH keeps it: the next PATCH carries the whole count."""
        self._metrics.events_dropped.labels(why).inc()
        if series.name is None:
            self._series.pop(key, None)

    def _expire(self, now: float) -> None:
        """(Lock held.) Forget series whose window has passed, keeping the table small."""
        stale = [
            k
            for k, s in self._series.items()
            if now - s.seen > self._window and not s.queued and s.name is not None
        ]
        for k in stale:
            del self._series[k]

    def _start_sender(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, name="prefetch-events")
            self._thread.daemon = True
            self._thread.start()

    # -- on the sender thread -----------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._send(*item)
            except Exception as exc:  # logged and counted, never raised
                self._metrics.event_errors.inc()
                log.warning(
                    "could not write a Kubernetes Event (%s): %s",
                    item[1][0] if item else "?",
                    scrub(f"{type(exc).__name__}: {exc}"),
                    extra={"phase": "events", "error": scrub(str(exc))},
                )
                if item is not None:
                    self._forget_uncreated(item[1])
            finally:
                self._queue.task_done()

    def _send(self, work: str, key: tuple[str, str, str]) -> None:
        sink = self._sink
        assert sink is not None
        with self._lock:
            series = self._series.get(key)
            if series is None:
                return
            series.queued = False
            name = series.name
            count, first, last = series.count, series.first, series.last
        if name is not None:
            patch = {"series": {"count": count, "lastObservedTime": _micro_time(last)}}
            if sink.patch(EVENT_NAMESPACE, name, patch):
                return
            # the Event expired (the API server's event TTL): tell the series again, anew
        name = self._new_name()
        body = self._body(series.event, name, first, count, last)
        sink.create(EVENT_NAMESPACE, body)
        with self._lock:
            series.name = name

    def _forget_uncreated(self, key: tuple[str, str, str]) -> None:
        with self._lock:
            series = self._series.get(key)
            if series is not None and series.name is None and not series.queued:
                del self._series[key]

    def _body(
        self, event: NodeEvent, name: str, first: float, count: int, last: float
    ) -> dict[str, object]:
        sink = self._sink
        assert sink is not None
        if self._uid is None:
            # the kubelet's convention when the uid is unknown; kubectl describe finds both
            self._uid = sink.node_uid() or sink.node_name
        body: dict[str, object] = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": EVENT_NAMESPACE},
            "eventTime": _micro_time(first),
            "reportingController": REPORTING_CONTROLLER,
            "reportingInstance": sink.node_name[:INSTANCE_LIMIT],
            "action": event.action,
            "reason": event.reason.value,
            "type": event.type,
            "note": _truncate(scrub(event.note), NOTE_LIMIT),
            "regarding": {
                "apiVersion": "v1",
                "kind": "Node",
                "name": sink.node_name,
                "uid": self._uid,
            },
        }
        if count > 1:
            body["series"] = {"count": count, "lastObservedTime": _micro_time(last)}
        return body

    def _new_name(self) -> str:
        """``<node>.<hex nanoseconds>``, as client-go names Events; strictly increasing."""
        assert self._sink is not None
        ns = max(time.time_ns(), self._last_name_ns + 1)
        self._last_name_ns = ns
        return f"{self._sink.node_name}.{ns:x}"


def _micro_time(ts: float) -> str:
    """A ``metav1.MicroTime``: RFC 3339 UTC with microseconds."""
    whole = int(ts)
    micros = round((ts - whole) * 1_000_000)
    if micros == 1_000_000:
        whole, micros = whole + 1, 0
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{micros:06d}Z"


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
