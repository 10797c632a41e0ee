#!/usr/bin/env python3
"""A ``file://`` pull from a real directory next to ``cp -r`` and ``rsync``: wall and CPU per GB.

One generated model (``prefetch.demo.modelgen.generate_model``: shards, JSON files, small files) in
a directory of this machine's disk, copied into a fresh destination on the same disk by each
variant in turn (A B C ..., A B C ...), after one unmeasured run of each:

* ``prefetch``: ``prefetch pull file://SRC DEST --json`` (no sidecar: checked by size only;
  bytes copied in the kernel with copy_file_range);
* ``prefetch-sha256``: the same directory with a ``SHA256SUMS`` beside it (every file verified;
  the shards still copied in the kernel, their sha256 read back from the partial file, the
  small files read with pread and hashed as they arrive);
* ``prefetch-pread``: as ``prefetch`` but with copy_file_range refused (ENOSYS), so every byte
  goes through pread into the engine's buffer and pwrite (O_DIRECT for large files): the
  fallback's cost, and what the choice of copy_file_range saves;
* ``cp``: ``cp -r SRC DEST`` (no fsync: its bytes may still be in the page cache when it
  exits); ``cp+sync``: the same, then ``sync -f DEST`` (durable, as prefetch's files are before
  it publishes them); ``rsync+sync``: ``rsync -a SRC/ DEST/`` then ``sync -f DEST`` (when
  installed).

Before every measured run: the destination deleted, ``sync``, and (root) the page cache dropped
(``echo 3 > /proc/sys/vm/drop_caches``), so the source is read from the disk, then the tool's
own code read back in (``python -c 'import prefetch.cli ...'``, ``cp --version``). Per run: wall
seconds and CPU seconds (user+sys of the process tree, ``os.wait4``).

    python bench/file_copy.py                      # 1 GiB, 3 runs each
    python bench/file_copy.py --size 256MiB --runs 1
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

from prefetch.demo.modelgen import generate_model  # noqa: E402
from prefetch.support.units import parse_size  # noqa: E402

#: prefetch with copy_file_range refused, as a kernel without it (or across filesystems) does
NO_COPY_RANGE = (
    "import errno, os, sys\n"
    "def refuse(*args):\n"
    "    raise OSError(errno.ENOSYS, 'copy_file_range refused by the benchmark')\n"
    "os.copy_file_range = refuse\n"
    "from prefetch.cli import main\n"
    "sys.exit(main())\n"
)


def commands(src: Path, summed: Path, dest: Path) -> dict[str, list[str]]:
    py = sys.executable
    pull = [py, "-m", "prefetch.cli", "pull"]
    found = {
        "prefetch": [*pull, f"file://{src}", str(dest), "--json"],
        "prefetch-sha256": [*pull, f"file://{summed}", str(dest), "--json"],
        "prefetch-pread": [py, "-c", NO_COPY_RANGE, "pull", f"file://{src}", str(dest), "--json"],
        "cp": ["cp", "-r", str(src), str(dest)],
        "cp+sync": ["sh", "-c", 'cp -r "$1" "$2" && sync -f "$2"', "cp", str(src), str(dest)],
    }
    if shutil.which("rsync"):
        found["rsync+sync"] = ["sh", "-c", 'rsync -a "$1/" "$2/" && sync -f "$2"', "rsync",
                               str(src), str(dest)]  # fmt: skip
    return found


def warm_code(argv: list[str], env: dict[str, str]) -> None:
    """Read the tool's own code back in after the page cache was dropped (a node's agent or
    a user's shell has it warm): only the source's bytes are read cold."""
    if argv[0] == sys.executable:
        code = (
            "import prefetch.cli, prefetch.pipeline.engine.transfer, "
            "prefetch.sources.file.source, awscrt"
        )
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        subprocess.run([sys.executable, "-m", "prefetch.cli", "pull", "--help"], env=env,
                       check=True, capture_output=True)  # fmt: skip
    else:
        for tool in ("cp", "rsync", "sync"):
            if shutil.which(tool):
                subprocess.run([tool, "--version"], check=True, capture_output=True)


def settle(dest: Path, drop: bool) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    os.sync()
    if drop:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run(argv: list[str], env: dict[str, str]) -> dict[str, float]:
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{argv[:4]} failed: {err.strip()[-500:]}")
    return {"seconds": wall, "cpu_seconds": usage.ru_utime + usage.ru_stime}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None, help="default: a folder under /var/tmp")
    p.add_argument("--json", dest="json_out", type=Path, default=None)
    a = p.parse_args()
    size = parse_size(a.size, field="--size")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="file-copy-", dir="/var/tmp"))
    drop = os.geteuid() == 0
    if not drop:
        print("not root: the page cache is not dropped (the source is read warm)", file=sys.stderr)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        files = generate_model(work / "model", size, shards=a.shards, small_files=100)
        total = sum(f.size for f in files)
        summed = work / "summed"
        shutil.copytree(work / "model", summed)
        sums = "".join(
            f"{hashlib.sha256(f.local.read_bytes()).hexdigest()}  {f.path}\n" for f in files
        )
        (summed / "SHA256SUMS").write_text(sums)
        variants = commands(work / "model", summed, work / "dest")
        for argv in variants.values():  # unmeasured: cold imports, first-touch costs
            settle(work / "dest", drop)
            run(argv, env)
        samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for n in range(a.runs):
            for name, argv in variants.items():
                settle(work / "dest", drop)
                warm_code(argv, env)
                samples[name].append(run(argv, env))
                print(f"run {n + 1} {name}: {samples[name][-1]['seconds']:.2f} s", file=sys.stderr)
        gb = total / 1e9
        print(f"{total / 2**20:.0f} MiB in {len(files)} files, {a.runs} runs each, "
              f"page cache {'dropped' if drop else 'NOT dropped'} before each run\n")  # fmt: skip
        print("| variant | wall s (runs) | median wall s per GB | median CPU s per GB |")
        print("|---|---|--:|--:|")
        for name, runs in samples.items():
            walls = ", ".join(f"{r['seconds']:.2f}" for r in runs)
            wall = statistics.median(r["seconds"] for r in runs) / gb
            cpu = statistics.median(r["cpu_seconds"] for r in runs) / gb
            print(f"| {name} | {walls} | {wall:.2f} | {cpu:.2f} |")
        if a.json_out:
            out: dict[str, Any] = {"bytes": total, "samples": samples, "dropped": drop}
            a.json_out.write_text(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
