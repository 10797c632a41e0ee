"""Retry with exponential backoff and full jitter, for TransientSourceError only (deadlines:
:mod:`prefetch.deadline`)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from prefetch.errors import ConfigError, TransientSourceError

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
    (``prefetch.transfer.retry_read``), the node gate's GET/PATCH rounds, the agent's per-model
    backoff after a failed sync and the gate driver's wait after a failed apply.

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
    return TransientSourceError(
        f"{what}: giving up after {attempts} attempts: {detail}", hint=exc.hint
    )


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
