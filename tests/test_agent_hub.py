"""The agent with a Hub model: the cache it warms is what vLLM's huggingface_hub reads offline."""

from __future__ import annotations

import time
from pathlib import Path

from .fakes.hubserver import HubServer, make_model_repo
from .support import AgentProcess, clean_env, config_text, hf_check, server_files, wait_for
from .tls import TestCA


def test_agent_warms_a_hub_model_that_huggingface_hub_loads_offline(
    tmp_path: Path, test_ca: TestCA
) -> None:
    cache = tmp_path / "cache"
    with HubServer(test_ca, token="hf_agent_secret_token") as hub:
        sha = make_model_repo(hub, "acme/tiny", tmp_path / "src", seed=3)
        config = tmp_path / "models.yaml"
        models = [{"name": "tiny", "source": "hf://acme/tiny", "revision": "main"}]
        config.write_text(config_text(cache, models))
        env = clean_env(tmp_path / "home", HF_ENDPOINT=hub.endpoint,
                        HF_TOKEN="hf_agent_secret_token")  # fmt: skip
        agent = AgentProcess(config, env, tmp_path / "agent.log")
        try:
            assert agent.ready_then_terminated()["models"][0]["state"] == "ready"
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


def test_agent_follows_a_moved_branch_and_prunes_the_old_snapshot(
    tmp_path: Path, test_ca: TestCA
) -> None:
    cache = tmp_path / "cache"
    repo = cache / "hub" / "models--acme--tiny"
    with HubServer(test_ca) as hub:
        sha1 = make_model_repo(hub, "acme/tiny", tmp_path / "src", seed=4)
        config = tmp_path / "models.yaml"
        models = [{"name": "tiny", "source": "hf://acme/tiny"}]
        config.write_text(config_text(cache, models, resolveInterval="1s", supersededGrace="1h"))
        env = clean_env(tmp_path / "home", HF_ENDPOINT=hub.endpoint)
        agent = AgentProcess(config, env, tmp_path / "agent.log")
        try:
            wait_for(lambda: agent.up() and agent.get("/readyz")[0] == 200, "ready", timeout=60)
            assert (repo / "refs/main").read_text() == sha1
            sha2 = hub.add_commit("acme/tiny", {"config.json": b'{"v": 2}'}, inherit=True)
            wait_for(lambda: (repo / "refs/main").read_text() == sha2, "main moved", timeout=30)
            time.sleep(2.5)  # two more resolves: within the grace the old snapshot stays
            assert (repo / "snapshots" / sha1).is_dir()
            config.write_text(config_text(cache, models, resolveInterval="1s", supersededGrace="0"))
            wait_for(
                lambda: not (repo / "snapshots" / sha1).exists(),
                "the old snapshot pruned once the grace is 0",
                timeout=30,
            )
            removed = f"removed {len(server_files(hub, 'acme/tiny', revision=sha1))} file(s)"
            # the files go before the sync's log line is written: wait for the line, not the files
            wait_for(lambda: removed in agent.stderr(), "the pruning sync's log line", timeout=30)
            assert agent.get("/readyz")[0] == 200
        finally:
            agent.stop()
        expected = server_files(hub, "acme/tiny", revision=sha2)
        blobs = {f.etag for f in hub.files("acme/tiny", sha2).values()}
    assert removed in agent.stderr()  # the sync that pruned says so
    assert [p.name for p in (repo / "snapshots").iterdir()] == [sha2]
    assert {p.name for p in (repo / "blobs").iterdir()} == blobs  # the old config blob is gone
    out = hf_check(cache, 'out["path"] = hf.snapshot_download(params["repo"])', repo="acme/tiny")
    assert out["path"].endswith(sha2)
    assert sorted(
        str(p.relative_to(out["path"])) for p in Path(out["path"]).rglob("*") if p.is_file()
    ) == sorted(expected)
