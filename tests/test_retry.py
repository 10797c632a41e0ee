"""The one retry policy (prefetch.pipeline.retry.RetryPolicy) and the loops that wait as it says."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from prefetch.agent import gate_driver
from prefetch.agent.config_values import AgentConfig
from prefetch.agent.gate_driver import GATE_RETRY, GateDriver
from prefetch.agent.metrics import AgentMetrics
from prefetch.pipeline.engine.transfer import Cancelled
from prefetch.pipeline.engine.watched_read import retry_read
from prefetch.pipeline.retry import AdaptiveRate, RetryPolicy, call_with_retries
from prefetch.support.errors import ConfigError, SourceError, TransientSourceError


def low(a: float, b: float) -> float:
    return a


def high(a: float, b: float) -> float:
    return b


def test_the_wait_is_full_jitter_up_to_the_doubling_backoff_capped() -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=5.0)
    assert [policy.backoff(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert [policy.delay(n, uniform=low) for n in range(1, 6)] == [0.0] * 5
    assert [policy.delay(n, uniform=high) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    for n in range(1, 8):
        for _ in range(50):
            assert 0.0 <= policy.delay(n) <= policy.backoff(n)


def test_a_floor_lifts_the_low_end_of_the_jitter_but_never_above_the_cap() -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=8.0, min_delay=3.0)
    assert policy.delay(1, uniform=low) == 1.0  # the cap (1 s) is below the floor
    assert policy.delay(3, uniform=low) == 3.0
    assert policy.delay(3, uniform=high) == 4.0


def test_retry_after_wins_over_the_backoff_and_is_capped() -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=5.0)
    assert policy.delay(1, 4.0, uniform=low) == 4.0
    assert policy.delay(1, 100.0) == 15.0  # three times max_delay
    assert RetryPolicy(max_delay=5.0, max_retry_after=7.0).delay(1, 100.0) == 7.0
    assert policy.delay(2, 0.0, uniform=high) == 2.0  # no Retry-After: the backoff


def test_attempts_and_what_is_retryable() -> None:
    policy = RetryPolicy(attempts=3)
    transient = TransientSourceError("reset")
    assert not policy.gives_up(1, transient) and not policy.gives_up(2, transient)
    assert policy.gives_up(3, transient)
    assert policy.gives_up(1, SourceError("no such bucket"))
    assert RetryPolicy(retryable=lambda e: isinstance(e, KeyError)).retryable(KeyError())
    with pytest.raises(ConfigError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ConfigError, match="negative"):
        RetryPolicy(base_delay=-1)


class Flaky:
    def __init__(self, failures: int, retry_after: float | None = None) -> None:
        self.calls = 0
        self.failures = failures
        self.retry_after = retry_after

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise TransientSourceError("reset", retry_after=self.retry_after)
        return "ok"


class RecordingStop(threading.Event):
    """A stop event that records each wait instead of waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout or 0.0)
        return self.is_set()


def test_call_with_retries_waits_as_the_policy_says(monkeypatch: pytest.MonkeyPatch) -> None:
    stop = RecordingStop()
    policy = RetryPolicy(attempts=4, base_delay=0.5, max_delay=10.0)
    monkeypatch.setattr("prefetch.pipeline.retry.random.uniform", high)
    assert call_with_retries(Flaky(3), policy, what="x", stop=stop) == "ok"
    assert stop.waits == [0.5, 1.0, 2.0]
    stop.waits.clear()
    monkeypatch.setattr("prefetch.pipeline.retry.random.uniform", low)  # full jitter: down to 0
    assert call_with_retries(Flaky(3), policy, what="x", stop=stop) == "ok"
    assert stop.waits == [0.0, 0.0, 0.0]
    stop.waits.clear()
    assert call_with_retries(Flaky(1, retry_after=3.0), policy, what="x", stop=stop) == "ok"
    assert stop.waits == [3.0]
    with pytest.raises(TransientSourceError, match="giving up after 4 attempts"):
        call_with_retries(Flaky(9), policy, what="x", stop=stop)


def test_one_attempt_is_said_in_the_singular() -> None:
    with pytest.raises(TransientSourceError, match=r"^x: giving up after 1 attempt: "):
        call_with_retries(Flaky(9), RetryPolicy(attempts=1), what="x", stop=RecordingStop())


def test_retry_read_waits_as_the_policy_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("prefetch.pipeline.retry.random.uniform", low)
    stop = RecordingStop()
    policy = RetryPolicy(attempts=4, base_delay=0.5, max_delay=10.0, min_delay=0.25)
    read = Flaky(3)
    retried: list[str] = []
    retry_read(
        read,
        policy=policy,
        stop=stop,
        what="f",
        position=lambda: 0,
        on_retry=lambda exc: retried.append(str(exc)),
    )
    assert stop.waits == [0.25, 0.25, 0.25] and len(retried) == 3
    stop.waits.clear()
    read = Flaky(1, retry_after=2.0)
    retry_read(
        read,
        policy=policy, stop=stop, what="f", position=lambda: 0, on_retry=lambda exc: None,
    )  # fmt: skip
    assert stop.waits == [2.0]
    stop.set()
    with pytest.raises(Cancelled):
        retry_read(
            Flaky(1),
            policy=policy, stop=stop, what="f", position=lambda: 0, on_retry=lambda exc: None,
        )  # fmt: skip


class FailingGate:
    def __init__(self) -> None:
        self.calls = 0

    def apply(self, ready_models: Iterable[str], all_required_ready: bool) -> Any:
        self.calls += 1
        raise OSError("connection refused")


def test_the_gate_driver_backs_off_as_its_policy_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("prefetch.pipeline.retry.random.uniform", high)
    clock = [1000.0]
    monkeypatch.setattr(gate_driver.time, "monotonic", lambda: clock[0])
    gate = FailingGate()
    driver = GateDriver(lambda config: gate, AgentMetrics(CollectorRegistry()), lambda: ((), True))
    driver.open(AgentConfig())
    waits = []
    for failures in range(1, 5):
        asyncio.run(driver.apply())
        assert gate.calls == failures
        wait = GATE_RETRY.backoff(failures)
        waits.append(wait)
        clock[0] += wait - 0.01
        asyncio.run(driver.apply())  # too early: not tried
        assert gate.calls == failures
        clock[0] += 0.01
    assert waits == [10.0, 20.0, 40.0, 60.0]


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_adaptive_rate_engages_at_the_first_throttle_and_cuts_once_per_burst() -> None:
    t = FakeTime()
    pace = AdaptiveRate(clock=t.clock, sleep=t.sleep)
    tickets = [pace.acquire() for _ in range(20)]  # a burst: nothing limits it yet
    assert t.now == 100.0 and pace.rate is None
    for ticket in tickets:  # every request of the burst was throttled: one signal
        pace.throttled(ticket)
    assert pace.rate == pytest.approx(20 * 0.7)
    began = t.now
    for _ in range(29):
        pace.acquire()
    assert t.now - began == pytest.approx(29 / 14, rel=0.05)  # paced: ~14 per second
    pace.throttled(pace.acquire())  # sent after the cut: cuts again
    assert pace.rate is not None and pace.rate < 14


def test_the_adaptive_rate_grows_back_along_the_curve() -> None:
    t = FakeTime()
    pace = AdaptiveRate(clock=t.clock, sleep=t.sleep)
    pace.throttled(next(iter([pace.acquire() for _ in range(10)])))
    assert pace.rate == pytest.approx(7.0)
    rates = []
    for _ in range(60):  # six seconds of answers that are not throttled, paced
        pace.succeeded(pace.acquire())
        rates.append(pace.rate or 0.0)
    assert rates == sorted(rates)  # never down without a throttle
    assert rates[-1] > 10.0  # back past the rate it was throttled at


def test_the_adaptive_rate_remembers_only_its_window_when_never_throttled() -> None:
    """An agent's pace lives as long as the process: never throttled, it must not keep a
    timestamp of every request it ever sent (it kept them all until the first throttle)."""
    t = FakeTime()
    pace = AdaptiveRate(clock=t.clock, sleep=t.sleep)
    for _ in range(10_000):
        pace.acquire()
        pace.succeeded(t.now)
        t.now += 0.01  # 100 requests a second, for 100 s
    assert pace.rate is None
    assert len(pace._sent) <= 101  # the last WINDOW (1 s) of requests, not all 10,000
