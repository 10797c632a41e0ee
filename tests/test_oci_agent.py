"""The agent with an ``oci://`` model: synced from a real registry to ready, in the HF layout
huggingface_hub reads offline."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from .fakes.registry import Pusher, Registry
from .support import AgentProcess, clean_env, config_text, hf_check, wait_for

FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": os.urandom(300_000)}


def test_agent_syncs_an_oci_model_to_ready_in_the_hf_layout(registry: Registry, tmp_path: Path):
    pushed = Pusher(registry.url).modelpack("models/tiny", "v1", FILES)
    cache = tmp_path / "cache"
    config = tmp_path / "models.yaml"
    models = [{"name": "tiny", "source": f"oci://{registry.host}/models/tiny:v1",
               "hfRepo": "acme/tiny"}]  # fmt: skip
    config.write_text(config_text(cache, models))
    env = clean_env(tmp_path / "home", DOCKER_CONFIG=str(tmp_path / "docker"))
    agent = AgentProcess(config, env, tmp_path / "agent.log")
    try:
        wait_for(lambda: agent.up() and agent.get("/readyz")[0] == 200, "ready", timeout=60)
        body = json.loads(agent.get("/readyz")[1])
        assert body["models"][0]["state"] == "ready"
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(30) == 0
    finally:
        agent.stop()
    out = hf_check(
        cache,
        """
        path = hf.snapshot_download(params["repo"])
        out["path"] = path
        out["config"] = open(path + "/config.json").read()
        """,
        repo="acme/tiny",
    )
    assert out["path"].endswith(pushed.digest.split(":", 1)[1])
    assert out["config"] == FILES["config.json"].decode()
