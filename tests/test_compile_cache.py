"""Compile caches (prefetch.compile_cache): the key table, refusing an unfinished cache, and
push/pull between two "nodes" (two cache dirs) against the real local S3 server (SeaweedFS),
with a conditional-write race that exactly one pusher wins."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from prefetch.compile_cache import (
    CACHE_READY,
    CLAIM,
    COMPLETE,
    CacheKey,
    PushResult,
    finished_files,
    is_published,
    push,
)
from prefetch.errors import CompileCacheError

from .support import pull_s3, run_cli

BASE = CacheKey(
    vllm="sha256:" + "a" * 64,
    model="Qwen/Qwen3-0.6B",
    revision="c1899de289a04d12100db370d81485cdf75e47ca",
    tensor_parallel=1,
    gpu_product="NVIDIA-H100-80GB-HBM3",
)


# -- the key table -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "new_key"),
    [
        ({}, False),
        ({"vllm": "sha256:" + "b" * 64}, True),  # another image
        ({"vllm": "0.11.0"}, True),  # a version instead of a digest
        ({"model": "Qwen/Qwen3-1.7B"}, True),
        ({"revision": "0" * 40}, True),
        ({"tensor_parallel": 2}, True),
        ({"gpu_product": "NVIDIA-A100-SXM4-80GB"}, True),
        ({"torch": "2.9.0"}, True),  # given: counts
        ({"cuda": "12.8"}, True),
        ({"torch": None, "cuda": None}, False),  # not given: the key stays
        ({"torch": "  "}, False),  # blank is not given
        ({"model": " Qwen/Qwen3-0.6B "}, False),  # surrounding blanks do not count
    ],
)
def test_which_changes_make_a_new_key(change: dict[str, Any], new_key: bool) -> None:
    other = dataclasses.replace(BASE, **change)
    assert (other.key != BASE.key) is new_key
    assert other.key.startswith("v1-") and len(other.key) == 3 + 32


def test_torch_and_cuda_together_differ_from_each_alone() -> None:
    both = dataclasses.replace(BASE, torch="2.9.0", cuda="12.8")
    keys = {BASE.key, both.key, dataclasses.replace(BASE, torch="2.9.0").key}
    keys.add(dataclasses.replace(BASE, cuda="12.8").key)
    assert len(keys) == 4


@pytest.mark.parametrize("field", ["vllm", "model", "revision", "gpu_product"])
def test_a_key_needs_every_required_field(field: str) -> None:
    with pytest.raises(CompileCacheError, match=field):
        dataclasses.replace(BASE, **{field: ""})
    with pytest.raises(CompileCacheError, match="tensor_parallel"):
        dataclasses.replace(BASE, tensor_parallel=0)


# -- a finished cache ----------------------------------------------------------------------------


def vllm_cache(root: Path, *, seed: str = "a", ready: bool = True) -> dict[str, bytes]:
    """A directory shaped like vLLM's torch_compile_cache, with its marker when ``ready``."""
    files = {
        f"torch_compile_cache/{seed}1/rank_0_0/backbone/cache_key_factors.json": b'{"a": 1}',
        f"torch_compile_cache/{seed}1/rank_0_0/backbone/computation_graph.py": seed.encode() * 50,
        f"torch_compile_cache/{seed}1/rank_0_0/backbone/artifact_shape_None": os.urandom(70_000),
    }
    if ready:
        files[f"torch_compile_cache/{seed}1/rank_0_0/backbone/{CACHE_READY}"] = b""
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return files


def test_a_cache_without_its_ready_marker_is_refused(tmp_path: Path) -> None:
    vllm_cache(tmp_path, ready=False)
    with pytest.raises(CompileCacheError, match=r"no \.cache_ready marker"):
        finished_files(tmp_path, settle=0)


def test_a_cache_whose_files_change_while_checking_is_refused(tmp_path: Path) -> None:
    vllm_cache(tmp_path)

    def vllm_still_writing(_seconds: float) -> None:
        (tmp_path / "torch_compile_cache/late.bin").write_bytes(b"x")

    with pytest.raises(CompileCacheError, match="still being written"):
        finished_files(tmp_path, settle=0.01, sleep=vllm_still_writing)


def test_a_finished_cache_lists_its_files(tmp_path: Path) -> None:
    files = vllm_cache(tmp_path)
    assert finished_files(tmp_path, settle=0) == {k: len(v) for k, v in sorted(files.items())}


# -- two nodes against SeaweedFS -----------------------------------------------------------------


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and ".prefetch" not in p.relative_to(root).parts
    }


def test_node_a_pushes_node_b_pulls_through_the_engine_and_a_second_push_is_refused(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    node_a, node_b = tmp_path / "a" / "vllm-cache", tmp_path / "b" / "vllm-cache"
    files = vllm_cache(node_a)
    uri = f"s3://{bucket}/compile-cache/{BASE.key}"
    assert not is_published(s3_client, uri)  # the first node: nothing to pull, no error
    result = push(s3_client, node_a, uri, key=BASE, settle=0)
    assert result.uploaded and result.files == len(files)
    assert is_published(s3_client, uri)
    claim = json.loads(
        s3_client.get_object(Bucket=bucket, Key=f"compile-cache/{BASE.key}/{CLAIM}")["Body"].read()
    )
    assert claim["key"] == BASE.fields()

    synced = pull_s3(s3_client, uri + "/", node_b)
    assert synced.files_verified == len(files) + 2  # the cache, the claim and the marker
    pulled = tree(node_b)
    assert {k: pulled[k] for k in files} == files
    assert set(pulled) - set(files) == {CLAIM, COMPLETE}

    # node B compiles the same thing again: its push leaves A's cache alone
    (node_b / "torch_compile_cache/a1/rank_0_0/backbone/computation_graph.py").write_bytes(b"B")
    again = push(s3_client, node_b, uri, settle=0)
    assert not again.uploaded and "exists" in again.reason
    body = s3_client.get_object(
        Bucket=bucket,
        Key=f"compile-cache/{BASE.key}/torch_compile_cache/a1/rank_0_0/backbone/computation_graph.py",
    )["Body"].read()
    assert body == b"a" * 50


@pytest.mark.parametrize("round_", range(5))
def test_two_pushers_race_and_exactly_one_wins(
    s3_client: Any, bucket: str, tmp_path: Path, round_: int
) -> None:
    trees = {name: vllm_cache(tmp_path / name, seed=name) for name in ("x", "y")}
    uri = f"s3://{bucket}/compile-cache/race-{round_}"
    start = threading.Barrier(2)
    results: dict[str, PushResult | BaseException] = {}

    def pusher(name: str) -> None:
        try:
            results[name] = push(
                s3_client, tmp_path / name, uri, settle=0, sleep=lambda _s: start.wait(10)
            )
        except BaseException as exc:
            results[name] = exc

    threads = [threading.Thread(target=pusher, args=(n,)) for n in trees]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(r, PushResult) for r in results.values()), results
    won = [n for n, r in results.items() if isinstance(r, PushResult) and r.uploaded]
    assert len(won) == 1, results
    loser = ({"x", "y"} - set(won)).pop()
    # the prefix holds the winner's files only, complete
    listing = s3_client.list_objects_v2(Bucket=bucket, Prefix=f"compile-cache/race-{round_}/")
    keys = {o["Key"].split("/", 2)[2] for o in listing["Contents"]}
    assert keys == set(trees[won[0]]) | {CLAIM, COMPLETE}
    assert not any(f"/{loser}1/" in k for k in keys)


# -- the command line ----------------------------------------------------------------------------


def test_cli_push_refuses_an_unfinished_cache_then_publishes_once(
    s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    cache = tmp_path / "vllm-cache"
    vllm_cache(cache, ready=False)
    uri = f"s3://{bucket}/compile-cache/{BASE.key}"
    refused = run_cli("cache", "push", str(cache), uri, "--settle", "0", env=s3_env)
    assert refused.returncode == 1
    assert refused.stderr.startswith("Error: ") and "cache_ready" in refused.stderr
    assert "Traceback" not in refused.stderr
    vllm_cache(cache)  # now finished
    first = run_cli("cache", "push", str(cache), uri, "--settle", "0", "--json", env=s3_env)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["uploaded"] is True
    second = run_cli("cache", "push", str(cache), uri, "--settle", "0", "--json", env=s3_env)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["uploaded"] is False


def test_cli_key_prints_the_key(s3_env: dict[str, str]) -> None:
    args = ["cache", "key", "--vllm", BASE.vllm, "--model", BASE.model, "--revision",
            BASE.revision, "--gpu-product", BASE.gpu_product]  # fmt: skip
    proc = run_cli(*args, env=s3_env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == BASE.key
    tp2 = run_cli(*args, "--tensor-parallel", "2", "--json", env=s3_env)
    assert json.loads(tp2.stdout)["fields"]["tensor_parallel"] == 2
    assert json.loads(tp2.stdout)["key"] != BASE.key
