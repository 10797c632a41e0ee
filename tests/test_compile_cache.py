"""Compile caches (prefetch.publish.compile_cache): the key table, refusing an unfinished cache, and
push/pull between two "nodes" (two cache dirs) against the real local S3 server (SeaweedFS),
with a conditional-write race that exactly one pusher wins."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prefetch.publish import compile_cache
from prefetch.publish.compile_cache import (
    CACHE_READY,
    CacheKey,
    PushResult,
    finished_files,
    is_published,
    push,
)
from prefetch.publish.compile_cache_claim import CLAIM, COMPLETE, PUBLISHED
from prefetch.support.errors import CompileCacheError, CompileCacheRefused

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
    # with --json a failed push prints its one JSON object too, as pull, verify and mirror do
    refused = run_cli("cache", "push", str(cache), uri, "--settle", "0", "--json", env=s3_env)
    assert refused.returncode == 1
    out = json.loads(refused.stdout)
    assert out["uploaded"] is False and out["uri"] == uri and "cache_ready" in out["error"]
    assert out["error_reason"] == "compile_cache", out
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


# -- hostile pushFrom: swaps and growth after the check (issue 29, item 13) ---------------------


class _AfterClaim:
    """An S3 client that runs ``hook`` once, right after the push's claim is written: between
    the push's listing (its check) and its first open of a file."""

    def __init__(self, client: Any, hook: Callable[[], None]) -> None:
        self._client, self._hook, self.fired = client, hook, False

    def put_object(self, **kw: Any) -> Any:
        answer = self._client.put_object(**kw)
        if kw["Key"].endswith(CLAIM) and not self.fired:
            self.fired = True
            self._hook()
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _keys(s3_client: Any, bucket: str, prefix: str) -> set[str]:
    listing = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return {o["Key"][len(prefix) :] for o in listing.get("Contents", [])}


GRAPH = "torch_compile_cache/a1/rank_0_0/backbone/computation_graph.py"


def test_a_file_swapped_for_a_symlink_after_the_check_is_not_followed(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    cache = tmp_path / "vllm-cache"
    vllm_cache(cache)
    secret = tmp_path / "host-secret"
    secret.write_bytes(b"root:secret-hash")

    def swap() -> None:
        (cache / GRAPH).unlink()
        (cache / GRAPH).symlink_to(secret)

    hooked = _AfterClaim(s3_client, swap)
    uri = f"s3://{bucket}/compile-cache/swap"
    with pytest.raises(CompileCacheRefused, match="symlink"):
        push(hooked, cache, uri, settle=0)
    assert hooked.fired
    keys = _keys(s3_client, bucket, "compile-cache/swap/")
    assert COMPLETE not in keys and CLAIM not in keys  # nothing published, the key given up
    for key in keys:
        body = s3_client.get_object(Bucket=bucket, Key=f"compile-cache/swap/{key}")["Body"]
        assert b"secret" not in body.read()


def test_a_directory_swapped_for_a_symlink_after_the_check_is_not_followed(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    cache = tmp_path / "vllm-cache"
    vllm_cache(cache)
    outside = tmp_path / "outside"
    (outside / "backbone").mkdir(parents=True)
    for p in (cache / "torch_compile_cache/a1/rank_0_0/backbone").iterdir():
        (outside / "backbone" / p.name).write_bytes(b"secret from outside the cache")

    def swap() -> None:
        real = cache / "torch_compile_cache/a1/rank_0_0"
        real.rename(tmp_path / "moved")
        real.symlink_to(outside)

    with pytest.raises(CompileCacheRefused, match="symlink"):
        push(_AfterClaim(s3_client, swap), cache, f"s3://{bucket}/cc/dir", settle=0)
    assert not is_published(s3_client, f"s3://{bucket}/cc/dir")
    for key in _keys(s3_client, bucket, "cc/dir/"):
        body = s3_client.get_object(Bucket=bucket, Key=f"cc/dir/{key}")["Body"].read()
        assert b"secret" not in body


def test_a_symlink_in_the_cache_is_refused_for_good(tmp_path: Path) -> None:
    vllm_cache(tmp_path)
    (tmp_path / "torch_compile_cache/link").symlink_to("/etc/hostname")
    with pytest.raises(CompileCacheRefused, match="not a regular file"):
        finished_files(tmp_path, settle=0)


def test_a_file_that_grows_after_the_check_is_not_published_with_the_wrong_size(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    cache = tmp_path / "vllm-cache"
    vllm_cache(cache)
    (cache / GRAPH).write_bytes(b"g" * 1000)

    def grow() -> None:
        with open(cache / GRAPH, "ab") as f:
            f.write(b"h" * 5000)

    uri = f"s3://{bucket}/cc/grow"
    with pytest.raises(CompileCacheRefused, match="1000 bytes when checked, 6000 now"):
        push(_AfterClaim(s3_client, grow), cache, uri, settle=0)
    assert not is_published(s3_client, uri)
    # the next push (the file now stays as it is) publishes, and COMPLETE says what the
    # objects hold: every size and SHA-256 is the object's
    assert push(s3_client, cache, uri, settle=0).uploaded
    manifest = json.loads(
        s3_client.get_object(Bucket=bucket, Key=f"cc/grow/{COMPLETE}")["Body"].read()
    )
    assert manifest["files"][GRAPH] == 6000
    for rel, size in manifest["files"].items():
        body = s3_client.get_object(Bucket=bucket, Key=f"cc/grow/{rel}")["Body"].read()
        assert len(body) == size
        assert hashlib.sha256(body).hexdigest() == manifest["sha256"][rel]
    assert set(manifest["files"]) | {CLAIM, COMPLETE} == _keys(s3_client, bucket, "cc/grow/")


# -- a push killed after its claim (issue 29, item 14) -------------------------------------------


def _dead_claim(s3_client: Any, bucket: str, prefix: str, at: float, lease: float) -> None:
    """What a push killed after its claim and one file leaves behind."""
    claim = {"host": "preempted-node", "claimed_at": at, "lease_seconds": lease,
             "expires_at": at + lease}  # fmt: skip
    s3_client.put_object(Bucket=bucket, Key=prefix + CLAIM, Body=json.dumps(claim).encode())
    s3_client.put_object(Bucket=bucket, Key=prefix + "torch_compile_cache/z1/half", Body=b"h")


def test_a_claim_without_completion_expires_and_the_next_writer_takes_it_over(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    cache = tmp_path / "vllm-cache"
    files = vllm_cache(cache)
    prefix, t0 = "cc/lease/", 1_800_000_000.0
    uri = f"s3://{bucket}/{prefix}"
    _dead_claim(s3_client, bucket, prefix, t0, lease=600)

    held = push(s3_client, cache, uri, settle=0, clock=lambda: t0 + 599)
    assert not held.uploaded and held.pending and "publishing" in held.reason
    assert not is_published(s3_client, uri)

    took = push(s3_client, cache, uri, settle=0, clock=lambda: t0 + 601)
    assert took.uploaded and took.to_json()["took_over"] is True
    # the dead push's leftovers are gone: the key holds this push's files, whole
    assert _keys(s3_client, bucket, prefix) == set(files) | {CLAIM, COMPLETE}
    claim = json.loads(s3_client.get_object(Bucket=bucket, Key=prefix + CLAIM)["Body"].read())
    assert claim["host"] != "preempted-node"

    # a completed entry is never taken over, however old its claim
    (cache / GRAPH).write_bytes(b"another compile")
    later = push(s3_client, cache, uri, settle=0, clock=lambda: t0 + 10**6)
    assert not later.uploaded and not later.pending and later.reason == PUBLISHED
    body = s3_client.get_object(Bucket=bucket, Key=prefix + GRAPH)["Body"].read()
    assert body == files[GRAPH]


def test_a_claim_without_a_written_time_expires_by_its_upload_time(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    vllm_cache(tmp_path / "c")
    s3_client.put_object(Bucket=bucket, Key=f"cc/old/{CLAIM}", Body=b"{}")
    uri = f"s3://{bucket}/cc/old"
    assert push(s3_client, tmp_path / "c", uri, settle=0, lease=3600).pending
    assert push(s3_client, tmp_path / "c", uri, settle=0, lease=0.001).uploaded


def test_two_writers_take_over_one_expired_claim_and_exactly_one_wins(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    trees = {name: vllm_cache(tmp_path / name, seed=name) for name in ("x", "y")}
    prefix, t0 = "cc/takeover/", 1_800_000_000.0
    _dead_claim(s3_client, bucket, prefix, t0, lease=60)
    start = threading.Barrier(2)
    results: dict[str, PushResult | BaseException] = {}

    def pusher(name: str) -> None:
        try:
            results[name] = push(s3_client, tmp_path / name, f"s3://{bucket}/{prefix}",
                                 settle=0, sleep=lambda _s: start.wait(10),
                                 clock=lambda: t0 + 61)  # fmt: skip
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
    assert _keys(s3_client, bucket, prefix) == set(trees[won[0]]) | {CLAIM, COMPLETE}


def test_a_push_whose_claim_was_taken_over_does_not_complete(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    """A push stalled past its lease: another writer took the key over; the stalled push
    stops before COMPLETE and leaves the new writer's claim alone."""
    vllm_cache(tmp_path / "c")
    prefix = "cc/lost/"

    def taken_over() -> None:
        s3_client.put_object(Bucket=bucket, Key=prefix + CLAIM, Body=b'{"host": "other"}')

    with pytest.raises(CompileCacheError, match="took this key over"):
        push(_AfterClaim(s3_client, taken_over), tmp_path / "c", f"s3://{bucket}/{prefix}",
             settle=0)  # fmt: skip
    assert not is_published(s3_client, f"s3://{bucket}/{prefix}")
    claim = s3_client.get_object(Bucket=bucket, Key=prefix + CLAIM)["Body"].read()
    assert claim == b'{"host": "other"}'


def test_a_large_file_is_uploaded_in_place_as_hashed(
    s3_client: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files above IN_MEMORY are not copied: each is read for its hash, then uploaded from the
    file with that SHA-256, which the store checks."""
    monkeypatch.setattr(compile_cache, "IN_MEMORY", 1)
    cache = tmp_path / "vllm-cache"
    files = vllm_cache(cache)
    assert push(s3_client, cache, f"s3://{bucket}/cc/big", settle=0).uploaded
    manifest = json.loads(
        s3_client.get_object(Bucket=bucket, Key=f"cc/big/{COMPLETE}")["Body"].read()
    )
    for rel, data in files.items():
        body = s3_client.get_object(Bucket=bucket, Key=f"cc/big/{rel}")["Body"].read()
        assert body == data and manifest["sha256"][rel] == hashlib.sha256(data).hexdigest()


class _RewritesBeforeUpload:
    """An S3 client that rewrites ``path`` in place (same size) just before ``key`` is put: the
    file changes between the push's hash and its upload."""

    def __init__(self, client: Any, key: str, path: Path) -> None:
        self._client, self._key, self._path = client, key, path

    def put_object(self, **kw: Any) -> Any:
        if kw["Key"] == self._key:
            fd = os.open(self._path, os.O_WRONLY)
            try:
                os.pwrite(fd, b"Z" * 100, 0)
            finally:
                os.close(fd)
        return self._client.put_object(**kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_a_large_file_rewritten_between_its_hash_and_its_upload_is_refused(
    s3_client: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compile_cache, "IN_MEMORY", 1)
    cache = tmp_path / "vllm-cache"
    vllm_cache(cache)
    uri = f"s3://{bucket}/cc/rewrite"
    hooked = _RewritesBeforeUpload(s3_client, f"cc/rewrite/{GRAPH}", cache / GRAPH)
    with pytest.raises(CompileCacheRefused, match="changed while it was uploaded"):
        push(hooked, cache, uri, settle=0)
    assert not is_published(s3_client, uri)


def test_a_published_cache_whose_claim_was_deleted_is_left_alone(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    files = vllm_cache(tmp_path / "a")
    uri = f"s3://{bucket}/cc/noclaim"
    assert push(s3_client, tmp_path / "a", uri, settle=0).uploaded
    s3_client.delete_object(Bucket=bucket, Key=f"cc/noclaim/{CLAIM}")
    vllm_cache(tmp_path / "b", seed="b")
    again = push(s3_client, tmp_path / "b", uri, settle=0)
    assert not again.uploaded and again.reason == PUBLISHED
    assert _keys(s3_client, bucket, "cc/noclaim/") == set(files) | {COMPLETE}
