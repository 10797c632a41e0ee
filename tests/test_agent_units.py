"""Small pieces of the agent: JSON logs, metrics as a ProgressSink, health, failure reasons."""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from prefetch.agent.config_values import AgentConfig
from prefetch.agent.loop import HEALTH_STALE_AFTER, Agent, failure_reason
from prefetch.agent.metrics import MODEL_STATES, AgentMetrics
from prefetch.agent.watch import ConfigWatcher
from prefetch.support.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    DeadlineExceededError,
    InsufficientSpaceError,
    PrefetchError,
    SourceError,
    TransientSourceError,
)
from prefetch.support.logjson import JsonFormatter, TextFormatter, scrub, setup_logging


def test_json_log_lines_carry_the_fields() -> None:
    stream = io.StringIO()
    handler = setup_logging("json", stream=stream)
    try:
        log = logging.getLogger("prefetch.test")
        log.info("synced %s", "m", extra={"model": "m", "phase": "sync", "bytes": 10, "rate": 5})
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed", extra={"model": "m"})
        logging.getLogger("botocore.hooks").info("noise")  # quietened
    finally:
        logging.getLogger().removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["msg"] == "synced m" and first["level"] == "info"
    assert first["logger"] == "prefetch.test" and first["ts"].endswith("Z")
    assert (first["model"], first["phase"], first["bytes"], first["rate"]) == ("m", "sync", 10, 5)
    assert second["error"] == "ValueError: boom" and "Traceback" in second["traceback"]


@pytest.mark.parametrize(
    "secret",
    [
        "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIAXXXX%2F2026&X-Amz-Signature=abcdef0123",
        "Authorization: Bearer hf_abcdefghijklmnopqrstuvwxyz",
        "token=hf_abcdefghijklmnopqrstuvwxyz123",
        "aws_secret_access_key = wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY",
        "https://cdn/x?Expires=1700000000&Signature=SiGnAtUrE&Key-Pair-Id=KPID",
    ],
)
def test_secrets_are_scrubbed(secret: str) -> None:
    out = scrub(f"request failed: {secret} (retrying)")
    for leaked in ("abcdef0123", "hf_abcdefghijklmnop", "wJalrXUtnFEMI", "SiGnAtUrE", "AKIAXXXX"):
        assert leaked not in out, out
    assert out.startswith("request failed: ") and out.endswith("(retrying)")
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "%s", (secret,), None)
    record.error = secret
    for formatter in (JsonFormatter(), TextFormatter()):
        assert "hf_abcdefghijklmnop" not in formatter.format(record)


def test_metrics_sink_feeds_the_registry() -> None:
    registry = CollectorRegistry()
    now = [1000.0]
    metrics = AgentMetrics(registry, rate_window=10, clock=lambda: now[0])
    sink = metrics.sink("m", "s3")
    sink.start("m", 20, 2)
    for _ in range(5):
        sink.advance(2)
    for _ in range(3):  # the engine tells each ranged request it completed
        sink.chunk_done()
    sink.file_done("a", 10)
    sink.retry("reset")
    sink.checksum_failure("b")
    assert sink.remaining == 10
    metrics.update_rates()
    value = registry.get_sample_value
    assert value("model_prefetch_downloaded_bytes_total", {"model": "m", "source": "s3"}) == 10
    assert value("model_prefetch_model_remaining_bytes", {"model": "m"}) == 10
    assert value("model_prefetch_files_downloaded_total", {"model": "m", "source": "s3"}) == 1
    assert value("model_prefetch_chunks_downloaded_total", {"model": "m", "source": "s3"}) == 3
    assert value("model_prefetch_retries_total", {"model": "m", "source": "s3"}) == 1
    assert (
        value("model_prefetch_checksum_failures_total", {"model": "m", "reason": "download"}) == 1
    )
    assert value("model_prefetch_download_rate_bytes_per_second", {"model": "m"}) == 1.0
    now[0] += 60
    metrics.update_rates()
    assert value("model_prefetch_download_rate_bytes_per_second", {"model": "m"}) == 0.0

    metrics.set_state("m", "syncing", ready=False, required=True)
    states = {
        s: value("model_prefetch_model_state", {"model": "m", "state": s}) for s in MODEL_STATES
    }
    assert states == {s: (1.0 if s == "syncing" else 0.0) for s in MODEL_STATES}
    metrics.forget_model("m")
    assert value("model_prefetch_model_state", {"model": "m", "state": "syncing"}) is None

    names = {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    # the agent's own, and the process collector's (process_start_time_seconds...)
    assert all(n.startswith(("model_prefetch_", "process_")) for n in names)
    # two registries never share state (no module-level registry)
    assert CollectorRegistry().get_sample_value("model_prefetch_all_required_ready") is None
    AgentMetrics(CollectorRegistry())


def test_health_fails_when_the_loop_stalls() -> None:
    agent = Agent(None, config=AgentConfig(), serve=False)
    assert agent.health()[0] == 503  # not running yet
    agent._running = True
    agent._beat = time.monotonic()
    assert agent.health() == (200, "ok")
    agent._beat = time.monotonic() - HEALTH_STALE_AFTER - 1
    code, text = agent.health()
    assert code == 503 and "stalled" in text


def test_failure_reasons_are_a_small_vocabulary() -> None:
    assert failure_reason(BucketNotFoundError("x")) == "not_found"
    assert failure_reason(AccessDeniedError("x")) == "access_denied"
    assert failure_reason(TransientSourceError("x")) == "transient"
    assert failure_reason(InsufficientSpaceError("x")) == "insufficient_space"
    assert failure_reason(RuntimeError("x")) == "internal"


def _kinds(cls: type[BaseException]) -> list[type[BaseException]]:
    return [cls, *(k for sub in cls.__subclasses__() for k in _kinds(sub))]


def test_the_agents_failure_labels_and_the_clis_error_reasons_are_one_vocabulary() -> None:
    from prefetch.cli.common import error_reason

    kinds = _kinds(PrefetchError)
    assert len(kinds) > 20
    for kind in [*kinds, OSError, RuntimeError]:
        exc = kind.__new__(kind)  # isinstance is all the table looks at
        assert failure_reason(exc) == error_reason(exc), kind
    assert failure_reason(DeadlineExceededError("x")) == "deadline"
    assert failure_reason(SourceError("x")) == "source_error"  # the agent said "source" before


def test_watcher_sees_a_kubelet_swap_but_not_reads(tmp_path: Path) -> None:
    (tmp_path / "..v1").mkdir()
    (tmp_path / "..v1" / "models.yaml").write_text("models: []\n")
    (tmp_path / "..data").symlink_to("..v1")
    (tmp_path / "models.yaml").symlink_to("..data/models.yaml")
    events = threading.Event()
    watcher = ConfigWatcher(tmp_path / "models.yaml", events.set)
    assert watcher.start()
    try:
        time.sleep(0.2)
        (tmp_path / "models.yaml").read_text()
        assert not events.wait(0.5), "reading the file must not count as a change"
        (tmp_path / "..v2").mkdir()
        (tmp_path / "..v2" / "models.yaml").write_text("models: [{}]\n")
        (tmp_path / "..data_tmp").symlink_to("..v2")
        (tmp_path / "..data_tmp").replace(tmp_path / "..data")
        assert events.wait(5)
    finally:
        watcher.stop()
