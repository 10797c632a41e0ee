"""The node's story as Kubernetes Events (events.k8s.io/v1) and as JSON log lines.

``kubectl describe node`` and ``kubectl get events`` should tell an operator what the agent did
without reading its logs: warming started, each model ready (bytes, seconds, the source that
served it), the node gate opened, and what went wrong (a failed sync, a checksum failure, a
failed re-verification, an eviction). Every such :class:`NodeEvent` is also one JSON log line
with the same fields (``event``, ``model``, ``bytes``, ``seconds``, ``source``, ``node``), so a
log query finds what ``kubectl`` shows, and a line written inside a sync carries its ``sync_id``.

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
counted in ``model_prefetch_event_errors_total``, never raised. RBAC needed: ``events`` in API
group ``events.k8s.io``, verbs ``create`` and ``patch``, in namespace ``default`` only (a Role
there); the node GET for its uid is covered by the gate's ``nodes: get``.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from prefetch.agent.metrics import AgentMetrics
from prefetch.support import settings
from prefetch.support.logjson import scrub
from prefetch.support.units import format_bytes

if TYPE_CHECKING:
    from kubernetes import client as k8s_client

__all__ = [
    "BURST",
    "EVENT_NAMESPACE",
    "REFILL_SECONDS",
    "REPORTING_CONTROLLER",
    "SERIES_WINDOW",
    "EventRecorder",
    "EventSink",
    "KubeEventSink",
    "NodeEvent",
    "Reason",
    "TokenBucket",
    "WarmingStory",
    "checksum_failed",
    "compile_cache_already_published",
    "compile_cache_not_published",
    "compile_cache_pulled",
    "compile_cache_push_refused",
    "compile_cache_pushed",
    "evicted",
    "gate_opened",
    "in_cluster_events",
    "model_ready",
    "reverify_failed",
    "sync_failed",
    "warm_up_finished",
    "warm_up_started",
    "warming_started",
]

log = logging.getLogger(__name__)

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


class Reason(StrEnum):
    """The ``reason`` of every Event the agent writes (docs/operations.md: when each fires)."""

    WARMING_STARTED = "WarmingStarted"
    MODEL_READY = "ModelReady"
    NODE_GATE_OPENED = "NodeGateOpened"
    SYNC_FAILED = "SyncFailed"
    CHECKSUM_FAILED = "ChecksumFailed"
    REVERIFY_FAILED = "ReverifyFailed"
    EVICTED = "Evicted"
    WARM_UP_STARTED = "WarmUpStarted"
    WARM_UP_FINISHED = "WarmUpFinished"
    WARM_UP_SKIPPED = "WarmUpSkipped"
    COMPILE_CACHE_PULLED = "CompileCachePulled"
    COMPILE_CACHE_NOT_PUBLISHED = "CompileCacheNotPublished"
    COMPILE_CACHE_PUSHED = "CompileCachePushed"
    COMPILE_CACHE_ALREADY_PUBLISHED = "CompileCacheAlreadyPublished"
    COMPILE_CACHE_PUSH_REFUSED = "CompileCachePushRefused"


@dataclass(frozen=True)
class NodeEvent:
    """One thing that happened on the node, as an Event and a log line say it.

    ``key`` joins repeats into one series (with ``reason`` and ``action``): occurrences with the
    same three are the same story told again. The other fields go into the log line as they are.
    """

    reason: Reason
    action: str
    note: str
    warning: bool = False
    key: str = ""
    model: str | None = None
    bytes: int | None = None
    seconds: float | None = None
    source: str | None = None
    error: str | None = None

    @property
    def type(self) -> str:
        return "Warning" if self.warning else "Normal"


# -- the events, one builder each ------------------------------------------------------------------


def _size(n: int) -> str:
    return f"{format_bytes(n)} ({n} bytes)"


def warming_started(
    models: Sequence[str],
    total_bytes: int,
    to_fetch: int,
    unresolved: Sequence[str] = (),
    failed: Sequence[str] = (),
) -> NodeEvent:
    """The node starts fetching the models it lacks: ``total_bytes`` is their size and
    ``to_fetch`` what is not in the cache yet, over the models resolved so far (``unresolved``
    are the others: waiting for a sync slot, or slow to resolve; ``failed``: their sync ended
    before it resolved them). With no model resolved no size is given (never "0 B")."""
    pending = [m for m in unresolved if m not in failed]
    later = f"; sizes not resolved yet: {', '.join(pending)}" if pending else ""
    later += f"; failed before resolving: {', '.join(failed)}" if failed else ""
    if len(unresolved) >= len(models):
        return NodeEvent(
            Reason.WARMING_STARTED,
            "Warm",
            f"Warming {len(models)} model(s): {', '.join(models)}{later}",
        )
    return NodeEvent(
        Reason.WARMING_STARTED,
        "Warm",
        f"Warming {len(models)} model(s): {', '.join(models)}; {_size(total_bytes)} in total, "
        f"{_size(to_fetch)} to download{later}",
        bytes=total_bytes,
    )


def model_ready(
    model: str, *, bytes_total: int, downloaded: int, seconds: float, source: str, revision: str
) -> NodeEvent:
    seconds = round(seconds, 3)  # the note and the log line show the same number
    return NodeEvent(
        Reason.MODEL_READY,
        "Sync",
        f"Model {model} is ready: revision {revision[:12] or '-'}, {_size(bytes_total)}; "
        f"downloaded {_size(downloaded)} in {seconds:.1f}s from {source}",
        key=f"{model}@{revision}",  # a new revision is news; the same one again is a repeat
        model=model,
        bytes=bytes_total,
        seconds=seconds,
        source=source,
    )


def gate_opened(ready_models: Sequence[str], taint: str, *, taint_removed: bool) -> NodeEvent:
    """Every required model is ready and the node says so: ``ready_models`` (required or not)
    are labelled, and the startup taint is gone."""
    taint_part = (
        f"removed the startup taint {taint}"
        if taint_removed
        else f"the startup taint {taint} was not on the node"
    )
    return NodeEvent(
        Reason.NODE_GATE_OPENED,
        "OpenGate",
        f"All required models are ready: labelled {len(ready_models)} model(s) ready "
        f"({', '.join(ready_models) or 'none'}) and {taint_part}",
    )


def sync_failed(model: str, reason: str, message: str, *, source: str) -> NodeEvent:
    return NodeEvent(
        Reason.SYNC_FAILED,
        "Sync",
        f"Sync of model {model} from {source} failed ({reason}): {message}",
        warning=True,
        key=f"{model}/{reason}",
        model=model,
        source=source,
        error=message,
    )


def checksum_failed(model: str, detail: str, *, source: str, sync_failed: bool) -> NodeEvent:
    outcome = "the sync failed" if sync_failed else "re-fetched and verified"
    return NodeEvent(
        Reason.CHECKSUM_FAILED,
        "Verify",
        f"Model {model} from {source}: {detail}; {outcome}",
        warning=True,
        key=model,
        model=model,
        source=source,
        error=detail,
    )


def reverify_failed(model: str, detail: str) -> NodeEvent:
    return NodeEvent(
        Reason.REVERIFY_FAILED,
        "Verify",
        f"Re-verification of model {model} failed: {detail}; "
        "it left the ready set and is fetched again",
        warning=True,
        key=model,
        model=model,
        error=detail,
    )


def evicted(entry: str, freed: int, *, for_model: str) -> NodeEvent:
    return NodeEvent(
        Reason.EVICTED,
        "Evict",
        f"Evicted {entry} from the cache ({_size(freed)} freed) to make room for {for_model}",
        key=entry,
        model=entry,
        bytes=freed,
    )


def warm_up_started(model: str, bytes_total: int, *, revision: str) -> NodeEvent:
    """A ``warmPageCache`` model's page-cache warm-up begins (``bytes_total``: its files)."""
    return NodeEvent(
        Reason.WARM_UP_STARTED,
        "Warm",
        f"Reading model {model} (revision {revision[:12] or '-'}, {_size(bytes_total)}) "
        "into the page cache",
        key=f"{model}@{revision}",
        model=model,
        bytes=bytes_total,
    )


def warm_up_finished(
    model: str, state: str, *, bytes_read: int, seconds: float, reason: str, revision: str
) -> NodeEvent:
    """How a warm-up ended: ``warm`` (WarmUpFinished: bytes and seconds), or ``skipped`` /
    ``partial`` / ``failed`` (WarmUpSkipped, with why; a failure, or a warm-up whose pages did
    not all stay in the page cache, is a Warning)."""
    seconds = round(seconds, 3)
    if state == "warm":
        return NodeEvent(
            Reason.WARM_UP_FINISHED,
            "Warm",
            f"Model {model} is in the page cache: read {_size(bytes_read)} in {seconds:.1f}s",
            key=f"{model}@{revision}",
            model=model,
            bytes=bytes_read,
            seconds=seconds,
        )
    return NodeEvent(
        Reason.WARM_UP_SKIPPED,
        "Warm",
        f"Page-cache warm-up of model {model} {state}: {reason or state}",
        warning=state in ("failed", "partial"),
        key=f"{model}@{revision}/{state}",
        model=model,
        bytes=bytes_read,
        seconds=seconds,
        error=reason or None,
    )


def compile_cache_pulled(model: str, key: str, *, bytes_total: int, source: str) -> NodeEvent:
    """A ``compileCaches`` entry's published cache for ``key`` is in the node's cache."""
    return NodeEvent(
        Reason.COMPILE_CACHE_PULLED,
        "CompileCache",
        f"Compile cache {model} pulled for key {key}: {_size(bytes_total)} from {source}",
        key=f"{model}/{key}",
        model=model,
        bytes=bytes_total,
        source=source,
    )


def compile_cache_not_published(model: str, key: str, *, source: str) -> NodeEvent:
    """Nothing complete is published for ``key`` yet: vLLM compiles from scratch here."""
    return NodeEvent(
        Reason.COMPILE_CACHE_NOT_PUBLISHED,
        "CompileCache",
        f"Compile cache {model}: nothing published for key {key} yet at {source}; "
        "vLLM compiles from scratch on this node",
        key=f"{model}/{key}",
        model=model,
        source=source,
    )


def compile_cache_pushed(
    model: str, key: str, *, files: int, bytes_total: int, uri: str
) -> NodeEvent:
    """This node published the compile cache for ``key`` (it won the key)."""
    return NodeEvent(
        Reason.COMPILE_CACHE_PUSHED,
        "CompileCache",
        f"Compile cache {model} pushed for key {key}: {files} file(s), {_size(bytes_total)} "
        f"to {uri}",
        key=f"{model}/{key}",
        model=model,
        bytes=bytes_total,
        source=uri,
    )


def compile_cache_already_published(model: str, key: str, *, uri: str) -> NodeEvent:
    """Another writer published (or is publishing) ``key`` first; this node left it alone."""
    return NodeEvent(
        Reason.COMPILE_CACHE_ALREADY_PUBLISHED,
        "CompileCache",
        f"Compile cache {model}: key {key} already published at {uri} by another writer; "
        "not uploaded",
        key=f"{model}/{key}",
        model=model,
        source=uri,
    )


def compile_cache_push_refused(model: str, key: str, *, detail: str) -> NodeEvent:
    """The ``pushFrom`` directory holds what a cache must not (a symlink, a file swapped after
    its check): not published; looked at again with a growing interval."""
    return NodeEvent(
        Reason.COMPILE_CACHE_PUSH_REFUSED,
        "CompileCache",
        f"Compile cache {model}: push for key {key} refused: {detail}",
        warning=True,
        key=f"{model}/{key}",
        model=model,
        error=detail,
    )


#: The longest a sync that ended waits for the other syncs of its warming episode to resolve
#: (a resolve takes well under a second when the source answers).
RESOLVE_WAIT = 10.0


class WarmingStory:
    """Tells WarmingStarted once per warming episode, with the size of what is warming.

    On a cold node no model's size is known before its sync resolves it, moments after the sync
    starts. So the Agent opens the episode with :meth:`begin` (the models to warm, and which of
    them start syncing now), each of those syncs reports its plan (:meth:`planned`), and the
    Event goes out when all of them have (within the time a resolve takes). A sync of the
    episode that ends first (:meth:`settled`: it failed fast, or its model was small) waits,
    at most ``resolve_wait`` seconds, for the others to resolve before it goes on to tell its
    ModelReady or failure: so the Event always comes before the episode's first ModelReady,
    with every size that could be had, and names the models whose size it does not have
    (never a size it does not have). Thread-safe: syncs report from their worker threads.
    """

    def __init__(self, recorder: EventRecorder, *, resolve_wait: float = RESOLVE_WAIT) -> None:
        self._recorder = recorder
        self._resolve_wait = resolve_wait
        self._lock = threading.Lock()
        self._resolved = threading.Condition(self._lock)
        self._models: list[str] = []
        self._waiting: set[str] = set()
        self._sizes: dict[str, tuple[int, int]] = {}  # model -> (total, to fetch)
        self._failed: list[str] = []  # their sync ended before resolving them
        self._open = False

    def begin(self, models: Sequence[str], starting: Sequence[str], known: dict[str, int]) -> None:
        """A new episode: ``models`` lack a ready copy; ``starting`` start syncing now;
        ``known`` sizes come from the cache's records (a copy being repaired)."""
        with self._lock:
            self._models = list(models)
            self._waiting = set(starting)
            self._sizes = {m: (n, n) for m, n in known.items()}
            self._failed = []
            self._open = True
        self._maybe_tell()

    def planned(self, model: str, total: int, to_fetch: int) -> None:
        """A sync of ``model`` resolved its plan. A model of the open episode that was not
        starting at :meth:`begin` (it got a slot later, e.g. one a stalled sync gave up)
        counts too: its size is known, and it did not fail before resolving."""
        with self._lock:
            if not self._open or model not in self._models:
                return
            self._waiting.discard(model)
            self._sizes[model] = (total, to_fetch)
            self._resolved.notify_all()
        self._maybe_tell()

    def stalled(self, model: str) -> None:
        """``model``'s sync made no progress for ``stallTimeout`` (it gave up its slot): the
        others no longer wait for its size, which the Event names as not resolved. Told at the
        next plan or end of a sync (the model given the slot resolves first), not now."""
        with self._lock:
            self._waiting.discard(model)
            self._resolved.notify_all()

    def settled(self, model: str, stop: threading.Event | None = None) -> None:
        """A sync ended (any outcome). Before it tells how (its model's ModelReady comes
        next), wait for the episode's other starting syncs to resolve, at most
        ``resolve_wait`` seconds (less when ``stop`` is set), then tell with what is known."""
        give_up = time.monotonic() + self._resolve_wait
        with self._resolved:
            if self._open and model in self._models and model not in self._sizes:
                self._failed.append(model)
            self._waiting.discard(model)
            while self._open and self._waiting and not (stop is not None and stop.is_set()):
                left = give_up - time.monotonic()
                if left <= 0:
                    break
                self._resolved.wait(min(left, 0.2))
            self._waiting.clear()
        self._maybe_tell()

    def _maybe_tell(self) -> None:
        with self._lock:
            if not self._open or self._waiting:
                return
            self._open = False
            models, sizes, failed = self._models, dict(self._sizes), list(self._failed)
        unresolved = [m for m in models if m not in sizes]
        total = sum(t for t, _ in sizes.values())
        to_fetch = sum(f for _, f in sizes.values())
        self._recorder.emit(warming_started(models, total, to_fetch, unresolved, failed))


# -- sending ---------------------------------------------------------------------------------------


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
            self._log(event)
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

    def _log(self, event: NodeEvent) -> None:
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
                "node": self.node_name,
                "error": event.error,
            },
        )

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


# -- the Kubernetes API ----------------------------------------------------------------------------


class KubeEventSink:
    """Writes Events through the kubernetes client: ``EventsV1Api`` for the Events and
    ``CoreV1Api`` for one GET of the node (its uid). Requests are bounded by
    ``request_timeout``; answers are read to their end and not deserialized."""

    def __init__(
        self,
        events_api: k8s_client.EventsV1Api,
        core_api: k8s_client.CoreV1Api,
        node_name: str,
        *,
        request_timeout: float = 10.0,
    ) -> None:
        self._events = events_api
        self._core = core_api
        self._node_name = node_name
        self._timeout = request_timeout

    @property
    def node_name(self) -> str:
        return self._node_name

    def node_uid(self) -> str | None:
        try:
            resp = self._core.read_node(
                self._node_name, _preload_content=False, _request_timeout=self._timeout
            )
            try:
                node = json.loads(resp.data)
            finally:
                resp.release_conn()
            uid = node.get("metadata", {}).get("uid") if isinstance(node, dict) else None
            return str(uid) if uid else None
        except Exception as exc:
            log.info("events: cannot read node %s for its uid: %s", self._node_name, exc)
            return None

    def create(self, namespace: str, body: Mapping[str, object]) -> None:
        resp = self._events.create_namespaced_event(
            namespace, body, _preload_content=False, _request_timeout=self._timeout
        )
        _finish(resp)

    def patch(self, namespace: str, name: str, body: Mapping[str, object]) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = self._events.patch_namespaced_event(
                name,
                namespace,
                body,
                _content_type="application/merge-patch+json",
                _preload_content=False,
                _request_timeout=self._timeout,
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        _finish(resp)
        return True


class _PooledResponse(Protocol):
    """What the Kubernetes client returns with ``_preload_content=False`` (urllib3's response)."""

    def drain_conn(self) -> None: ...

    def release_conn(self) -> None: ...


def _finish(resp: _PooledResponse) -> None:
    """Read the answer to its end before its connection goes back to the pool."""
    try:
        resp.drain_conn()
    finally:
        resp.release_conn()


def in_cluster_events(node_name: str | None) -> KubeEventSink | None:
    """A :class:`KubeEventSink` with the pod's service account; None outside a cluster or
    without a node name (then events are only logged). Never raises: an agent that cannot
    send Events still syncs models."""
    if not settings.in_kubernetes() or not node_name:
        return None
    from kubernetes import client as k8s_client
    from kubernetes import config as k8s_config

    configuration = k8s_client.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except k8s_config.ConfigException as exc:
        log.warning("events off: the in-cluster Kubernetes config cannot be loaded: %s", exc)
        return None
    api_client = k8s_client.ApiClient(configuration)
    return KubeEventSink(
        k8s_client.EventsV1Api(api_client), k8s_client.CoreV1Api(api_client), node_name
    )
