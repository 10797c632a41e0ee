"""``prefetch status`` against the Kubernetes API stub, through a real kubeconfig file: the table,
``-o json``, a node without an agent report, a label selector, and each way reading can fail."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from click.testing import CliRunner, Result
from prometheus_client import CollectorRegistry

from prefetch.agent.metrics import AgentMetrics
from prefetch.agent.node import NodeGate, label_key
from prefetch.agent.progress_note import build_note, encode
from prefetch.agent.scheduler import Job, JobKind, ModelState
from prefetch.cli import main
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import SyncResult
from prefetch.support.constants import (
    DEFAULT_LABEL_PREFIX,
    DEFAULT_STARTUP_TAINT_KEY,
    PROGRESS_ANNOTATION,
)
from tests.fakes.k8s_stub import KubeStub, running_stub
from tests.support import free_port

GiB = 1 << 30
MiB = 1 << 20
STARTUP = {"key": DEFAULT_STARTUP_TAINT_KEY, "value": "true", "effect": "NoSchedule"}
GPU_POOL = {"karpenter.sh/nodepool": "gpu"}


@pytest.fixture
def stub() -> Iterator[KubeStub]:
    yield from running_stub()


def kubeconfig(path: Path, server: str, *, extra_server: str = "http://127.0.0.1:9") -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "stub", "cluster": {"server": server}},
            {"name": "other", "cluster": {"server": extra_server}},
        ],
        "users": [{"name": "me", "user": {"token": "test-token"}}],
        "contexts": [
            {"name": "stub", "context": {"cluster": "stub", "user": "me"}},
            {"name": "other", "context": {"cluster": "other", "user": "me"}},
        ],
        "current-context": "stub",
    }
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def status(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, ["status", *args], env=env or {})


def model(name: str) -> ModelState:
    spec = ModelSpec(source=parse_source_uri(f"s3://bucket/{name}"), name=name)
    return ModelState(spec=spec, digest="d")


def warming_node(stub: KubeStub, name: str, written_ago: float) -> None:
    """A node whose agent reported 8 of 32 GiB of llama at 200 MiB/s, qwen ready and labelled."""
    stub.add_node(
        name,
        labels={**GPU_POOL, label_key(DEFAULT_LABEL_PREFIX, "qwen"): "ready"},
        taints=[STARTUP],
    )
    metrics = AgentMetrics(CollectorRegistry())
    llama = model("llama")
    sink = metrics.sink("llama", "s3")
    llama.start_sync(Job(JobKind.SYNC, cast(Any, None), threading.Event(), 0.0), sink)
    sink.start("llama", 32 * GiB, 4)
    sink.advance(8 * GiB)
    qwen = model("qwen")
    qwen.sync_succeeded(SyncResult("qwen", "s3://bucket/qwen", bytes_total=14 * GiB), 0.0)
    note = build_note(
        [llama, qwen],
        lambda m: 200 * MiB if m == "llama" else 0.0,
        all_ready=False,
        prefix=DEFAULT_LABEL_PREFIX,
        taint=DEFAULT_STARTUP_TAINT_KEY,
        now=time.time() - written_ago,
    )
    NodeGate(stub.client(), name).annotate(PROGRESS_ANNOTATION, encode(note))


def test_the_table_shows_each_nodes_models_progress_eta_age_and_gate(
    stub: KubeStub, tmp_path: Path
) -> None:
    warming_node(stub, "gpu-node-1", written_ago=12)
    stub.add_node("gpu-node-2", labels=GPU_POOL)  # its agent never reported

    result = status("--kubeconfig", str(kubeconfig(tmp_path / "kc", stub.url)))

    assert result.exit_code == 0, result.output
    header, llama, qwen, silent = result.stdout.splitlines()
    assert header.split() == [
        "NODE", "READY", "TAINT", "MODEL", "PHASE", "PROGRESS", "RATE", "ETA", "AGE", "LABEL",
    ]  # fmt: skip
    assert llama.split() == [
        "gpu-node-1", "no", "on", "llama", "syncing", "8.0", "GiB/32.0", "GiB", "25%",
        "200.0", "MiB/s", "2m03s", llama.split()[-2], "-",
    ]  # fmt: skip
    assert llama.split()[-2] in ("12s", "13s")  # the note's age
    assert qwen.split()[3:6] == ["qwen", "ready", "14.0"] and qwen.split()[-1] == "ready"
    assert silent.split() == ["gpu-node-2", "-", "off", "(no", "agent", "report)"]


def test_json_is_one_document_with_every_node(stub: KubeStub, tmp_path: Path) -> None:
    warming_node(stub, "gpu-node-1", written_ago=400)
    stub.add_node("gpu-node-2", labels=GPU_POOL)

    result = status("--kubeconfig", str(kubeconfig(tmp_path / "kc", stub.url)), "-o", "json")

    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["nodes_without_report"] == 1
    first, second = doc["nodes"]
    assert first["node"] == "gpu-node-1" and first["report"] is True
    assert first["all_required_ready"] is False and first["startup_taint"] is True
    assert first["stale"] is True  # bytes were moving and nothing was written for 400 s
    assert 399 <= first["age_seconds"] <= 402
    assert first["models"][0] == {
        "name": "llama",
        "phase": "syncing",
        "bytes_done": 8 * GiB,
        "bytes_total": 32 * GiB,
        "percent": 25.0,
        "rate_bytes_per_second": 200 * MiB,
        "eta_seconds": 123,
        "labelled": False,
        "reason": None,
    }
    assert first["models"][1]["labelled"] is True
    assert second == {
        "node": "gpu-node-2",
        "report": False,
        "problem": "no agent report",
        "all_required_ready": None,
        "startup_taint": False,
        "written_at": None,
        "age_seconds": None,
        "stale": False,
        "models": [],
    }


def test_a_selector_narrows_the_nodes(stub: KubeStub, tmp_path: Path) -> None:
    warming_node(stub, "gpu-node-1", written_ago=1)
    stub.add_node("system-node", labels={"karpenter.sh/nodepool": "system"})
    config = str(kubeconfig(tmp_path / "kc", stub.url))

    result = status("--kubeconfig", config, "-o", "json", "-l", "karpenter.sh/nodepool=gpu")

    assert [n["node"] for n in json.loads(result.stdout)["nodes"]] == ["gpu-node-1"]
    lists = [r for r in stub.requests_of("GET") if r.path == "/api/v1/nodes"]
    assert "labelSelector=karpenter.sh%2Fnodepool%3Dgpu" in lists[-1].query


def test_the_kubeconfig_comes_from_kubeconfig_env_and_the_context_option(
    stub: KubeStub, tmp_path: Path
) -> None:
    stub.add_node("gpu-node-1")
    config = kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{free_port()}", extra_server=stub.url)

    result = status("--context", "other", "-o", "json", env={"KUBECONFIG": str(config)})

    assert result.exit_code == 0, result.output
    assert [n["node"] for n in json.loads(result.stdout)["nodes"]] == ["gpu-node-1"]


@pytest.mark.parametrize(
    ("status_code", "expected"),
    [
        (403, "Error: you may not list nodes on http://127.0.0.1:"),
        (401, "Error: the API server at http://127.0.0.1:"),
    ],
)
def test_a_refusal_is_one_error_line_naming_it(
    stub: KubeStub, tmp_path: Path, status_code: int, expected: str
) -> None:
    stub.fail_next(1, status_code, method="GET")
    result = status("--kubeconfig", str(kubeconfig(tmp_path / "kc", stub.url)))
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert lines[0].startswith(expected) and f"HTTP {status_code}" in lines[0]
    assert lines[1].startswith("Hint: ") and result.stdout == ""


def test_an_unreachable_api_server_is_one_error_line(tmp_path: Path) -> None:
    server = f"http://127.0.0.1:{free_port()}"
    result = status("--kubeconfig", str(kubeconfig(tmp_path / "kc", server)), "-o", "json")
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.splitlines()[0].startswith(
        f"Error: cannot reach the Kubernetes API server at {server}"
    )


def test_no_kubeconfig_is_one_error_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    result = status("--kubeconfig", str(missing))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: cannot load the kubeconfig ({missing})")
    result = status("--context", "gone", env={"KUBECONFIG": str(missing), "HOME": str(tmp_path)})
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: cannot load the kubeconfig")
