"""``prefetch pull --processes N`` (the engine's multi-process mode) end to end against the real
local S3 server (SeaweedFS over HTTPS): the files identical and verified, one progress and one
publish, resume after a kill -9 of the pull, a worker's death or checksum failure failing the
pull cleanly, and a stop reaching every worker."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from prefetch.demo.modelgen import generate_model, tree_bytes, upload_model
from prefetch.pipeline.engine.processes import ProcessEngine, SourceRecipe, parse_processes, shares
from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.snapshot import RemoteFile
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.sources import SourceSettings

from .fakes.s3proxy import S3FaultProxy
from .support import journaled_bytes, put, run_cli, write_mirror

MiB = 1024 * 1024


def pull_args(bucket: str, dest: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "prefetch.cli", "pull", f"s3://{bucket}/m", str(dest),
            "--json", "--processes", "2", "--chunk-size", "4MiB", *extra]  # fmt: skip


def start_pull(bucket: str, dest: Path, env: dict[str, str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen(pull_args(bucket, dest, *extra), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def workers_of(pid: int) -> list[psutil.Process]:
    """The pull's worker processes: the children of its fork server (or its spawned children,
    less multiprocessing's helpers)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        line = " ".join(_cmdline(child))
        if "resource_tracker" in line:
            continue
        try:
            parent = child.parent()
        except psutil.Error:
            continue
        if "forkserver" in line and parent is not None and parent.pid == pid:
            continue  # the fork server itself: the workers are its children
        found.append(child)
    return found


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def wait_for(predicate: Any, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def no_pull_process_left(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


def upload(s3_client: Any, bucket: str, tmp_path: Path, total: int, shards: int = 2) -> Any:
    files = generate_model(tmp_path / "src", total, shards=shards)
    upload_model(s3_client, bucket, "m", files, create_bucket=False, part_size=8 * MiB)
    return files


# -- the plan's shares (no server) -------------------------------------------------------------


def test_shares_balance_bytes_and_leave_none_empty():
    files = [RemoteFile(f"f{i}", size, "v") for i, size in enumerate([100, 60, 50, 10, 5])]
    two = shares(files, 2)
    assert sorted(sum(f.size for f in s) for s in two) == [110, 115]
    assert sorted(f.path for s in two for f in s) == sorted(f.path for f in files)
    assert len(shares(files[:1], 4)) == 1  # one file: one share, one process


def test_processes_flag_values():
    assert parse_processes("2") == 2
    assert parse_processes("auto") == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="auto or 1 to 64"):
        parse_processes("0")


class _MemorySource:
    """A source only this process can read (no ``adopt``): files from a dict."""

    def __init__(self, data: dict[str, bytes]) -> None:
        self.data = data
        self.reader_pids: set[int] = set()

    def resolve(self, spec: Any) -> Any:
        raise NotImplementedError

    def describe(self, file: RemoteFile) -> RemoteFile:
        return file

    def open_range(self, file: RemoteFile, start: int, end: int) -> Any:
        self.reader_pids.add(os.getpid())
        return io.BytesIO(self.data[file.path][start:end])


def test_a_source_workers_cannot_read_runs_in_this_process(tmp_path):
    data = {"a.bin": os.urandom(3000), "b.bin": os.urandom(5000)}
    source = _MemorySource(data)
    published: dict[str, bytes] = {}

    def publish(file: RemoteFile, staged: Path, checks: Any) -> None:
        published[file.path] = staged.read_bytes()

    spec = ModelSpec(source=parse_source_uri("s3://bucket/m"))
    engine = ProcessEngine(
        source, tmp_path / "staging", publish, TransferConfig(),
        recipe=SourceRecipe(spec, SourceSettings()), processes=2,
    )  # fmt: skip
    stats = engine.run([RemoteFile(p, len(b), "v") for p, b in data.items()])
    assert published == data and stats.files_downloaded == 2
    assert source.reader_pids == {os.getpid()}  # read here, by one Transfer


# -- end to end --------------------------------------------------------------------------------


def test_two_processes_pull_identical_verified_files(s3_client, bucket, s3_env, tmp_path):
    files = upload(s3_client, bucket, tmp_path, 40 * MiB, shards=2)
    extra = {f"small/f{i:02d}.json": os.urandom(100 + i) for i in range(30)}
    for path, data in extra.items():
        put(s3_client, bucket, f"m/{path}", data)
    dest = tmp_path / "dest"
    args = pull_args(bucket, dest, "--no-progress")
    args.insert(args.index("pull"), "-v")
    proc = subprocess.run(args, env=s3_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "2 worker processes" in proc.stderr
    summary = json.loads(proc.stdout)
    count = len(files) + len(extra)
    assert summary["files"] == summary["files_downloaded"] == summary["files_verified"] == count
    assert summary["bytes_downloaded"] == summary["bytes_total"]
    assert summary["retries"] == 0
    assert summary["checksum_algorithms"]["crc64nvme"] == 2  # the shards, one in each worker
    source = {f.path: (tmp_path / "src" / f.path).read_bytes() for f in files}
    assert tree_bytes(dest) == {**source, **extra}
    assert not list((dest / ".prefetch" / "partial").iterdir())
    check = subprocess.run([sys.executable, "-m", "prefetch.cli", "verify", str(dest)],
                           env=s3_env, capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stderr
    again = subprocess.run(pull_args(bucket, dest), env=s3_env, capture_output=True, text=True)
    assert json.loads(again.stdout)["up_to_date"] is True, again.stderr


def test_the_parent_shows_one_progress_of_all_workers(s3_client, bucket, s3_env, tmp_path):
    files = upload(s3_client, bucket, tmp_path, 16 * MiB, shards=2)
    proc = subprocess.run(pull_args(bucket, tmp_path / "d", "--progress"), env=s3_env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # off a terminal the bar is a line at the start and one at the end: the last one counts
    # the bytes and files of both workers
    last = proc.stderr.strip().splitlines()[-1]
    count = f"files {len(files)}/{len(files)}"
    assert "100.0%" in last and "16.0 MiB/16.0 MiB" in last and count in last, proc.stderr


@pytest.mark.slow
def test_resume_after_sigkill_of_the_pull(test_ca, s3_server, s3_client, bucket, s3_env,
                                          tmp_path):  # fmt: skip
    total = 64 * MiB
    upload(s3_client, bucket, tmp_path, total, shards=2)
    dest = tmp_path / "dest"
    partial = dest / ".prefetch" / "partial"
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        proxy.faults.throttle_bps = 4 * MiB  # per connection: ~4 s, so the kill lands mid-pull
        env = dict(s3_env, AWS_ENDPOINT_URL=proxy.endpoint)
        proc = start_pull(bucket, dest, env, "--concurrency", "4")
        try:
            wait_for(lambda: len(workers_of(proc.pid)) == 2, "two workers")
            pids = [w.pid for w in workers_of(proc.pid)]
            wait_for(lambda: journaled_bytes(partial) >= 0.4 * total, "half the bytes", 120)
            proc.kill()
            proc.wait(10)
            # the kernel ends the workers with the pull: nothing writes behind the next run
            wait_for(lambda: no_pull_process_left(pids), "the workers to die", 3)
        finally:
            if proc.poll() is None:
                proc.kill()
    second = subprocess.run(pull_args(bucket, dest), env=s3_env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout)
    assert summary["resumed_bytes"] >= 0.3 * total, summary
    assert summary["bytes_downloaded"] <= 0.7 * summary["bytes_total"], summary
    check = subprocess.run([sys.executable, "-m", "prefetch.cli", "verify", str(dest)],
                           env=s3_env, capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stderr


@pytest.mark.slow
def test_sigkill_of_one_worker_fails_the_pull_cleanly(test_ca, s3_server, s3_client, bucket,
                                                      s3_env, tmp_path):  # fmt: skip
    total = 48 * MiB
    files = upload(s3_client, bucket, tmp_path, total, shards=2)
    shards = [f.path for f in files if f.path.endswith(".safetensors")]
    dest = tmp_path / "dest"
    partial = dest / ".prefetch" / "partial"
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        proxy.faults.throttle_bps = 2 * MiB
        env = dict(s3_env, AWS_ENDPOINT_URL=proxy.endpoint)
        proc = start_pull(bucket, dest, env, "--concurrency", "4")
        try:
            wait_for(lambda: len(workers_of(proc.pid)) == 2, "two workers")
            wait_for(lambda: journaled_bytes(partial) >= 4 * MiB, "bytes on disk")
            victim, other = workers_of(proc.pid)
            victim.kill()
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 1, err
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "worker process" in errors[0] and "SIGKILL" in errors[0], err
    assert "Traceback" not in err
    assert json.loads(out)["error_reason"]
    assert not other.is_running() or other.status() == "zombie"  # the other worker was stopped
    assert not any((dest / s).exists() for s in shards)  # no half-written shard published
    assert list(partial.glob("*.journal"))  # the journals are left for the resume
    rerun = subprocess.run(pull_args(bucket, dest), env=s3_env, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads(rerun.stdout)["resumed_bytes"] > 0
    source = {f.path: (tmp_path / "src" / f.path).read_bytes() for f in files}
    assert tree_bytes(dest) == source


def test_checksum_failure_in_one_worker_fails_the_pull_cleanly(
    test_ca, s3_server, s3_client, bucket, s3_env, tmp_path
):
    bad, good = "bad.safetensors", "good.safetensors"
    put(s3_client, bucket, f"m/{bad}", os.urandom(8 * MiB))  # checked by its MD5 ETag
    put(s3_client, bucket, f"m/{good}", os.urandom(40 * MiB))
    dest = tmp_path / "dest"
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        proxy.faults.flip_key = f"m/{bad}"
        proxy.faults.flip_offset = 3 * MiB + 7
        # the other shard's worker is still downloading when the bad one fails (twice)
        proxy.faults.throttle_bps = 3 * MiB
        env = dict(s3_env, AWS_ENDPOINT_URL=proxy.endpoint)
        proc = start_pull(bucket, dest, env, "--concurrency", "4")
        try:
            wait_for(lambda: len(workers_of(proc.pid)) == 2, "two workers")
            pids = [w.pid for w in workers_of(proc.pid)]
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 1, err
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and bad in errors[0] and "checksum" in errors[0].lower(), err
    assert "Traceback" not in err
    summary = json.loads(out)
    assert summary["error_reason"] == "checksum_mismatch", summary
    assert summary["checksum_failures"] == 2  # the bad shard, fetched twice
    assert no_pull_process_left(pids)
    assert not (dest / bad).exists()  # nothing of the failed file published
    assert not (dest / good).exists()  # the other worker was stopped before it finished
    staged = list((dest / ".prefetch" / "partial").glob("*.incomplete"))
    assert len(staged) == 1  # the other shard's partial, kept to resume; the bad one deleted


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_pull_stops_its_workers(test_ca, s3_server, s3_client, bucket, s3_env,
                                                tmp_path, sig):  # fmt: skip
    upload(s3_client, bucket, tmp_path, 32 * MiB, shards=2)
    dest = tmp_path / "dest"
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        proxy.faults.throttle_bps = 1 * MiB
        env = dict(s3_env, AWS_ENDPOINT_URL=proxy.endpoint)
        proc = start_pull(bucket, dest, env, "--concurrency", "2")
        try:
            wait_for(lambda: len(workers_of(proc.pid)) == 2, "two workers")
            pids = [w.pid for w in workers_of(proc.pid)]
            wait_for(lambda: journaled_bytes(dest / ".prefetch" / "partial") > 0, "bytes")
            proc.send_signal(sig)  # to the parent only: it stops the workers
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode != 0
    assert "Traceback" not in err, err
    assert no_pull_process_left(pids)
    assert list((dest / ".prefetch" / "partial").glob("*.journal"))  # resumable


def test_a_bad_processes_value_is_one_error_line(s3_env, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "prefetch.cli", "pull", "s3://no-bucket/m", str(tmp_path / "d"),
         "--processes", "0"],
        env=s3_env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.startswith("Error: processes: must be auto or 1 to 64"), proc.stderr
    assert "Traceback" not in proc.stderr


def hub_tree(home: Path) -> dict[str, bytes]:
    """Every file of an HF cache (links read through), by path."""
    return {
        str(p.relative_to(home)): p.read_bytes()
        for p in sorted((home / "hub").rglob("*"))
        if p.is_file() and ".prefetch" not in p.parts and not p.name.endswith(".lock")
    }


def test_two_processes_pull_an_s3_mirror_into_the_hub_layout(
    hub: Any, s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    sha = write_mirror(s3_client, bucket, "mirror/", hub)
    one, two = tmp_path / "one", tmp_path / "two"
    first = run_cli("pull", f"s3://{bucket}/mirror/", str(one), "--json", env=s3_env)
    assert first.returncode == 0, first.stderr
    proc = run_cli("-v", "pull", f"s3://{bucket}/mirror/", str(two), "--json",
                   "--processes", "2", env=s3_env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "2 worker processes" in proc.stderr  # the workers read the mirror's blobs
    summary = json.loads(proc.stdout)
    assert summary["revision"] == sha and summary["files_verified"] == summary["files"]
    assert summary["retries"] == 0
    assert hub_tree(two) == hub_tree(one) and hub_tree(two)
