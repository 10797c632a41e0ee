"""The agent with an ``oci://`` model: synced from a real registry to ready, in the HF layout
huggingface_hub reads offline."""

from __future__ import annotations

import os
from pathlib import Path

from .fakes.registry import Registry
from .support import AgentProcess, clean_env, config_text, hf_check

FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": os.urandom(300_000)}


def test_agent_syncs_an_oci_model_to_ready_in_the_hf_layout(registry: Registry, tmp_path: Path):
    pushed = registry.pusher().modelpack("models/tiny", "v1", FILES)
    cache = tmp_path / "cache"
    config = tmp_path / "models.yaml"
    models = [{"name": "tiny", "source": f"oci://{registry.host}/models/tiny:v1",
               "hfRepo": "acme/tiny"}]  # fmt: skip
    config.write_text(config_text(cache, models))
    env = clean_env(tmp_path / "home", DOCKER_CONFIG=str(tmp_path / "docker"))
    agent = AgentProcess(config, env, tmp_path / "agent.log")
    try:
        assert agent.ready_then_terminated()["models"][0]["state"] == "ready"
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
