"""Issue 29 item 18: a stalled model does not hold the only sync slot. With ``parallelModels: 1``
and default stall settings, one model's source trickling a byte every 5 s and a healthy second
model, the healthy one is ready within 90 s (the agent as a subprocess, against a scripted HTTPS
S3 endpoint)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from .fakes.scripted_s3 import ScriptedS3
from .support import AgentProcess, clean_env, wait_for
from .tls import TestCA

MiB = 1024 * 1024


def agent_env(tmp_path: Path, ca: TestCA, endpoint: str) -> dict[str, str]:
    return clean_env(
        tmp_path / "hf",
        **ca.env(),
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="AKIASTALL",
        AWS_SECRET_ACCESS_KEY="stall-secret",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws-credentials"),
    )


def ready_models(agent: AgentProcess) -> list[str]:
    if not agent.up():
        return []
    body = json.loads(agent.get("/readyz")[1])
    return sorted(m["name"] for m in body.get("models", []) if m.get("ready"))


@pytest.mark.slow
def test_a_stalled_model_does_not_hold_the_only_slot(test_ca: TestCA, tmp_path: Path) -> None:
    objects = {
        "stalled/w.bin": bytes(range(256)) * (8 * 1024),  # 2 MiB: ranged GETs, trickled
        "healthy/config.json": b"{}",
        "healthy/w.bin": bytes(range(256)) * 1024,
    }
    config = tmp_path / "models.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "cacheDir": str(tmp_path / "cache"),
                "minFreeSpace": "1MiB",
                "parallelModels": 1,  # everything else: the defaults
                "models": [
                    {"name": "stalled", "source": "s3://bkt/stalled"},
                    {"name": "healthy", "source": "s3://bkt/healthy"},
                ],
            },
            sort_keys=False,
        )
    )
    with ScriptedS3(test_ca, objects=objects, trickle=("stalled/",), trickle_every=5.0) as s3:
        agent = AgentProcess(config, agent_env(tmp_path, test_ca, s3.endpoint), tmp_path / "log")
        try:
            wait_for(agent.up, "the agent to come up", timeout=30)
            started = time.monotonic()
            wait_for(
                lambda: "healthy" in ready_models(agent),
                "the healthy model to be ready",
                timeout=90,
                interval=0.5,
                dump=agent.stderr,
            )
            took = time.monotonic() - started
            assert "stalled" not in ready_models(agent)
            trickled = [r for r in s3.requests() if r.kind == "get" and r.key == "stalled/w.bin"]
            assert trickled, "the stalled model never started"
            assert trickled[0].at < s3.requests()[-1].at  # it started first, and still runs
        finally:
            agent.stop()
    assert took < 90
    log = agent.stderr()
    assert "stalled: no progress" in log, log[-3000:]
