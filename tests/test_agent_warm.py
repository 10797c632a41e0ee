"""The agent's page-cache warm-up (``warmPageCache``, ``gateOnWarm``): against the real local S3
server (SeaweedFS), residency checked through mincore, the phase in /readyz and the metrics."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from prefetch.agent.config import parse_config
from prefetch.agent.loop import Agent
from prefetch.pipeline.warmup import DEFAULT_MEMORY_SHARE, DEFAULT_READ_RATE, resident_bytes
from prefetch.support.errors import ConfigError
from tests.support import AgentThread, config_text, model_status, upload, wait_for

MiB = 1024 * 1024

#: A warm-up that read every byte ends ``warm``, or ``partial`` when the machine's memory pressure
#: pushed some of it out of the page cache before the residency check (which tests/test_warm.py
#: covers with its own files): which one is the machine's, not the agent's, to decide.
ENDED = ("warm", "partial")


def model_files(agent: Agent, name: str) -> list[Path]:
    spec = agent.config.model(name)
    assert spec is not None
    return [rec.local for rec in agent.store.layout(spec).recorded()]


def warm_state(agent: Agent, name: str) -> str | None:
    warm = model_status(agent, name).get("warm")
    return warm["state"] if warm else None


def test_config_reads_the_warm_keys() -> None:
    text = """
warmMemoryShare: 0.25
warmReadRate: 100MB
models:
  - {name: a, source: s3://bkt/a, warmPageCache: true}
  - {name: g, source: s3://bkt/g, gateOnWarm: true}
  - {name: c, source: s3://bkt/c}
"""
    config = parse_config(text)
    assert config.warm_page_cache == {"a", "g"}  # gateOnWarm implies the warm-up
    assert config.gate_on_warm == {"g"}
    assert config.warm_limits().memory_share == 0.25
    assert config.warm_limits().read_rate == 100 * 1000 * 1000
    plain = parse_config("models: [{name: c, source: s3://bkt/c}]")
    assert plain.warm_page_cache == plain.gate_on_warm == frozenset()
    assert plain.warm_limits().memory_share == DEFAULT_MEMORY_SHARE
    assert plain.warm_limits().read_rate == DEFAULT_READ_RATE
    assert parse_config("warmReadRate: 0").warm_read_rate is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("warmMemoryShare: 0", "warmMemoryShare: expected a number in (0, 1]"),
        ("warmMemoryShare: 1.5", "warmMemoryShare: expected a number in (0, 1]"),
        ("warmMemoryShare: yes", "warmMemoryShare: expected a number in (0, 1]"),
        ("models: [{name: a, source: s3://bkt/a, warmPageCache: 3}]", "models[0].warmPageCache"),
        ("models: [{name: a, source: s3://bkt/a, gateOnWarm: maybe}]", "models[0].gateOnWarm"),
    ],
)
def test_config_rejects_bad_warm_values(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(text)


def test_a_warm_page_cache_model_is_resident_after_it_is_ready(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    upload(s3_client, bucket, "w", tmp_path, 6 * MiB, seed=1)
    upload(s3_client, bucket, "cold", tmp_path, 6 * MiB, seed=2)
    config = tmp_path / "models.yaml"
    config.write_text(
        config_text(
            tmp_path / "cache",
            [
                {"name": "w", "source": f"s3://{bucket}/w", "warmPageCache": True},
                {"name": "cold", "source": f"s3://{bucket}/cold"},
            ],
        )
    )
    agent = Agent(config, s3_client=s3_client, serve=False, tick=0.2)
    with AgentThread(agent):
        wait_for(lambda: warm_state(agent, "w") in ENDED, "w's warm-up", dump=agent.status)
        wait_for(lambda: model_status(agent, "cold").get("ready"), "cold", dump=agent.status)
        w = model_status(agent, "w")
        assert w["ready"]
        assert w["warm"]["bytes_read"] == w["bytes_total"] >= 6 * MiB
        assert w["warm"]["bytes_read"] <= w["warm"]["budget"]
        assert "warm" in w["last_sync"]["phases"]
        assert model_status(agent, "cold")["warm"] is None
        assert "warm" not in model_status(agent, "cold")["last_sync"]["phases"]
        for f in model_files(agent, "w"):
            assert resident_bytes(f) >= f.stat().st_size
        get = agent.registry.get_sample_value
        assert get("model_prefetch_warmups_total", {"model": "w", "result": "warm"}) == 1
        assert get("model_prefetch_warm_bytes", {"model": "w"}) == w["bytes_total"]
        assert get("model_prefetch_warm_duration_seconds", {"model": "w"}) is not None
        assert get("model_prefetch_warmups_total", {"model": "cold", "result": "warm"}) is None


def test_gate_on_warm_holds_readiness_until_the_warm_up_ends_and_warm_alone_does_not(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    upload(s3_client, bucket, "g", tmp_path, 4 * MiB, seed=3)
    upload(s3_client, bucket, "w", tmp_path, 4 * MiB, seed=4)
    config = tmp_path / "models.yaml"
    config.write_text(
        config_text(
            tmp_path / "cache",
            [
                {"name": "g", "source": f"s3://{bucket}/g", "gateOnWarm": True},
                {"name": "w", "source": f"s3://{bucket}/w", "warmPageCache": True},
            ],
            warmReadRate="1MiB",  # 4 MiB: about 4 s of warming to watch
        )
    )
    agent = Agent(config, s3_client=s3_client, serve=False, tick=0.2)
    with AgentThread(agent):
        seen = wait_for(
            lambda: (
                [model_status(agent, n) for n in ("g", "w")]
                if warm_state(agent, "g") == warm_state(agent, "w") == "warming"
                else None
            ),
            "both warm-ups to run",
            dump=agent.status,
            interval=0.02,
        )
        g, w = seen
        assert not g["ready"] and "warming the page cache" in g["detail"]
        assert w["ready"] and "warming the page cache" in w["detail"]
        assert agent.readiness()[0] == 503  # g is required and not ready yet
        wait_for(lambda: model_status(agent, "g").get("ready"), "g ready", dump=agent.status)
        assert warm_state(agent, "g") in ENDED
        for f in model_files(agent, "g"):
            assert resident_bytes(f) >= f.stat().st_size


def test_a_model_over_its_memory_share_is_skipped_and_still_ready(
    s3_client: Any, bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefetch.pipeline.warmup")
    upload(s3_client, bucket, "big", tmp_path, 4 * MiB, seed=5)
    config = tmp_path / "models.yaml"
    config.write_text(
        config_text(
            tmp_path / "cache",
            [{"name": "big", "source": f"s3://{bucket}/big", "gateOnWarm": True}],
            warmMemoryShare=1e-6,  # of ~24 GiB: some 25 KB
        )
    )
    agent = Agent(config, s3_client=s3_client, serve=False, tick=0.2)
    with AgentThread(agent):
        wait_for(lambda: model_status(agent, "big").get("ready"), "big", dump=agent.status)
        warm = model_status(agent, "big")["warm"]
        assert warm["state"] == "skipped" and "does not fit" in warm["reason"]
        assert warm["bytes_read"] == 0 and warm["bytes_total"] >= 4 * MiB
    assert any("warm-up skipped" in r.getMessage() for r in caplog.records)


def test_a_partial_warm_up_is_a_warning_event() -> None:
    from prefetch.agent.events import warm_up_finished

    why = "only 4 B of 10 B (40%) stayed in the page cache"
    partial = warm_up_finished("m", "partial", bytes_read=10, seconds=1.0, revision="r", reason=why)
    assert partial.type == "Warning" and "40%" in partial.note
    skipped = warm_up_finished("m", "skipped", bytes_read=0, seconds=0.0, revision="r",
                               reason="does not fit")  # fmt: skip
    assert skipped.type == "Normal"
