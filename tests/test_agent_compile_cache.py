"""The agent's ``compileCaches`` entries: the key in the config, a missing entry that is not an
error, a half-pushed one that is not pulled, and a published one pulled through the engine into
``<cacheDir>/models/<name>/`` (against the real local S3 server, SeaweedFS)."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from prefetch.agent.config import parse_config
from prefetch.agent.kube_events import KubeEventSink
from prefetch.agent.loop import Agent
from prefetch.agent.node import NodeGate
from prefetch.publish.compile_cache import CACHE_READY, GPU_PRODUCT_LABEL, CacheKey, push
from prefetch.publish.compile_cache_claim import CLAIM, COMPLETE
from prefetch.support.errors import ConfigError
from tests.fakes.k8s_stub import KubeStub, running_stub
from tests.support import AgentThread, config_text, model_status, put, wait_for

from .test_compile_cache import tree, vllm_cache

ENTRY = {
    "name": "llama-compile",
    "source": "s3://bkt/compile-cache/",
    "target": "vllm",
    "vllm": "vllm/vllm-openai:v0.18.0",
    "model": "hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4",
    "revision": "a" * 40,
    "tensorParallelSize": 4,
    "gpuProduct": "NVIDIA-A10G",
}


@pytest.fixture
def stub() -> Iterator[KubeStub]:
    yield from running_stub()


KEY = CacheKey(
    vllm="vllm/vllm-openai:v0.18.0",
    model="hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4",
    revision="a" * 40,
    tensor_parallel=4,
    gpu_product="NVIDIA-A10G",
)


def test_a_compile_cache_entry_is_a_model_at_its_key() -> None:
    config = parse_config(config_text(Path("/c"), [], compileCaches=[ENTRY]))
    [spec] = config.models
    assert spec.name == "llama-compile"
    assert str(spec.source) == f"s3://bkt/compile-cache/{KEY.key}/"
    assert spec.required is False  # unless required: true
    assert config.is_compile_cache("llama-compile")
    tp8 = parse_config(
        config_text(Path("/c"), [], compileCaches=[{**ENTRY, "tensorParallelSize": 8}])
    )
    assert str(tp8.models[0].source) != str(spec.source)


def test_an_entry_without_gpu_product_is_keyed_by_the_node_s() -> None:
    entry = {k: v for k, v in ENTRY.items() if k != "gpuProduct"}
    config = parse_config(config_text(Path("/c"), [], compileCaches=[entry]))
    assert config.models == () and config.unkeyed_compile_caches == ("llama-compile",)
    on_a10g = config.with_overrides(gpu_product="NVIDIA-A10G")
    [spec] = on_a10g.models
    assert str(spec.source) == f"s3://bkt/compile-cache/{KEY.key}/"
    assert on_a10g.unkeyed_compile_caches == () and on_a10g.is_compile_cache("llama-compile")
    on_h100 = config.with_overrides(gpu_product="NVIDIA-H100-80GB-HBM3")
    assert on_h100.models[0].source != spec.source
    # a configured gpuProduct wins over the node's
    fixed = parse_config(config_text(Path("/c"), [], compileCaches=[ENTRY]))
    assert fixed.with_overrides(gpu_product="NVIDIA-H100-80GB-HBM3").models == fixed.models


def test_the_node_gate_reads_the_gpu_product_label(stub: KubeStub) -> None:
    stub.add_node("gpu-1", labels={GPU_PRODUCT_LABEL: "NVIDIA-A10G"})
    stub.add_node("cpu-1", labels={})
    assert NodeGate(stub.client(), "gpu-1").label(GPU_PRODUCT_LABEL) == "NVIDIA-A10G"
    assert NodeGate(stub.client(), "cpu-1").label(GPU_PRODUCT_LABEL) is None


def test_outside_a_cluster_the_agent_knows_no_gpu_product(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefetch.cli.agent import _node_gpu_product

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert _node_gpu_product("gpu-1") is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vllm": None}, "compileCaches[0].vllm: missing"),
        ({"target": "sglang"}, "compileCaches[0].target: only vllm"),
        ({"source": "hf://org/name"}, "compileCaches[0].source: expected s3://"),
        ({"tensorParallelSize": 0}, "compileCaches[0].tensorParallelSize"),
        ({"colour": "blue"}, "compileCaches[0].colour: unknown key"),
        ({"name": "m"}, "compileCaches[0].name: 'm' is also a model's name"),
        ({"push": True}, "compileCaches[0].pushFrom: push: true needs the absolute path"),
        ({"push": True, "pushFrom": "rel/dir"}, "compileCaches[0].pushFrom: push: true needs"),
        ({"push": "yes", "pushFrom": "/d"}, "compileCaches[0].push: expected true or false"),
        ({"extraDirs": ["triton"]}, "compileCaches[0].extraDirs[0]: 'triton' is not one of"),
        ({"extraDirs": "flashinfer"}, "compileCaches[0].extraDirs: expected a list"),
        ({"extraDirs": ["deepgemm", "deepgemm"]}, "extraDirs: a directory is named twice"),
    ],
)
def test_bad_compile_cache_entries_are_rejected(change: dict[str, Any], message: str) -> None:
    entry = {k: v for k, v in {**ENTRY, **change}.items() if v is not None}
    text = config_text(Path("/c"), [{"name": "m", "source": "s3://bkt/m"}], compileCaches=[entry])
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(text)


def test_two_compile_caches_of_one_name_are_rejected() -> None:
    """Before: accepted, though both would live in models/<name> and the agent tracks them by
    name."""
    other = {**ENTRY, "source": "s3://bkt/other-cache/"}
    text = config_text(Path("/c"), [], compileCaches=[ENTRY, other])
    with pytest.raises(ConfigError, match=re.escape("compileCaches[1].name: duplicate compile")):
        parse_config(text)


def test_the_agent_pulls_a_compile_cache_once_it_is_published_and_not_before(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    # no gpuProduct: keyed by the node's (here given as the agent's --gpu-product)
    entry = {k: v for k, v in ENTRY.items() if k != "gpuProduct"}
    entry.update(source=f"s3://{bucket}/compile-cache/", required=True)
    prefix = f"compile-cache/{KEY.key}/"
    config = tmp_path / "models.yaml"
    cache = tmp_path / "cache"
    config.write_text(config_text(cache, [], compileCaches=[entry], resolveInterval="1s"))
    agent = Agent(config, s3_client=s3_client, serve=False, tick=0.2, gpu_product="NVIDIA-A10G")
    target = cache / "models" / "llama-compile"
    with AgentThread(agent):
        # nothing under the key: the first node of its kind; ready, so the gate opens
        wait_for(
            lambda: model_status(agent, "llama-compile").get("ready"), "ready", dump=agent.status
        )
        status = model_status(agent, "llama-compile")
        assert status["nothing_published"] and "no compile cache published" in status["detail"]
        assert status["failures"] == 0 and status["last_error"] is None
        assert agent.readiness()[0] == 200

        # a push in progress (its claim and one file, no completion marker): not pulled
        put(s3_client, bucket, prefix + CLAIM, b"{}")
        put(s3_client, bucket, prefix + "torch_compile_cache/x/half", b"half")
        passes = agent.passes
        wait_for(lambda: agent.passes > passes + 10, "a few passes")
        assert model_status(agent, "llama-compile")["nothing_published"]
        assert not (target / "torch_compile_cache").exists()
        s3_client.delete_object(Bucket=bucket, Key=prefix + CLAIM)
        s3_client.delete_object(Bucket=bucket, Key=prefix + "torch_compile_cache/x/half")

        # node A publishes; this node pulls it, verified, at the next resolve
        node_a = tmp_path / "node-a"
        files = vllm_cache(node_a)
        assert push(s3_client, node_a, f"s3://{bucket}/{prefix}", key=KEY, settle=0).uploaded
        wait_for(
            lambda: not model_status(agent, "llama-compile").get("nothing_published"),
            "the published cache",
            timeout=60,
            dump=agent.status,
        )
        status = model_status(agent, "llama-compile")
        assert status["ready"] and status["detail"] == "verified copy in the cache"
    pulled = tree(target)
    assert {k: pulled[k] for k in files} == files


def test_push_from_is_read_only_with_push_true() -> None:
    plain = parse_config(config_text(Path("/c"), [], compileCaches=[ENTRY]))
    assert plain.push_targets() == []
    off = {**ENTRY, "push": False, "pushFrom": "/var/cache/vllm"}
    assert parse_config(config_text(Path("/c"), [], compileCaches=[off])).push_targets() == []
    on = {**ENTRY, "push": True, "pushFrom": "/var/cache/vllm", "extraDirs": ["deepgemm"]}
    [target] = parse_config(config_text(Path("/c"), [], compileCaches=[on])).push_targets()
    assert (target.name, target.root, target.key) == ("llama-compile", Path("/var/cache/vllm"), KEY)
    assert target.uri == f"s3://bkt/compile-cache/{KEY.key}/"
    assert target.extra_dirs == ("deepgemm",)


def test_two_agents_push_one_key_exactly_one_wins_and_the_other_tells_already_published(
    s3_client: Any, bucket: str, stub: KubeStub, tmp_path: Path
) -> None:
    """Two nodes' agents watch their vLLM pods' cache directories (``push: true``): nothing is
    uploaded while vLLM has not written its ``.cache_ready`` marker; once both have one, the
    two race for the key and exactly one publishes (If-None-Match: *), the other leaves it
    alone and says so in its Event; the key's objects are the winner's, whole."""
    agents: dict[str, Agent] = {}
    dirs: dict[str, Path] = {}
    for node in ("node-a", "node-b"):
        stub.add_node(node)
        dirs[node] = tmp_path / node / "vllm-cache"
        entry = {**ENTRY, "source": f"s3://{bucket}/compile-cache/", "push": True,
                 "pushFrom": str(dirs[node])}  # fmt: skip
        config = tmp_path / node / "models.yaml"
        config.parent.mkdir()
        config.write_text(config_text(tmp_path / node / "cache", [], compileCaches=[entry]))
        sink = KubeEventSink(stub.events_client(), stub.client(), node)
        agents[node] = Agent(config, s3_client=s3_client, serve=False, tick=0.1,
                             event_sink=sink, push_poll=0.1, push_settle=1.0)  # fmt: skip
    prefix = f"compile-cache/{KEY.key}/"
    # vLLM is still compiling on both nodes: files, no marker
    for seed, node in zip("ab", agents, strict=True):
        vllm_cache(dirs[node], seed=seed, ready=False)
    with AgentThread(agents["node-a"]) as a, AgentThread(agents["node-b"]) as b:
        wait_for(lambda: a.passes > 20 and b.passes > 20, "a few looks at the directories")
        listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix)
        assert listed.get("KeyCount", 0) == 0  # nothing uploaded while being written
        for node in agents:
            marker = next(dirs[node].rglob("backbone")) / CACHE_READY
            marker.write_bytes(b"")
        states = lambda: {  # noqa: E731
            n: (ag.scheduler.get("llama-compile") or SimpleNamespace(cache_push=None)).cache_push
            for n, ag in agents.items()
        }
        wait_for(lambda: None not in states().values(), "both pushes", timeout=30)
        assert sorted(states().values()) == ["published-elsewhere", "pushed"]
        for ag in agents.values():
            assert ag.events.flush()
    winner = next(n for n, v in states().items() if v == "pushed")
    loser = next(n for n in agents if n != winner)
    told = {
        n: [e["reason"] for e in stub.events("default") if e["regarding"]["name"] == n]
        for n in agents
    }
    assert "CompileCachePushed" in told[winner]
    assert "CompileCacheAlreadyPublished" not in told[winner]
    assert "CompileCacheAlreadyPublished" in told[loser]
    assert "CompileCachePushed" not in told[loser]
    pushed = next(e for e in stub.events("default") if e["reason"] == "CompileCachePushed")
    assert KEY.key in pushed["note"] and "4 file(s)" in pushed["note"]
    claim = json.loads(s3_client.get_object(Bucket=bucket, Key=prefix + CLAIM)["Body"].read())
    assert claim["files"] == 4
    published = {
        o["Key"][len(prefix) :]
        for o in s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
    }
    winner_files = {p.relative_to(dirs[winner]).as_posix() for p in dirs[winner].rglob("*")
                    if p.is_file()}  # fmt: skip
    assert published == winner_files | {CLAIM, COMPLETE}


def test_extra_dirs_are_published_with_the_key_and_undeclared_ones_are_left_out(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    """``extraDirs: [flashinfer]``: the agent publishes FlashInfer's JIT workspace beside vLLM's
    cache under the same key, and leaves DeepGEMM's (not opted in) out; a node pulling the key
    gets both of the published ones."""
    root = tmp_path / "vllm-cache"
    files = vllm_cache(root)
    extra = {
        "flashinfer/.cache/flashinfer/90/cached_ops/batch_prefill/batch_prefill.so": b"so" * 99,
        "deep_gemm/cache/kernel.fp8_gemm.0123456789ab/kernel.cubin": b"cubin" * 40,
    }
    for rel, data in extra.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    entry = {**ENTRY, "source": f"s3://{bucket}/compile-cache/", "push": True,
             "pushFrom": str(root), "extraDirs": ["flashinfer"]}  # fmt: skip
    config = tmp_path / "models.yaml"
    config.write_text(config_text(tmp_path / "cache", [], compileCaches=[entry]))
    agent = Agent(config, s3_client=s3_client, serve=False, tick=0.1, push_poll=0.1,
                  push_settle=0.2)  # fmt: skip
    with AgentThread(agent):
        wait_for(
            lambda: (
                (
                    agent.scheduler.get("llama-compile") or SimpleNamespace(cache_push=None)
                ).cache_push
                == "pushed"
            ),
            "the push",
            timeout=30,
        )
    prefix = f"compile-cache/{KEY.key}/"
    published = {
        o["Key"][len(prefix) :]
        for o in s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
    }
    flashinfer = next(k for k in extra if k.startswith("flashinfer/"))
    assert published == set(files) | {flashinfer, CLAIM, COMPLETE}

    from prefetch.publish.compile_cache import extra_env

    assert extra_env("/var/cache/vllm", ["flashinfer", "deepgemm"]) == {
        "FLASHINFER_WORKSPACE_BASE": "/var/cache/vllm/flashinfer",
        "DG_JIT_CACHE_DIR": "/var/cache/vllm/deep_gemm",
    }


# -- a push refused for good (issue 29, item 15) -------------------------------------------------


def _hostile_push_from(root: Path) -> None:
    """A finished cache with a symlink in it, as a vLLM pod running model code could leave."""
    vllm_cache(root)
    (root / "torch_compile_cache" / "link").symlink_to("/etc/hostname")


def test_a_push_refused_for_good_is_one_warning_event_not_a_line_every_poll(
    s3_client: Any,
    bucket: str,
    stub: KubeStub,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    stub.add_node("node-a")
    root = tmp_path / "vllm-cache"
    _hostile_push_from(root)
    entry = {**ENTRY, "source": f"s3://{bucket}/compile-cache/", "push": True,
             "pushFrom": str(root)}  # fmt: skip
    config = tmp_path / "models.yaml"
    config.write_text(config_text(tmp_path / "cache", [], compileCaches=[entry]))
    sink = KubeEventSink(stub.events_client(), stub.client(), "node-a")
    agent = Agent(config, s3_client=s3_client, serve=False, tick=0.05, event_sink=sink,
                  push_poll=0.05, push_settle=0.01)  # fmt: skip
    caplog.set_level(logging.DEBUG, logger="prefetch.agent.cache_push")
    with AgentThread(agent):
        wait_for(lambda: agent.passes > 5, "the agent's first passes")
        passes = agent.passes
        wait_for(lambda: agent.passes > passes + 40, "many push polls")
        assert agent.events.flush()
    refused = [e for e in stub.events("default") if e["reason"] == "CompileCachePushRefused"]
    assert len(refused) == 1 and refused[0]["type"] == "Warning"
    assert "series" not in refused[0]
    assert "symlink" in refused[0]["note"] or "not a regular file" in refused[0]["note"]
    loud = [r for r in caplog.records
            if r.name == "prefetch.agent.cache_push" and r.levelno >= logging.INFO]  # fmt: skip
    assert loud == []  # the Event's own line says it once; no line at every poll
    assert s3_client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


class _Told:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def emit(self, event: Any) -> None:
        self.events.append(event)


def test_a_refused_push_is_looked_at_again_with_a_growing_interval(tmp_path: Path) -> None:
    from prefetch.agent.cache_push import REFUSED_FIRST, CachePusher

    root = tmp_path / "vllm-cache"
    _hostile_push_from(root)
    entry = {**ENTRY, "push": True, "pushFrom": str(root)}
    config = parse_config(config_text(tmp_path / "cache", [], compileCaches=[entry]))
    now, looks, told = [1000.0], [], _Told()

    def client(_config: Any) -> None:
        looks.append(now[0])  # made for each push attempt

    pusher = CachePusher(told, client, settle=0, clock=lambda: now[0])
    scheduler = SimpleNamespace(get=lambda _name: None, current=lambda _ms: False)
    stop = threading.Event()

    def polls(n: int) -> None:
        for _ in range(n):
            pusher.run(config, scheduler, stop)

    polls(5)
    assert looks == [1000.0] and [e.reason.value for e in told.events] == [
        "CompileCachePushRefused"
    ]
    now[0] += REFUSED_FIRST
    polls(5)
    assert len(looks) == 2 and len(told.events) == 1  # looked again, not told again
    now[0] += REFUSED_FIRST
    polls(5)
    assert len(looks) == 2  # the interval doubled
    now[0] += REFUSED_FIRST
    polls(5)
    assert len(looks) == 3


def test_a_key_another_writer_s_live_claim_holds_is_looked_at_again(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    """Issue 29, item 14: a claim without completion is a push in progress, or one that died
    and whose lease will run out: not "published elsewhere" for good; once the claim is gone
    (or expired) this node publishes."""
    from prefetch.agent.cache_push import CachePusher

    root = tmp_path / "vllm-cache"
    vllm_cache(root)
    entry = {**ENTRY, "source": f"s3://{bucket}/compile-cache/", "push": True,
             "pushFrom": str(root)}  # fmt: skip
    config = parse_config(config_text(tmp_path / "cache", [], compileCaches=[entry]))
    claim = f"compile-cache/{KEY.key}/{CLAIM}"
    live = {"host": "node-b", "expires_at": 4_000_000_000.0}
    s3_client.put_object(Bucket=bucket, Key=claim, Body=json.dumps(live).encode())
    looks, told = [], _Told()

    def client(_config: Any) -> Any:
        looks.append(1)
        return s3_client

    pusher = CachePusher(told, client, settle=0)
    scheduler = SimpleNamespace(get=lambda _name: None, current=lambda _ms: False)
    stop = threading.Event()
    pusher.run(config, scheduler, stop)
    pusher.run(config, scheduler, stop)
    assert len(looks) == 2 and told.events == []  # held: looked at again, nothing told
    s3_client.delete_object(Bucket=bucket, Key=claim)  # that push gave the key up
    pusher.run(config, scheduler, stop)
    assert [e.reason.value for e in told.events] == ["CompileCachePushed"]
    pusher.run(config, scheduler, stop)
    assert len(looks) == 3  # done with this key
