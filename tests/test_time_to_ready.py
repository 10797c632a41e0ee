"""Time to ready, by phase: a sync's phase timings, the agent's phase histograms and /readyz
fields, and the node's time to ready from its creation and from the agent's start."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from prefetch.agent.loop import Agent
from prefetch.agent.metrics import AgentMetrics
from prefetch.agent.node import NodeGate
from prefetch.agent.progress_note import WriteLimiter
from prefetch.agent.ready_clock import ReadyClock
from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.snapshot import RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import SYNC_PHASES, sync
from prefetch.support.constants import PROGRESS_ANNOTATION
from tests.fakes.k8s_stub import KubeStub, running_stub
from tests.fakes.memory import MemorySource
from tests.support import AgentThread, config_text, upload, wait_for

MiB = 1 << 20
NODE = "gpu-node-1"
SPEC = ModelSpec(source=parse_source_uri("s3://bucket/model"), name="model")
FILES = {"config.json": b"{}", "weights.bin": bytes(range(256)) * 4096}


@pytest.fixture
def stub() -> Iterator[KubeStub]:
    yield from running_stub()


# -- one sync's phases -------------------------------------------------------------------------


class SlowResolve(MemorySource):
    def resolve(self, spec: ModelSpec) -> Snapshot:
        time.sleep(0.2)
        return super().resolve(spec)


class SlowPublish(PlainLayout):
    def publish(self, file: RemoteFile, staged: Path, checks: Any) -> None:
        time.sleep(0.15)
        super().publish(file, staged, checks)


def test_each_phase_is_timed_where_its_time_went_and_they_add_up(tmp_path: Path) -> None:
    result = sync(SPEC, SlowResolve(dict(FILES)), SlowPublish(tmp_path / "dest"), TransferConfig())

    phases = result.timings.to_json()
    assert list(phases) == list(SYNC_PHASES)
    assert phases["resolve"] >= 0.2  # the slow listing
    # the last file's publish came after the last byte: waited for, so counted as publish
    assert phases["publish"] >= 0.15
    assert phases["download"] > 0 and phases["verify"] >= 0
    # the phases cover the sync but for a few calls between them (and the rounding to ms)
    assert -0.005 <= result.seconds - sum(phases.values()) < 0.25
    assert result.to_json()["timings"] == phases
    json.dumps(result.to_json())  # pull --json prints it


# -- the agent --------------------------------------------------------------------------------


class Reader:
    def __init__(self, created: float) -> None:
        self.created = created
        self.calls = 0

    def creation_time(self) -> float:
        self.calls += 1
        return self.created


def test_the_ready_clock_observes_once_and_skips_node_age_after_a_warm_start() -> None:
    now = [5000.0]
    cold = ReadyClock(AgentMetrics(CollectorRegistry()), started=4900.0, now=lambda: now[0])
    reader = Reader(created=4000.0)
    assert cold.on_pass(False) is False
    assert cold.on_pass(True) is True
    asyncio.run(cold.observe_node(reader))
    now[0] = 6000.0
    assert cold.on_pass(True) is False  # once per process
    assert cold.seconds == {"agent_start": 100.0, "node_creation": 1000.0}

    warm = ReadyClock(AgentMetrics(CollectorRegistry()), started=4900.0, now=lambda: now[0])
    assert warm.on_pass(True) is False  # ready on its first pass: a restart, not a cold start
    assert warm.seconds == {"agent_start": 1100.0}


def sample(agent: Agent, name: str, labels: dict[str, str]) -> float | None:
    return agent.registry.get_sample_value(name, labels)


@pytest.mark.slow
def test_a_cold_start_reports_phase_durations_and_time_to_ready_once(
    s3_client: Any, bucket: str, stub: KubeStub, tmp_path: Path
) -> None:
    created = time.time() - 600  # the node came up ten minutes ago
    stub.add_node(NODE, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)))
    upload(s3_client, bucket, "m1", tmp_path, 4 * MiB, seed=1)
    config = tmp_path / "models.yaml"
    config.write_text(
        config_text(tmp_path / "cache", [{"name": "m1", "source": f"s3://{bucket}/m1"}])
    )
    agent = Agent(
        config,
        s3_client=s3_client,
        gate_factory=lambda cfg: NodeGate(stub.client(), NODE, label_prefix=cfg.label_prefix),
        serve=False,
        tick=0.2,
    )
    agent.progress.limiter = WriteLimiter(interval=0.5)  # the rule is tested elsewhere
    with AgentThread(agent):
        wait_for(lambda: agent.status()["time_to_ready"]["node_creation"], "time to ready")
        wait_for(
            lambda: json.loads(
                stub.node(NODE)["metadata"].get("annotations", {}).get(PROGRESS_ANNOTATION, "{}")
            ).get("ready"),
            "the note to say ready",
        )
        passes = agent.passes
        wait_for(lambda: agent.passes > passes + 5, "more passes")
        body = agent.status()

    since = body["time_to_ready"]
    assert 600 <= since["node_creation"] < 660
    assert 0 < since["agent_start"] < since["node_creation"] - 590
    for key, value in since.items():
        gauge = sample(agent, "model_prefetch_ready_after_seconds", {"since": key})
        assert gauge == pytest.approx(value, abs=0.001)
        count = sample(agent, "model_prefetch_time_to_ready_seconds_count", {"since": key})
        assert count == 1.0  # once per process, however many passes follow

    last = body["models"][0]["last_sync"]
    assert set(last["phases"]) == set(SYNC_PHASES) and last["bytes_downloaded"] >= 4 * MiB
    assert -0.005 <= last["seconds"] - sum(last["phases"].values()) < 0.25
    for phase in SYNC_PHASES:
        labels = {"model": "m1", "phase": phase}
        assert sample(agent, "model_prefetch_sync_phase_duration_seconds_count", labels) == 1.0
        observed = sample(agent, "model_prefetch_sync_phase_duration_seconds_sum", labels)
        assert observed == pytest.approx(last["phases"][phase], abs=0.001)
    assert sample(agent, "process_start_time_seconds", {}) is not None
