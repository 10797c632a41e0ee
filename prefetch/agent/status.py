"""What ``/readyz`` shows, built from the scheduler's model table.

Owns the body's shape: overall readiness (a config is loaded and every required model is
ready), a one-line summary, and per model its phase, what is missing and why (bytes and files
left while it downloads, the backoff after a failure), plus the config's and the node gate's
last errors. Reading only: it never changes a model's state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from prefetch.agent.scheduler import ModelPhase, ModelState
from prefetch.support.units import format_bytes, iso_utc

#: A JSON object as served (the /readyz body and its parts).
JsonObject = dict[str, object]


class ModelStatus(TypedDict):
    """One model's entry in the /readyz body."""

    name: str
    source: str
    required: bool
    pinned: bool
    state: str
    ready: bool
    detail: str
    revision: str | None
    bytes_total: int | None
    bytes_remaining: int | None
    files_remaining: int | None
    last_error: str | None
    error_reason: str | None
    failures: int
    last_success: str | None
    last_sync: JsonObject | None
    warm: JsonObject | None
    nothing_published: bool


@dataclass(frozen=True)
class AgentFacts:
    """What the body says beside the models: the config and the node gate."""

    config_path: Path | None
    config_digest: str
    config_loaded: bool
    config_error: str | None
    gate_enabled: bool
    gate_error: str | None
    #: Seconds to the first all-required-ready, by what they count from (see ready_clock).
    time_to_ready: Mapping[str, float] = field(default_factory=dict)
    progress_error: str | None = None


def readiness_body(models: list[ModelState], facts: AgentFacts, now: float) -> JsonObject:
    """The /readyz body; ``models`` in config order, ``now`` on the monotonic clock."""
    shown = [model_status(ms, now) for ms in models]
    missing = [m["name"] for m in shown if m["required"] and not m["ready"]]
    ready = facts.config_loaded and not missing
    if ready:
        summary = "all required models are ready"
    elif missing:
        summary = f"waiting for {len(missing)} required model(s): {', '.join(missing)}"
    else:
        summary = "starting"
    return {
        "ready": ready,
        "summary": summary,
        "models": shown,
        "config": {
            "path": str(facts.config_path) if facts.config_path else None,
            "digest": facts.config_digest[:12] or None,
            "last_reload_error": facts.config_error,
        },
        "gate": {
            "enabled": facts.gate_enabled,
            "last_error": facts.gate_error,
            "progress_annotation_error": facts.progress_error,
        },
        "time_to_ready": {
            "agent_start": facts.time_to_ready.get("agent_start"),
            "node_creation": facts.time_to_ready.get("node_creation"),
        },
    }


def model_status(ms: ModelState, now: float) -> ModelStatus:
    """One model's entry in the /readyz body."""
    sink = ms.sink
    remaining: int | None
    files_left: int | None
    if sink is not None and ms.syncing:
        remaining = sink.remaining
        files_left = max(sink.files_total - sink.files_done, 0)
    else:
        remaining = 0 if ms.ready else None
        files_left = 0 if ms.ready else None
    return {
        "name": ms.spec.name,
        # the source that served the last sync (a mirror or the Hub), else the model's own
        "source": ms.served_by or str(ms.spec.source),
        "required": ms.spec.required,
        "pinned": ms.spec.pin,
        "state": ms.phase.value,
        "ready": ms.ready,
        "detail": _detail(ms, now, remaining, files_left),
        "revision": ms.revision,
        "bytes_total": ms.bytes_total
        if ms.bytes_total is not None or sink is None or not sink.total
        else sink.total,
        "bytes_remaining": remaining,
        "files_remaining": files_left,
        "last_error": ms.last_error,
        "error_reason": ms.error_reason,
        "failures": ms.failures,
        "last_success": iso_utc(ms.last_success),
        "last_sync": _last_sync(ms),
        "warm": _warm(ms),
        "nothing_published": ms.nothing_published,
    }


def _warm(ms: ModelState) -> JsonObject | None:
    """The page-cache warm-up (``warmPageCache``): running, or how the last one went."""
    if ms.warming:
        return {"state": "warming"}
    return ms.warm.to_json() if ms.warm is not None else None


def _last_sync(ms: ModelState) -> JsonObject | None:
    """How long the last sync that changed the cache took, and where the time went."""
    result = ms.last_change
    if result is None:
        return None
    return {
        "revision": result.revision,
        "seconds": result.seconds,
        "bytes_downloaded": result.bytes_downloaded,
        "phases": {**result.timings.to_json(), **_warm_phase(ms, result.revision)},
    }


def _warm_phase(ms: ModelState, revision: str) -> dict[str, float]:
    """The ``warm`` phase of the sync that fetched ``revision``, once its warm-up ran."""
    if ms.warm is None or ms.warmed_revision != revision:
        return {}
    return {"warm": round(ms.warm.seconds, 3)}


def _detail(ms: ModelState, now: float, remaining: int | None, files_left: int | None) -> str:
    """What a person reading /readyz wants to know about the model, in one line."""
    sink = ms.sink
    if ms.ready and ms.nothing_published and not ms.last_error:
        return "no compile cache published for this key yet (vLLM compiles from scratch)"
    if ms.ready:
        detail = "verified copy in the cache"
        if ms.phase is ModelPhase.UPDATING:
            detail += f"; updating: {format_bytes(remaining or 0)} to fetch"
        elif ms.warming:
            detail += "; warming the page cache"
        elif ms.last_error:
            detail += f"; last refresh failed: {ms.last_error}"
        return detail
    if ms.warming:
        return "warming the page cache (gateOnWarm)"
    if ms.phase is ModelPhase.SYNCING:
        if remaining is not None and sink is not None and sink.total:
            detail = f"downloading: {format_bytes(remaining)} left in {files_left} file(s)"
        else:
            detail = "resolving the source"
        if ms.failures and ms.error_reason:  # a retry: why the last attempt did not finish
            detail += f"; attempt {ms.failures + 1}, the last failed ({ms.error_reason})"
        return detail
    if ms.phase is ModelPhase.FAILED:
        wait = math.ceil(max(ms.next_attempt - now, 0.0))
        when = f"next try in {wait}s" if wait else "retrying now"
        return f"failed ({ms.error_reason}): {ms.last_error}; {when}"
    if ms.phase is ModelPhase.VERIFYING:
        return "re-verifying cached files"
    return "not synced yet"
