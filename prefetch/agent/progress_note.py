"""The progress annotation: one compact JSON document on the agent's Node, for ``prefetch status``.

The annotation (:data:`~prefetch.support.constants.PROGRESS_ANNOTATION`) says, per configured model,
its phase, bytes done and total of the current sync, the download rate and an ETA, plus when it was
written and whether every required model is ready::

    {"v":1,"at":"2026-12-03T18:10:00Z","ready":false,"prefix":"model-prefetch.io",
     "taint":"model-prefetch.io/warming","models":[{"name":"llama","phase":"syncing",
     "done":1073741824,"total":16060522496,"rate":52428800,"eta":286}]}

**The write rule** (:class:`WriteLimiter`): never two writes less than ``PROGRESS_INTERVAL``
(30 s) apart. A write is due when what the note *says* changed since the last successful write
(a model's phase, or all-ready: so warming start and all ready go out as soon as the interval
allows), or, while bytes are moving, once per interval to refresh the numbers. In the steady
state (everything ready, nothing fetching) nothing is written, also while a model keeps failing
(its retries show ``failed`` until one fetches a byte: see :func:`shown_phase`). A failed write
counts against the interval like a successful one (a struggling API server gets at most one try
per interval) but leaves the change due, so it is tried again. The cost of that at 1,000 nodes
is worked out in docs/operations.md.

Phases in the note are the scheduler's, except that a ready model being re-verified, or checked
against its source with nothing to fetch, shows ``ready``: those periodic checks would otherwise
make two writes per model per ``resolveInterval`` on every node, for nothing an operator needs.

The PATCH itself is :class:`NodeAnnotator`'s (the node gate, :meth:`NodeGate.annotate`): one
merge patch, no GET, run in a worker thread from a background task, so it never blocks the loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import NotRequired, Protocol, TypedDict, runtime_checkable

from prefetch.agent.config_values import AgentConfig
from prefetch.agent.metrics import AgentMetrics
from prefetch.agent.scheduler import ModelPhase, ModelState, Scheduler
from prefetch.support.constants import PROGRESS_ANNOTATION, PROGRESS_INTERVAL
from prefetch.support.logjson import scrub
from prefetch.support.units import iso_utc

log = logging.getLogger(__name__)

#: The note's format version (``"v"``); ``prefetch status`` refuses notes it does not know.
NOTE_VERSION = 1
#: Phases during which bytes move and the numbers are refreshed every interval.
_MOVING = frozenset({"syncing", "updating"})


class ModelNote(TypedDict):
    """One model in the note (see :func:`model_note`)."""

    name: str
    phase: str
    done: NotRequired[int | None]
    total: NotRequired[int | None]
    rate: NotRequired[int]
    eta: NotRequired[int | None]
    reason: NotRequired[str]
    warm: NotRequired[str]
    cache: NotRequired[str]


class Note(TypedDict):
    """The annotation's JSON (see :func:`build_note`)."""

    v: int
    at: str | None
    ready: bool
    prefix: str
    taint: str
    models: list[ModelNote]


#: What counts as a change that matters: each model's shown phase, warm-up and compile cache
#: state, and all-ready.
Shape = tuple[tuple[tuple[str, str, str, str], ...], bool]


@runtime_checkable
class NodeAnnotator(Protocol):
    """Sets one annotation on the agent's node (:class:`~prefetch.agent.node.NodeGate` does)."""

    def annotate(self, key: str, value: str) -> None: ...


def shown_phase(ms: ModelState) -> str:
    """The phase the note shows: the scheduler's, but ``ready`` for a ready model that is only
    being re-verified or checked against its source (nothing to fetch), and ``failed`` for a
    failed model's retry until it fetches a byte (a model that keeps failing, say an optional
    one on a ready node, changes nothing in the note at each retry: nothing is written)."""
    if ms.phase is ModelPhase.SYNCING and ms.last_error is not None and not retry_moved(ms):
        return "failed"
    if ms.ready and ms.phase is ModelPhase.VERIFYING:
        return "ready"
    if ms.ready and ms.phase is ModelPhase.UPDATING and not (ms.sink and ms.sink.total):
        return "ready"
    return ms.phase.value


def retry_moved(ms: ModelState) -> bool:
    """Has the running sync fetched any byte?"""
    return ms.sink is not None and ms.sink.done > 0


def warm_state(ms: ModelState) -> str | None:
    """The page-cache warm-up: ``warming`` now, else how the last one ended (warm, skipped,
    stopped, failed); None for a model that never warmed (no ``warmPageCache``)."""
    if ms.warming:
        return "warming"
    return ms.warm.state if ms.warm is not None else None


def cache_state(ms: ModelState) -> str:
    """A compile cache entry's state on this node: ``pushed`` (this node published its key),
    ``published-elsewhere`` (another writer won it), ``none`` (nothing published for the key
    yet), ``pulled`` (the published cache is here), else its sync phase's ``pending``."""
    if ms.cache_push is not None:
        return ms.cache_push
    if ms.nothing_published:
        return "none"
    return "pulled" if ms.ready else "pending"


def model_note(ms: ModelState, rate: float, *, compile_cache: bool = False) -> ModelNote:
    """One model's entry: phase, bytes done/total of the current sync (of the model when it is
    ready), rate in bytes/s, ETA in seconds (None while unknown); the warm-up state when it has
    one, and, for a compile cache entry, its :func:`cache_state`."""
    phase = shown_phase(ms)
    entry: ModelNote = {"name": ms.spec.name, "phase": phase}
    sink = ms.sink
    if phase in _MOVING and sink is not None and ms.syncing:
        total = sink.total or None
        done = min(sink.done, sink.total) if total else sink.done
        remaining = max(sink.total - sink.done, 0)
        entry["done"] = done
        entry["total"] = total
        entry["rate"] = round(rate)
        entry["eta"] = math.ceil(remaining / rate) if total and rate > 0 else None
    elif ms.ready:
        entry["done"] = entry["total"] = ms.bytes_total
    if phase in ("failed", "syncing") and ms.error_reason:  # syncing: a retry, and why
        entry["reason"] = ms.error_reason
    if (warm := warm_state(ms)) is not None:
        entry["warm"] = warm
    if compile_cache:
        entry["cache"] = cache_state(ms)
    return entry


def build_note(
    models: Sequence[ModelState],
    rate: Callable[[str], float],
    *,
    all_ready: bool,
    prefix: str,
    taint: str,
    now: float,
    compile_caches: frozenset[str] = frozenset(),
) -> Note:
    """The whole note; ``now`` is Unix time, ``rate(model)`` bytes/s; ``compile_caches`` the
    names of the ``compileCaches`` entries."""
    return {
        "v": NOTE_VERSION,
        "at": iso_utc(now),
        "ready": all_ready,
        "prefix": prefix,
        "taint": taint,
        "models": [
            model_note(ms, rate(ms.spec.name), compile_cache=ms.spec.name in compile_caches)
            for ms in models
        ],
    }


def agent_note(scheduler: Scheduler, rate: Callable[[str], float], config: AgentConfig) -> Note:
    """The note for the agent's models now, under ``config`` (its gate and compile caches)."""
    return build_note(
        scheduler.states(),
        rate,
        all_ready=scheduler.all_required_ready(),
        prefix=config.label_prefix,
        taint=config.startup_taint,
        now=time.time(),
        compile_caches=frozenset(name for name, _key in config.compile_caches),
    )


def note_shape(note: Note) -> Shape:
    shown = tuple(
        (m["name"], m["phase"], m.get("warm", ""), m.get("cache", "")) for m in note["models"]
    )
    return shown, bool(note["ready"])


def moving(note: Note) -> bool:
    return any(m["phase"] in _MOVING for m in note["models"])


def encode(note: Note) -> str:
    """Compact JSON: the annotation is copied to every watcher of the Node, so bytes count."""
    return json.dumps(note, separators=(",", ":"))


class WriteLimiter:
    """Decides when the note is written (the rule is in the module docstring).

    ``clock`` is monotonic seconds; tests pass their own."""

    def __init__(
        self, interval: float = PROGRESS_INTERVAL, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self._clock = clock
        self._attempted = -math.inf
        self._written: Shape | None = None

    def due(self, shape: Shape, in_flight: bool) -> bool:
        if self._clock() - self._attempted < self.interval:
            return False
        return shape != self._written or in_flight

    def attempting(self) -> None:
        self._attempted = self._clock()

    def written(self, shape: Shape) -> None:
        self._written = shape


class ProgressReporter:
    """Writes the note when :class:`WriteLimiter` says so, through whatever annotator the node
    gate provides now (none outside a cluster: then nothing is written)."""

    def __init__(
        self,
        build: Callable[[], Note],
        annotator: Callable[[], object | None],
        metrics: AgentMetrics,
        limiter: WriteLimiter | None = None,
    ) -> None:
        self._build = build
        self._annotator = annotator
        self._metrics = metrics
        self.limiter = limiter or WriteLimiter()
        self.last_error: str | None = None

    async def maybe_write(self) -> None:
        """Write the note if it is due; on the loop, the PATCH in a worker thread."""
        annotator = self._annotator()
        if not isinstance(annotator, NodeAnnotator):
            return
        note = self._build()
        shape = note_shape(note)
        if not self.limiter.due(shape, moving(note)):
            return
        self.limiter.attempting()
        try:
            await asyncio.to_thread(annotator.annotate, PROGRESS_ANNOTATION, encode(note))
        except Exception as exc:
            self._metrics.progress_writes.labels("failed").inc()
            self.last_error = scrub(str(exc))
            log.warning(
                "could not write the progress annotation: %s",
                self.last_error,
                extra={"phase": "progress", "error": self.last_error},
            )
            return
        self._metrics.progress_writes.labels("ok").inc()
        self.limiter.written(shape)
        self.last_error = None
