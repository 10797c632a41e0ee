"""The one deadline mechanism (prefetch.pipeline.deadline): alarms, watches, the watchdog, deadlines
on calls; a stop or a deadline interrupts a wait for response headers through the HTTP seam."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from prefetch.pipeline.deadline import Alarms, Watchdog, call_with_deadline
from prefetch.pipeline.engine.transfer import Cancelled, TransferConfig
from prefetch.pipeline.engine.watched_read import engine_watchdog, open_watched
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import sync
from prefetch.sources.http.transport import make_http_pool
from prefetch.sources.s3.factory import lazy_s3_client
from prefetch.sources.s3.source import S3Source
from prefetch.support.errors import NotFoundError, TransientSourceError
from prefetch.support.logjson import JsonFormatter, sync_context
from tests.fakes.misbehaving import SilentServer
from tests.tls import TestCA


def test_the_alarms_run_on_time_skip_cancelled_ones_and_end_their_thread_when_idle() -> None:
    """One alarm thread per S3 source bounds its small GETs; an agent makes a source per sync,
    so the thread must not outlive its work (it ends when idle and starts again when needed).
    (Moved from test_s3_lean with the alarms.)"""
    alarms = Alarms(idle=0.2)
    fired = threading.Event()
    cancelled = threading.Event()
    alarm = alarms.schedule(0.05, cancelled.set)
    alarm.cancel()
    alarms.schedule(0.1, fired.set)
    assert fired.wait(5) and not cancelled.is_set()
    deadline = time.monotonic() + 5
    while alarms.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alarms.running
    again = threading.Event()
    alarms.schedule(0.0, again.set)
    assert again.wait(5)


def test_an_alarm_later_than_the_earliest_does_not_wake_the_alarm_thread() -> None:
    """Issue 33: every small object's GET schedules an alarm; waking the alarm thread for each
    cost a thread switch and a GIL hand-off per file. The thread sleeps until the earliest
    alarm, so it is woken only by an alarm earlier than that one, which still runs on time;
    cancelled alarms do not pile up in the heap."""
    alarms = Alarms(idle=5.0)
    later = threading.Event()
    alarms.schedule(30.0, later.set)  # starts the thread, which sleeps until then
    for _ in range(200):  # like 200 small GETs, each finished well before its bound
        alarms.schedule(60.0, later.set).cancel()
        time.sleep(0.001)  # (lets the alarm thread run, were it woken)
    assert alarms.wakeups <= 2  # its start (+ a spurious one); not one per alarm
    for _ in range(1500):
        alarms.schedule(60.0, later.set).cancel()
    assert alarms.pending <= 1024  # the cancelled ones are dropped, not 1701 in the heap
    earlier = threading.Event()
    alarms.schedule(0.05, earlier.set)  # earlier than the head: wakes the thread
    assert earlier.wait(10) and not later.is_set()


def test_call_with_deadline_returns_raises_or_gives_up_on_a_server_that_never_answers(
    test_ca: TestCA,
) -> None:
    """(Moved from test_units: the deadline now runs the call in the caller's thread and
    interrupts the request in flight instead of parking a thread per call.)"""
    alarms = Alarms(idle=0.2)
    assert call_with_deadline(lambda: 42, 5, what="answer", alarms=alarms) == 42

    def missing() -> None:
        raise NotFoundError("no such repo")

    with pytest.raises(NotFoundError, match="no such repo"):  # the call's own error, as it was
        call_with_deadline(missing, 5, what="lookup", alarms=alarms)
    pool = make_http_pool(2)
    with SilentServer(test_ca) as server:
        t0 = time.monotonic()
        with pytest.raises(TransientSourceError, match=r"^listing: no answer within 0.2 s$"):
            call_with_deadline(
                lambda: pool.request("GET", server.url + "/", timeout=30, retries=False),
                0.2, what="listing", alarms=alarms,
            )  # fmt: skip
        assert time.monotonic() - t0 < 3  # not the 30 s read timeout
        assert server.accepted == 1


def test_a_stop_interrupts_a_ranged_read_waiting_for_response_headers(test_ca: TestCA) -> None:
    """Issue 22: SIGTERM while waiting for response headers waited out the socket's read
    timeout; the watch now starts before the request is sent."""
    stop = threading.Event()
    watchdog = engine_watchdog(TransferConfig(min_rate=0, stall_window=1.0), stop)
    watchdog.start()
    pool = make_http_pool(2)
    try:
        with SilentServer(test_ca) as server:
            threading.Timer(0.3, stop.set).start()
            t0 = time.monotonic()
            with pytest.raises(Cancelled, match="stopped"):
                open_watched(
                    watchdog, "w.bin bytes 0-9",
                    lambda: pool.request("GET", server.url + "/w.bin", timeout=30, retries=False),
                )  # fmt: skip
            assert time.monotonic() - t0 < 3
    finally:
        watchdog.close()


def test_the_stall_rule_covers_the_wait_for_headers(test_ca: TestCA) -> None:
    """A server that never sends headers is a stall like one that stops sending the body."""
    stop = threading.Event()
    watchdog = engine_watchdog(TransferConfig(min_rate=1024, stall_window=0.4), stop)
    watchdog.start()
    pool = make_http_pool(2)
    try:
        t0 = time.monotonic()
        with (
            SilentServer(test_ca) as server,
            pytest.raises(TransientSourceError, match="stalled: 0"),
        ):
            open_watched(
                watchdog, "w.bin bytes 0-9",
                lambda: pool.request("GET", server.url + "/w.bin", timeout=30, retries=False),
            )  # fmt: skip
        assert time.monotonic() - t0 < 3  # not the 30 s read timeout
    finally:
        watchdog.close()


def test_the_watchdogs_abort_lines_carry_the_sync_id(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 22.3: the watchdog writes from its own thread, outside the sync's context; the
    line must still carry the sync_id of the sync whose read it aborts."""
    stop = threading.Event()
    watchdog = Watchdog(
        TransferConfig(min_rate=1024, stall_window=1.0), stop, cancelled=lambda: Cancelled("x")
    )
    with sync_context("5eed1d00"):
        watch = watchdog.watch("w.bin bytes 0-9")
    caplog.set_level(logging.DEBUG, logger="prefetch.pipeline.deadline")
    checked = threading.Thread(target=watchdog.check, args=(time.monotonic() + 5,))
    checked.start()  # another thread, with no sync context: as the watchdog's
    checked.join()
    assert watch.aborted
    lines = [r for r in caplog.records if r.getMessage().startswith("aborting w.bin")]
    assert len(lines) == 1
    assert '"sync_id": "5eed1d00"' in JsonFormatter().format(lines[0])


def test_an_s3_listing_that_never_answers_is_bounded_by_the_metadata_deadline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, test_ca: TestCA
) -> None:
    """S3 metadata calls (listing pages, metadata objects) had no overall bound: each byte of a
    trickle, or a server that never answers, waited on the socket timeout alone."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with SilentServer(test_ca) as server:
        client = lazy_s3_client(
            endpoint_url=server.url, access_key="k", secret_key="s", region="us-east-1",
            read_timeout=30,
        )  # fmt: skip
        spec = ModelSpec(source=parse_source_uri("s3://bkt/m/"))
        source = S3Source(client, spec.source, retry=RetryPolicy(attempts=1))
        source.metadata_timeout = 0.3
        t0 = time.monotonic()
        with pytest.raises(TransientSourceError, match=r"no answer within 0.3 s"):
            source.resolve(spec)
        assert time.monotonic() - t0 < 3  # not the 30 s read timeout
        assert not client.created  # static keys: the seam, no botocore client


def test_a_stop_interrupts_a_resolve_waiting_for_response_headers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, test_ca: TestCA
) -> None:
    """Issue 22: SIGTERM (the pull's stop) during the listing waited out the read timeout."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with SilentServer(test_ca) as server:
        client = lazy_s3_client(
            endpoint_url=server.url, access_key="k", secret_key="s", region="us-east-1",
            read_timeout=30,
        )  # fmt: skip
        spec = ModelSpec(source=parse_source_uri("s3://bkt/m/"))
        source = S3Source(client, spec.source, retry=RetryPolicy(attempts=3))
        stop = threading.Event()
        threading.Timer(0.5, stop.set).start()
        t0 = time.monotonic()
        with pytest.raises(Cancelled, match="stopped"):
            sync(spec, source, PlainLayout(tmp_path / "dest"), TransferConfig(), stop=stop)
        assert time.monotonic() - t0 < 3  # not the 30 s read timeout, nor retries after it
