"""The progress annotation: its content, its write rule (with a test clock, no sleeping) and the
merge patch that writes it, against the Kubernetes API stub through the real client."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from prefetch.agent.config_values import AgentConfig
from prefetch.agent.loop import Agent
from prefetch.agent.metrics import AgentMetrics
from prefetch.agent.node import GateResult, NodeGate
from prefetch.agent.progress_note import (
    ProgressReporter,
    WriteLimiter,
    build_note,
    encode,
)
from prefetch.agent.scheduler import Job, JobKind, ModelPhase, ModelState
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import SyncResult
from prefetch.support.constants import PROGRESS_ANNOTATION, PROGRESS_INTERVAL
from tests.fakes.k8s_stub import KubeStub, running_stub
from tests.support import AgentThread, wait_for

NODE = "gpu-node-1"
NOON = 1_796_385_600.0  # 2026-12-04T12:00:00Z
GiB = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def stub() -> Iterator[KubeStub]:
    yield from running_stub()


def state(name: str, *, required: bool = True) -> ModelState:
    spec = ModelSpec(source=parse_source_uri(f"s3://bucket/{name}"), name=name, required=required)
    return ModelState(spec=spec, digest="d")


def syncing(metrics: AgentMetrics, name: str, total: int, done: int) -> ModelState:
    ms = state(name)
    sink = metrics.sink(name, "s3")
    ms.start_sync(Job(JobKind.SYNC, cast(Any, None), threading.Event(), 0.0), sink)
    sink.start(name, total, 3)
    sink.advance(done)
    return ms


def ready(name: str, size: int) -> ModelState:
    ms = state(name)
    ms.sync_succeeded(SyncResult(name, f"s3://bucket/{name}", revision="r", bytes_total=size), 0)
    return ms


def note_of(models: list[ModelState], *, rate: float = 0.0, all_ready: bool = False) -> Any:
    return build_note(
        models,
        lambda name: rate,
        all_ready=all_ready,
        prefix="model-prefetch.io",
        taint="model-prefetch.io/warming",
        now=NOON,
    )


def test_a_retry_after_a_deadline_says_why_in_the_note_and_in_readyz() -> None:
    """`prefetch status` (the note) and /readyz tell why a model is not ready yet, both while it
    backs off and while it tries again: most of a trickling model's time is spent trying."""
    from prefetch.agent.status import model_status
    from prefetch.support.errors import DeadlineExceededError

    metrics = AgentMetrics(CollectorRegistry())
    ms = state("slow")
    ms.sync_failed(DeadlineExceededError("syncDeadline passed"), 0.0, cast(Any, _Backoff()))
    assert note_of([ms])["models"][0] == {"name": "slow", "phase": "failed", "reason": "deadline"}
    assert model_status(ms, 0.0)["detail"].startswith("failed (deadline): syncDeadline passed")
    sink = metrics.sink("slow", "s3")
    ms.start_sync(Job(JobKind.SYNC, cast(Any, None), threading.Event(), 0.0), sink)
    sink.start("slow", GiB, 1)
    assert note_of([ms])["models"][0]["reason"] == "deadline"
    assert model_status(ms, 0.0)["detail"] == (
        "downloading: 1.0 GiB left in 1 file(s); attempt 2, the last failed (deadline)"
    )


def test_the_note_gives_each_models_phase_bytes_rate_and_eta_and_when_it_was_written() -> None:
    metrics = AgentMetrics(CollectorRegistry())
    failed = state("broken")
    failed.sync_failed(PermissionError("no"), 0.0, cast(Any, _Backoff()))
    models = [syncing(metrics, "llama", 4 * GiB, GiB), ready("qwen", 2 * GiB), failed]

    note = note_of(models, rate=1000 * 1024 * 1024)

    assert note == {
        "v": 1,
        "at": "2026-12-04T12:00:00Z",
        "ready": False,
        "prefix": "model-prefetch.io",
        "taint": "model-prefetch.io/warming",
        "models": [
            {
                "name": "llama",
                "phase": "syncing",
                "done": GiB,
                "total": 4 * GiB,
                "rate": 1000 * 1024 * 1024,
                "eta": 4,  # 3 GiB at 1000 MiB/s is 3.072 s, rounded up
            },
            {"name": "qwen", "phase": "ready", "done": 2 * GiB, "total": 2 * GiB},
            {"name": "broken", "phase": "failed", "reason": "os_error"},
        ],
    }
    assert " " not in encode(note)  # compact: every watcher of the Node gets a copy


def test_the_eta_is_unknown_until_bytes_flow_and_the_total_until_the_plan() -> None:
    metrics = AgentMetrics(CollectorRegistry())
    resolving = state("m")
    resolving.start_sync(
        Job(JobKind.SYNC, cast(Any, None), threading.Event(), 0.0),
        metrics.sink("m", "s3"),
    )
    entry = note_of([resolving], rate=0.0)["models"][0]
    assert entry == {
        "name": "m",
        "phase": "syncing",
        "done": 0,
        "total": None,
        "rate": 0,
        "eta": None,
    }


def test_a_ready_model_only_checked_or_reverified_shows_ready() -> None:
    metrics = AgentMetrics(CollectorRegistry())
    checked = ready("checked", 10)
    checked.start_sync(
        Job(JobKind.SYNC, cast(Any, None), threading.Event(), 0.0),
        metrics.sink("checked", "s3"),
    )
    checked.sink.start("checked", 0, 0)  # type: ignore[union-attr]  # up to date: nothing to fetch
    verifying = ready("verifying", 10)
    verifying.start_verify(Job(JobKind.VERIFY, cast(Any, None), threading.Event(), 0.0))
    updating = ready("updating", 10)
    updating.start_sync(
        Job(JobKind.SYNC, cast(Any, None), threading.Event(), 0.0),
        metrics.sink("updating", "s3"),
    )
    updating.sink.start("updating", 500, 1)  # type: ignore[union-attr]  # a new revision

    assert checked.phase is ModelPhase.UPDATING and verifying.phase is ModelPhase.VERIFYING
    phases = [m["phase"] for m in note_of([checked, verifying, updating], all_ready=True)["models"]]
    assert phases == ["ready", "ready", "updating"]


# -- the write rule --------------------------------------------------------------------------


class Scene:
    """An agent's models as the reporter sees them, a test clock, and the stub's node."""

    def __init__(self, stub: KubeStub) -> None:
        stub.add_node(NODE)
        self.stub = stub
        self.clock = Clock()
        self.metrics = AgentMetrics(CollectorRegistry())
        self.models = [syncing(self.metrics, "llama", 4 * GiB, 0)]
        self.all_ready = False
        gate = NodeGate(stub.client(), NODE)
        self.reporter = ProgressReporter(
            lambda: note_of(self.models, rate=1e6, all_ready=self.all_ready),
            lambda: gate,
            self.metrics,
            WriteLimiter(clock=self.clock),
        )

    def run_for(self, seconds: float, step: float = 0.5) -> None:
        """Call the reporter every ``step`` seconds of test time, as the loop would."""

        async def passes() -> None:
            end = self.clock.t + seconds
            while self.clock.t < end:
                await self.reporter.maybe_write()
                self.clock.t += step

        asyncio.run(passes())

    def patches(self) -> list[Any]:
        return [r.body for r in self.stub.requests_of("PATCH")]

    def written(self) -> Any:
        annotations = self.stub.node(NODE)["metadata"].get("annotations") or {}
        return json.loads(annotations[PROGRESS_ANNOTATION])

    def writes(self, result: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "model_prefetch_node_progress_writes_total", {"result": result}
        )


def test_many_progress_updates_make_at_most_one_patch_per_interval(stub: KubeStub) -> None:
    scene = Scene(stub)
    sink = scene.models[0].sink
    assert sink is not None

    async def downloading() -> None:
        for _ in range(240):  # two minutes of passes, two a second, bytes arriving all along
            sink.advance(10 * 1024 * 1024)
            await scene.reporter.maybe_write()
            scene.clock.t += 0.5

    asyncio.run(downloading())

    # at t = 0, 30, 60 and 90 s: the first pass, then one refresh per interval while bytes move
    assert len(scene.patches()) == 4
    assert scene.written()["models"][0]["done"] == 10 * 1024 * 1024 * (1 + 3 * 60)
    assert PROGRESS_INTERVAL == 30.0


def test_nothing_is_written_in_the_steady_state(stub: KubeStub) -> None:
    scene = Scene(stub)
    scene.models = [ready("llama", GiB)]
    scene.all_ready = True
    scene.run_for(600)
    assert len(scene.patches()) == 1  # the first pass; then nothing changes and nothing moves


def test_all_ready_is_written_as_soon_as_the_interval_allows(stub: KubeStub) -> None:
    scene = Scene(stub)
    scene.run_for(10)  # written at t=0 (warming), then not again within the interval
    assert len(scene.patches()) == 1
    scene.models = [ready("llama", 4 * GiB)]
    scene.all_ready = True
    scene.run_for(19.5)  # t = 10 .. 29.5: due, but the interval has not passed
    assert len(scene.patches()) == 1
    scene.run_for(1)  # t = 30
    assert len(scene.patches()) == 2
    note = scene.written()
    assert note["ready"] is True and note["models"][0]["phase"] == "ready"
    scene.run_for(300)
    assert len(scene.patches()) == 2


def test_a_failed_write_waits_an_interval_and_is_then_retried(stub: KubeStub) -> None:
    scene = Scene(stub)
    scene.models = [ready("llama", GiB)]
    scene.all_ready = True
    stub.fail_next(1, 500, method="PATCH")
    scene.run_for(29.5)
    assert len(scene.patches()) == 1  # the failed one; no burst of retries
    assert scene.reporter.last_error and "500" in scene.reporter.last_error
    scene.run_for(1)
    assert len(scene.patches()) == 2
    assert scene.written()["ready"] is True
    assert (scene.writes("failed"), scene.writes("ok")) == (1.0, 1.0)
    assert scene.reporter.last_error is None


def test_without_a_gate_that_can_annotate_nothing_is_tried() -> None:
    metrics = AgentMetrics(CollectorRegistry())
    reporter = ProgressReporter(lambda: note_of([]), lambda: object(), metrics)  # no annotate()
    asyncio.run(reporter.maybe_write())
    written = {
        result: metrics.registry.get_sample_value(
            "model_prefetch_node_progress_writes_total", {"result": result}
        )
        for result in ("ok", "failed")
    }
    assert written == {"ok": 0.0, "failed": 0.0} and reporter.last_error is None


# -- the PATCH -------------------------------------------------------------------------------


def test_annotate_is_one_merge_patch_that_keeps_other_annotations(stub: KubeStub) -> None:
    stub.add_node(NODE, annotations={"example.com/owner": "team-a"})
    stub.add_node("bare")

    NodeGate(stub.client(), NODE).annotate(PROGRESS_ANNOTATION, '{"v":1}')
    NodeGate(stub.client(), "bare").annotate(PROGRESS_ANNOTATION, '{"v":1}')

    assert stub.node(NODE)["metadata"]["annotations"] == {
        "example.com/owner": "team-a",
        PROGRESS_ANNOTATION: '{"v":1}',
    }
    assert stub.node("bare")["metadata"]["annotations"] == {PROGRESS_ANNOTATION: '{"v":1}'}
    assert [r.method for r in stub.requests] == ["PATCH", "PATCH"]  # no GET first
    assert {r.content_type for r in stub.requests} == {"application/merge-patch+json"}
    assert {r.query for r in stub.requests} == {"fieldManager=model-prefetch"}


class _Backoff:
    initial = max = 1.0

    def delay(self, failures: int) -> float:
        return 1.0


# -- the agent's loop ------------------------------------------------------------------------


class HungApiGate:
    """A node gate whose annotation PATCH hangs until released, as on an API server that
    accepts the connection and never answers."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def apply(self, ready_models: Any, all_required_ready: bool) -> GateResult:
        return GateResult()

    def annotate(self, key: str, value: str) -> None:
        self.entered.set()
        self.release.wait(30)


def test_a_hung_annotation_write_never_stalls_the_reconcile_loop(tmp_path: Path) -> None:
    gate = HungApiGate()
    config = AgentConfig(cache_dir=tmp_path / "cache")
    agent = Agent(None, config=config, serve=False, tick=0.05, gate_factory=lambda cfg: gate)
    try:
        with AgentThread(agent):
            assert gate.entered.wait(10), "the note was never written"
            passes = agent.passes
            wait_for(lambda: agent.passes >= passes + 10, "the loop to go on meanwhile")
            assert agent.health()[0] == 200
            gate.release.set()  # before the agent stops, which waits for its writes
    finally:
        gate.release.set()


def test_the_note_shows_the_warm_up_and_the_compile_cache_state_and_a_change_is_written() -> None:
    from prefetch.agent.progress_note import note_shape
    from prefetch.pipeline.warmup import WarmReport

    model = ready("llama", 2 * GiB)
    cache = ready("llama-compile", 0)
    cache.nothing_published = True
    notes = lambda: build_note(  # noqa: E731
        [model, cache], lambda name: 0.0, all_ready=True, prefix="model-prefetch.io",
        taint="model-prefetch.io/warming", now=NOON, compile_caches=frozenset({"llama-compile"}),
    )  # fmt: skip
    first = notes()
    assert first["models"][0] == {"name": "llama", "phase": "ready", "done": 2 * GiB,
                                  "total": 2 * GiB}  # fmt: skip
    assert first["models"][1]["cache"] == "none"
    model.warming = True
    second = notes()
    assert second["models"][0]["warm"] == "warming"
    model.warming, model.warm = False, WarmReport("skipped", reason="does not fit")
    third = notes()
    assert third["models"][0]["warm"] == "skipped" and "cache" not in third["models"][0]
    cache.cache_push = "pushed"
    fourth = notes()
    assert fourth["models"][1]["cache"] == "pushed" and "warm" not in fourth["models"][1]
    shapes = [note_shape(n) for n in (first, second, third, fourth)]
    assert len(set(shapes)) == 4  # each is a change: written as soon as the interval allows
    limiter = WriteLimiter(interval=30.0, clock=Clock())
    limiter.written(shapes[0])
    assert not limiter.due(shapes[0], in_flight=False)  # steady state: nothing
    assert limiter.due(shapes[1], in_flight=False)  # the warm-up began: written


def test_an_optional_model_that_keeps_failing_writes_nothing_once_the_node_is_ready(
    stub: KubeStub,
) -> None:
    """docs/operations.md: 0 writes/s once ready. A failing optional model's retries fetch
    nothing, so its note keeps saying ``failed``: no change, nothing moving, nothing written."""
    from prefetch.support.errors import TransientSourceError

    scene = Scene(stub)
    extra = state("extra", required=False)
    extra.sync_failed(TransientSourceError("503"), 0.0, cast(Any, _Backoff()))
    scene.models = [ready("llama", GiB), extra]
    scene.all_ready = True
    for _ in range(20):  # ten minutes: a retry every 30 s, each failing after 10 s
        sink = scene.metrics.sink("extra", "s3")
        extra.start_sync(Job(JobKind.SYNC, cast(Any, None), threading.Event(), 0.0), sink)
        scene.run_for(10)
        extra.job = None
        extra.sync_failed(TransientSourceError("503"), 0.0, cast(Any, _Backoff()))
        scene.run_for(20)
    assert len(scene.patches()) == 1  # the first pass only
    assert scene.written()["models"][1] == {
        "name": "extra",
        "phase": "failed",
        "reason": "transient",
    }
    # a retry that does fetch bytes is progress again, and shown as such
    sink = scene.metrics.sink("extra", "s3")
    extra.start_sync(Job(JobKind.SYNC, cast(Any, None), threading.Event(), 0.0), sink)
    sink.start("extra", GiB, 1)
    sink.advance(1024)
    scene.run_for(1)
    assert scene.written()["models"][1]["phase"] == "syncing"
