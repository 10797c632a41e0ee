"""Page-cache warm-up (prefetch.warm), checked through the kernel: ``mincore`` says which pages
of a file are resident, before and after."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from prefetch.modelgen import generate_model, upload_model
from prefetch.warm import WarmLimits, resident_bytes, warm_files

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
    caplog.set_level(logging.INFO, logger="prefetch.warm")
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
