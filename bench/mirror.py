#!/usr/bin/env python3
"""Benchmark ``prefetch mirror`` against what users do today: ``hf download`` then ``aws s3 sync``.

The same generated model is served by the local Hub-compatible server (tests/fakes/hubserver.py,
LFS blobs through its CDN port) and copied into a local SeaweedFS two ways, alternately
(A B, A B, ...), each run into a fresh S3 prefix:

* ``prefetch-mirror``: ``prefetch mirror hf://acme/bench s3://bench/mirror/<run>/ --json``
  (defaults): bytes stream from the Hub into multipart uploads, nothing staged on local disk,
  every file checked against the Hub's ids before its upload completes;
* ``hf+aws-sync``: ``hf download acme/bench --local-dir STAGE`` (fresh HF_HOME), then
  ``aws s3 sync STAGE s3://bench/sync/<run>/ --exclude '.cache/*'`` (awscli defaults): the
  whole model lands on local disk first, and nothing compares the uploaded bytes with the Hub's
  ids. Its two steps are measured one after the other and summed; the steps also get a row each.

Measured per run, with bench/harness.py like bench/run.py: wall seconds, CPU seconds (user+sys
of the whole process tree, ``os.wait4``), peak RSS of the whole process tree (psutil, polled
every 50 ms; the maximum over a row's steps), the servers' CPU seconds (Hub server and SeaweedFS)
meanwhile, and what reached S3 (the bytes under the run's prefix, checked against the model).
Before every run the staging directory is deleted, dirty pages synced, the page cache dropped
(root, not with ``--quick``) and the model's files read back in (the Hub's disk stays warm).

    python bench/mirror.py --size 1GiB --runs 3
    python bench/mirror.py --size 8MiB --runs 1 --quick --json /tmp/m.json   # tests/test_bench.py

A Markdown table goes to stdout (progress to stderr), every run to ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "bench"))

from datasets import BUCKET, HUB_REPO  # noqa: E402
from harness import Cache, MiB, Sample, count_bytes, run_measured, say  # noqa: E402
from report import fmt, summarize  # noqa: E402
from tools import VERSION_ARG, find_bin, prefetch_cmd  # noqa: E402

from prefetch.demo.locals3 import SeaweedS3  # noqa: E402
from prefetch.demo.modelgen import generate_model  # noqa: E402
from prefetch.support.units import parse_size  # noqa: E402

MIRROR = "prefetch-mirror"
TODAY = "hf+aws-sync"
STEPS = ("hf-download", "aws-s3-sync")
#: The end-to-end target of issue 13: prefetch mirror at least this many times faster.
TARGET_SPEEDUP = 2.0


@dataclass
class Row:
    """What report.summarize needs of a tool: its name, group, label and why it is missing."""

    name: str
    label: str
    group: str = "mirror"
    missing: str = ""
    samples: list[Sample] = field(default_factory=list)


class MirrorBench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-mirror-")).resolve()
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.model = self.work / "model"
        self.stage = self.work / "stage"
        self.hub_proc: subprocess.Popen[bytes] | None = None
        self.hub_endpoint = ""
        self.s3: SeaweedS3 | None = None
        self.total = 0
        self.files = 0

    # -- servers and environment

    def start(self) -> None:
        files = generate_model(self.model, self.args.size, shards=self.args.shards)
        self.total, self.files = sum(f.size for f in files), len(files)
        say(f"model: {self.files} files, {self.total / MiB:.0f} MiB under {self.model}")
        self.s3 = SeaweedS3(data_dir=self.work / "s3").start()
        self.s3.client().create_bucket(Bucket=BUCKET)
        self.hub_endpoint = self._start_hub()

    def _start_hub(self) -> str:
        argv = [sys.executable, str(REPO / "tests" / "fakes" / "hubserver.py"),
                "--repo", HUB_REPO, "--dir", str(self.model)]  # fmt: skip
        with open(self.logs / "hubserver.err", "wb") as err:
            self.hub_proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                start_new_session=True, env=self.env(),
            )  # fmt: skip
        assert self.hub_proc.stdout is not None
        line = self.hub_proc.stdout.readline()
        if not line:
            raise SystemExit(f"the Hub server did not start: see {self.logs / 'hubserver.err'}")
        return str(json.loads(line)["endpoint"])

    def stop(self) -> None:
        if self.hub_proc is not None and self.hub_proc.poll() is None:
            os.killpg(self.hub_proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.hub_proc.wait(10)
        if self.s3 is not None:
            self.s3.stop()
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = str(REPO)
        for name in ("PREFETCH_DEBUG", "PREFETCH_CONCURRENCY", "HF_TOKEN"):
            env.pop(name, None)
        env.update(HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
                   DO_NOT_TRACK="1", HF_HOME=str(self.stage / "hf-home"))  # fmt: skip
        if self.hub_endpoint:
            env["HF_ENDPOINT"] = self.hub_endpoint
        if self.s3 is not None:
            # both tools send bodies unsigned, as they do over HTTPS (every real S3), unless
            # --sign-payloads: over this plain-HTTP endpoint botocore would SHA256 every body
            unsigned = (
                "" if self.args.sign_payloads else "s3 =\n    payload_signing_enabled = false\n"
            )
            (self.work / "aws-config").write_text(f"[default]\nregion = us-east-1\n{unsigned}")
            env.update(self.s3.aws_env(self.work), AWS_EC2_METADATA_DISABLED="true")
        return env

    def server_pids(self) -> list[int]:
        pids = [self.hub_proc.pid] if self.hub_proc else []
        if self.s3 is not None and self.s3._proc is not None:
            pids.append(self.s3._proc.pid)
        return pids

    def warm_cmds(self) -> list[list[str]]:
        cmds = [
            [
                sys.executable,
                "-c",
                "import boto3, huggingface_hub, prefetch.cli, prefetch.publish.s3_mirror",
            ]
        ]
        cmds += [[exe, VERSION_ARG[n]] for n in ("hf", "aws") if (exe := find_bin(n))]
        return cmds

    # -- the two ways

    def mirror_cmd(self, run: int) -> list[str]:
        return [*prefetch_cmd(), "mirror", f"hf://{HUB_REPO}",
                f"s3://{BUCKET}/mirror/{run}/", "--json", "--no-progress"]  # fmt: skip

    def step_cmds(self, run: int) -> dict[str, list[str]]:
        hf, aws = find_bin("hf") or "hf", find_bin("aws") or "aws"
        return {
            "hf-download": [hf, "download", HUB_REPO, "--local-dir", str(self.stage / "model")],
            "aws-s3-sync": [aws, "s3", "sync", str(self.stage / "model"),
                            f"s3://{BUCKET}/sync/{run}/", "--exclude", ".cache/*",
                            "--only-show-errors"],
        }  # fmt: skip

    def uploaded(self, prefix: str) -> int:
        """Bytes of the model's files that reached S3 under ``prefix`` (a mirror's blobs, or a
        sync's objects)."""
        assert self.s3 is not None
        client, total = self.s3.client(), 0
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix) :]
                if prefix.startswith("mirror/") and not rel.startswith("blobs/"):
                    continue  # the snapshot JSON and refs are metadata, not model bytes
                total += int(obj["Size"])
        return total

    def measure(self, name: str, cmd: list[str], run: int) -> Sample:
        wall, user, system, peak, maxrss, server, other, codes, outs, _ = run_measured(
            [cmd], env=self.env(), logs=self.logs / f"{name}-{run}",
            timeout=max(self.args.timeout, self.total / 5e6), server_pids=self.server_pids(),
        )  # fmt: skip
        ok = codes == [0]
        error = ""
        if not ok:
            tail = outs[0].with_suffix(".err").read_text(errors="replace").strip().splitlines()
            error = f"exit {codes}: " + " | ".join(tail[-3:])
        extra: dict[str, Any] = {}
        if name == MIRROR and ok:
            with contextlib.suppress(ValueError, IndexError):
                extra = json.loads(outs[0].read_text().strip().splitlines()[-1])
        return Sample(
            name,
            run,
            ok,
            round(wall, 3),
            round(user + system, 3),
            round(user, 3),
            round(system, 3),
            peak,
            maxrss,
            round(server, 3),
            round(other, 3),
            0,
            codes[0] if codes else -1,
            error,
            False,
            self.cache.load_before,
            extra,
        )

    def run_mirror(self, run: int) -> Sample:
        self.cache.settle([self.stage], [self.model])
        sample = self.measure(MIRROR, self.mirror_cmd(run), run)
        sample.bytes = self.uploaded(f"mirror/{run}/")
        sample.ok = sample.ok and sample.bytes == self.total
        sample.extra["staged_bytes"] = 0
        return sample

    def run_today(self, run: int) -> tuple[Sample, list[Sample]]:
        """Both steps back to back (as a user's script runs them), and their sum."""
        self.cache.settle([self.stage], [self.model])
        steps = [self.measure(name, cmd, run) for name, cmd in self.step_cmds(run).items()]
        staged = count_bytes(self.stage / "model")
        uploaded = self.uploaded(f"sync/{run}/")
        total = Sample(
            TODAY, run, all(s.ok for s in steps) and uploaded == self.total,
            round(sum(s.wall_s for s in steps), 3), round(sum(s.cpu_s for s in steps), 3),
            round(sum(s.user_s for s in steps), 3), round(sum(s.sys_s for s in steps), 3),
            max(s.peak_rss_bytes for s in steps), max(s.max_rss_one_process_bytes for s in steps),
            round(sum(s.server_cpu_s for s in steps), 3),
            round(sum(s.other_cpu_s for s in steps), 3), uploaded, steps[-1].returncode,
            "; ".join(s.error for s in steps if s.error), False, self.cache.load_before,
            {"staged_bytes": staged, **{s.tool: s.wall_s for s in steps}},
        )  # fmt: skip
        steps[0].bytes, steps[1].bytes = staged, uploaded
        return total, steps

    # -- the whole benchmark

    def run(self) -> dict[str, Any]:
        missing = [n for n in ("hf", "aws") if find_bin(n) is None]
        rows = {
            MIRROR: Row(MIRROR, "prefetch mirror hf:// s3:// (defaults; streamed, checked)"),
            TODAY: Row(TODAY, "hf download --local-dir, then aws s3 sync (awscli defaults)"),
            "hf-download": Row("hf-download", "step 1: hf download --local-dir STAGE"),
            "aws-s3-sync": Row("aws-s3-sync", "step 2: aws s3 sync STAGE s3://..."),
        }
        if missing:
            for name in (TODAY, *STEPS):
                rows[name].missing = f"not available: {', '.join(missing)} not installed"
        self.cache = Cache(not self.args.quick, self.warm_cmds(), self.env(),
                           0 if self.args.quick else self.args.quiet_wait)  # fmt: skip
        for run in range(1, self.args.runs + 1):
            say(f"round {run} of {self.args.runs}")
            rows[MIRROR].samples.append(self.run_mirror(run))
            if not missing:
                total, steps = self.run_today(run)
                rows[TODAY].samples.append(total)
                for step in steps:
                    rows[step.tool].samples.append(step)
            for row in rows.values():
                if row.samples and row.samples[-1].run == run:
                    s = row.samples[-1]
                    say(f"  {row.name:<16} {s.wall_s:7.2f}s rss {s.peak_rss_bytes / MiB:5.0f} MiB"
                        f"{'' if s.ok else '  FAILED: ' + s.error}")  # fmt: skip
        summary = [summarize(row, row.samples, self.total) for row in rows.values()]
        return {
            "meta": {
                "date": dt.date.today().isoformat(),
                "command": " ".join(["python", "bench/mirror.py", *sys.argv[1:]]),
                "runs": self.args.runs,
                "cache": self.cache.note,
                "cpus": os.cpu_count(),
            },
            "dataset": {"total": self.total, "files": self.files, "shards": self.args.shards},
            "rows": summary,
            "target": speedup(summary),
        }


def speedup(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median end-to-end time of today's way over prefetch mirror's, against the target."""
    walls = {r["tool"]: r["median_wall_s"] for r in rows}
    mirror, today = walls.get(MIRROR), walls.get(TODAY)
    if not mirror or not today:
        return {"target": f">= {TARGET_SPEEDUP:g}x faster end to end", "value": None, "met": None}
    ratio = today / mirror
    return {
        "target": f">= {TARGET_SPEEDUP:g}x faster end to end",
        "value": round(ratio, 2),
        "met": ratio >= TARGET_SPEEDUP,
    }


def report(res: dict[str, Any]) -> str:
    meta, data = res["meta"], res["dataset"]
    rows = res["rows"]
    base = next((r["median_wall_s"] for r in rows if r["tool"] == MIRROR), None)
    out = [
        f"## prefetch mirror vs hf download + aws s3 sync ({meta['date']})",
        "",
        f"`{meta['command']}`",
        "",
        f"Data: {data['total'] / MiB:.0f} MiB in {data['files']} files ({data['shards']} shards),"
        f" local Hub server to local SeaweedFS; {meta['runs']} run(s) each, alternating; "
        f"{meta['cache']}. {meta['cpus']} CPUs shared by the tools and both servers. MB/s = model "
        "bytes / wall (10^6 bytes/s). CPU s and peak RSS: the tool's whole process tree; server "
        "CPU s: the Hub server and SeaweedFS meanwhile; other load: the rest of the machine "
        "(noise).",
        "",
        "| tool | runs | median s | MB/s | time / prefetch mirror | CPU s | peak RSS MiB "
        "| server CPU s | other load CPU s | staged on disk MiB | what |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        if not r["available"]:
            out.append(f"| {r['tool']} | - | - | - | - | - | - | - | - | - | {r['note']} |")
            continue
        walls = ", ".join(f"{w:.2f}" for w in r.get("walls", []))
        ratio = r["median_wall_s"] / base if base and r["median_wall_s"] else None
        staged = [s["extra"].get("staged_bytes") for s in r["runs"] if s["tool"] != "aws-s3-sync"]
        staged_mib = max(staged) / MiB if staged and None not in staged else None
        note = r["label"] + ("" if r["ok"] else f" **FAILED** {r['note']}")
        out.append(
            f"| {r['tool']} | {walls} | {fmt(r['median_wall_s'], '.2f')} | {fmt(r['mb_s'], '.0f')}"
            f" | {fmt(ratio, '.2f')} | {fmt(r['cpu_s'], '.2f')} | {fmt(r['peak_rss_mib'], '.0f')}"
            f" | {fmt(r['server_cpu_s'], '.2f')} | {fmt(r['other_cpu_s'], '.2f')}"
            f" | {fmt(staged_mib, '.0f')} | {note} |"
        )
    target = res["target"]
    met = {True: "yes", False: "**no**", None: "-"}[target["met"]]
    value = "-" if target["value"] is None else f"{target['value']:.2f}x"
    out += ["", f"Target: prefetch mirror {target['target']}: {value} ({met})"]
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB", type=lambda v: parse_size(v, field="--size"),
                   help="total size of the model's shards (default 1GiB)")  # fmt: skip
    p.add_argument("--shards", type=int, default=3)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true",
                   help="no page-cache drop, no waiting for a quiet machine (tests)")  # fmt: skip
    p.add_argument("--quiet-wait", type=float, default=60.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per step, at least")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.add_argument("--sign-payloads", action="store_true",
                   help="let botocore SHA256-sign request bodies, as it does over plain HTTP "
                        "(default: unsigned for both tools, as over HTTPS)")  # fmt: skip
    p.add_argument("--json", dest="json_out", type=Path, default=None, help="every run, as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = MirrorBench(args)
    try:
        bench.start()
        res = bench.run()
    finally:
        bench.stop()
    print(report(res))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(res, indent=1, default=str))
    rows = {r["tool"]: r for r in res["rows"]}
    return 0 if all(r["ok"] for r in rows.values() if r["available"]) else 1


if __name__ == "__main__":
    sys.exit(main())
