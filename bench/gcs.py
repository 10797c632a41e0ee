"""``prefetch pull gs://`` (the source on the project's HTTP seam, google-auth for tokens) against
google-cloud-storage's own download of the same data, from the same emulator, alternated in one
run: wall, CPU seconds per GB of the client process (user+sys, from ``os.wait4``), and the no-op
(a second pull of an unchanged prefix) beside the SDK's cheapest equivalent (list the prefix
and compare sizes with what is on disk). Also what each way costs to import. ``prefetch 32MiB
chunks``: prefetch with the chunk size the SDK's transfer manager is given here (16 workers
each way).

The server is gcp-storage-emulator (plain HTTP on loopback, in memory): it is Python and slow,
so the wall times measure it more than the clients; CPU per GB is the client's own.

    python bench/gcs.py --size 256MiB --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BUCKET = "bench"

#: google-cloud-storage's download of every object under the prefix: the large ones in parallel
#: ranged chunks (its transfer manager, threads), CRC32C checked by the SDK, small ones whole.
SDK_PULL = r"""
import os, sys
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage import transfer_manager
client = storage.Client(project="bench", credentials=AnonymousCredentials())
bucket, prefix, dest = sys.argv[1], sys.argv[2], sys.argv[3]
for blob in client.list_blobs(bucket, prefix=prefix):
    path = os.path.join(dest, blob.name[len(prefix):])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if blob.size > 32 * 1024 * 1024:
        transfer_manager.download_chunks_concurrently(
            blob, path, chunk_size=32 * 1024 * 1024, max_workers=16,
            worker_type=transfer_manager.THREAD, crc32c_checksum=True)
    else:
        blob.download_to_filename(path, checksum="crc32c")
"""
SDK_NOOP = r"""
import os, sys
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
client = storage.Client(project="bench", credentials=AnonymousCredentials())
bucket, prefix, dest = sys.argv[1], sys.argv[2], sys.argv[3]
stale = [b.name for b in client.list_blobs(bucket, prefix=prefix)
         if not os.path.exists(os.path.join(dest, b.name[len(prefix):]))
         or os.path.getsize(os.path.join(dest, b.name[len(prefix):])) != b.size]
assert not stale, stale
"""


def run(args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds (user+sys of the child) of one command, which must succeed."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        err = proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        raise SystemExit(f"{args[:4]} failed: {err}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    from prefetch.demo.modelgen import generate_model
    from prefetch.support.units import parse_size
    from tests.fakes.gcs import GcsEmulator

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    total = parse_size(opts.size)
    work = Path(tempfile.mkdtemp(prefix="bench-gcs-"))
    emulator = GcsEmulator(work)
    emulator.start()
    try:
        files = generate_model(work / "src", total, shards=2)
        emulator.create_bucket(BUCKET)
        emulator.upload_dir(BUCKET, "model/", {f.path: f.local for f in files})
        size = sum(f.size for f in files)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GOOGLE_", "CLOUDSDK_"))}
        env.update(STORAGE_EMULATOR_HOST=emulator.endpoint, PYTHONPATH=str(REPO))
        py = sys.executable
        rows: dict[str, list[tuple[float, float]]] = {}
        for _ in range(opts.rounds):
            for name in ("prefetch", "prefetch 32MiB chunks", "google-cloud-storage"):
                dest = work / name
                shutil.rmtree(dest, ignore_errors=True)
                dest.mkdir()
                if name.startswith("prefetch"):
                    pull = [py, "-m", "prefetch.cli", "pull", f"gs://{BUCKET}/model", str(dest)]
                    if name != "prefetch":  # the SDK's chunk size, beside the default 64 MiB
                        pull += ["--chunk-size", "32MiB"]
                    noop = pull
                else:
                    pull = [py, "-c", SDK_PULL, BUCKET, "model/", str(dest)]
                    noop = [py, "-c", SDK_NOOP, BUCKET, "model/", str(dest)]
                rows.setdefault(name, []).append(run(pull, env))
                rows.setdefault(f"{name} no-op", []).append(run(noop, env))
            for name, code in (
                (
                    "import google.auth (+ prefetch's source)",
                    "import google.auth, google.auth.transport.urllib3, "
                    "prefetch.sources.gcs.source",
                ),
                ("import google.cloud.storage", "import google.cloud.storage"),
            ):
                rows.setdefault(name, []).append(run([py, "-c", code], env))
        print(f"{size / 1e6:.0f} MB in {len(files)} files, {opts.rounds} rounds, median:\n")
        print("| row | wall s | CPU s | CPU s per GB | CPU s per GB beyond its no-op |")
        print("|---|---|---|---|---|")
        cpus = {name: statistics.median(c for _, c in runs) for name, runs in rows.items()}
        for name, runs in rows.items():
            wall = statistics.median(w for w, _ in runs)
            cpu, gb = cpus[name], size / 1e9
            noop = cpus.get(f"{name} no-op")
            per_gb = f"{cpu / gb:.2f}" if noop is not None else ""
            beyond = f"{(cpu - noop) / gb:.2f}" if noop is not None else ""
            print(f"| {name} | {wall:.2f} | {cpu:.2f} | {per_gb} | {beyond} |")
        (work / "bench-gcs.json").write_text(json.dumps(rows))
    finally:
        emulator.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
