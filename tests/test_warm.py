"""Page-cache warm-up (prefetch.pipeline.warmup), checked through the kernel: ``mincore`` says which
pages of a file are resident, before and after."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prefetch.demo.modelgen import generate_model, upload_model
from prefetch.pipeline.warmup import (
    WarmLimits,
    cgroup_memory,
    resident_bytes,
    share_text,
    warm_files,
)

from .support import run_cli

MiB = 1024 * 1024


def drop_from_page_cache(path: Path) -> None:
    """Push ``path`` out of the page cache: its dirty pages written first (a dirty page cannot
    be dropped), then POSIX_FADV_DONTNEED."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cold_file(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    drop_from_page_cache(path)
    return path


def test_files_dropped_from_the_page_cache_are_resident_after_the_warm_up(tmp_path):
    files = [cold_file(tmp_path / f"shard-{i}.safetensors", 3 * MiB + 100) for i in range(2)]
    assert [resident_bytes(f) for f in files] == [0, 0]
    report = warm_files(files, WarmLimits(read_rate=None))
    assert report.state == "warm"
    assert report.files == 2
    assert report.bytes_read == report.bytes_total == 2 * (3 * MiB + 100)
    for f in files:  # whole pages: the last, partial page counts in full
        assert resident_bytes(f) >= f.stat().st_size


def test_a_model_larger_than_its_share_of_memory_is_skipped_with_a_log_line(tmp_path, caplog):
    big = cold_file(tmp_path / "big.bin", 6 * MiB)
    caplog.set_level(logging.INFO, logger="prefetch.pipeline.warmup")
    # 10 MiB available, half of it allowed: 6 MiB does not fit
    report = warm_files(
        [big], WarmLimits(memory_share=0.5, read_rate=None), available=lambda: 10 * MiB, model="m"
    )
    assert report.state == "skipped"
    assert report.budget == 5 * MiB and report.bytes_read == 0
    assert resident_bytes(big) == 0
    assert any(
        "warm-up skipped" in r.getMessage() and "does not fit" in r.getMessage()
        for r in caplog.records
    )
    # the same model under a larger share fits
    roomy = WarmLimits(memory_share=0.7, read_rate=None)
    fits = warm_files([big], roomy, available=lambda: 10 * MiB)
    assert fits.state == "warm" and resident_bytes(big) >= 6 * MiB


def test_the_read_rate_bounds_the_warm_up(tmp_path):
    f = cold_file(tmp_path / "f.bin", 4 * MiB)
    t0 = time.monotonic()
    report = warm_files([f], WarmLimits(read_rate=16 * MiB))
    # 4 MiB at 16 MiB/s: at least 0.25 s (the first 8 MiB block is read at once, then paid for)
    assert time.monotonic() - t0 >= 0.24
    assert report.state == "warm"


def test_a_stopped_warm_up_says_so(tmp_path):
    files = [cold_file(tmp_path / f"f{i}.bin", 1 * MiB) for i in range(3)]
    stop = threading.Event()
    stop.set()
    report = warm_files(files, WarmLimits(read_rate=None), stop=stop)
    assert report.state == "stopped"
    assert report.files == 0


def test_a_read_error_is_reported_not_raised(tmp_path, caplog):
    d = tmp_path / "a-directory"
    d.mkdir()
    report = warm_files([d], WarmLimits(read_rate=None))
    assert report.state == "failed"
    assert "a-directory" in report.reason


def test_limits_are_checked():
    with pytest.raises(ValueError):
        WarmLimits(memory_share=0.0)
    with pytest.raises(ValueError):
        WarmLimits(memory_share=1.5)
    with pytest.raises(ValueError):
        WarmLimits(read_rate=0)


def test_pull_warm_page_cache_reads_the_pulled_model_into_memory(
    s3_client, bucket, s3_env, tmp_path
):
    files = generate_model(tmp_path / "src", 12 * MiB, shards=2)
    upload_model(s3_client, bucket, "warm", files, create_bucket=False)
    dest = tmp_path / "dest"
    first = run_cli("pull", f"s3://{bucket}/warm", str(dest), "--json", env=s3_env)
    assert first.returncode == 0, first.stderr
    assert "warm" not in json.loads(first.stdout)
    assert "warm" not in json.loads(first.stdout)["timings"]
    pulled = [dest / f.path for f in files]
    for p in pulled:
        drop_from_page_cache(p)
    assert sum(resident_bytes(p) for p in pulled) == 0
    # up to date: nothing downloaded, the published files warmed all the same
    proc = run_cli(
        "pull", f"s3://{bucket}/warm", str(dest), "--json", "--warm-page-cache", env=s3_env
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    warm = summary["warm"]
    assert summary["timings"]["warm"] == round(warm["seconds"], 3)
    total = sum(f.size for f in files)
    assert warm["state"] == "warm"
    assert warm["files"] == len(files) and warm["bytes_read"] == total
    assert warm["bytes_read"] <= warm["budget"]
    for p in pulled:
        assert resident_bytes(p) >= p.stat().st_size


def test_pull_warm_page_cache_skips_a_model_over_its_share_with_a_warning(
    s3_client, bucket, s3_env, tmp_path
):
    files = generate_model(tmp_path / "src", 4 * MiB, shards=1)
    upload_model(s3_client, bucket, "warm", files, create_bucket=False)
    dest = tmp_path / "dest"
    # a share so small that not even 4 MiB fits (24 GiB * 1e-6 is about 25 KB)
    proc = run_cli(
        "pull", f"s3://{bucket}/warm", str(dest), "--warm-page-cache",
        "--warm-memory-share", "0.000001", env=s3_env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Warning: page-cache warm-up skipped" in proc.stderr
    assert "does not fit" in proc.stderr


def test_pull_refuses_a_warm_memory_share_out_of_range(s3_env, tmp_path):
    proc = run_cli("pull", "s3://b/m", str(tmp_path / "d"), "--warm-memory-share", "2", env=s3_env)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "--warm-memory-share" in proc.stderr


def test_pull_warm_page_cache_in_the_hf_layout_warms_the_snapshot_files(
    s3_client, bucket, s3_env, tmp_path
):
    files = generate_model(tmp_path / "src", 10 * MiB, shards=1)
    upload_model(s3_client, bucket, "hfm", files, create_bucket=False)
    home = tmp_path / "hf-home"
    proc = run_cli(
        "pull", f"s3://{bucket}/hfm", str(home), "--layout", "hf", "--hf-repo", "org/hfm",
        "--json", "--warm-page-cache", env=s3_env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    warm = json.loads(proc.stdout)["warm"]
    assert warm["state"] == "warm" and warm["files"] == len(files)
    assert warm["bytes_read"] == sum(f.size for f in files)


# -- the memory cgroup's limit and what stayed resident (issue 29, item 16) ----------------------


def fake_cgroup_v2(root: Path, path: str, levels: dict[str, tuple[str, int, int]]) -> Path:
    """A cgroup v2 file system under ``root`` for a process in ``path``: ``levels`` maps each
    cgroup (relative to the root, "" for the root) to (memory.max, memory.current, file)."""
    for rel, (limit, current, file) in levels.items():
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text(f"{current}\n")
        (d / "memory.stat").write_text(f"anon {current - file}\nfile {file}\nkernel 4096\n")
    proc = root.parent / "proc-self-cgroup"
    proc.write_text(f"0::{path}\n")
    return proc


def fake_cgroup_v1(root: Path, path: str, levels: dict[str, tuple[int, int, int]]) -> Path:
    """The same for cgroup v1's memory controller (memory.limit_in_bytes, usage_in_bytes,
    total_cache)."""
    for rel, (limit, usage, cache) in levels.items():
        d = root / "memory" / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"cache {cache // 2}\nrss 1\ntotal_cache {cache}\n")
    proc = root.parent / "proc-self-cgroup"
    proc.write_text(f"12:pids:/x\n4:memory:{path}\n1:name=systemd:{path}\n")
    return proc


V1_NO_LIMIT = 9223372036854771712
POD = "kubepods.slice/kubepods-burstable.slice/pod1"


def test_cgroup_v2_limit_and_room(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    proc = fake_cgroup_v2(root, f"/{POD}/agent", {
        "": ("max", 9 * 2**30, 2**30),
        POD: (str(2 * 2**30), 700 * MiB, 100 * MiB),
        f"{POD}/agent": (str(512 * MiB), 200 * MiB, 80 * MiB),
    })  # fmt: skip
    group = cgroup_memory(root, proc)
    assert group is not None
    # the container's limit, less what is not page cache (120 MiB of its own memory)
    assert (group.limit, group.room) == (512 * MiB, 392 * MiB)


def test_cgroup_v2_a_tighter_limit_above_wins_and_max_is_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    proc = fake_cgroup_v2(root, f"/{POD}/agent", {
        POD: (str(300 * MiB), 250 * MiB, 50 * MiB),  # 100 MiB of room left in the pod
        f"{POD}/agent": ("max", 100 * MiB, 40 * MiB),
    })  # fmt: skip
    group = cgroup_memory(root, proc)
    assert group is not None and (group.limit, group.room) == (300 * MiB, 100 * MiB)
    unlimited = tmp_path / "u" / "cgroup"
    proc = fake_cgroup_v2(unlimited, "/a", {"": ("max", 1, 0), "a": ("max", 1, 0)})
    assert cgroup_memory(unlimited, proc) is None


def test_cgroup_v1_limit_and_room_and_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    proc = fake_cgroup_v1(root, "/kubepods/pod1/agent", {
        "": (V1_NO_LIMIT, 5 * 2**30, 2**30),
        "kubepods/pod1/agent": (160 * MiB, 150 * MiB, 100 * MiB),
    })  # fmt: skip
    group = cgroup_memory(root, proc)
    assert group is not None and (group.limit, group.room) == (160 * MiB, 110 * MiB)
    free = tmp_path / "free" / "cgroup"
    proc = fake_cgroup_v1(free, "/a", {"": (V1_NO_LIMIT, 1, 0), "a": (V1_NO_LIMIT, 1, 0)})
    assert cgroup_memory(free, proc) is None


def test_inside_a_container_the_mount_is_the_container_s_cgroup(tmp_path: Path) -> None:
    """A container without a cgroup namespace sees the host's path in /proc/self/cgroup, and
    its own cgroup mounted at the root: the root's limit counts."""
    root = tmp_path / "cgroup"
    proc = fake_cgroup_v1(root, "/kubepods/pod1/agent", {"": (256 * MiB, 64 * MiB, 0)})
    group = cgroup_memory(root, proc)
    assert group is not None and group.room == 192 * MiB


def test_no_cgroup_file_system_is_no_limit(tmp_path: Path) -> None:
    assert cgroup_memory(tmp_path / "none", tmp_path / "no-proc-file") is None


def test_the_budget_takes_the_agent_s_memory_limit_into_account(tmp_path: Path) -> None:
    """A 6 MiB model, 10 GiB available, but an agent limited to 16 MiB with 8 MiB of its own:
    half of the 8 MiB left is 4 MiB, so the warm-up is skipped and says why; raising the
    limit lets it run."""
    model = cold_file(tmp_path / "model.bin", 6 * MiB)
    root = tmp_path / "cgroup"
    proc = fake_cgroup_v2(root, "/agent", {"agent": (str(16 * MiB), 10 * MiB, 2 * MiB)})
    report = warm_files([model], WarmLimits(read_rate=None), available=lambda: 10 * 2**30,
                        cgroup=lambda: cgroup_memory(root, proc))  # fmt: skip
    assert report.state == "skipped" and report.bytes_read == 0
    assert (report.budget, report.cgroup_limit, report.cgroup_room) == (4 * MiB, 16 * MiB, 8 * MiB)
    assert "memory cgroup" in report.reason and "16.0 MiB" in report.reason
    assert resident_bytes(model) == 0
    proc = fake_cgroup_v2(root, "/agent", {"agent": (str(64 * MiB), 10 * MiB, 2 * MiB)})
    roomy = warm_files([model], WarmLimits(read_rate=None), available=lambda: 10 * 2**30,
                       cgroup=lambda: cgroup_memory(root, proc))  # fmt: skip
    assert roomy.state == "warm" and roomy.budget == 28 * MiB


def test_resident_bytes_measures_a_real_file(tmp_path: Path) -> None:
    f = cold_file(tmp_path / "f.bin", 8 * MiB)
    assert resident_bytes(f) == 0
    f.read_bytes()
    assert resident_bytes(f) == 8 * MiB
    fd = os.open(f, os.O_RDONLY)
    try:  # the second half leaves the page cache (clean pages: dropped at once)
        os.posix_fadvise(fd, 4 * MiB, 4 * MiB, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert resident_bytes(f) == 4 * MiB


class _EvictsAtTheEnd(threading.Event):
    """Stands in for the memory cgroup's reclaim: when the warm-up asks whether to stop after
    its last block, the first file's pages leave the page cache."""

    def __init__(self, victim: Path, reads: int) -> None:
        super().__init__()
        self._victim, self._reads = victim, reads

    def is_set(self) -> bool:
        self._reads -= 1
        if self._reads == 0:
            drop_from_page_cache(self._victim)
        return super().is_set()


def test_a_warm_up_whose_pages_did_not_stay_is_partial_not_warm(tmp_path: Path) -> None:
    files = [cold_file(tmp_path / f"shard-{i}.bin", 4 * MiB) for i in range(2)]
    # one 4 MiB read per file (the 8 MiB buffer): the second is the last
    stop = _EvictsAtTheEnd(files[0], reads=2)
    report = warm_files(files, WarmLimits(read_rate=None), stop=stop)
    assert report.bytes_read == 8 * MiB
    assert report.state == "partial"
    assert report.bytes_resident == 4 * MiB
    assert "50%" in report.reason and "stayed in the page cache" in report.reason


def test_a_share_under_half_a_percent_is_not_written_as_zero(tmp_path: Path) -> None:
    assert share_text(0.004) == "<1%"
    assert share_text(0.000001) == "<1%"
    assert share_text(0.5) == "50%"
    assert share_text(1.0) == "100%"
    model = cold_file(tmp_path / "m.bin", 1 * MiB)
    report = warm_files([model], WarmLimits(memory_share=0.001, read_rate=None),
                        available=lambda: 100 * MiB, cgroup=lambda: None)  # fmt: skip
    assert report.state == "skipped"
    assert "does not fit in <1% of the 100.0 MiB" in report.reason and " 0% " not in report.reason


def test_pull_json_carries_the_warm_up_warning(s3_client, bucket, s3_env, tmp_path):
    """``pull --json --warm-page-cache``: a script reading only stdout sees the warning too."""
    files = generate_model(tmp_path / "src", 4 * MiB, shards=1)
    upload_model(s3_client, bucket, "warm", files, create_bucket=False)
    proc = run_cli(
        "pull", f"s3://{bucket}/warm", str(tmp_path / "dest"), "--json", "--warm-page-cache",
        "--warm-memory-share", "0.000001", env=s3_env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["warm"]["state"] == "skipped"
    [warning] = out["warnings"]
    assert (
        warning.startswith("page-cache warm-up skipped: ") and "does not fit in <1% of" in warning
    )
    assert "Warning: page-cache warm-up skipped" in proc.stderr
    fine = run_cli(
        "pull", f"s3://{bucket}/warm", str(tmp_path / "dest"), "--json", "--warm-page-cache",
        env=s3_env,
    )  # fmt: skip
    assert json.loads(fine.stdout)["warnings"] == []


def _test_cgroup_parent() -> Path | None:
    """A memory cgroup directory the test may create a child in: only one named by
    PREFETCH_TEST_MEMORY_CGROUP (a cgroup made for tests, e.g. ``mkdir
    /sys/fs/cgroup/prefetch-tests`` as root, with the memory controller enabled in v2): the
    cgroups a machine runs its tests in belong to whatever runs them."""
    where = os.environ.get("PREFETCH_TEST_MEMORY_CGROUP")
    if not where:
        return None
    parent = Path(where)
    limit_file = "memory.max" if (parent / "memory.max").exists() else "memory.limit_in_bytes"
    if not (parent / limit_file).exists() or not os.access(parent, os.W_OK):
        return None
    return parent


WARM_ONE = """
import json, sys
from pathlib import Path
from prefetch.pipeline.warmup import WarmLimits, warm_files
report = warm_files([Path(sys.argv[1])], WarmLimits(read_rate=None))
print(json.dumps(report.to_json()))
"""


@pytest.mark.skipif(
    _test_cgroup_parent() is None,
    reason="no memory cgroup for tests: set PREFETCH_TEST_MEMORY_CGROUP to a writable memory "
    "cgroup directory (docs/deploy.md, 'The agent's memory limit', has the manual check)",
)
def test_in_a_real_memory_cgroup_the_warm_up_is_bounded_and_tells_the_truth(tmp_path):
    parent = _test_cgroup_parent()
    assert parent is not None
    child = parent / f"prefetch-warm-{os.getpid()}"
    child.mkdir()
    v2 = (child / "memory.max").exists()
    (child / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(160 * MiB))
    try:
        results = {}
        for name, size in (("small", 16 * MiB), ("large", 300 * MiB)):
            model = cold_file(tmp_path / f"{name}.bin", size)

            def enter(procs: Path = child / "cgroup.procs") -> None:
                procs.write_text(str(os.getpid()))

            proc = subprocess.run(
                [sys.executable, "-c", WARM_ONE, str(model)], capture_output=True, text=True,
                preexec_fn=enter, timeout=120, check=False,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr
            results[name] = (json.loads(proc.stdout), resident_bytes(model), size)
    finally:
        child.rmdir()
    small, small_resident, small_size = results["small"]
    assert small["state"] == "warm" and small_resident >= small_size
    assert small["cgroup_limit"] == 160 * MiB
    large, large_resident, large_size = results["large"]
    # 300 MiB cannot stay under a 160 MiB limit: never "warm" unless it all stayed
    assert large["state"] in ("skipped", "partial"), large
    assert large["state"] != "warm" or large_resident >= large_size
