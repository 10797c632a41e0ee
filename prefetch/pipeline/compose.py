"""The pipeline of one sync, composed once for every entry point (``prefetch pull``, ``prefetch
mirror``'s read of a prefix, the agent's SyncJob):

    resolve -> layout -> prepare -> make room -> execute -> warm

``resolve`` is the one place a snapshot is made (an S3 prefix is found to be a mirror there),
once per sync; it returns what the layout needs (the spec to publish under, the layout's name).
The agent's extra steps are :class:`Hooks`: what it checks once the plan is known, how it makes
room, and how it bounds the transfer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from prefetch.pipeline.engine.transfer import Transfer, TransferConfig
from prefetch.pipeline.layout import Layout
from prefetch.pipeline.progress import ProgressSink
from prefetch.pipeline.snapshot import Snapshot
from prefetch.pipeline.spec import ModelSpec, SpecError, layout_kind
from prefetch.pipeline.sync import (
    EngineFactory,
    Plan,
    SyncResult,
    execute,
    prepare,
    resolve_within,
)
from prefetch.sources.base import Source

if TYPE_CHECKING:
    from prefetch.pipeline.warmup import WarmLimits, WarmReport

__all__ = ["Hooks", "Pipeline", "Resolved"]

#: Where a model is published: its layout for the spec and the layout's name.
Place = Callable[[ModelSpec, str], Layout]


@dataclass(frozen=True)
class Resolved:
    """What resolving found: the ``spec`` to publish under (with ``hf_repo`` from a mirror's
    metadata when it named none), the ``snapshot``, the ``layout`` it goes to and that
    layout's name (``hf`` or ``plain``)."""

    spec: ModelSpec
    snapshot: Snapshot
    layout: Layout
    layout_name: str


class Hooks:
    """The steps an entry point adds (no-ops here: ``prefetch pull``'s pipeline)."""

    def planned(self, plan: Plan) -> None:
        """Once the plan is known, under the model's lock (may raise to give up)."""

    def make_room(self, plan: Plan, room: contextlib.ExitStack) -> bool:
        """Make room for ``plan.bytes_needed`` (held in ``room``); True: room was made, the
        transfer does not check the free space again."""
        return False

    def transfer_config(self, plan: Plan, config: TransferConfig) -> TransferConfig:
        """The transfer's config for ``plan`` (the agent bounds it by its syncDeadline)."""
        return config

    def executing(self) -> contextlib.AbstractContextManager[None]:
        """Around the transfer (the agent turns its deadline into its own error)."""
        return contextlib.nullcontext()


class Pipeline:
    """One model's sync from ``source`` into the layout ``place`` gives.

    ``layout_name``: the layout asked for (None: the spec's, see
    :func:`~prefetch.pipeline.spec.layout_kind`). ``repo_from_mirror``: an S3 mirror prefix without
    ``hf_repo`` is published under the repo id its metadata records; off, that is a SpecError
    on ``hf_repo`` (the agent, whose cache index is read offline, needs the id in its config).
    ``flag``: the deadline's setting, named when resolving outlasts it. ``refused``: the error
    a broken spec rule found at resolve is told as (the agent names its config's keys).
    ``engine``: what runs the transfer (``prefetch pull --processes``: worker processes)."""

    def __init__(
        self,
        spec: ModelSpec,
        source: Source,
        place: Place,
        *,
        layout_name: str | None = None,
        repo_from_mirror: bool = True,
        flag: str = "--deadline",
        hooks: Hooks | None = None,
        refused: Callable[[SpecError], Exception] = lambda exc: exc,
        engine: EngineFactory = Transfer,
    ) -> None:
        self.spec = spec
        self.source = source
        self._place = place
        self._layout_name = layout_name
        self._repo_from_mirror = repo_from_mirror
        self._flag = flag
        self._hooks = hooks or Hooks()
        self._refused = refused
        self._engine = engine

    def resolve(self, seconds: float | None, *, stop: threading.Event | None = None) -> Resolved:
        """The snapshot (within ``seconds``, interrupted by ``stop``) and where it goes."""
        spec = self.spec
        # a source that unpacks archives is told where the spec's layout keeps them (an OCI
        # source: its layout is the spec's; only an S3 mirror prefix changes it, below)
        kind = layout_kind(spec, self._layout_name)
        first = self._place(spec, kind)
        snapshot = resolve_within(
            spec, self.source, seconds, layout=first, stop=stop, flag=self._flag
        )
        if snapshot.layout is None:
            return Resolved(spec, snapshot, first, kind)
        if spec.hf_repo is None and snapshot.repo_id is not None:
            if not self._repo_from_mirror:
                raise self._refused(
                    SpecError(
                        "hf_repo",
                        f"{_literal(spec.source)} is a mirror of {_literal(snapshot.repo_id)} "
                        "(prefetch mirror's output): name its repo id as {hf_repo} to publish "
                        "it in the Hugging Face layout",
                        cross_field=True,
                    )
                )
            spec = replace(spec, hf_repo=snapshot.repo_id)
        return Resolved(spec, snapshot, self._place(spec, snapshot.layout), snapshot.layout)

    def run(
        self,
        config: TransferConfig,
        *,
        progress: ProgressSink | None = None,
        stop: threading.Event | None = None,
        delete: bool = False,
        superseded_grace: float = 0.0,
        lock_timeout: float = 3600.0,
        resolve_seconds: float | None = None,
        so_far: SyncResult | None = None,
    ) -> tuple[Resolved, SyncResult]:
        """Resolve (within ``resolve_seconds``, default: the config's deadline, which the
        resolve then counts in), lay out, prepare, make room and execute."""
        t0 = time.monotonic()
        own_deadline = resolve_seconds is None
        resolved = self.resolve(config.deadline if own_deadline else resolve_seconds, stop=stop)
        if own_deadline:
            config = _deadline_left(config, t0)
        if so_far is not None:
            so_far.note_snapshot(resolved.snapshot, resolved.layout)  # known without the lock
            so_far.bytes_downloaded = resolved.snapshot.fetched_bytes
        with (
            # an entry prepare makes only to hold its lock stays (deleting it would pull the
            # lock from under a waiting pull)
            prepare(resolved.spec, self.source, resolved.layout, snapshot=resolved.snapshot,
                    lock_timeout=lock_timeout) as plan,
            contextlib.ExitStack() as room,
        ):  # fmt: skip
            if own_deadline:
                plan.started = t0  # the resolve counts in the sync's seconds
                plan.resolve_seconds = time.monotonic() - t0
            self._hooks.planned(plan)
            made_room = self._hooks.make_room(plan, room)
            transfer = self._hooks.transfer_config(plan, config)
            with self._hooks.executing():
                result = execute(
                    plan, transfer, progress=progress, stop=stop, delete=delete,
                    superseded_grace=superseded_grace, so_far=so_far, check_space=not made_room,
                    engine=self._engine,
                )  # fmt: skip
        return resolved, result


def warm(
    layout: Layout,
    result: SyncResult,
    limits: WarmLimits,
    *,
    stop: threading.Event | None = None,
    model: str = "",
    on_start: Callable[[int], None] | None = None,
) -> WarmReport:
    """The last stage: read the model's published files into the page cache (its module, and
    psutil, imported only for a warm-up: a no-op pull does without)."""
    from prefetch.pipeline.warmup import published_files, warm_files

    files = published_files(layout, Path(result.path))
    return warm_files(files, limits, stop=stop, model=model, on_start=on_start)


def _deadline_left(config: TransferConfig, started: float) -> TransferConfig:
    """``config`` with its deadline reduced by what the resolve since ``started`` took."""
    if config.deadline is None:
        return config
    left = config.deadline - (time.monotonic() - started)
    return dataclasses.replace(config, deadline=max(left, 0.001))


def _literal(value: object) -> str:
    """``value`` taken literally inside a SpecError reason (braces doubled)."""
    return str(value).replace("{", "{{").replace("}", "}}")
