"""The one coordinator (prefetch.pipeline.engine.coordinator) the pull engine and the mirror
run on."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from prefetch.pipeline.engine.coordinator import Coordinator
from prefetch.pipeline.engine.transfer import Cancelled


@dataclass
class Step:
    name: str


def test_done_runs_on_the_calling_thread_and_may_submit_more() -> None:
    stop = threading.Event()
    seen: list[tuple[str, Any, str]] = []
    with ThreadPoolExecutor(2) as pool:

        def done(task: Step, result: Any) -> None:
            seen.append((task.name, result, threading.current_thread().name))
            if task.name == "first":
                tasks.submit(pool, Step("second"), lambda x: x * 2, 21)

        tasks = Coordinator[Step](stop, done=done, failed=lambda t, e: None)
        tasks.submit(pool, Step("first"), lambda: 1)
        tasks.run()
    me = threading.current_thread().name
    assert seen == [("first", 1, me), ("second", 42, me)]
    assert not stop.is_set()


def test_the_first_error_is_raised_after_every_task_ended_and_stops_the_rest() -> None:
    stop = threading.Event()
    failed: list[str] = []
    done: list[str] = []
    ended: list[str] = []

    def boom() -> None:
        raise ValueError("first")

    def slow() -> str:
        stop.wait(5)  # ends early because the coordinator sets stop
        time.sleep(0.05)
        ended.append("slow")
        return "late"

    with ThreadPoolExecutor(2) as pool:
        tasks = Coordinator[Step](
            stop, done=lambda t, r: done.append(t.name), failed=lambda t, e: failed.append(t.name)
        )
        tasks.submit(pool, Step("slow"), slow)
        tasks.submit(pool, Step("boom"), boom)
        with pytest.raises(ValueError, match="first"):
            tasks.run()
        assert ended == ["slow"]  # the loop waited for it before raising
    assert stop.is_set() and failed == ["boom"]
    assert done == []  # what finished after the error is not acted on


def test_a_real_error_replaces_a_cancellation_it_caused() -> None:
    stop = threading.Event()
    gate = threading.Event()

    def cancelled() -> None:
        raise Cancelled("stopped")

    def real() -> None:
        gate.wait(5)
        raise OSError("disk on fire")

    with ThreadPoolExecutor(2) as pool:
        tasks = Coordinator[Step](
            stop, done=lambda t, r: None, failed=lambda t, e: gate.set(), minor=Cancelled
        )
        tasks.submit(pool, Step("real"), real)
        tasks.submit(pool, Step("cancelled"), cancelled)
        with pytest.raises(OSError, match="disk on fire"):
            tasks.run()


def test_an_error_in_the_loop_itself_stops_and_cancels_what_is_queued() -> None:
    stop = threading.Event()
    started: list[int] = []
    with ThreadPoolExecutor(1) as pool:

        def done(task: Step, result: Any) -> None:
            raise RuntimeError("handler failed")

        tasks = Coordinator[Step](stop, done=done, failed=lambda t, e: None)
        tasks.submit(pool, Step("a"), lambda: started.append(1))
        for _ in range(5):
            tasks.submit(pool, Step("queued"), lambda: (stop.wait(5), started.append(2)))
        with pytest.raises(RuntimeError, match="handler failed"):
            tasks.run()
    assert stop.is_set() and len(started) <= 2  # the queued ones were cancelled


def test_after_round_runs_while_no_error_is_held() -> None:
    stop = threading.Event()
    rounds: list[int] = []
    with ThreadPoolExecutor(1) as pool:
        tasks = Coordinator[Step](
            stop,
            done=lambda t, r: None,
            failed=lambda t, e: None,
            after_round=lambda: rounds.append(1),
        )
        tasks.submit(pool, Step("a"), lambda: None)
        tasks.run()
    assert rounds == [1]
