"""The agent with a Hub model: the cache it warms is what vLLM's huggingface_hub reads offline."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from .hubserver import HubServer, make_model_repo
from .test_agent import AgentProcess, config_text, wait_for
from .test_pull_hf import clean_env, hf_check, server_files


def test_agent_warms_a_hub_model_that_huggingface_hub_loads_offline(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with HubServer(token="hf_agent_secret_token") as hub:
        sha = make_model_repo(hub, "acme/tiny", tmp_path / "src", seed=3)
        config = tmp_path / "models.yaml"
        models = [{"name": "tiny", "source": "hf://acme/tiny", "revision": "main"}]
        config.write_text(config_text(cache, models))
        env = clean_env(tmp_path / "home", HF_ENDPOINT=hub.endpoint,
                        HF_TOKEN="hf_agent_secret_token")  # fmt: skip
        agent = AgentProcess(config, env, tmp_path / "agent.log")
        try:
            wait_for(lambda: agent.up() and agent.get("/readyz")[0] == 200, "ready", timeout=60)
            body = json.loads(agent.get("/readyz")[1])
            assert body["models"][0]["state"] == "ready"
            agent.proc.send_signal(signal.SIGTERM)
            assert agent.proc.wait(30) == 0
        finally:
            agent.stop()
        expected = server_files(hub, "acme/tiny")
        assert not [r for r in hub.requests if r.port == "cdn" and r.authorization]
    assert "hf_agent_secret_token" not in agent.stderr()
    # huggingface_hub itself, offline, with HF_HOME on the agent's cache dir
    out = hf_check(
        cache,
        """
        path = hf.snapshot_download(params["repo"])
        out["path"] = path
        out["files"] = sorted(
            str(p.relative_to(path)) for p in __import__("pathlib").Path(path).rglob("*")
            if p.is_file()
        )
        info = hf.scan_cache_dir()
        out["warnings"] = [str(w) for w in info.warnings]
        out["repos"] = [r.repo_id for r in info.repos]
        """,
        repo="acme/tiny",
    )
    assert out["path"].endswith(sha)
    assert out["files"] == sorted(expected)
    assert out["warnings"] == [] and out["repos"] == ["acme/tiny"]
    # our own state stays out of the repo folder huggingface_hub scans
    assert not list((cache / "hub").rglob(".prefetch"))
