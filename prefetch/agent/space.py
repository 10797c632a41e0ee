"""Disk space for the agent's syncs: reservations, busy entries, and LRU eviction.

Owns the accounting that lets parallel syncs share one cache volume: a sync reserves the bytes
its plan still needs (so two syncs do not both count the same free space), marks its cache
entry busy (so it is never evicted under itself), and, when the space is short, evicts the
least-recently-used entries that are neither in the config nor pinned, through the
:class:`~prefetch.pipeline.store.Store`. When even that cannot make room it fails with a clear
reason and evicts nothing. It also records each ready model's use (the LRU order) and measures the
cache.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from prefetch.agent.event_recorder import EventRecorder
from prefetch.agent.events import evicted
from prefetch.agent.metrics import AgentMetrics, MetricsSink
from prefetch.pipeline.spec import ModelSpec
from prefetch.pipeline.store import Store
from prefetch.pipeline.sync import SPACE_MARGIN
from prefetch.support.errors import InsufficientSpaceError, LockTimeoutError
from prefetch.support.units import format_bytes, iso_utc

log = logging.getLogger(__name__)


@dataclass
class Reservation:
    """Disk space a running sync will still take (so parallel syncs do not both count it)."""

    needed: int
    sink: MetricsSink

    @property
    def remaining(self) -> int:
        return max(self.needed - self.sink.done, 0)


class SpaceManager:
    """Reservations and busy entries of running syncs, and eviction to make room (thread-safe:
    syncs call it from their worker threads)."""

    def __init__(
        self, store: Store, metrics: AgentMetrics, events: EventRecorder | None = None
    ) -> None:
        self.store = store
        self._metrics = metrics
        self._events = events
        self._lock = threading.Lock()
        self._reserved: dict[str, Reservation] = {}
        self._busy: dict[str, int] = {}

    @contextmanager
    def busy(self, spec: ModelSpec) -> Iterator[None]:
        """Mark the model's cache entry in use for the block: it is never an eviction candidate."""
        key = self.store.entry_key(spec)
        with self._lock:
            self._busy[key] = self._busy.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._busy[key] -= 1
                if not self._busy[key]:
                    del self._busy[key]

    @contextmanager
    def reserved(
        self,
        spec: ModelSpec,
        needed: int,
        *,
        wanted: Sequence[ModelSpec],
        min_free: int,
        sink: MetricsSink,
    ) -> Iterator[None]:
        """:meth:`make_room` for the block, and release the reservation after it."""
        try:
            self.make_room(spec, needed, wanted=wanted, min_free=min_free, sink=sink)
            yield
        finally:
            with self._lock:
                self._reserved.pop(spec.name, None)

    def make_room(
        self,
        spec: ModelSpec,
        needed: int,
        *,
        wanted: Sequence[ModelSpec],
        min_free: int,
        sink: MetricsSink,
    ) -> None:
        """Ensure ``needed`` bytes fit while keeping ``min_free`` (``minFreeSpace``) free,
        evicting LRU entries not in ``wanted`` and not pinned if that makes it fit; otherwise
        raise InsufficientSpaceError and evict nothing. Reserves ``needed`` on success."""
        if needed <= 0:
            return
        keep = max(min_free, SPACE_MARGIN)
        with self._lock:
            others = sum(r.remaining for k, r in self._reserved.items() if k != spec.name)
            free = self.store.free_bytes() - others
            if needed + keep > free:
                free = self._evict_for(spec, needed, keep, free, others, wanted)
            self._reserved[spec.name] = Reservation(needed, sink)

    def _evict_for(
        self,
        spec: ModelSpec,
        needed: int,
        keep: int,
        free: int,
        others: int,
        wanted: Sequence[ModelSpec],
    ) -> int:
        """Evict until ``needed + keep`` fits; returns the free bytes then (lock held)."""
        candidates = self.store.eviction_candidates(wanted, busy=set(self._busy))
        evictable = sum(c.size for c in candidates)
        if needed + keep > free + evictable:
            raise InsufficientSpaceError(
                f"{spec.name}: not enough disk space: needs {format_bytes(needed)} and keeps "
                f"{format_bytes(keep)} free (minFreeSpace), but {format_bytes(max(free, 0))} "
                f"is free and evicting all {len(candidates)} unwanted, unpinned model(s) "
                f"would free only {format_bytes(evictable)} more",
                hint="use a larger cache volume, drop models from the config, or unpin "
                "models no longer needed",
            )
        for entry in candidates:
            try:
                freed = self.store.evict(entry, lock_timeout=5.0)
            except LockTimeoutError:
                log.info("skipping eviction of %s: it is locked", entry.key)
                continue
            self._metrics.evictions.labels("disk_pressure").inc()
            self._metrics.evicted_bytes.labels("disk_pressure").inc(freed)
            log.info(
                "evicted %s (%s, last used %s) to make room for %s",
                entry.key,
                format_bytes(entry.size),
                iso_utc(entry.last_used),
                spec.name,
                extra={"model": spec.name, "phase": "evict", "bytes": freed},
            )
            if self._events is not None:
                self._events.emit(evicted(entry.name, freed, for_model=spec.name))
            free = self.store.free_bytes() - others
            if needed + keep <= free:
                return free
        raise InsufficientSpaceError(
            f"{spec.name}: not enough disk space even after evicting: needs "
            f"{format_bytes(needed)} and keeps {format_bytes(keep)} free, "
            f"{format_bytes(max(free, 0))} is free",
            hint="files held open by running pods free their space only when closed",
        )

    def record_usage(self, touch: Sequence[ModelSpec]) -> None:
        """Blocking: record "still wanted" on each cached entry of ``touch`` (it orders
        eviction), then measure the cache for the usage gauge."""
        for spec in touch:
            if self.store.entry_dir(spec).is_dir():
                try:
                    self.store.touch(spec)
                except OSError as exc:
                    log.warning("%s: cannot record its use: %s", spec.name, exc)
        try:
            used = sum(e.size for e in self.store.list())
        except OSError as exc:
            log.warning("cannot measure the cache: %s", exc)
            return
        self._metrics.cache_used.set(used)
