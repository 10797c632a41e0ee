#!/usr/bin/env python3
"""What a ``SHA256SUMS`` sidecar costs a pull: the same model with and without one.

The sidecar is checked beside the server's own checksums (docs/pulling.md, "The sidecar checksum
manifest"), so with one present a large file needs two checks: CRC64NVME per range as the bytes
arrive, and sha256 fed in file order by hash workers reading back each finished run of pieces.
This measures that second check, nothing else: one generated model uploaded twice to a local
SeaweedFS (multipart with CRC64NVME, as ``prefetch.demo.modelgen.upload_model`` does), once bare and
once with a correct ``SHA256SUMS`` beside it, pulled alternately (bare, sidecar, bare, ...) by
``prefetch pull --json`` with verification on, each run into a fresh destination, after one
unmeasured pull of each.

    python bench/sidecar_cost.py                        # 1 GiB in 2 shards, 3 runs each
    python bench/sidecar_cost.py --size 512MiB --runs 5 --drop-caches   # root: cold page cache

Reported per variant: median wall seconds, MB/s (10^6 bytes/s), median CPU seconds of the pull
(user+sys, ``os.wait4``), and the checksum algorithms the pull says it checked.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prefetch.demo.locals3 import SeaweedS3  # noqa: E402
from prefetch.demo.modelgen import GeneratedFile, generate_model, upload_model  # noqa: E402
from prefetch.support.units import parse_size  # noqa: E402

BUCKET = "bench"
VARIANTS = ("no-sidecar", "sidecar")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(4 * 1024 * 1024):
            h.update(chunk)
    return h.hexdigest()


def upload(server: SeaweedS3, files: list[GeneratedFile]) -> None:
    """The model under ``no-sidecar/`` and again under ``sidecar/`` with its SHA256SUMS."""
    client = server.client()
    upload_model(client, BUCKET, "no-sidecar", files)
    upload_model(client, BUCKET, "sidecar", files, create_bucket=False)
    sums = "".join(f"{sha256_of(f.local)}  {f.path}\n" for f in files)
    client.put_object(Bucket=BUCKET, Key="sidecar/SHA256SUMS", Body=sums.encode())


def settle(dest: Path, drop_caches: bool) -> None:
    """Every run starts alike: no destination, nothing pending write-back, (root) cold cache."""
    shutil.rmtree(dest, ignore_errors=True)
    os.sync()
    if drop_caches:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def pull_once(server: SeaweedS3, variant: str, dest: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env.update(
        AWS_ENDPOINT_URL=server.endpoint,
        AWS_ACCESS_KEY_ID=server.access_key,
        AWS_SECRET_ACCESS_KEY=server.secret_key,
        AWS_DEFAULT_REGION="us-east-1",
        PYTHONPATH=str(REPO),
    )
    args = [sys.executable, "-m", "prefetch.cli", "pull", f"s3://{BUCKET}/{variant}/", str(dest)]
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen([*args, "--json"], env=env, stdout=out, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - t0
        out.seek(0)
        text = out.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{variant}: prefetch pull failed: {text.strip()}")
    summary = json.loads(text)
    return {
        "seconds": wall,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "bytes": summary["bytes_downloaded"],
        "checksum_algorithms": summary["checksum_algorithms"],
    }


def report(samples: dict[str, list[dict[str, Any]]], size: int, runs: int) -> str:
    lines = [
        f"Model: {size / 2**20:.0f} MiB, {runs} runs each, verify on.",
        "",
        "| variant | median s | MB/s | CPU s | checked with |",
        "|---|--:|--:|--:|---|",
    ]
    for variant in VARIANTS:
        runs_of = samples[variant]
        wall = statistics.median(r["seconds"] for r in runs_of)
        cpu = statistics.median(r["cpu_seconds"] for r in runs_of)
        algorithms = ", ".join(
            f"{a} x{n}" for a, n in sorted(runs_of[0]["checksum_algorithms"].items())
        )
        mb_s = runs_of[0]["bytes"] / wall / 1e6
        lines.append(f"| {variant} | {wall:.2f} | {mb_s:.0f} | {cpu:.2f} | {algorithms} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB", help="total size of the shards (default 1GiB)")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache (root)")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    p.add_argument("--json", dest="json_out", type=Path, default=None, help="every run, as JSON")
    a = p.parse_args()
    size = parse_size(a.size, field="--size")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="sidecar-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        files = generate_model(work / "model", size, shards=a.shards)
        with SeaweedS3(data_dir=work / "s3") as server:
            upload(server, files)
            for variant in VARIANTS:  # unmeasured: the first run pays for cold imports
                settle(work / "dest", a.drop_caches)
                pull_once(server, variant, work / "dest")
            samples: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
            for n in range(a.runs):
                for variant in VARIANTS:
                    settle(work / "dest", a.drop_caches)
                    sample = pull_once(server, variant, work / "dest")
                    samples[variant].append(sample)
                    print(f"run {n + 1} {variant}: {sample['seconds']:.2f} s", file=sys.stderr)
        print(report(samples, size, a.runs))
        if a.json_out:
            a.json_out.write_text(json.dumps({"size": size, "samples": samples}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
