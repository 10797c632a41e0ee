#!/usr/bin/env python3
"""Benchmark ``prefetch pull`` against the tools users would pick instead (issue 4).

One run generates a model-like data set, serves it from a local S3 server (SeaweedFS) and a local
Hugging Face Hub-compatible server, then measures every tool several times in alternation
(A B C A B C ...). Before each measured run the destination is deleted, dirty pages are synced,
the page cache is dropped (root only; noted when not permitted) and the server's data plus the
tools' own code are read back in, so every run starts from the same state: source warm (as a
remote server's would be), destination cold, nothing pending write-back.

Each tool runs as a subprocess in its own session; we report wall time, MB/s (10^6 bytes/s),
CPU seconds (user+sys of the whole process tree, from ``os.wait4`` of each child), peak RSS of the
whole process tree (psutil, polled every 50 ms) and the server's CPU seconds meanwhile. Then
``prefetch`` alone: verification off vs on, resume after SIGKILL at 50%, scaling with model size,
and many small files. A Markdown report goes to stdout, everything to a JSON file.

    python bench/run.py                          # 4 GiB, 3 runs, every tool found
    python bench/run.py --size 64MiB --runs 1 --quick --json /tmp/b.json
    python bench/run.py --tools s3,ceiling --scaling none --no-resume --no-small-files
    python bench/run.py --tls ...                # the same with SeaweedFS behind HTTPS

The pieces, side by side in bench/: harness.py measures one run and settles the machine between
runs, datasets.py makes and uploads the data, tools.py is the table of tools (what each row runs),
report.py turns samples into rows and the Markdown report. This file has the command line and the
phases (compare, small files, resume, scaling).

See bench/README.md for what each row runs and how to read the results.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "bench"))  # the sibling modules, however run.py is started

from datasets import (  # noqa: E402
    BUCKET,
    HUB_REPO,
    MODEL_PREFIX,
    SCALE_PREFIX,
    SMALL_PREFIX,
    DataSet,
    make_dataset,
    s3_put_small,
    s3_upload_stream,
)
from harness import Cache, GiB, MiB, Sample, mb_s, read_proc_io, run_measured, say  # noqa: E402
from report import linearity, report, summarize  # noqa: E402
from tools import (  # noqa: E402
    CEILING_ROWS,
    HUB_ROWS,
    PREFETCH,
    VERSION_ARG,
    Tool,
    ToolContext,
    build,
    build_rows,
    build_s3_tools,
    find_bin,
    run_values,
    scaling_row,
)

from prefetch.demo.locals3 import SeaweedS3  # noqa: E402
from prefetch.demo.modelgen import upload_model  # noqa: E402
from prefetch.support.units import parse_size  # noqa: E402
from tests.tls import TestCA  # noqa: E402

BIN_DIR = Path(sys.executable).parent


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir).resolve()
        self.logs = self.work / "logs"
        self.results: dict[str, Any] = {}
        self.servers: list[Any] = []
        self.hub_proc: subprocess.Popen[bytes] | None = None
        self.notes: list[str] = []
        #: --tls: the private CA SeaweedFS's certificate chains to (the tests' own, tests/tls.py)
        self.ca: TestCA | None = None

    # -- environment

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = str(REPO) + (
            os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
        )
        for k in ("PREFETCH_DEBUG", "PREFETCH_CONCURRENCY", "PREFETCH_CHUNK_SIZE"):
            env.pop(k, None)
        env["HF_HUB_DISABLE_TELEMETRY"] = "1"
        env["HF_HOME"] = str(self.work / "hf-home-unused")
        env["DO_NOT_TRACK"] = "1"
        return env

    def s3_env(self, server: SeaweedS3) -> dict[str, str]:
        env = self.base_env()
        (self.work / "aws-config").write_text("[default]\nregion = us-east-1\n")
        (self.work / "aws-credentials").write_text("")
        (self.work / "rclone.conf").write_text("")
        env.update(
            server.aws_env(self.work),
            AWS_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",
            RCLONE_CONFIG=str(self.work / "rclone.conf"),
            RCLONE_CONFIG_BENCHS3_TYPE="s3",
            RCLONE_CONFIG_BENCHS3_PROVIDER="Other",
            RCLONE_CONFIG_BENCHS3_ENDPOINT=server.endpoint,
            RCLONE_CONFIG_BENCHS3_ACCESS_KEY_ID=server.access_key,
            RCLONE_CONFIG_BENCHS3_SECRET_ACCESS_KEY=server.secret_key,
            RCLONE_CONFIG_BENCHS3_REGION="us-east-1",
            RCLONE_CONFIG_BENCHS3_FORCE_PATH_STYLE="true",
        )
        if self.ca is not None:
            # every tool trusts the private CA the way its users make it: AWS_CA_BUNDLE (prefetch,
            # boto3, aws), SSL_CERT_FILE (Go's crypto/x509: s5cmd, rclone), CURL_CA_BUNDLE (curl),
            # and rclone's own --ca-cert too (as RCLONE_CA_CERT)
            env.update(self.ca.env(), RCLONE_CA_CERT=str(self.ca.ca_file))
        return env

    def warm_cmds(self) -> list[list[str]]:
        cmds = [
            [
                sys.executable,
                "-c",
                "import boto3, s3transfer.manager, huggingface_hub, prefetch.cli, "
                "prefetch.pipeline.sync, prefetch.sources.s3.source, "
                "prefetch.pipeline.engine.transfer; "
                "boto3.client('s3', region_name='us-east-1')",
            ]
        ]
        for name in ("s5cmd", "rclone", "aws", "hf", "curl", "dd"):
            exe = find_bin(name)
            if exe:
                cmds.append([exe, VERSION_ARG[name]])
        return cmds

    # -- servers

    def start_s3(self, name: str, *, keep: bool = False) -> SeaweedS3:
        data_dir = self.work / name
        if not keep:
            shutil.rmtree(data_dir, ignore_errors=True)
        tls: dict[str, Any] = {}
        if self.ca is not None:
            tls = {
                "tls_cert": self.ca.cert_file,
                "tls_key": self.ca.key_file,
                "ca_file": self.ca.ca_file,
                "host": self.ca.host_for("s3"),
            }
        server = SeaweedS3(data_dir=data_dir, **tls).start()
        self.servers.append(server)
        client = server.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=BUCKET)
        return server

    def stop_s3(self, server: SeaweedS3) -> None:
        server.stop()
        self.servers.remove(server)
        shutil.rmtree(server.data_dir or "", ignore_errors=True)

    def start_hub(self, root: Path) -> str:
        argv = [
            sys.executable,
            str(REPO / "tests" / "fakes" / "hubserver.py"),
            "--repo",
            HUB_REPO,
            "--dir",
            str(root),
            "--page-size",
            "1000",
        ]
        with open(self.logs / "hubserver.err", "wb") as err:
            self.hub_proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.base_env(),
            )
        assert self.hub_proc.stdout is not None
        line = self.hub_proc.stdout.readline()
        if not line:
            raise RuntimeError(f"hub server did not start: {(self.logs / 'hubserver.err')}")
        return str(json.loads(line)["endpoint"])

    def stop_hub(self) -> None:
        proc, self.hub_proc = self.hub_proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def cleanup(self) -> None:
        self.stop_hub()
        for server in list(self.servers):
            with contextlib.suppress(Exception):
                self.stop_s3(server)
        if not self.args.reuse:
            shutil.rmtree(self.work, ignore_errors=True)
        else:
            shutil.rmtree(self.work / "dest", ignore_errors=True)

    # -- tool catalogue (the rows themselves are in tools.py)

    def s3_context(self, server: SeaweedS3, prefix: str) -> ToolContext:
        """What the S3 rows need: ``server``, serving ``prefix`` of the bucket."""
        return ToolContext(
            self.s3_env(server),
            [server.data_dir] if server.data_dir else [],
            [server._proc.pid] if server._proc else [],
            {
                **run_values(self.args),
                "endpoint": server.endpoint,
                "prefix": prefix,
                "uri": f"s3://{BUCKET}/{prefix}/",
            },
        )

    def s3_tools(self, server: SeaweedS3, prefix: str) -> list[Tool]:
        """The S3 rows for ``prefix``: prefetch's (and ``--prefetch-variant``'s), the rivals'."""
        return build_s3_tools(self.s3_context(server, prefix), self.args.prefetch_variant)

    def ceiling_tools(self, server: SeaweedS3, prefix: str, total: int) -> list[Tool]:
        """The ceilings: curl's ranged GETs of ``prefix`` (config files written only when curl is
        there), dd writing ``total`` bytes."""
        ctx = self.s3_context(server, prefix)
        ctx.values["total"] = total
        ctx.values["curl_configs"] = (
            self.curl_configs(server, prefix, self.args.ceiling_streams) if find_bin("curl") else []
        )
        return build_rows(CEILING_ROWS, ctx)

    def curl_configs(self, server: SeaweedS3, prefix: str, streams: int) -> list[Path]:
        client = server.client()
        objects = []
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=f"{prefix}/"
        ):
            objects += [(o["Key"], o["Size"]) for o in page.get("Contents", [])]
        step = self.args.ceiling_chunk_size
        jobs: list[tuple[str, int, int]] = []
        for key, size in objects:
            url = client.generate_presigned_url(
                "get_object", Params={"Bucket": BUCKET, "Key": key}, ExpiresIn=24 * 3600
            )
            jobs += [(url, s, min(s + step, size) - 1) for s in range(0, size, step)] or [
                (url, 0, -1)
            ]
        # big ranges first, dealt round-robin, so the streams finish together
        jobs.sort(key=lambda j: j[2] - j[1], reverse=True)
        configs = []
        for i in range(streams):
            lines = []
            for url, start, end in jobs[i::streams]:
                if lines:
                    lines.append("next")
                lines.append(f'url = "{url}"')
                if end >= 0:
                    lines.append(f'range = "{start}-{end}"')
                lines += ['output = "/dev/null"', 'write-out = "%{size_download}\\n"']
            path = self.work / f"curl-{prefix}-{i}.cfg"
            path.write_text("\n".join(lines) + "\n")
            configs.append(path)
        return configs

    def hub_tools(self, endpoint: str, data: DataSet) -> list[Tool]:
        """The Hub rows, against the local Hub-compatible server at ``endpoint``."""
        env = self.base_env()
        env["HF_ENDPOINT"] = endpoint
        env["HF_HUB_ETAG_TIMEOUT"] = "60"
        servers = [self.hub_proc.pid] if self.hub_proc else []
        return build_rows(HUB_ROWS, ToolContext(env, [data.root], servers, run_values(self.args)))

    # -- measuring

    def measure(
        self,
        tool: Tool,
        run: int,
        dest: Path,
        expected: int,
        *,
        kill_when: Callable[[int], bool] | None = None,
        poll: float = 0.05,
        settle: bool = True,
    ) -> Sample:
        if settle:
            self.cache.settle([dest], tool.warm)
        dest.mkdir(parents=True, exist_ok=True)
        cmds = tool.cmds(dest)
        timeout = max(self.args.timeout, expected / (20 * 1e6))
        wall, user, system, peak, maxrss, server, other, codes, outs, fired = run_measured(
            cmds,
            env=tool.env,
            logs=self.logs / f"{tool.name}-{run}",
            timeout=timeout,
            server_pids=tool.servers,
            kill_when=kill_when,
            poll=poll,
        )
        got = tool.count(dest, outs) if not fired else 0
        ok = not fired and all(c == 0 for c in codes) and got == expected
        error = ""
        if not fired and not ok:
            err_file = outs[0].with_suffix(".err")
            tail = err_file.read_text(errors="replace").strip().splitlines()[-3:]
            error = f"exit {codes}, {got} of {expected} bytes: " + " | ".join(tail)
        extra: dict[str, Any] = {}
        if tool.json_out and not fired:
            with contextlib.suppress(ValueError, OSError):
                text = outs[0].read_text().strip().splitlines()
                extra = json.loads(text[-1]) if text else {}
        sample = Sample(
            tool.name,
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
            got,
            codes[0] if codes else -1,
            error,
            fired,
            self.cache.load_before if settle else 0.0,
            extra,
        )
        say(
            f"  {tool.name:<18} run {run}: {wall:7.2f}s {mb_s(expected, wall):7.0f} MB/s "
            f"cpu {user + system:6.2f}s rss {peak / MiB:6.0f} MiB server {server:5.2f}s"
            f"{'' if ok or fired else '  FAILED: ' + error}"
        )
        return sample

    def alternate(
        self, tools: list[Tool], runs: int, expected: int, tag: str
    ) -> list[dict[str, Any]]:
        """Each available tool ``runs`` times, in rounds: A B C, A B C, ..."""
        samples: dict[str, list[Sample]] = {t.name: [] for t in tools}
        live = [t for t in tools if not t.missing]
        for run in range(1, runs + 1):
            say(f"{tag}: round {run} of {runs}")
            for tool in live:
                samples[tool.name].append(self.measure(tool, run, self.work / "dest", expected))
        self.cache.settle([self.work / "dest"], [])
        return [summarize(t, samples[t.name], expected) for t in tools]

    # -- phases

    def run(self) -> dict[str, Any]:
        a = self.args
        self.work.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.cache = Cache(a.drop_caches, self.warm_cmds(), self.base_env(), a.quiet_wait)
        if a.tls:
            self.ca = TestCA.create(self.work / "tls")
        want = set(a.tools)
        t_start = time.monotonic()
        marker = self.work / "dataset.json"
        shape = {
            k: getattr(a, k)
            for k in ("size", "shards", "model_small_files", "model_small_file_size", "part_size")
        }
        reuse = (
            a.reuse and marker.is_file() and json.loads(marker.read_text()).get("shape") == shape
        )
        if reuse:
            data = DataSet(**{**json.loads(marker.read_text())["data"], "root": self.work / "src"})
            server = self.start_s3("seaweed-main", keep=True)
            say(f"reusing the data set in {self.work} ({data.total / MiB:.0f} MiB)")
        else:
            marker.unlink(missing_ok=True)
            data, files = make_dataset(a, self.work / "src")
            server = self.start_s3("seaweed-main")
            say(
                f"uploading {data.total / MiB:.0f} MiB to {server.endpoint} "
                f"(multipart, {a.part_size // MiB} MiB parts, CRC64NVME)"
            )
            t0 = time.monotonic()
            upload_model(
                server.client(),
                BUCKET,
                MODEL_PREFIX,
                files,
                part_size=a.part_size,
                multipart_threshold=a.part_size,
                create_bucket=False,
            )
            say(f"uploaded in {time.monotonic() - t0:.1f}s")
            if a.reuse:
                saved = {k: v for k, v in asdict(data).items() if k != "root"}
                marker.write_text(json.dumps({"shape": shape, "data": saved}))
        variants = {f"prefetch-{v.partition('=')[0]}" for v in a.prefetch_variant}
        variants |= {"prefetch-baseline", "hf-prefetch-baseline"} if a.baseline else set()
        tools = [
            t
            for t in self.s3_tools(server, MODEL_PREFIX)
            if t.name in want or t.name in variants or "s3" in want
        ]
        tools += [
            t
            for t in self.ceiling_tools(server, MODEL_PREFIX, data.total)
            if t.name in want or "ceiling" in want
        ]
        hub_wanted = [n for n in ("hf-prefetch", "hf-snapshot", "hf-cli") if n in want] or (
            "hub" in want
        )
        if hub_wanted:
            endpoint = self.start_hub(data.root)
            say(f"hub server at {endpoint}")
            tools += [
                t
                for t in self.hub_tools(endpoint, data)
                if t.name in want or t.name in variants or "hub" in want
            ]
        for t in tools:
            if t.missing:
                say(f"skipping {t.name}: {t.missing}")
        if a.compare:
            rows = self.alternate(tools, a.runs, data.total, "compare")
            self.results["compare"] = {"expected_bytes": data.total, "rows": rows}
        if "noop" in want:
            noop_names = {"prefetch", "hf-prefetch"} | variants
            noop_tools = [t for t in tools if t.name in noop_names and t.group in ("s3", "hub")]
            self.results["noop"] = self.noop(noop_tools, a.runs, data.total)
        self.stop_hub()

        if a.small_files > 0 and "small" in want:
            say(f"uploading {a.small_files} x {a.small_file_size // 1024} KiB")
            small_total = s3_put_small(
                server.client(), SMALL_PREFIX, a.small_files, a.small_file_size
            )
            rivals = {"s5cmd", "rclone", "aws", "boto3"}
            small_names = {"prefetch"} | (rivals & want or rivals) | variants
            small_tools = [t for t in self.s3_tools(server, SMALL_PREFIX) if t.name in small_names]
            self.results["small_files"] = {
                "files": a.small_files,
                "file_size": a.small_file_size,
                "expected_bytes": small_total,
                "rows": self.alternate(small_tools, a.runs, small_total, "small files"),
            }

        if a.resume and "resume" in want:
            self.results["resume"] = self.resume(server, data.total)

        if a.reuse:
            server.stop()
            self.servers.remove(server)
        else:
            self.stop_s3(server)
            shutil.rmtree(data.root, ignore_errors=True)

        if a.scaling and "scaling" in want:
            self.results["scaling"] = self.scaling(a.scaling)

        self.results["dataset"] = {
            k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(data).items()
        }
        self.results["elapsed_s"] = round(time.monotonic() - t_start, 1)
        return self.results

    def noop(self, tools: list[Tool], runs: int, expected: int) -> dict[str, Any]:
        """A pull into a destination that is already complete (the agent's every resync, and
        a pod start on a node that has the model): each tool pulls once into its own DEST,
        then ``runs`` rounds of pulling again, warm (nothing dropped) then cold (page cache
        dropped, the tools' code NOT read back in: a fresh node's first command)."""
        dests = {t.name: self.work / f"noop-{t.name}" for t in tools}
        live = [t for t in tools if not t.missing]
        for tool in live:
            say(f"noop: first pull of {tool.name}")
            self.measure(tool, 0, dests[tool.name], expected)
        out: dict[str, Any] = {}
        for mode in ("warm", "cold"):
            samples: dict[str, list[Sample]] = {t.name: [] for t in tools}
            for run in range(1, runs + 1):
                say(f"noop {mode}: round {run} of {runs}")
                for tool in live:
                    if mode == "cold":
                        self.cache.settle([], [], warm_code=False)
                    else:
                        self.cache.wait_quiet()
                    sample = self.measure(tool, run, dests[tool.name], expected, settle=False)
                    samples[tool.name].append(sample)
            out[mode] = [summarize(t, samples[t.name], expected) for t in tools]
        self.cache.settle(list(dests.values()), [])
        return out

    def resume(self, server: SeaweedS3, total: int) -> dict[str, Any]:
        """SIGKILL ``prefetch pull`` once it has written half the bytes, pull again, count."""
        tool = build(PREFETCH, self.s3_context(server, MODEL_PREFIX))
        dest = self.work / "dest"
        trials = []
        for run in range(1, self.args.runs + 1):
            say(f"resume: trial {run} of {self.args.runs}")
            seen: dict[str, int] = {}

            def kill_when(pid: int, seen: dict[str, int] = seen) -> bool:
                wchar = read_proc_io(pid).get("wchar", 0)
                if wchar >= total // 2:
                    seen["written"] = wchar
                    return True
                return False

            # A small model can finish between two polls: try again on a clean DEST (3 times).
            for _ in range(3):
                first = self.measure(tool, run, dest, total, kill_when=kill_when, poll=0.002)
                if first.killed:
                    break
                shutil.rmtree(dest, ignore_errors=True)
            if not first.killed:
                trials.append({"error": "the pull finished before it could be killed at 50%"})
                continue
            second = self.measure(tool, run, dest, total, settle=False)
            j = second.extra
            downloaded = int(j.get("bytes_downloaded", 0))
            written = seen["written"]
            refetched = max(downloaded + written - total, 0)
            trials.append(
                {
                    "ok": second.ok,
                    "killed_after_bytes": written,
                    "second_pull_bytes_downloaded": downloaded,
                    "second_pull_resumed_bytes": int(j.get("resumed_bytes", 0)),
                    "refetched_bytes": refetched,
                    "refetched_pct": round(100 * refetched / total, 2),
                    "second_pull_wall_s": second.wall_s,
                    "error": second.error,
                }
            )
            say(
                f"  killed at {written / MiB:.0f} MiB; second pull fetched {downloaded / MiB:.0f}"
                f" MiB; re-fetched {refetched / MiB:.1f} MiB = {100 * refetched / total:.2f}%"
            )
        self.cache.settle([dest], [])
        good = [t["refetched_pct"] for t in trials if "refetched_pct" in t]
        return {
            "trials": trials,
            "median_refetched_pct": statistics.median(good) if good else None,
            "expected_bytes": total,
        }

    def scaling(self, points: list[int]) -> dict[str, Any]:
        unit = min(points)
        if any(p % unit for p in points):
            raise SystemExit(f"--scaling: every point must be a multiple of {unit} bytes")
        count = max(points) // unit
        server = self.start_s3("seaweed-scale")
        try:
            say(f"scaling: uploading {count} x {unit / MiB:.0f} MiB (streamed, no local copy)")
            client = server.client()
            names = [f"shard-{i:03d}.safetensors" for i in range(1, count + 1)]
            for i, name in enumerate(names):
                s3_upload_stream(
                    client, f"{SCALE_PREFIX}/{name}", unit, 1000 + i, self.args.part_size
                )
            ctx = self.s3_context(server, SCALE_PREFIX)
            tools = [build(scaling_row(p, names[: p // unit]), ctx) for p in sorted(points)]
            rows = []
            samples: dict[str, list[Sample]] = {t.name: [] for t in tools}
            for run in range(1, self.args.scaling_runs + 1):
                say(f"scaling: round {run} of {self.args.scaling_runs}")
                for t, p in zip(tools, sorted(points), strict=True):
                    samples[t.name].append(self.measure(t, run, self.work / "dest", p))
            for t, p in zip(tools, sorted(points), strict=True):
                row = summarize(t, samples[t.name], p)
                row["size_bytes"] = p
                rows.append(row)
            self.cache.settle([self.work / "dest"], [])
        finally:
            self.stop_s3(server)
        return {"points": rows, **linearity(rows)}


# ---- command line ------------------------------------------------------------------------------

ALL_TOOLS = [
    "prefetch",
    "prefetch-noverify",
    "s5cmd",
    "s5cmd-tuned",
    "rclone",
    "rclone-mts8",
    "aws",
    "boto3",
    "hf-prefetch",
    "hf-snapshot",
    "hf-cli",
    "ceiling-get",
    "ceiling-dd",
    "dd-buffered",
]
GROUPS = {"s3", "hub", "ceiling", "small", "resume", "scaling", "noop"}


def size_list(text: str) -> list[int]:
    if text.strip().lower() in ("", "none", "off", "0"):
        return []
    return [parse_size(p.strip(), field="--scaling") for p in text.split(",") if p.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--size", default="4GiB", help="total size of the model's shards")
    p.add_argument("--shards", type=int, default=0, help="shard count (default: ~768 MiB each)")
    p.add_argument(
        "--model-small-files",
        type=int,
        default=100,
        help="small files inside the model (besides config/tokenizer JSON)",
    )
    p.add_argument("--model-small-file-size", default="100KiB")
    p.add_argument("--part-size", default="8MiB", help="multipart part size of the upload")
    p.add_argument("--runs", type=int, default=3, help="measured runs per tool")
    p.add_argument(
        "--tools",
        default="all",
        help=f"comma list of tools and groups: {','.join(ALL_TOOLS)}; "
        f"groups {','.join(sorted(GROUPS))}; 'all'",
    )
    p.add_argument("--skip", default="", help="comma list of tools/groups to leave out")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny and fast (for the test): no cache drop, 1 run, small extras",
    )
    p.add_argument(
        "--scaling",
        default=None,
        help="model sizes for the scaling test, e.g. 1GiB,2GiB,4GiB,8GiB; 'none'",
    )
    p.add_argument("--scaling-runs", type=int, default=None, help="runs per scaling point")
    p.add_argument("--small-files", type=int, default=None, help="count for the small-files test")
    p.add_argument("--small-file-size", default="100KiB")
    p.add_argument("--no-resume", dest="resume", action="store_false")
    p.add_argument("--no-small-files", dest="no_small", action="store_true")
    p.add_argument(
        "--no-compare",
        dest="compare",
        action="store_false",
        help="skip the whole-model comparison (run only the other phases asked for)",
    )
    p.add_argument("--no-drop-caches", dest="drop_caches", action="store_false", default=None)
    p.add_argument(
        "--s5cmd-tuned",
        default="--numworkers 16 -c 8 -p 16",
        help="global flags (first two words) then cp flags for the tuned s5cmd row",
    )
    p.add_argument("--boto3-concurrency", type=int, default=16)
    p.add_argument("--boto3-chunk-size", default="16MiB")
    p.add_argument("--ceiling-streams", type=int, default=8)
    p.add_argument("--ceiling-chunk-size", default="64MiB")
    p.add_argument(
        "--prefetch-variant",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="an extra prefetch row, e.g. c8='--concurrency 8' (repeatable)",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=None,
        help="before each run, wait up to this many seconds for other load on the "
        "machine to drop below 0.3 cores (default 60; 0 with --quick)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="also run prefetch with the package found in DIR (DIR/prefetch/...) "
        "first on PYTHONPATH: rows prefetch-baseline and hf-prefetch-baseline, for "
        "before/after figures of an engine change",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="SeaweedFS speaks HTTPS only, with a certificate from a private CA every S3 tool is "
        "told to trust (the Hub rows stay on plain HTTP)",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per tool run (minimum)")
    p.add_argument(
        "--workdir",
        default=str(REPO / "bench" / "results" / "work"),
        help="data sets, server data, destinations, logs (deleted afterwards)",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="keep the work dir's data set and S3 data, and reuse them next time when "
        "the shape flags match (for repeated runs; delete the work dir when done)",
    )
    p.add_argument(
        "--json", dest="json_out", default=str(REPO / "bench" / "results" / "bench.json")
    )
    a = p.parse_args(argv)
    a.command = "python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    a.size = parse_size(a.size, field="--size")
    a.model_small_file_size = parse_size(a.model_small_file_size, field="--model-small-file-size")
    a.small_file_size = parse_size(a.small_file_size, field="--small-file-size")
    a.part_size = parse_size(a.part_size, field="--part-size")
    a.boto3_chunk_size = parse_size(a.boto3_chunk_size, field="--boto3-chunk-size")
    a.ceiling_chunk_size = parse_size(a.ceiling_chunk_size, field="--ceiling-chunk-size")
    if a.quick:
        a.drop_caches = False if a.drop_caches is None else a.drop_caches
        a.scaling = a.scaling if a.scaling is not None else f"{a.size // 2},{a.size}"
        a.scaling_runs = a.scaling_runs or 1
        a.small_files = 100 if a.small_files is None else a.small_files
    a.drop_caches = True if a.drop_caches is None else a.drop_caches
    a.quiet_wait = (0.0 if a.quick else 60.0) if a.quiet_wait is None else a.quiet_wait
    a.scaling = size_list(a.scaling if a.scaling is not None else "1GiB,2GiB,4GiB,8GiB")
    a.scaling_runs = a.scaling_runs or a.runs
    a.small_files = 1000 if a.small_files is None else a.small_files
    if a.no_small:
        a.small_files = 0
    names = {t.strip() for t in a.tools.split(",") if t.strip()}
    if "all" in names:
        names = set(ALL_TOOLS) | GROUPS
    names -= {t.strip() for t in a.skip.split(",") if t.strip()}
    unknown = names - set(ALL_TOOLS) - GROUPS
    if unknown:
        p.error(f"--tools: unknown {sorted(unknown)}")
    if names & {"resume", "scaling", "small", "noop"} and "prefetch" not in names:
        names.add("prefetch")
    a.tools = sorted(names)
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    handler = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        res = bench.run()
    finally:
        bench.cleanup()
        signal.signal(signal.SIGTERM, handler)
    res["meta"] = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": args.command,
        "runs": args.runs,
        "cache": bench.cache.note,
        "cpus": os.cpu_count(),
        "mem_gib": round(psutil.virtual_memory().total / GiB),
        "python": platform.python_version(),
        "versions": tool_versions(),
        "tools": args.tools,
        "tls": args.tls,
    }
    text = report(res)
    print(text)
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, sort_keys=True, default=str) + "\n")
    say(f"JSON written to {out}")
    return 0


def tool_versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for name in ("s5cmd", "rclone", "aws", "weed", "curl"):
        exe = find_bin(name)
        if exe:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                r = subprocess.run(
                    [exe, VERSION_ARG[name]], capture_output=True, text=True, timeout=30
                )
                first = (r.stdout or r.stderr).strip().splitlines()
                out[name] = first[0] if first else ""
    for mod in ("boto3", "botocore", "huggingface_hub", "awscrt", "urllib3"):
        with contextlib.suppress(Exception):
            out[mod] = __import__(mod).__version__
    return out


if __name__ == "__main__":
    sys.exit(main())
