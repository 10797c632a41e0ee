"""The one deadline mechanism: operations that another thread may abort, and alarms that do it.

* :class:`Alarms`: callbacks run at deadlines by one daemon thread (a heap, not a thread per
  alarm: a ``threading.Timer`` per small file cost ~7% of the CPU of 1000 small files); the
  thread ends when idle and starts again with the next alarm.
* :class:`Watch`: one operation (a ranged read, a small object's GET, a metadata call) that may
  be aborted from another thread. Whatever the operation is blocked on registers how to
  interrupt it (:meth:`Watch.attach`): the HTTP seam attaches the socket of the request in
  flight while it waits for the response headers and while the body is read, so an abort wakes
  a thread blocked in either at once (``shutdown(SHUT_RDWR)``, whatever the socket timeout).
  :func:`watching` makes a watch the calling thread's current one, which is how the seam finds
  it without every call passing it down.
* :class:`Watchdog`: the stall rule, the overall deadline and stop, applied every ``tick`` to
  the watches of one transfer (the pull engine, the mirror's part streamer).
* :func:`call_with_deadline`: run a call in the calling thread, aborted when ``seconds`` pass.

Why abort sockets instead of short socket timeouts: a timed-out socket file cannot be read
again (``SocketIO`` refuses after a timeout), and a timeout shorter than a healthy server's
pauses turns slow servers into errors; a shutdown from another thread wakes a blocked ``recv``
at once and leaves the healthy path free of polling.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

from prefetch.support.errors import PrefetchError, TransientSourceError
from prefetch.support.logjson import current_sync_id

log = logging.getLogger(__name__)
T = TypeVar("T")
#: Alarms in the heap (cancelled ones included) past which ``schedule`` drops the cancelled ones.
_COMPACT_AT = 1024


class Alarm:
    """A scheduled callback; :meth:`cancel` keeps it from running (if it has not yet)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn: Callable[[], None] | None = fn

    def cancel(self) -> None:
        self.fn = None


class Alarms:
    """Callbacks run at deadlines by one daemon thread. The thread ends after ``idle`` seconds
    with nothing scheduled (the agent makes a source per sync) and starts with the next alarm."""

    def __init__(self, idle: float = 30.0, name: str = "prefetch-alarms") -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Alarm]] = []
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._idle = idle
        self._name = name
        self._wakeups = 0
        self._compacted = 0  # heap size after the last compaction

    def schedule(self, delay: float, fn: Callable[[], None]) -> Alarm:
        """Run ``fn`` in ``delay`` seconds unless the returned alarm is cancelled first."""
        alarm = Alarm(fn)
        with self._cond:
            self._seq += 1
            if len(self._heap) >= _COMPACT_AT and len(self._heap) >= 2 * self._compacted:
                self._compact()
            entry = (time.monotonic() + delay, self._seq, alarm)
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif self._heap[0] is entry:
                # the thread sleeps until the earliest alarm: wake it only when that changed.
                # (Waking it for every alarm cost a thread switch and a GIL hand-off per small
                # file's GET: ~10% of the GIL-held time of 1000 small files, bench/README.md.)
                self._cond.notify()
        return alarm

    def _compact(self) -> None:
        """Drop cancelled alarms (the thread forgets one only when it reaches the heap's head,
        and it sleeps until then): the heap stays proportional to the alarms still pending."""
        self._heap = [e for e in self._heap if e[2].fn is not None]
        heapq.heapify(self._heap)
        self._compacted = len(self._heap)

    @property
    def wakeups(self) -> int:
        """How many times the alarm thread woke up (started, notified, or timed out)."""
        with self._cond:
            return self._wakeups

    @property
    def pending(self) -> int:
        """Alarms in the heap (cancelled ones the thread or a compaction has not dropped yet)."""
        with self._cond:
            return len(self._heap)

    @property
    def running(self) -> bool:
        with self._cond:
            return self._thread is not None

    def _run(self) -> None:
        with self._cond:
            self._wakeups += 1
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    if self._heap and self._heap[0][2].fn is None:
                        heapq.heappop(self._heap)  # cancelled: forget it now
                        continue
                    if not self._heap:
                        woken = self._cond.wait(self._idle)
                        self._wakeups += 1
                        if not woken and not self._heap:
                            self._thread = None  # idle: the next schedule starts another
                            return
                        continue
                    self._cond.wait(self._heap[0][0] - time.monotonic())
                    self._wakeups += 1
                _, _, alarm = heapq.heappop(self._heap)
            fn = alarm.fn
            if fn is not None:
                try:
                    fn()
                except Exception:  # an alarm's failure must not end the thread of all alarms
                    log.debug("an alarm failed", exc_info=True)


class Watch:
    """One operation that another thread may abort. ``received`` and the window marks serve the
    stall rule (:class:`Watchdog`); ``sync_id`` is the sync the operation runs for (the lines
    the aborting thread writes carry it)."""

    def __init__(self, what: str, now: float | None = None) -> None:
        self.what = what
        self.sync_id = current_sync_id()
        self.received = 0
        self.window_start = time.monotonic() if now is None else now
        self.window_mark = 0
        self.reason: PrefetchError | None = None
        self.stalls = True  #: does the stall rule apply (see Watchdog)?
        self._lock = threading.Lock()
        self._interrupts: list[Callable[[], None]] = []
        self._closed = False

    @property
    def aborted(self) -> bool:
        return self.reason is not None

    def attach(self, interrupt: Callable[[], None]) -> Callable[[], None]:
        """Register how to interrupt what the operation is blocked on now; returns the detach.
        On a watch already aborted, ``interrupt`` runs at once."""
        with self._lock:
            if self.reason is None:
                self._interrupts.append(interrupt)

                def detach() -> None:
                    with self._lock, contextlib.suppress(ValueError):
                        self._interrupts.remove(interrupt)

                return detach
        interrupt()
        return lambda: None

    def abort(self, reason: PrefetchError) -> None:
        """Abort the operation (once): the reason is what it raises, and whatever it is blocked
        on is interrupted now."""
        with self._lock:  # held while interrupting: after close() returns, nothing is
            if self.reason is not None or self._closed:
                return
            self.reason = reason
            interrupts, self._interrupts = self._interrupts, []
            log.debug("aborting %s: %s", self.what, reason, extra={"sync_id": self.sync_id})
            for interrupt in interrupts:
                with contextlib.suppress(Exception):
                    interrupt()

    def close(self) -> None:
        """The operation is over: an abort from now on does nothing (its sockets may be back
        in a pool, serving someone else)."""
        with self._lock:
            self._closed = True
            self._interrupts = []

    def raise_if_aborted(self) -> None:
        if self.reason is not None:
            raise self.reason


class _Current(threading.local):
    def __init__(self) -> None:
        self.watches: list[Watch] = []


class Scope:
    """The watches of the operations each thread runs now, innermost last (see
    :func:`watching`): a metadata call under its own deadline inside a resolve that a stop
    interrupts is watched by both. One per process is enough; a value so tests can make their
    own."""

    def __init__(self) -> None:
        self._local = _Current()

    def current(self) -> Watch | None:
        watches = self._local.watches
        return watches[-1] if watches else None

    def active(self) -> tuple[Watch, ...]:
        return tuple(self._local.watches)

    def attach(self, interrupt: Callable[[], None]) -> None:
        """Register ``interrupt`` with every watch of this thread (the HTTP seam: a socket)."""
        for watch in self._local.watches:
            watch.attach(interrupt)

    def raise_if_aborted(self) -> None:
        """Raise the reason of the outermost aborted watch of this thread, if any."""
        for watch in self._local.watches:
            watch.raise_if_aborted()

    @contextlib.contextmanager
    def watching(self, watch: Watch) -> Iterator[Watch]:
        self._local.watches.append(watch)
        try:
            yield watch
        finally:
            self._local.watches.remove(watch)


#: The process's scope: a thread-local stack, so no state is shared between threads.
SCOPE = Scope()
watching = SCOPE.watching
current_watch = SCOPE.current
attach_to_watches = SCOPE.attach


@contextlib.contextmanager
def stop_interrupts(
    stop: threading.Event | None,
    cancelled: Callable[[], PrefetchError],
    *,
    what: str = "stopped",
    alarms: Alarms | None = None,
    poll: float = 0.2,
) -> Iterator[None]:
    """Inside the block, a set ``stop`` interrupts what this thread waits for through the HTTP
    seam (a header wait, a body) within ``poll`` seconds, and the block raises ``cancelled()``:
    for the calls before a transfer's watchdog runs (a resolve). No-op when ``stop`` is None."""
    if stop is None:
        yield
        return
    own = alarms or Alarms(idle=1.0, name="prefetch-stop")
    watch = Watch(what)
    state: dict[str, Alarm] = {}

    def look() -> None:
        if stop.is_set():
            watch.abort(cancelled())
        else:
            state["alarm"] = own.schedule(poll, look)

    state["alarm"] = own.schedule(0.0, look)
    try:
        with watching(watch):
            try:
                yield
            except Exception:
                watch.raise_if_aborted()
                raise
        watch.raise_if_aborted()
    finally:
        state["alarm"].cancel()
        watch.close()


def call_with_deadline(
    fn: Callable[[], T],
    seconds: float,
    *,
    what: str,
    alarms: Alarms,
    expired: Callable[[], PrefetchError] | None = None,
) -> T:
    """Run ``fn`` in this thread under a watch that is aborted when ``seconds`` pass: the
    request in flight (its header wait or body) is interrupted through the HTTP seam, and the
    call raises TransientSourceError (or ``expired()``, when given). For calls made of several
    requests that must end in bounded time as a whole (metadata: redirects, then every page of
    a listing): a socket timeout bounds each wait, not the sum."""
    SCOPE.raise_if_aborted()  # an outer watch (a stop) already fired: do not start
    watch = Watch(what)

    def reason() -> PrefetchError:
        if expired is not None:
            return expired()
        return TransientSourceError(f"{what}: no answer within {seconds:g} s")

    alarm = alarms.schedule(seconds, lambda: watch.abort(reason()))
    try:
        with watching(watch):
            try:
                result = fn()
            except Exception:
                SCOPE.raise_if_aborted()  # a stop outside wins over this call's deadline
                raise
        watch.raise_if_aborted()
        return result
    finally:
        alarm.cancel()
        watch.close()


class StallRule(Protocol):
    """What the watchdog needs of a transfer's settings."""

    @property
    def min_rate(self) -> int: ...
    @property
    def stall_window(self) -> float: ...
    @property
    def deadline(self) -> float | None: ...


class Watchdog:
    """Enforces the stall rule, the deadline and stop on the operations in flight.

    Every ``tick`` seconds it looks at each watch: one that received fewer than ``min_rate *
    stall_window`` bytes since its window started is aborted with a TransientSourceError (the
    caller retries it from its last byte); otherwise its window starts again. Once ``stop`` is
    set (by the caller, or here when the deadline passes) every watch is aborted with
    ``cancelled()``. A watch is watched from before its request is sent, so a stop also
    interrupts a wait for response headers.
    """

    def __init__(
        self,
        config: StallRule,
        stop: threading.Event,
        *,
        cancelled: Callable[[], PrefetchError],
        alarms: Alarms | None = None,
    ) -> None:
        self._config = config
        self._stop = stop
        self._cancelled = cancelled
        self._alarms = alarms or Alarms(idle=1.0, name="prefetch-watchdog")
        self._lock = threading.Lock()
        self._watches: set[Watch] = set()
        self._alarm: Alarm | None = None
        self._deadline_at: float | None = None
        self.deadline_passed = False
        self.tick = min(0.5, config.stall_window / 4)

    def start(self) -> None:
        if self._config.deadline is not None:
            self._deadline_at = time.monotonic() + self._config.deadline
        with self._lock:
            self._alarm = self._alarms.schedule(self.tick, self._tick)

    def close(self) -> None:
        with self._lock:
            if self._alarm is not None:
                self._alarm.cancel()
                self._alarm = None

    def watch(self, what: str, *, stalls: bool = True) -> Watch:
        """A new watch, looked after until :meth:`unwatch`; aborted at once when stopping.
        ``stalls=False``: stop and the deadline only (a call whose bytes are not counted)."""
        w = Watch(what)
        w.stalls = stalls
        with self._lock:
            self._watches.add(w)
        if self._stop.is_set():
            w.abort(self._cancelled())
        return w

    def unwatch(self, w: Watch) -> None:
        """After this returns the watchdog never aborts ``w`` (so a reader that finished
        cleanly may hand its connection back to the pool)."""
        with self._lock:
            self._watches.discard(w)
        w.close()

    def _tick(self) -> None:
        self.check(time.monotonic())
        with self._lock:
            if self._alarm is not None:
                self._alarm = self._alarms.schedule(self.tick, self._tick)

    def check(self, now: float) -> None:
        """One look at every operation in flight (run every ``tick`` seconds)."""
        if self._deadline_at is not None and now >= self._deadline_at and not self._stop.is_set():
            self.deadline_passed = True
            self._stop.set()
        stopping = self._stop.is_set()
        cfg = self._config
        with self._lock:  # held while aborting: after unwatch() returns, never aborted
            for w in self._watches:
                if w.aborted:
                    continue
                if stopping:
                    w.abort(self._cancelled())
                    continue
                elapsed = now - w.window_start
                if not w.stalls or elapsed < cfg.stall_window:
                    continue
                got = w.received - w.window_mark
                if cfg.min_rate and got < cfg.min_rate * cfg.stall_window:
                    w.abort(TransientSourceError(
                        f"{w.what}: stalled: {got} bytes in the last {elapsed:.0f}s, below the "
                        f"minimum rate of {cfg.min_rate} bytes/s (--min-rate, --stall-timeout)"
                    ))  # fmt: skip
                else:
                    w.window_start, w.window_mark = now, w.received


__all__ = [
    "SCOPE",
    "Alarm",
    "Alarms",
    "Scope",
    "StallRule",
    "Watch",
    "Watchdog",
    "attach_to_watches",
    "call_with_deadline",
    "current_watch",
    "stop_interrupts",
    "watching",
]
