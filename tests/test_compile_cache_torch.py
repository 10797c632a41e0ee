"""A real compiler cache through the whole path: PyTorch (CPU, ``torch.compile`` with inductor)
compiles a small module on node A into its cache dir, ``prefetch cache push`` publishes it to
the real local S3 server (SeaweedFS), node B's agent pulls it through the engine, and node B
compiles again with an inductor cache hit, faster than B compiling without it.

Needs torch (``pip install torch==2.13.0``: the CPU build); skipped without it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prefetch.agent.loop import Agent
from prefetch.publish.compile_cache import CACHE_READY, CacheKey
from tests.support import AgentThread, config_text, model_status, run_cli, wait_for

COMPILE = """
import json, time
import torch
from torch._dynamo.utils import counters

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64)

    def forward(self, x):
        return torch.nn.functional.gelu(self.down(torch.relu(self.up(x)))) * 2 + x

torch.manual_seed(0)
block = Block()
compiled = torch.compile(block)
x = torch.randn(8, 64)
t0 = time.monotonic()
y = compiled(x)
seconds = time.monotonic() - t0
assert torch.allclose(y, block(x), atol=1e-5)
print(json.dumps({"seconds": seconds, "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def compile_with(cache_dir: Path, script: Path) -> dict[str, Any]:
    """One "vLLM start": compile the module in a fresh process with ``cache_dir`` as
    inductor's cache; its seconds and cache hits/misses."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_node_b_compiles_with_the_cache_node_a_published(
    s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    script = tmp_path / "compile_block.py"
    script.write_text(COMPILE)
    key = CacheKey(
        vllm="torch-only-test", model="block", revision="1", gpu_product="cpu",
        torch=str(torch.__version__),
    )  # fmt: skip
    uri = f"s3://{bucket}/compile-cache/{key.key}"

    # node A: the first of its kind compiles from scratch, then publishes its cache
    node_a = tmp_path / "node-a" / "inductor"
    on_a = compile_with(node_a, script)
    assert on_a["misses"] >= 1 and on_a["hits"] == 0
    (node_a / CACHE_READY).write_text("")  # the compile finished (vLLM writes its own marker)
    pushed = run_cli("cache", "push", str(node_a), uri, "--settle", "0.5", "--json", env=s3_env)
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["uploaded"] is True

    # node B, without the cache: the same compile from scratch
    cold = compile_with(tmp_path / "node-b-cold" / "inductor", script)
    assert cold["misses"] >= 1 and cold["hits"] == 0

    # node B's agent pulls the entry; the pod starts on a copy of it (deploy/vllm's init step)
    config = tmp_path / "models.yaml"
    entry = {
        "name": "block-compile", "source": f"s3://{bucket}/compile-cache/", "vllm": key.vllm,
        "model": key.model, "revision": key.revision, "gpuProduct": key.gpu_product,
        "torch": key.torch, "required": True,
    }  # fmt: skip
    config.write_text(config_text(tmp_path / "cache-b", [], compileCaches=[entry]))
    agent = Agent(config, s3_client=s3_client, serve=False, tick=0.2)
    with AgentThread(agent):
        wait_for(
            lambda: model_status(agent, "block-compile").get("ready"), "the pull", dump=agent.status
        )
        assert not model_status(agent, "block-compile")["nothing_published"]
    pulled = tmp_path / "cache-b" / "models" / "block-compile"
    warm_dir = tmp_path / "node-b-warm" / "inductor"
    shutil.copytree(pulled, warm_dir, ignore=shutil.ignore_patterns(".prefetch"))
    warm = compile_with(warm_dir, script)
    assert warm["hits"] >= 1 and warm["misses"] == 0, warm
    assert warm["seconds"] < cold["seconds"]
    print(
        f"\ncompile on node A (no cache) {on_a['seconds']:.1f}s; node B without the cache "
        f"{cold['seconds']:.1f}s, with the pulled cache {warm['seconds']:.1f}s"
    )
