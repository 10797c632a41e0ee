"""Retry with exponential backoff and full jitter, for TransientSourceError only (deadlines:
:mod:`prefetch.pipeline.deadline`)."""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from prefetch.support.errors import ConfigError, TransientSourceError

log = logging.getLogger(__name__)
T = TypeVar("T")


def transient(exc: BaseException) -> bool:
    """What the sources' retry loops retry: a :class:`TransientSourceError` (a reset, a 5xx, a
    throttle, a stall); anything else is the caller's answer."""
    return isinstance(exc, TransientSourceError)


@dataclass(frozen=True)
class RetryPolicy:
    """The one retry policy: how many attempts, how long to wait between them, what is retried.

    The wait before attempt ``n + 1`` is drawn uniformly ("full jitter") from ``[min_delay,
    cap]``, where ``cap = min(max_delay, base_delay * 2**(n-1))``: clients that failed together
    spread out over the whole window instead of coming back in a pack. A server's Retry-After
    wins over the backoff (it knows when it will answer again), capped at ``max_retry_after``
    (default three times ``max_delay``) so a hostile value cannot park a worker for hours.
    ``retryable`` decides which errors are retried (default: TransientSourceError).

    Every retry loop uses it: :func:`call_with_retries`, the ranged reads
    (``prefetch.pipeline.engine.watched_read.retry_read``), the node gate's GET/PATCH rounds, the
    agent's per-model backoff after a failed sync and the gate driver's wait after a failed apply.

    Hand-written rather than tenacity: the loops that use it wait on a stop event (SIGTERM ends
    the wait at once and becomes Cancelled), resume from a byte position, sleep through an
    injected clock (tests) or do not loop at all (the scheduler and the gate driver only need
    the next delay); what they share is this arithmetic, a few lines, and the agent's start-up
    stays free of another import.
    """

    attempts: int = 6
    base_delay: float = 0.25
    max_delay: float = 20.0
    min_delay: float = 0.0
    max_retry_after: float | None = None
    retryable: Callable[[BaseException], bool] = transient

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"attempts: must be at least 1, got {self.attempts}")
        if min(self.base_delay, self.max_delay, self.min_delay) < 0:
            raise ConfigError("retry delays: must not be negative")

    def backoff(self, attempt: int) -> float:
        """The most the wait after failed attempt ``attempt`` (from 1) may be."""
        return min(self.max_delay, self.base_delay * 2.0 ** max(attempt - 1, 0))

    def delay(
        self,
        attempt: int,
        retry_after: float | None = None,
        *,
        uniform: Callable[[float, float], float] | None = None,
    ) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (attempt counts from 1); ``uniform``
        draws the jitter (default ``random.uniform``)."""
        if retry_after is not None and retry_after > 0:
            cap = self.max_retry_after if self.max_retry_after is not None else self.max_delay * 3
            return min(retry_after, cap)
        cap = self.backoff(attempt)
        return (uniform or random.uniform)(min(self.min_delay, cap), cap)

    def gives_up(self, attempt: int, exc: BaseException) -> bool:
        """After failed attempt ``attempt`` (from 1) with ``exc``: stop trying?"""
        return attempt >= self.attempts or not self.retryable(exc)


def gave_up(what: str, attempts: int, exc: TransientSourceError) -> TransientSourceError:
    """The error after the last of ``attempts`` failed with ``exc``: ``what`` once (the last
    error's own ``what:`` prefix is dropped), and its hint kept."""
    detail = str(exc).removeprefix(f"{what}: ")
    tries = "1 attempt" if attempts == 1 else f"{attempts} attempts"
    return TransientSourceError(f"{what}: giving up after {tries}: {detail}", hint=exc.hint)


def call_with_retries(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    what: str,
    on_retry: Callable[[TransientSourceError], None] | None = None,
    stop: threading.Event | None = None,
) -> T:
    """Run ``fn``; on TransientSourceError wait and try again, up to ``policy.attempts`` times."""
    attempt = 1
    while True:
        try:
            return fn()
        except TransientSourceError as exc:
            if policy.gives_up(attempt, exc):
                raise gave_up(what, attempt, exc) from exc
            wait = policy.delay(attempt, exc.retry_after)
            log.info("retrying %s in %.2fs (attempt %d): %s", what, wait, attempt + 1, exc)
            if on_retry is not None:
                on_retry(exc)
            if stop is not None:
                if stop.wait(wait):
                    raise
            else:
                time.sleep(wait)
            attempt += 1


class AdaptiveRate:
    """A client-side request rate for one server, shared by every thread that talks to it: not
    limited until the server first throttles, then a token bucket whose rate is cut at each
    throttle and grows back between them along the CUBIC curve (RFC 8312), as botocore's
    ``adaptive`` retry mode and the CRT client do. A throttled node so slows down as a whole,
    instead of each request retrying on its own schedule and multiplying the load.

    Hand-written rather than botocore's: botocore applies its limiter to requests its own
    client sends, while most of ours go out on the transport seam (urllib3) with no botocore
    loaded at all (a pull with static keys never imports it).

    :meth:`acquire` before each request (it returns the request's ticket), then
    :meth:`throttled` or :meth:`succeeded` with that ticket: the answers to requests sent before
    the last cut do not cut again (one burst of 503s is one signal, not one per request).
    """

    #: The CUBIC constant and multiplicative decrease (RFC 8312's C and beta, botocore's too).
    SCALE = 0.4
    BETA = 0.7
    #: Requests per second the rate is never cut below.
    MIN_RATE = 0.5
    #: Seconds over which the rate actually sent is measured.
    WINDOW = 1.0
    #: The longest single sleep of a waiting request (it checks ``abort`` in between).
    SLICE = 0.2

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._rate: float | None = None  # requests/s; None: not limited (never throttled)
        self._peak = 0.0  # the rate when last throttled (CUBIC's W_max)
        self._cut_at = float("-inf")
        self._tokens = 0.0
        self._filled_at = 0.0
        self._sent: collections.deque[float] = collections.deque()

    @property
    def rate(self) -> float | None:
        """Requests per second allowed now (None: not limited)."""
        with self._lock:
            return self._rate

    def acquire(self, abort: Callable[[], None] | None = None) -> float:
        """Wait for the turn of one request; its ticket (the time it may go). ``abort`` is
        called between waits and may raise (a stop, a deadline)."""
        while True:
            with self._lock:
                now = self._clock()
                wait = self._take(now)
                if wait <= 0:
                    self._sent.append(now)
                    self._sent_rate(now)  # forgets what left the window: bounded, never throttled
                    return now
            if abort is not None:
                abort()
            self._sleep(min(wait, self.SLICE))

    def _take(self, now: float) -> float:
        """Take a token (0) or say how long until there is one (under the lock)."""
        rate = self._rate
        if rate is None:
            return 0.0
        self._tokens = min(max(1.0, rate), self._tokens + (now - self._filled_at) * rate)
        self._filled_at = now
        if self._tokens >= 1.0 - 1e-9:  # float dust must not leave a request waiting
            self._tokens = max(0.0, self._tokens - 1.0)
            return 0.0
        return (1.0 - self._tokens) / rate

    def throttled(self, ticket: float) -> None:
        """The request of ``ticket`` was throttled: cut the rate to BETA of what was being
        sent (unless a cut came after the request went out)."""
        with self._lock:
            if ticket <= self._cut_at:
                return
            now = self._clock()
            sent = self._sent_rate(now)
            base = sent if self._rate is None else min(self._rate, sent)
            self._peak = base
            self._rate = max(self.MIN_RATE, base * self.BETA)
            self._cut_at = now
            self._tokens, self._filled_at = 0.0, now
        log.info("throttled: at most %.1f requests/s from now on", self._rate)

    def succeeded(self, ticket: float) -> None:
        """The request of ``ticket`` was not throttled: the rate grows back along the curve."""
        del ticket  # every answer that is not a throttle lets the rate grow, whenever sent
        with self._lock:
            if self._rate is None:
                return
            now = self._clock()
            since = now - self._cut_at
            k = (self._peak * (1 - self.BETA) / self.SCALE) ** (1 / 3)
            grown = self.SCALE * (since - k) ** 3 + self._peak
            # never above twice what is being sent: a rate nobody uses is no information
            ceiling = max(2.0 * self._sent_rate(now), self.MIN_RATE)
            self._rate = max(self.MIN_RATE, min(grown, ceiling))

    def _sent_rate(self, now: float) -> float:
        """Requests per second sent over the last WINDOW (at least one request)."""
        while self._sent and now - self._sent[0] > self.WINDOW:
            self._sent.popleft()
        return max(1.0, len(self._sent)) / self.WINDOW
