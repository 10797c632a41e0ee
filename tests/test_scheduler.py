"""The agent's model table: phases and their transitions, backoff, what is due, and which due
jobs start first under parallelModels. Pure: no loop, no disk, no source."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from prefetch.agent.config_values import Backoff
from prefetch.agent.metrics import MODEL_STATES
from prefetch.agent.scheduler import (
    Intervals,
    Job,
    JobKind,
    ModelPhase,
    ModelState,
    Scheduler,
    failure_reason,
    sync_retry_policy,
)
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import SyncResult
from prefetch.support.errors import InsufficientSpaceError, NotFoundError

HOURLY = Intervals(resolve=3600.0, verify=None)


def state(name: str, *, required: bool = True, index: int = 0, ready: bool = False) -> ModelState:
    spec = ModelSpec(source=parse_source_uri(f"s3://bucket/{name}"), name=name, required=required)
    ms = ModelState(spec=spec, digest="d", index=index)
    if ready:
        ms.found_copy("rev", 10, None)
        ms.last_resolved = 0.0  # confirmed with the source at t=0
    return ms


@pytest.fixture
def job() -> Iterator[Job]:
    """A job whose task has nothing to do (the table never awaits it)."""
    loop = asyncio.new_event_loop()

    async def idle() -> None:
        return None

    task = loop.create_task(idle())
    yield Job(JobKind.SYNC, task, threading.Event(), 0.0)
    loop.run_until_complete(task)
    loop.close()


def succeeded(revision: str = "rev-2") -> SyncResult:
    return SyncResult("m", "s3://bucket/m", revision=revision, bytes_total=42)


# -- phases -------------------------------------------------------------------------------------


def test_phase_values_are_the_strings_readyz_and_the_metrics_show() -> None:
    assert {p.value for p in ModelPhase} == set(MODEL_STATES)
    assert f"{ModelPhase.UPDATING}" == "updating"  # as formatted into logs and labels


def test_a_new_model_is_pending_and_a_sync_makes_it_syncing_then_ready(job: Job) -> None:
    ms = state("m")
    assert ms.phase is ModelPhase.PENDING and not ms.ready
    ms.start_sync(job)
    assert ms.phase is ModelPhase.SYNCING and ms.syncing
    ms.sync_succeeded(succeeded(), now=5.0)
    assert ms.phase is ModelPhase.READY and ms.ready
    assert (ms.revision, ms.bytes_total, ms.last_resolved, ms.last_verified) == (
        "rev-2",
        42,
        5.0,
        5.0,
    )


def test_refreshing_a_ready_model_is_updating_and_a_failure_keeps_it_ready(job: Job) -> None:
    ms = state("m", ready=True)
    ms.start_sync(job)
    assert ms.phase is ModelPhase.UPDATING
    ms.sync_failed(NotFoundError("gone"), now=0.0, backoff=Backoff(), jitter=lambda a, b: 1.0)
    assert ms.phase is ModelPhase.READY and ms.ready
    assert (ms.last_error, ms.error_reason, ms.failures) == ("gone", "not_found", 1)


def test_a_failed_first_sync_is_failed_and_a_success_clears_the_error(job: Job) -> None:
    ms = state("m")
    ms.start_sync(job)
    ms.sync_failed(
        InsufficientSpaceError("full"), now=0.0, backoff=Backoff(), jitter=lambda a, b: 1
    )
    assert ms.phase is ModelPhase.FAILED and ms.error_reason == "insufficient_space"
    ms.sync_succeeded(succeeded(), now=100.0)
    assert ms.phase is ModelPhase.READY
    assert (ms.failures, ms.last_error, ms.error_reason) == (0, None, None)


@pytest.mark.parametrize("ready", [False, True])
def test_a_cancelled_sync_goes_back_to_where_it_was(job: Job, ready: bool) -> None:
    ms = state("m", ready=ready)
    ms.start_sync(job)
    ms.sync_cancelled()
    assert ms.phase is (ModelPhase.READY if ready else ModelPhase.PENDING)


def test_verify_then_drop_ready_leaves_the_model_pending_and_unverified(job: Job) -> None:
    ms = state("m", ready=True)
    ms.start_verify(job)
    assert ms.phase is ModelPhase.VERIFYING
    ms.drop_ready("re-verification failed: bad")
    assert not ms.ready and ms.last_verified is None and ms.error_reason == "verify_failed"
    ms.verify_finished(now=7.0, current=True)
    assert ms.phase is ModelPhase.PENDING and ms.job is None and ms.last_verified == 7.0


def test_a_passed_verify_returns_to_ready(job: Job) -> None:
    ms = state("m", ready=True)
    ms.start_verify(job)
    ms.verify_passed(now=3.0)
    ms.verify_finished(now=3.0, current=True)
    assert ms.phase is ModelPhase.READY and ms.last_verified == 3.0


def test_a_verify_of_a_model_no_longer_configured_keeps_its_phase(job: Job) -> None:
    ms = state("m", ready=True)
    ms.start_verify(job)
    ms.verify_finished(now=3.0, current=False)
    assert ms.phase is ModelPhase.VERIFYING and ms.job is None


# -- backoff ------------------------------------------------------------------------------------


def test_backoff_grows_with_each_failure_with_full_jitter_above_half_the_first_delay() -> None:
    backoff = Backoff()
    ms = state("m")
    delays = [
        ms.sync_failed(RuntimeError("x"), now=0.0, backoff=backoff, jitter=lambda a, b: b)
        for _ in range(3)
    ]
    assert delays == [backoff.delay(1), backoff.delay(2), backoff.delay(3)]
    assert ms.next_attempt == delays[-1]
    # the jitter's low end (RetryPolicy's full jitter, floored at half the first delay)
    low = ms.sync_failed(RuntimeError("x"), now=0.0, backoff=backoff, jitter=lambda a, b: a)
    assert low == backoff.initial / 2
    assert ms.error_reason == failure_reason(RuntimeError()) == "internal"


def test_the_sync_backoff_is_the_one_retry_policy() -> None:
    backoff = Backoff(initial=4.0, max=30.0)
    policy = sync_retry_policy(backoff)
    assert (policy.base_delay, policy.max_delay, policy.min_delay) == (4.0, 30.0, 2.0)
    for failures in range(1, 8):
        ms = state("m")
        ms.failures = failures - 1
        drawn: list[tuple[float, float]] = []

        def jitter(low: float, high: float) -> float:
            drawn.append((low, high))  # noqa: B023 (called before the loop moves on)
            return high

        ms.sync_failed(RuntimeError("x"), now=0.0, backoff=backoff, jitter=jitter)
        assert drawn == [(2.0, policy.backoff(failures))]


# -- due ----------------------------------------------------------------------------------------


def test_a_model_without_a_copy_is_due_for_sync_after_its_backoff() -> None:
    ms = state("m")
    assert ms.due(0.0, HOURLY) is JobKind.SYNC
    ms.sync_failed(RuntimeError("x"), now=0.0, backoff=Backoff(), jitter=lambda a, b: 1.0)
    assert ms.due(ms.next_attempt - 0.5, HOURLY) is None
    assert ms.due(ms.next_attempt, HOURLY) is JobKind.SYNC


def test_a_copy_found_at_start_up_is_confirmed_with_the_source_at_once() -> None:
    ms = state("m")
    ms.found_copy("rev", 10, None)
    assert ms.due(0.0, HOURLY) is JobKind.SYNC


def test_a_ready_model_is_due_every_resolve_interval_then_every_verify_interval() -> None:
    ms = state("m", ready=True)
    intervals = Intervals(resolve=100.0, verify=30.0)
    assert ms.due(10.0, intervals) is None
    assert ms.due(30.0, intervals) is JobKind.VERIFY
    ms.verify_passed(30.0)
    assert ms.due(59.0, intervals) is None
    assert ms.due(100.0, intervals) is JobKind.SYNC
    assert ms.due(10**6, Intervals(resolve=None, verify=None)) is None


def test_damage_found_makes_a_sync_due_and_a_running_job_makes_nothing_due(job: Job) -> None:
    ms = state("m", ready=True)
    ms.refetch = True
    assert ms.due(1.0, HOURLY) is JobKind.SYNC
    ms.start_sync(job)
    assert ms.due(1.0, HOURLY) is None


# -- the choice under parallelModels ----------------------------------------------------------


def test_due_jobs_are_required_first_then_without_a_copy_then_in_config_order() -> None:
    scheduler = Scheduler()
    table = [
        state("optional-missing", required=False, index=0),
        state("required-cached", index=1, ready=True),
        state("required-missing-late", index=3),
        state("required-missing", index=2),
        state("optional-cached", required=False, index=4, ready=True),
    ]
    for ms in table:
        ms.refetch = ms.ready  # every model due
    scheduler.replace({ms.spec.name: ms for ms in table})
    chosen = scheduler.due_jobs(0.0, HOURLY, slots=10)
    assert [ms.spec.name for ms, _ in chosen] == [
        "required-missing",
        "required-missing-late",
        "required-cached",
        "optional-missing",
        "optional-cached",
    ]
    assert [ms.spec.name for ms, _ in scheduler.due_jobs(0.0, HOURLY, slots=2)] == [
        "required-missing",
        "required-missing-late",
    ]
    assert scheduler.due_jobs(0.0, HOURLY, slots=0) == []


def test_the_table_reports_ready_names_required_readiness_and_config_order() -> None:
    scheduler = Scheduler()
    a, b = state("b-model", index=0, ready=True), state("a-model", index=1)
    scheduler.replace({"b-model": a, "a-model": b})
    assert scheduler.ready_names() == ("b-model",)
    assert not scheduler.all_required_ready()
    assert [ms.spec.name for ms in scheduler.states()] == ["b-model", "a-model"]
    assert scheduler.current(a) and not scheduler.current(state("b-model"))


def test_a_sync_is_stalled_after_a_window_without_enough_bytes(job: Job) -> None:
    """Issue 29 item 18: what frees a parallelModels slot (see JobLauncher.stalled_syncs)."""
    from prometheus_client import CollectorRegistry

    from prefetch.agent.metrics import AgentMetrics

    ms = state("m")
    sink = AgentMetrics(CollectorRegistry()).sink("m", "s3")
    job.started = 100.0
    ms.start_sync(job, sink)
    assert not ms.stalled(129.0, 30.0, 1000)  # resolving: not yet a window without progress
    assert ms.stalled(130.0, 30.0, 1000)
    sink.start("m", 10_000, 1)
    sink.advance(999)  # a trickle: less than enough
    assert ms.stalled(131.0, 30.0, 1000)
    sink.advance(1)  # enough bytes: progress, and the window starts again
    assert not ms.stalled(132.0, 30.0, 1000)
    assert not ms.stalled(161.0, 30.0, 1000)
    assert ms.stalled(162.0, 30.0, 1000)
    ms.job = None
    assert not ms.stalled(200.0, 30.0, 1000)  # no sync running: nothing to free
