"""The warming episode's story: one WarmingStarted Event per episode, told once the sizes of
the models warming are known (see :class:`WarmingStory`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prefetch.agent.events import warming_started

if TYPE_CHECKING:
    from prefetch.agent.event_recorder import EventRecorder

__all__ = ["RESOLVE_WAIT", "WarmingStory"]

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
