"""The model table in line with the config: each model the config names has a
:class:`~prefetch.agent.scheduler.ModelState` in the :class:`~prefetch.agent.scheduler.Scheduler`;
a new model starts from what the :class:`~prefetch.pipeline.store.Store` holds, a re-specced one
keeps its copy when its content is the same (and syncs again when it is not), a dropped one has its
job cancelled and its metrics forgotten. Each cached model's pin is written from the config at
once."""

from __future__ import annotations

import logging

from prefetch.agent.config import spec_digest
from prefetch.agent.config_values import AgentConfig
from prefetch.agent.metrics import AgentMetrics
from prefetch.agent.scheduler import ModelState, Scheduler
from prefetch.pipeline.spec import ModelSpec
from prefetch.pipeline.store import Store

# Its lines keep the logger name they have always had, so log queries keep matching.
log = logging.getLogger("prefetch.agent.loop")

__all__ = ["ModelTable", "cancel"]


class ModelTable:
    """Makes the scheduler's model table match a config (:meth:`apply`) and shows each model's
    phase in the metrics (:meth:`publish`)."""

    def __init__(self, scheduler: Scheduler, store: Store, metrics: AgentMetrics) -> None:
        self._scheduler = scheduler
        self._store = store
        self._metrics = metrics

    def apply(self, config: AgentConfig) -> None:
        """Make the model table match ``config``: add, drop (cancelling jobs), re-spec."""
        old_states = self._scheduler.table()
        new_states: dict[str, ModelState] = {}
        for index, spec in enumerate(config.models):
            digest = spec_digest(spec)
            ms = old_states.get(spec.name)
            if ms is not None and ms.digest == digest:
                _respec(ms, spec, index)
                new_states[spec.name] = ms
                continue
            if ms is not None:
                log.info(
                    "%s: its source or filters changed; syncing it again",
                    spec.name,
                    extra={"model": spec.name, "phase": "config"},
                )
                cancel(ms)
            new_states[spec.name] = self._new_state(spec, digest, index)
        for name, ms in old_states.items():
            if name not in new_states:
                log.info(
                    "%s: removed from the config; it may be evicted when space is needed",
                    name,
                    extra={"model": name, "phase": "config"},
                )
                cancel(ms)
                self._metrics.forget_model(name)
        self._scheduler.replace(new_states)
        self._record_pins(config)
        for ms in new_states.values():
            self.publish(ms)

    def publish(self, ms: ModelState) -> None:
        """Show a model's phase and readiness in the metrics."""
        self._metrics.set_state(
            ms.spec.name, ms.phase.value, ready=ms.ready, required=ms.spec.required
        )

    def _record_pins(self, config: AgentConfig) -> None:
        """Write each cached model's pin (or unpin) from ``config`` now: a pin changed on a model
        already in the cache starts no sync, and it must hold even if the model leaves the
        config before the next one."""
        for spec in config.models:
            try:
                if self._store.record_pin(spec):
                    log.info(
                        "%s: recorded %s",
                        spec.name,
                        "pinned" if spec.pin else "not pinned",
                        extra={"model": spec.name, "phase": "config"},
                    )
            except OSError as exc:
                log.warning("%s: cannot record its pin: %s", spec.name, exc)

    def _new_state(self, spec: ModelSpec, digest: str, index: int) -> ModelState:
        ms = ModelState(spec=spec, digest=digest, index=index)
        if self._store.copy_intact(spec, digest):
            rec = self._store.usage(spec)
            ms.found_copy(rec.get("revision"), rec.get("bytes"), rec.get("synced_at"))
            log.info(
                "%s: a verified copy is in the cache (revision %s); confirming it with the source",
                spec.name,
                ms.revision,
                extra={"model": spec.name, "phase": "start"},
            )
        return ms


def _respec(ms: ModelState, spec: ModelSpec, index: int) -> None:
    """The same content under a new spec: required/pin/sources may change without touching the
    copy; changed sources confirm it with them at once."""
    if ms.spec.fetch_route != spec.fetch_route:
        log.info(
            "%s: its sources changed; confirming the copy with them",
            spec.name,
            extra={"model": spec.name, "phase": "config"},
        )
        ms.reconfirm()
    ms.spec = spec
    ms.index = index


def cancel(ms: ModelState) -> None:
    """Set the stop event of the model's running job, if any."""
    if ms.job is not None:
        ms.job.stop.set()
