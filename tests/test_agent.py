"""The node agent end to end: against the real local S3 server (SeaweedFS), the Kubernetes API
stub, kubelet-style ConfigMap updates, a small tmpfs, and as a subprocess receiving SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner

from prefetch.agent.loop import Agent
from prefetch.agent.node import NodeGate, label_key
from prefetch.cli import main
from prefetch.demo.locals3 import SeaweedS3
from prefetch.pipeline.store import Store
from prefetch.support.constants import DEFAULT_LABEL_PREFIX, DEFAULT_STARTUP_TAINT_KEY
from tests.fakes.k8s_stub import KubeStub, running_stub
from tests.support import (
    AgentProcess,
    AgentThread,
    config_text,
    http_get,
    is_ready,
    model_status,
    upload,
    wait_for,
)

MiB = 1024 * 1024
NODE = "gpu-node-1"
STARTUP = {"key": DEFAULT_STARTUP_TAINT_KEY, "value": "true", "effect": "NoSchedule"}
GPU = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


# -- helpers ------------------------------------------------------------------------------------


def other_bucket(bucket: str, suffix: str) -> str:
    return f"{bucket[:50].rstrip('-')}-{suffix}"


def stub_gate(stub: KubeStub) -> Callable[[Any], NodeGate]:
    def make(cfg: Any) -> NodeGate:
        return NodeGate(
            stub.client(),
            NODE,
            label_prefix=cfg.label_prefix,
            startup_taint_key=cfg.startup_taint,
            backoff=0.01,
            max_backoff=0.05,
        )

    return make


def ready_label(model: str) -> str:
    return label_key(DEFAULT_LABEL_PREFIX, model)


def gate_patches(stub: KubeStub) -> list[Any]:
    """The node gate's PATCHes (JSON patches of labels and taints), not the progress note's."""
    return [
        p
        for p in stub.requests_of("PATCH")
        if p.path.startswith("/api/v1/nodes/") and p.content_type == "application/json-patch+json"
    ]


def sample(agent: Agent, name: str, **labels: str) -> float | None:
    return agent.registry.get_sample_value(name, labels)


class ThrottleProxy:
    """A TCP proxy to the S3 server that caps the download rate (bytes/s across connections).

    Bytes pass unchanged, so SigV4 signatures (made for the proxy's Host) stay valid, and TLS
    runs end to end: the proxy's endpoint has the upstream's scheme and host name (the one its
    certificate names), only the port is the proxy's.
    """

    def __init__(self, upstream: str, rate: float) -> None:
        u = urlsplit(upstream)
        self._upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self._rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()
        self._socks: list[socket.socket] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"{u.scheme}://{u.hostname}:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
                upstream = socket.create_connection(self._upstream)
            except OSError:
                return
            self._socks += [client, upstream]
            for src, dst, slow in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, slow), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while data := src.recv(64 * 1024):
                if slow:
                    with self._lock:
                        now = time.monotonic()
                        self._next = max(self._next, now) + len(data) / self._rate
                        delay = self._next - now
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._server.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()


@pytest.fixture
def stub() -> Iterator[KubeStub]:
    yield from running_stub()


# -- subprocess: cold start, metrics, SIGTERM ------------------------------------------------------


def test_cold_start_to_ready_as_a_subprocess(
    s3_server: SeaweedS3, s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    files = upload(s3_client, bucket, "llama", tmp_path, 16 * MiB)
    total = sum(len(b) for b in files.values())
    config = tmp_path / "models.yaml"
    config.write_text(
        config_text(tmp_path / "cache", [{"name": "llama", "source": f"s3://{bucket}/llama"}])
    )
    proxy = ThrottleProxy(s3_server.endpoint, rate=8e6)  # ~2 s: /readyz is seen failing first
    agent = AgentProcess(
        config, {**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}, tmp_path / "agent.log"
    )
    try:
        wait_for(agent.up, "/healthz to answer 200", timeout=30)
        code, body = agent.get("/readyz")
        assert code == 503, body
        first = json.loads(body)
        assert first["ready"] is False and first["models"][0]["name"] == "llama"
        assert first["models"][0]["ready"] is False

        wait_for(lambda: agent.get("/readyz")[0] == 200, "/readyz to turn 200", timeout=60)
        ready = json.loads(agent.get("/readyz")[1])
        (model,) = ready["models"]
        assert model["state"] == "ready" and model["bytes_remaining"] == 0
        assert model["bytes_total"] == total and model["last_error"] is None

        assert (
            agent.metric("model_prefetch_downloaded_bytes_total", model="llama", source="s3")
            == total
        )
        assert agent.metric("model_prefetch_files_downloaded_total", model="llama") == len(files)
        assert agent.metric("model_prefetch_model_ready", model="llama") == 1
        assert agent.metric("model_prefetch_model_state", model="llama", state="ready") == 1
        assert agent.metric("model_prefetch_all_required_ready") == 1
        assert agent.metric("model_prefetch_sync_duration_seconds_count", model="llama") == 1
        assert agent.metric("model_prefetch_last_success_timestamp_seconds", model="llama")
        assert (agent.metric("model_prefetch_cache_free_bytes") or 0) > 0

        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(30) == 0
    finally:
        agent.stop()
        proxy.close()
    log = agent.stderr()
    assert s3_server.secret_key not in log
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert records and all({"ts", "level", "logger", "msg"} <= r.keys() for r in records)
    assert any(
        r.get("model") == "llama" and r.get("phase") == "sync" and r.get("bytes") == total
        for r in records
    )
    assert (tmp_path / "cache" / "models" / "llama" / "config.json").read_bytes() == files[
        "config.json"
    ]


@pytest.mark.slow
def test_sigterm_mid_sync_exits_cleanly_and_the_next_run_resumes(
    s3_server: SeaweedS3, s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    files = upload(s3_client, bucket, "big", tmp_path, 32 * MiB, seed=3)
    total = sum(len(b) for b in files.values())
    cache = tmp_path / "cache"
    config = tmp_path / "models.yaml"
    config.write_text(
        config_text(
            cache,
            [{"name": "big", "source": f"s3://{bucket}/big"}],
            concurrency=4,
            chunkSize="1MiB",
        )
    )
    proxy = ThrottleProxy(s3_server.endpoint, rate=4e6)
    first = AgentProcess(
        config, {**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}, tmp_path / "first.log"
    )
    try:
        wait_for(first.up, "the first agent to come up", timeout=30)
        wait_for(
            lambda: (
                (first.metric("model_prefetch_downloaded_bytes_total", model="big") or 0) >= 8 * MiB
            ),
            "8 MiB downloaded",
            timeout=60,
        )
        t0 = time.monotonic()
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(30) == 0, first.stderr()
        assert time.monotonic() - t0 < 30
    finally:
        first.stop()
        proxy.close()
    partial = cache / "models" / "big" / ".prefetch" / "partial"
    assert list(partial.glob("*.incomplete")), "no partial download was left to resume"
    assert "SIGTERM received" in first.stderr()

    second = AgentProcess(config, s3_env, tmp_path / "second.log")
    try:
        wait_for(second.up, "the second agent to come up", timeout=30)
        wait_for(lambda: second.get("/readyz")[0] == 200, "the resumed model", timeout=60)
        again = second.metric("model_prefetch_downloaded_bytes_total", model="big")
        assert again is not None and 0 < again < total - 2 * MiB, (again, total)
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(30) == 0
    finally:
        second.stop()
    assert "resuming" in second.stderr()
    for path, data in files.items():
        assert (cache / "models" / "big" / path).read_bytes() == data, path


# -- in process: failures, the gate, config reloads ---------------------------------------------


def test_one_bad_source_does_not_hold_up_the_others(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    upload(s3_client, bucket, "g1", tmp_path, 6 * MiB, seed=1)
    upload(s3_client, bucket, "g2", tmp_path, 6 * MiB, seed=2)
    missing = other_bucket(bucket, "missing")
    config = tmp_path / "models.yaml"
    config.write_text(
        config_text(
            tmp_path / "cache",
            [
                {"name": "broken", "source": f"s3://{missing}/x"},  # first in line, and required
                {"name": "g1", "source": f"s3://{bucket}/g1"},
                {"name": "g2", "source": f"s3://{bucket}/g2", "required": False},
            ],
            parallelModels=1,
            listen="127.0.0.1:0",
            retryBackoff={"initial": "30s", "max": "5m"},
        )
    )
    agent = Agent(config, s3_client=s3_client, tick=0.2)
    with AgentThread(agent):
        wait_for(
            lambda: is_ready(agent, "g1") and is_ready(agent, "g2"), "g1 and g2", dump=agent.status
        )
        assert agent.server is not None
        code, body = http_get(f"http://127.0.0.1:{agent.server.port}/readyz")
        assert code == 503
        status = json.loads(body)
        broken = next(m for m in status["models"] if m["name"] == "broken")
        assert broken["state"] == "failed" and not broken["ready"]
        assert "bucket does not exist" in broken["last_error"]
        assert broken["error_reason"] == "not_found" and broken["failures"] == 1  # backing off
        waits = re.findall(r"; next try in (\d+)s$", broken["detail"])
        assert waits and 1 <= int(waits[0]) <= 60, broken["detail"]  # 30 s + jitter; never "0s"
        assert "broken" in status["summary"]
        assert (
            sample(agent, "model_prefetch_sync_failures_total", model="broken", reason="not_found")
            == 1
        )
        code, metrics = http_get(f"http://127.0.0.1:{agent.server.port}/metrics")
        assert code == 200 and b"model_prefetch_model_state" in metrics
        assert http_get(f"http://127.0.0.1:{agent.server.port}/healthz")[0] == 200


def test_gate_labels_ready_models_and_lifts_the_taint_when_all_required_are_ready(
    s3_client: Any, bucket: str, stub: KubeStub, tmp_path: Path
) -> None:
    stub.add_node(NODE, labels={"karpenter.sh/nodepool": "gpu"}, taints=[GPU, STARTUP])
    upload(s3_client, bucket, "r1", tmp_path, 4 * MiB, seed=1)
    late = other_bucket(bucket, "late")
    config = tmp_path / "models.yaml"
    config.write_text(
        config_text(
            tmp_path / "cache",
            [
                {"name": "r1", "source": f"s3://{bucket}/r1"},
                {"name": "r2", "source": f"s3://{late}/r2"},  # its bucket appears later
                {
                    "name": "optional",
                    "source": f"s3://{other_bucket(bucket, 'never')}/o",
                    "required": False,
                },
            ],
        )
    )
    agent = Agent(config, s3_client=s3_client, gate_factory=stub_gate(stub), serve=False, tick=0.2)
    with AgentThread(agent):
        wait_for(
            lambda: stub.labels(NODE).get(ready_label("r1")) == "ready",
            "r1's label",
            dump=agent.status,
        )
        assert STARTUP in stub.taints(NODE), "the taint went before every required model"
        assert ready_label("r2") not in stub.labels(NODE)
        assert agent.readiness()[0] == 503

        upload(s3_client, late, "r2", tmp_path, 4 * MiB, seed=2, create_bucket=True)
        wait_for(
            lambda: STARTUP not in stub.taints(NODE), "the startup taint to go", dump=agent.status
        )
        labels = stub.labels(NODE)
        assert labels[ready_label("r1")] == labels[ready_label("r2")] == "ready"
        assert ready_label("optional") not in labels  # failing, but not required
        assert labels["karpenter.sh/nodepool"] == "gpu" and stub.taints(NODE) == [GPU]
        assert agent.readiness()[0] == 200
    # the taint went in the same patch that labelled the last required model, not before
    taint_ops = [
        (i, p.body)
        for i, p in enumerate(gate_patches(stub))
        if any(op["op"] == "remove" and op["path"].startswith("/spec/taints") for op in p.body)
    ]
    assert len(taint_ops) == 1
    r2_add = "/metadata/labels/" + ready_label("r2").replace("/", "~1")
    assert any(op["op"] == "add" and op["path"] == r2_add for op in taint_ops[0][1])


class KubeletConfigDir:
    """A ConfigMap volume as the kubelet writes it, updated the way the kubelet does."""

    def __init__(self, root: Path, text: str) -> None:
        self.root = root
        root.mkdir()
        self._n = 0
        self._current = self._write(text)
        os.symlink(self._current, root / "..data")
        os.symlink("..data/models.yaml", root / "models.yaml")
        self.path = root / "models.yaml"

    def _write(self, text: str) -> str:
        self._n += 1
        name = f"..2026_01_0{self._n}_12_00_00.{1000 + self._n}"
        (self.root / name).mkdir()
        (self.root / name / "models.yaml").write_text(text)
        return name

    def update(self, text: str) -> None:
        new = self._write(text)
        os.symlink(new, self.root / "..data_tmp")
        os.replace(self.root / "..data_tmp", self.root / "..data")
        old, self._current = self._current, new
        (self.root / old / "models.yaml").unlink()
        (self.root / old).rmdir()


def test_config_reload_by_kubelet_symlink_swap(
    s3_client: Any, bucket: str, stub: KubeStub, tmp_path: Path
) -> None:
    stub.add_node(NODE, taints=[STARTUP])
    upload(s3_client, bucket, "m1", tmp_path, 4 * MiB, seed=1)
    upload(s3_client, bucket, "m2", tmp_path, 4 * MiB, seed=2)
    cache = tmp_path / "cache"
    m1 = {"name": "m1", "source": f"s3://{bucket}/m1"}
    m2 = {"name": "m2", "source": f"s3://{bucket}/m2"}
    cm = KubeletConfigDir(tmp_path / "config", config_text(cache, [m1]))
    agent = Agent(cm.path, s3_client=s3_client, gate_factory=stub_gate(stub), serve=False, tick=0.2)

    def labelled() -> set[str]:
        return {k for k, v in stub.labels(NODE).items() if v == "ready"}

    with AgentThread(agent):
        wait_for(lambda: labelled() == {ready_label("m1")}, "m1 labelled", dump=agent.status)
        # (the agent also polls the file every 30 s; these waits are shorter, so the watch counts)

        cm.update(config_text(cache, [m1, m2]))  # a model added: synced and labelled
        wait_for(
            lambda: labelled() == {ready_label("m1"), ready_label("m2")},
            "m2 labelled",
            timeout=15,
            dump=agent.status,
        )
        assert (cache / "models" / "m2" / "config.json").is_file()

        cm.update(config_text(cache, [m2]))  # a model removed: label gone, evictable
        wait_for(
            lambda: labelled() == {ready_label("m2")},
            "m1's label removed",
            timeout=15,
            dump=agent.status,
        )
        assert [m["name"] for m in agent.status()["models"]] == ["m2"]
        listing = CliRunner().invoke(main, ["ls", "--config", str(cm.path), "--json"])
        assert listing.exit_code == 0, listing.output
        wanted = {e["name"]: e["wanted"] for e in json.loads(listing.stdout)}
        assert wanted == {"m1": False, "m2": True}

        digest = agent.status()["config"]["digest"]
        cm.update(config_text(cache, [{"name": "m2"}]))  # malformed: no source
        wait_for(
            lambda: sample(agent, "model_prefetch_config_reload_failures_total") == 1,
            "the reload failure to count",
            timeout=15,
        )
        status = agent.status()
        assert "models[0].source: missing" in status["config"]["last_reload_error"]
        assert status["config"]["digest"] == digest  # the last good config keeps running
        assert sample(agent, "model_prefetch_config_last_reload_successful") == 0
        assert is_ready(agent, "m2") and labelled() == {ready_label("m2")}

        cm.update(config_text(cache, [m2], verifyInterval="1h"))  # fixed again
        wait_for(
            lambda: sample(agent, "model_prefetch_config_last_reload_successful") == 1,
            "the good config to load",
            timeout=15,
        )
        assert agent.status()["config"]["last_reload_error"] is None
        assert agent.config.verify_interval == 3600


def test_a_changed_source_is_picked_up_on_re_resolve(
    s3_client: Any, bucket: str, stub: KubeStub, tmp_path: Path
) -> None:
    stub.add_node(NODE, taints=[STARTUP])
    files = upload(s3_client, bucket, "m", tmp_path, 3 * MiB)
    cache = tmp_path / "cache"
    config = tmp_path / "models.yaml"
    config.write_text(
        config_text(cache, [{"name": "m", "source": f"s3://{bucket}/m"}], resolveInterval="1s")
    )
    agent = Agent(config, s3_client=s3_client, gate_factory=stub_gate(stub), serve=False, tick=0.2)
    with AgentThread(agent):
        wait_for(lambda: is_ready(agent, "m"), "m", dump=agent.status)
        before = model_status(agent, "m")["revision"]
        new_config = json.dumps({**json.loads(files["config.json"]), "rope_theta": 500000.0})
        s3_client.put_object(Bucket=bucket, Key="m/config.json", Body=new_config.encode())
        local = cache / "models" / "m" / "config.json"
        wait_for(
            lambda: local.read_text() == new_config,
            "the new config.json",
            timeout=15,
            dump=agent.status,
        )
        wait_for(lambda: model_status(agent, "m")["revision"] != before, "the new revision")
        assert is_ready(agent, "m")
    # the model kept its label throughout: no patch ever removed it
    assert not [
        p
        for p in gate_patches(stub)
        if any(op["op"] == "remove" and "labels" in op["path"] for op in p.body)
    ]


def test_bit_rot_is_found_the_label_dropped_first_and_the_file_fetched_again(
    s3_client: Any, bucket: str, stub: KubeStub, tmp_path: Path
) -> None:
    stub.add_node(NODE, taints=[STARTUP])
    files = upload(s3_client, bucket, "m", tmp_path, 6 * MiB)
    cache = tmp_path / "cache"
    config = tmp_path / "models.yaml"
    config.write_text(
        config_text(cache, [{"name": "m", "source": f"s3://{bucket}/m"}], verifyInterval="1s")
    )
    agent = Agent(config, s3_client=s3_client, gate_factory=stub_gate(stub), serve=False, tick=0.2)
    shard = sorted(p for p in files if p.endswith(".safetensors"))[0]
    local = cache / "models" / "m" / shard
    with AgentThread(agent):
        wait_for(
            lambda: stub.labels(NODE).get(ready_label("m")) == "ready" and not stub.taints(NODE),
            "m labelled",
            dump=agent.status,
        )
        wait_for(
            lambda: sample(agent, "model_prefetch_verifications_total", model="m", result="ok"),
            "a clean re-verification",
        )
        seen_at_unlabel: list[bytes] = []
        stub.before_next_patch(lambda node: seen_at_unlabel.append(local.read_bytes()))
        data = bytearray(local.read_bytes())
        data[len(data) // 2] ^= 0x01
        local.write_bytes(bytes(data))

        wait_for(
            lambda: sample(
                agent, "model_prefetch_checksum_failures_total", model="m", reason="reverify"
            ),
            "the mismatch to be found",
        )
        wait_for(
            lambda: (
                local.exists()
                and local.read_bytes() == files[shard]
                and stub.labels(NODE).get(ready_label("m")) == "ready"
            ),
            "the file re-fetched",
            dump=agent.status,
        )
    assert seen_at_unlabel == [bytes(data)], "the label must go before the file is touched"
    # (the observing hook bumps the node's resourceVersion, so that first patch is retried)
    removals = [
        p
        for p in gate_patches(stub)
        if p.status == 200 and any(op["op"] == "remove" and "labels" in op["path"] for op in p.body)
    ]
    assert len(removals) == 1
    assert sample(agent, "model_prefetch_verifications_total", model="m", result="failed") == 1


# -- disk pressure on a small filesystem ----------------------------------------------------------


@pytest.mark.slow
def test_disk_pressure_evicts_lru_keeps_pinned_and_fails_clearly(
    s3_client: Any, bucket: str, small_fs: Path, tmp_path: Path
) -> None:
    # 124 MiB filesystem, 64 MiB kept free (minFreeSpace). a, b, c: 12 MiB each.
    for i, name in enumerate(("a", "b", "c", "d", "e")):
        size = {"d": 30 * MiB, "e": 60 * MiB}.get(name, 12 * MiB)
        upload(s3_client, bucket, name, tmp_path, size, seed=i)
    cache = small_fs / "cache"
    config = tmp_path / "models.yaml"

    def models(*names: str) -> list[dict[str, Any]]:
        return [{"name": n, "source": f"s3://{bucket}/{n}", "pin": n == "a"} for n in names]

    config.write_text(config_text(cache, models("a", "b", "c"), minFreeSpace="64MiB"))
    agent = Agent(config, s3_client=s3_client, serve=False, tick=0.2)
    with AgentThread(agent):
        wait_for(lambda: all(is_ready(agent, n) for n in "abc"), "a, b, c", dump=agent.status)
    store = Store(cache)
    store.set_last_used("models/a", time.time() - 3000)  # the oldest, but pinned
    store.set_last_used("models/b", time.time() - 2000)
    store.set_last_used("models/c", time.time() - 1000)

    config.write_text(config_text(cache, models("d"), minFreeSpace="64MiB"))
    agent = Agent(config, s3_client=s3_client, serve=False, tick=0.2)
    with AgentThread(agent):
        wait_for(lambda: is_ready(agent, "d"), "d after an eviction", dump=agent.status)
        assert sorted(p.name for p in (cache / "models").iterdir()) == ["a", "c", "d"]
        assert sample(agent, "model_prefetch_evictions_total", reason="disk_pressure") == 1

        config.write_text(config_text(cache, models("d", "e"), minFreeSpace="64MiB"))
        wait_for(
            lambda: model_status(agent, "e").get("state") == "failed",
            "e to fail",
            dump=agent.status,
        )
        e = model_status(agent, "e")
        assert e["error_reason"] == "insufficient_space"
        assert "not enough disk space" in e["last_error"] and "minFreeSpace" in e["last_error"]
        assert agent.readiness()[0] == 503
        assert (
            sample(
                agent, "model_prefetch_sync_failures_total", model="e", reason="insufficient_space"
            )
            == 1
        )
        # nothing was evicted in vain, and the pinned model stayed; e's entry, made to hold its
        # lock, stays (the lock may be another process's) and, holding nothing, is no entry
        assert sorted(p.name for p in (cache / "models").iterdir()) == ["a", "c", "d", "e"]
        assert [m.key for m in Store(cache).list()] == ["models/a", "models/c", "models/d"]
        assert sample(agent, "model_prefetch_evictions_total", reason="disk_pressure") == 1
        assert is_ready(agent, "d")
