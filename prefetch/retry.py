"""Retry with exponential backoff and full jitter, for TransientSourceError only; and a wall-clock
deadline for calls that take no timeout of their own."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

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


def call_with_deadline(fn: Callable[[], T], seconds: float, *, what: str) -> T:
    """Run ``fn`` in a daemon thread and wait for it at most ``seconds``; past that, raise
    TransientSourceError (and leave the thread to finish or stay blocked on its own).

    For calls made of several requests that must end in bounded time as a whole (the Hub's
    metadata: redirects, then every page of a listing): a socket timeout bounds each wait, not
    the sum, so a server that answers slowly page after page, or trickles a body, would hang a
    resolve and the agent's sync of that model. The price, one parked thread per call that
    really hangs (until its socket times out), is paid only when the server misbehaves.
    """
    result: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            result["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="prefetch-deadline", daemon=True).start()
    if not done.wait(seconds):
        raise TransientSourceError(f"{what}: no answer within {seconds:g} s")
    if "error" in result:
        raise result["error"]
    return result["value"]  # type: ignore[no-any-return]
