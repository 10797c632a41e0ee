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

from prefetch.errors import TransientSourceError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6
    base_delay: float = 0.25
    max_delay: float = 20.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (attempt counts from 1)."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_delay * 3)
        cap = min(self.max_delay, self.base_delay * (2 ** (attempt - 1)))
        return random.uniform(cap / 2, cap)


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
            if attempt >= policy.attempts:
                raise TransientSourceError(
                    f"{what}: giving up after {attempt} attempts: {exc}"
                ) from exc
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
