"""``prefetch pull gs://bucket/prefix``: against gcp-storage-emulator behind the TLS front
(tests/fakes/gcs.py), and a scripted Cloud Storage for what the emulator does not do (credentials,
paging, redirects)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefetch.demo.modelgen import generate_model, make_model_dir, tree_bytes

from .fakes.gcs import GcsEmulator, tls_front
from .fakes.s3proxy import S3FaultProxy
from .support import AgentProcess, clean_env, config_text, hf_check, journaled_bytes, run_cli
from .tls import TestCA

MiB = 1024 * 1024
_buckets = iter(range(1_000_000))


@pytest.fixture
def gcs_bucket(gcs_emulator: GcsEmulator) -> str:
    name = f"b{next(_buckets)}-{os.getpid()}"
    gcs_emulator.create_bucket(name)
    return name


@pytest.fixture
def front(gcs_emulator: GcsEmulator, test_ca: TestCA) -> Iterator[S3FaultProxy]:
    with tls_front(gcs_emulator, test_ca) as proxy:
        yield proxy


def gcs_env(front: S3FaultProxy, work: Path) -> dict[str, str]:
    """A `prefetch` subprocess reading Cloud Storage at the front (the session CA is trusted
    through this process's environment), no Google credentials of the user's."""
    env = clean_env(work / "hf-home", STORAGE_EMULATOR_HOST=front.endpoint)
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_OAUTH_ACCESS_TOKEN",
                 "CLOUDSDK_AUTH_ACCESS_TOKEN"):  # fmt: skip
        env.pop(name, None)
    return env


def test_a_multi_file_model_is_pulled_byte_identical_and_verified_by_crc32c(
    gcs_emulator: GcsEmulator, gcs_bucket: str, front: S3FaultProxy, tmp_path: Path
) -> None:
    files = make_model_dir(tmp_path / "src", seed=3, shard_sizes=(3 * MiB + 1, 2 * MiB),
                           extra_files={"sub/dir/notes.txt": b"nested"})  # fmt: skip
    gcs_emulator.upload_dir(gcs_bucket, "models/tiny/", files)
    gcs_emulator.upload(gcs_bucket, "models/tinyX/other.bin", b"not under the prefix")
    env = gcs_env(front, tmp_path)
    dest = tmp_path / "dest"
    proc = run_cli("pull", f"gs://{gcs_bucket}/models/tiny", str(dest), "--json",
                   "--chunk-size", "1MiB", env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert tree_bytes(dest) == {rel: p.read_bytes() for rel, p in files.items()}
    assert summary["files_verified"] == len(files) and not summary["files_unverified"]
    assert summary["checksum_algorithms"] == {"crc32c": len(files)}
    ranged = [r for _, r in front.get_ranges if r is not None]
    assert len(ranged) >= 4  # the 3 MiB shard came in several ranges
    again = run_cli("pull", f"gs://{gcs_bucket}/models/tiny", str(dest), "--json", env=env)
    assert json.loads(again.stdout)["up_to_date"] is True
    check = run_cli("verify", str(dest), env=env)
    assert check.returncode == 0, check.stderr


def test_hf_repo_publishes_the_hub_layout_that_loads_offline(
    gcs_emulator: GcsEmulator, gcs_bucket: str, front: S3FaultProxy, tmp_path: Path
) -> None:
    files = make_model_dir(tmp_path / "src", seed=4, shard_sizes=(2 * MiB, 2 * MiB))
    gcs_emulator.upload_dir(gcs_bucket, "llama/", files)
    home = tmp_path / "home"
    env = gcs_env(front, tmp_path)
    proc = run_cli("pull", f"gs://{gcs_bucket}/llama", str(home), "--hf-repo", "acme/llama",
                   "--json", env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    snapshot = json.loads(proc.stdout)["path"]
    out = hf_check(  # HF_HUB_OFFLINE=1, HF_HOME=home
        home,
        """
        import pathlib
        root = hf.snapshot_download("acme/llama")
        out["root"] = root
        out["files"] = sorted(str(p.relative_to(root)) for p in pathlib.Path(root).rglob("*")
                              if p.is_file())
        out["config"] = open(hf.hf_hub_download("acme/llama", "config.json")).read()
        """,
    )
    assert out["root"] == snapshot
    assert out["files"] == sorted(files)
    assert out["config"] == files["config.json"].read_text()
    # equal-sized shards uploaded in one go are two blobs, never one
    blobs = list((home / "hub" / "models--acme--llama" / "blobs").iterdir())
    assert len(blobs) == len(files)


@pytest.mark.slow
def test_a_pull_killed_with_sigkill_resumes_without_fetching_again(
    gcs_emulator: GcsEmulator, gcs_bucket: str, front: S3FaultProxy, tmp_path: Path
) -> None:
    total = 32 * MiB
    generated = generate_model(tmp_path / "src", total, shards=2)
    gcs_emulator.upload_dir(gcs_bucket, "big/", {f.path: f.local for f in generated})
    dest = tmp_path / "dest"
    partial = dest / ".prefetch" / "partial"
    args = [sys.executable, "-m", "prefetch.cli", "pull", f"gs://{gcs_bucket}/big", str(dest),
            "--json", "--concurrency", "2", "--chunk-size", "2MiB"]  # fmt: skip
    env = gcs_env(front, tmp_path)
    front.faults.throttle_bps = 8 * MiB  # about 4 s: the kill lands mid-transfer
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            published = sum(f.stat().st_size for f in dest.glob("*.safetensors"))
            if journaled_bytes(partial) + published >= 0.6 * total:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the pull finished before it could be killed"
        proc.kill()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    front.faults.throttle_bps = 0
    second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout)
    assert summary["resumed_bytes"] > 0
    assert summary["bytes_downloaded"] < 0.5 * summary["bytes_total"], summary
    assert tree_bytes(dest) == {f.path: f.local.read_bytes() for f in generated}


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        (
            "gs://no-such-bucket-here/m",
            "Error: listing gs://no-such-bucket-here/m/: the bucket does not exist",
        ),
        ("gs://{bucket}/missing/prefix", "Error: no objects under gs://{bucket}/missing/prefix/"),
        ("gs://UPPER/m", "Error: malformed GCS URI 'gs://UPPER/m': 'UPPER' is not a valid bucket"),
    ],
)
def test_a_bad_bucket_or_prefix_is_one_error_line(
    gcs_bucket: str, front: S3FaultProxy, tmp_path: Path, uri: str, message: str
) -> None:
    proc = run_cli("pull", uri.format(bucket=gcs_bucket), str(tmp_path / "d"),
                   env=gcs_env(front, tmp_path))  # fmt: skip
    assert proc.returncode != 0
    assert proc.stderr.splitlines()[0].startswith(message.format(bucket=gcs_bucket))
    assert "Traceback" not in proc.stderr


def test_the_agent_syncs_a_gs_model_to_ready(
    gcs_emulator: GcsEmulator, gcs_bucket: str, front: S3FaultProxy, tmp_path: Path
) -> None:
    files = make_model_dir(tmp_path / "src", seed=5, shard_sizes=(1 * MiB + 3,))
    gcs_emulator.upload_dir(gcs_bucket, "tiny/", files)
    cache = tmp_path / "cache"
    config = tmp_path / "models.yaml"
    models = [{"name": "tiny", "source": f"gs://{gcs_bucket}/tiny", "hfRepo": "acme/tiny"}]
    config.write_text(config_text(cache, models))
    agent = AgentProcess(config, gcs_env(front, tmp_path), tmp_path / "agent.log")
    try:
        assert agent.ready_then_terminated()["models"][0]["state"] == "ready"
    finally:
        agent.stop()
    out = hf_check(
        cache,
        """
        path = hf.snapshot_download("acme/tiny")
        out["shard"] = len(open(path + "/model.safetensors", "rb").read())
        out["config"] = open(path + "/config.json").read()
        """,
    )
    assert out == {"shard": 1 * MiB + 3, "config": files["config.json"].read_text()}


@pytest.mark.slow
def test_the_gcs_benchmark_reports_both_ways_side_by_side(gcs_emulator: GcsEmulator) -> None:
    """bench/gcs.py runs (a tiny size): the seam and google-cloud-storage, pull and no-op."""
    pytest.importorskip("google.cloud.storage")
    bench = Path(__file__).resolve().parent.parent / "bench" / "gcs.py"
    proc = subprocess.run([sys.executable, str(bench), "--size", "4MiB", "--rounds", "1"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line[:2] == "| "]
    assert rows[1:7] == ["prefetch", "prefetch no-op", "prefetch 32MiB chunks",
                         "prefetch 32MiB chunks no-op", "google-cloud-storage",
                         "google-cloud-storage no-op"]  # fmt: skip
