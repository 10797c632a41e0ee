"""Watched ranged reads: the one retry loop and the one read loop of every driver of ranged reads
(the pull engine, :mod:`prefetch.pipeline.engine.transfer`, and the mirror's part streamer).

A read runs under a watch of one :class:`prefetch.pipeline.deadline.Watchdog` that enforces the
stall rule (under ``min_rate`` bytes/s over ``stall_window``: retried from the last byte received),
the deadline and a stop. Why not short socket timeouts: a timed-out socket file cannot be read again
(``SocketIO`` refuses, http.client's buffer state is lost), and a timeout shorter than a healthy
server's pauses turns slow servers into errors; ``shutdown(SHUT_RDWR)`` from another thread wakes
a blocked ``recv`` at once, covers the wait for the headers too, and leaves the healthy path free
of polling. Reads ask for at most :func:`read_slice` bytes so the rule sees bytes as they arrive.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from prefetch.pipeline.deadline import StallRule, Watch, Watchdog, watching
from prefetch.pipeline.engine.config import ENGINE_LOGGER
from prefetch.pipeline.retry import RetryPolicy, gave_up
from prefetch.pipeline.snapshot import RemoteFile
from prefetch.sources.base import RangeReader
from prefetch.support.errors import Cancelled, PrefetchError, TransientSourceError

#: what a describe returns (the file described; with its bytes, for DescribesWhole)
Described = TypeVar("Described")

log = logging.getLogger(ENGINE_LOGGER)


class SliceRule(StallRule, Protocol):
    """What :func:`read_slice` needs of a transfer's settings."""

    @property
    def buffer_size(self) -> int: ...


def read_slice(config: SliceRule) -> int:
    """Most bytes one ``readinto`` asks for. A socket file's ``readinto`` returns only when the
    slice is full, so the stall rule sees a request's bytes a slice at a time. Slices of half
    what a window must deliver (at most the buffer) mean a request averaging 1.5 x ``min_rate``
    or more is never judged by a half-filled slice, while a trickle is caught in one window.
    Smaller slices cost throughput: with the defaults, 240 KiB slices instead of ~1 MiB made a
    2 GiB S3 pull 8% slower here (bench/run.py with ``--prefetch-variant`` ``--min-rate 0``)."""
    if not config.min_rate:
        return config.buffer_size
    wanted = int(config.min_rate * config.stall_window / 2)
    return max(16 * 1024, min(config.buffer_size, wanted))


@dataclass
class Filled:
    """How much of a view :func:`fill_watched` has filled; it stays right when the read fails,
    so the caller keeps what arrived and a retry starts after it."""

    pos: int = 0


def retry_read(
    read: Callable[[], None],
    *,
    policy: RetryPolicy,
    stop: threading.Event,
    what: str,
    position: Callable[[], int],
    on_retry: Callable[[TransientSourceError], None],
) -> None:
    """Run ``read`` (one ranged request that resumes from ``position()`` when called again)
    until it succeeds, retrying transient failures with the policy's backoff. The one retry loop
    of every driver of ranged reads (the pull engine, the mirror); unlike
    :func:`prefetch.pipeline.retry.call_with_retries` a stop during the wait is :class:`Cancelled`
    (the pull or mirror is resumable), not the transient error."""
    attempt = 1
    while True:
        if stop.is_set():
            raise Cancelled("stopped")
        try:
            read()
            return
        except TransientSourceError as exc:
            if policy.gives_up(attempt, exc):
                raise gave_up(what, attempt, exc) from exc
            on_retry(exc)
            delay = policy.delay(attempt, exc.retry_after)
            log.info("retrying %s at byte %d in %.2fs: %s", what, position(), delay, exc)
            if stop.wait(delay):
                raise Cancelled("stopped") from exc
            attempt += 1


def connection_closed(file: RemoteFile, start: int, filled: int) -> str:
    """The message for a body that ended ``filled`` bytes into a read starting at ``start``."""
    return f"{file.path}: connection closed at byte {start + filled} of {file.size}"


def engine_watchdog(config: StallRule, stop: threading.Event) -> Watchdog:
    """The stall/deadline/stop watchdog of a driver of ranged reads (the pull engine, the
    mirror's part streamer): a stop aborts each read with Cancelled."""
    return Watchdog(config, stop, cancelled=lambda: Cancelled("stopped"))


def open_watched(
    watchdog: Watchdog, what: str, open_range: Callable[[], RangeReader]
) -> tuple[RangeReader, Watch]:
    """Open a ranged read under a new watch of ``watchdog``: the wait for the response headers
    is watched too (the HTTP seam attaches the socket), so a stop, a stall or the deadline
    interrupts it; the reader's ``abort()`` (if any) is attached for the body."""
    watch = watchdog.watch(what)
    try:
        with watching(watch):
            reader = open_range()
    except Exception:
        watchdog.unwatch(watch)
        watch.raise_if_aborted()
        raise
    abort = getattr(reader, "abort", None)
    if abort is not None:
        watch.attach(abort)
    return reader, watch


def call_watched(
    watchdog: Watchdog, what: str, fn: Callable[[RemoteFile], Described], file: RemoteFile
) -> Described:
    """``fn(file)`` (a describe: a HEAD, or a small object's whole GET) under a new watch of
    ``watchdog``: a stop or the deadline interrupts its requests (the stall rule does not: its
    bytes are not counted)."""
    watch = watchdog.watch(f"describing {what}", stalls=False)
    try:
        with watching(watch):
            try:
                return fn(file)
            except Exception:
                watch.raise_if_aborted()
                raise
    finally:
        watchdog.unwatch(watch)


def fill_watched(
    reader: RangeReader,
    watch: Watch,
    view: memoryview,
    filled: Filled,
    *,
    slice_size: int,
    stop: threading.Event,
    closed: Callable[[int], str],
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Read ``reader`` into ``view[filled.pos:]`` until it is full, ``slice_size`` bytes per
    ``readinto`` so the watchdog sees bytes arrive. The one read loop of every driver of ranged
    reads (the pull engine, the mirror): a read the watchdog aborted (stop, stall, deadline)
    raises the watchdog's reason rather than whatever the reader said; a closed connection is
    a TransientSourceError with the message ``closed(filled.pos)``."""
    while filled.pos < len(view):
        if stop.is_set():
            raise Cancelled("stopped")
        try:
            n = reader.readinto(view[filled.pos : min(len(view), filled.pos + slice_size)])
        except PrefetchError:
            watch.raise_if_aborted()
            raise
        watch.raise_if_aborted()
        if n <= 0:
            raise TransientSourceError(closed(filled.pos))
        filled.pos += n
        watch.received += n
        if on_bytes is not None:
            on_bytes(n)


__all__ = [
    "Filled",
    "SliceRule",
    "call_watched",
    "connection_closed",
    "engine_watchdog",
    "fill_watched",
    "open_watched",
    "read_slice",
    "retry_read",
]
