"""The node's story: what the agent tells as Kubernetes Events (events.k8s.io/v1) and as JSON
log lines, one :class:`NodeEvent` per thing that happened, each made by its builder here.

``kubectl describe node`` and ``kubectl get events`` should tell an operator what the agent did
without reading its logs: warming started, each model ready (bytes, seconds, the source that
served it), the node gate opened, and what went wrong (a failed sync, a checksum failure, a
failed re-verification, an eviction). Every such :class:`NodeEvent` is also one JSON log line
with the same fields (``event``, ``model``, ``bytes``, ``seconds``, ``source``, ``node``), so a
log query finds what ``kubectl`` shows, and a line written inside a sync carries its ``sync_id``.

How they are sent (series, rate limits, the sender thread) is
:class:`~prefetch.agent.event_recorder.EventRecorder`'s business; the log line is
:func:`~prefetch.agent.event_log.log_event`'s; the Kubernetes API is
:mod:`prefetch.agent.kube_events`'s; the WarmingStarted episode is
:class:`~prefetch.agent.warming.WarmingStory`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from prefetch.support.units import format_bytes

__all__ = [
    "NodeEvent",
    "Reason",
    "checksum_failed",
    "compile_cache_already_published",
    "compile_cache_not_published",
    "compile_cache_pulled",
    "compile_cache_push_refused",
    "compile_cache_pushed",
    "evicted",
    "gate_opened",
    "model_ready",
    "reverify_failed",
    "sync_failed",
    "warm_up_finished",
    "warm_up_started",
    "warming_started",
]


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
