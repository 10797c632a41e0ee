"""Time to serve: a safetensors loader's time after a plain pull and after a pull with warm-up.

```
PYTHONPATH=$PWD python bench/warm_load.py                 # 2.25 GiB in 3 shards, one pair
PYTHONPATH=$PWD python bench/warm_load.py --size 256MiB   # a quick look
```

Needs the bench extra (SeaweedFS, safetensors with numpy). One pair of runs, in this order:

1. ``plain``: the page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches`` when this
   machine allows it, else ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file of the server's
   data and the destination: the report says which), then ``prefetch pull s3://... DEST --json``;
2. ``warm``: the same with ``--warm-page-cache``.

After each pull, ``mincore`` says how much of the model is in the page cache, then a loader in
its own process (``python bench/warm_load.py load DEST``) reads every tensor of every
``*.safetensors`` file with ``safetensors.safe_open(..., framework="numpy")``; its wall time is
the load time. The warm-up's memory is the bytes it read into the page cache against its bound
(``--warm-memory-share`` of the available memory when it started); the pull's peak RSS is from
``wait4``. The machine's load average is recorded beside the numbers: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MiB = 1024 * 1024
BUCKET = "warmbench"
PREFIX = "model"


def load(dest: Path) -> None:
    """The loader: read every tensor of every shard under ``dest``; print seconds and bytes."""
    from safetensors import safe_open

    t0 = time.monotonic()
    tensors = nbytes = 0
    for path in sorted(dest.rglob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                array = f.get_tensor(key)
                tensors += 1
                nbytes += int(array.nbytes)
    print(json.dumps({"seconds": time.monotonic() - t0, "tensors": tensors, "bytes": nbytes}))


def drop_page_cache(paths: list[Path], *, whole: bool = True) -> str:
    """Empty the page cache: the whole of it if allowed (and ``whole``), else every file under
    ``paths``."""
    os.sync()
    try:
        if whole:
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("3\n")
            return "sync; echo 3 > /proc/sys/vm/drop_caches"
    except OSError:
        pass
    for root in paths:
        for f in (p for p in root.rglob("*") if p.is_file()):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "sync; posix_fadvise(POSIX_FADV_DONTNEED) on every file of the server and destination"


def run_child(argv: list[str], env: dict[str, str], work: Path) -> tuple[str, float, int]:
    """Run ``argv``; its stdout, wall seconds and peak RSS (bytes, from wait4)."""
    with open(work / "child.out", "w+b") as out, open(work / "child.err", "w+b") as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.monotonic() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{argv[:5]} failed ({proc.returncode}): {err.read()[-2000:]!r}")
        return out.read().decode(), seconds, usage.ru_maxrss * 1024


def resident(dest: Path) -> int:
    from prefetch.pipeline.warmup import resident_bytes

    return sum(resident_bytes(p) for p in dest.rglob("*.safetensors"))


def main() -> None:
    from prefetch.demo.locals3 import SeaweedS3
    from prefetch.demo.modelgen import generate_model, upload_model
    from prefetch.support.units import format_bytes, parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2304MiB", help="model size (default 2304MiB = 2.25 GiB)")
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--warm-memory-share", default="0.5")
    ap.add_argument(
        "--fadvise",
        action="store_true",
        help="drop only this run's files from the page cache, not the machine's",
    )
    ap.add_argument("--work", type=Path, default=Path("bench/results/warm-work"))
    ap.add_argument("--json", type=Path, default=Path("bench/results/warm_load.json"))
    args = ap.parse_args()
    size = parse_size(args.size)
    work: Path = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    files = generate_model(work / "src", size, shards=args.shards)
    total = sum(f.size for f in files)
    rows: list[dict[str, Any]] = []
    with SeaweedS3(data_dir=work / "s3") as server:
        upload_model(server.client(), BUCKET, PREFIX, files)
        shutil.rmtree(work / "src")
        env = dict(os.environ)
        env.update(server.aws_env(work))
        for mode in ("plain", "warm"):
            dest = work / f"dest-{mode}"
            shutil.rmtree(dest, ignore_errors=True)
            how = drop_page_cache([work], whole=not args.fadvise)
            argv = [sys.executable, "-m", "prefetch.cli", "pull", f"s3://{BUCKET}/{PREFIX}/"]
            argv += [str(dest), "--json", "--no-progress"]
            if mode == "warm":
                argv += ["--warm-page-cache", "--warm-memory-share", args.warm_memory_share]
            out, pull_seconds, rss = run_child(argv, env, work)
            summary = json.loads(out)
            before_load = resident(dest)
            loaded, _, _ = run_child([sys.executable, __file__, "load", str(dest)], env, work)
            result = json.loads(loaded)
            rows.append(
                {
                    "mode": mode,
                    "drop": how,
                    "pull_seconds": round(pull_seconds, 2),
                    "warm": summary.get("warm"),
                    "resident_before_load": before_load,
                    "load_seconds": round(result["seconds"], 2),
                    "tensors": result["tensors"],
                    "bytes_loaded": result["bytes"],
                    "pull_peak_rss": rss,
                    "loadavg": os.getloadavg(),
                }
            )
            print(
                f"{mode}: pull {pull_seconds:.1f}s, load {result['seconds']:.2f}s", file=sys.stderr
            )
            shutil.rmtree(dest)
    report = {"model_bytes": total, "shards": args.shards, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"model: {format_bytes(total)} in {args.shards} safetensors shards; {rows[0]['drop']}")
    head = ("run", "pull s", "warm-up s", "warm-up bytes / bound", "pull peak RSS",
            "resident before load", "load s")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        w = r["warm"] or {}
        bound = f"{format_bytes(w['bytes_read'])} / {format_bytes(w['budget'])}" if w else "-"
        print(
            f"| {r['mode']} | {r['pull_seconds']} | {w.get('seconds', '-')} | {bound} | "
            f"{format_bytes(r['pull_peak_rss'])} | {format_bytes(r['resident_before_load'])} | "
            f"{r['load_seconds']} |"
        )
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "load":
        load(Path(sys.argv[2]))
    else:
        main()
