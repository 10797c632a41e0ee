#!/usr/bin/env python3
"""Benchmark ``prefetch pull oci://`` against ``skopeo copy`` (and ``oras pull`` when installed).

A ModelPack artifact (``--shards`` raw weight layers of ``--size`` in all, plus a config.json) is
pushed to a local Debian ``docker-registry`` (distribution 2.8, filesystem storage) and pulled
from it by each tool in alternation (A B C, A B C, ...), each run into a fresh directory:

* ``prefetch``: ``prefetch pull oci://127.0.0.1:PORT/bench/model:v1 DEST --json`` (defaults:
  parallel ranged GETs, every layer checked against its sha256 digest, files at their
  ``org.cncf.model.filepath``);
* ``skopeo``: ``skopeo copy --src-tls-verify=false docker://... dir:DEST`` (blobs named by digest,
  checked by skopeo as it copies);
* ``oras``: ``oras pull 127.0.0.1:PORT/bench/model:v1 -o DEST --plain-http`` (the Go CLI) if on
  PATH; ``oras-py``: PyPI ``oras``'s ``OrasClient.pull`` with ``--oras-python`` (no CLI).

Measured with bench/harness.py like bench/run.py: wall seconds, CPU seconds (user+sys of the
process tree), peak RSS of the tree, the registry's CPU meanwhile. Before each run the destination
is deleted, dirty pages synced, the page cache dropped (root, unless ``--no-drop-caches``) and the
registry's blobs read back in (the registry's disk is warm, as a remote one's would be).

    python bench/oci.py --size 1GiB --runs 3
    python bench/oci.py --size 16MiB --runs 1 --no-drop-caches
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "bench"))

from harness import Cache, MiB, count_bytes, mb_s, run_measured, say  # noqa: E402

from prefetch.support.units import parse_size  # noqa: E402
from tests.fakes.registry import Pusher, Registry  # noqa: E402

#: oras-py (PyPI ``oras``) has no CLI: its client's ``pull``, run by a Python that has it.
ORAS_PY = (
    "import sys, oras.client; "
    "oras.client.OrasClient(hostname=sys.argv[1], insecure=True)"
    ".pull(target=sys.argv[2], outdir=sys.argv[3])"
)


def tools(host: str, dest: Path, oras_python: str | None) -> dict[str, list[str]]:
    ref = f"{host}/bench/model:v1"
    found = {
        "prefetch": [sys.executable, "-m", "prefetch.cli", "pull", f"oci://{ref}", str(dest),
                     "--json"],
        "skopeo": ["skopeo", "copy", "--src-tls-verify=false", f"docker://{ref}", f"dir:{dest}"],
        "oras": ["oras", "pull", "--plain-http", ref, "-o", str(dest)],
    }  # fmt: skip
    if oras_python:
        found["oras-py"] = [oras_python, "-c", ORAS_PY, host, ref, str(dest)]
    return {name: argv for name, argv in found.items() if shutil.which(argv[0])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB", type=lambda v: parse_size(v, field="--size"))
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--quiet-wait", type=float, default=30.0)
    p.add_argument("--oras-python", default=None,
                   help="a Python with PyPI oras installed (e.g. a venv's bin/python)")  # fmt: skip
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-oci-"))
    registry = Registry(work / "registry")
    registry.start()
    try:
        shard = args.size // args.shards
        files = {f"model-{i:05d}.safetensors": os.urandom(shard) for i in range(args.shards)}
        files["config.json"] = b'{"architectures": ["LlamaForCausalLM"]}'
        Pusher(registry.url).modelpack("bench/model", "v1", files)
        total = sum(len(v) for v in files.values())
        del files
        dest = work / "dest"
        rows = tools(registry.host, dest, args.oras_python)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        cache = Cache(not args.no_drop_caches, [], env, args.quiet_wait)
        say(f"{total / MiB:.0f} MiB in {args.shards + 1} layers; {cache.note}; tools: {list(rows)}")
        results: dict[str, list[tuple[float, float, int, float]]] = {name: [] for name in rows}
        for run in range(args.runs):
            for name, argv in rows.items():
                cache.settle([dest], [registry.storage])
                wall, user, system, peak, _, server, _, codes, _, _ = run_measured(
                    [argv], env=env, logs=work / "logs" / f"{name}-{run}", timeout=900,
                    server_pids=[registry.pid],
                )  # fmt: skip
                got = count_bytes(dest)
                ok = codes == [0] and got >= total
                say(f"{name} run {run}: {wall:.2f}s, {'ok' if ok else f'FAILED {codes}'}")
                results[name].append((wall, user + system, peak, server))
        print(
            f"\n{total / MiB:.0f} MiB ModelPack artifact, {args.runs} run(s) each; {cache.note}\n"
        )
        print("| tool | wall s (best) | MB/s | CPU s | peak RSS MiB | registry CPU s |")
        print("|---|---|---|---|---|---|")
        for name, samples in results.items():
            wall, cpu, peak, server = min(samples)
            print(f"| {name} | {wall:.2f} | {mb_s(total, wall):.0f} | {cpu:.2f} | "
                  f"{peak / MiB:.0f} | {server:.2f} |")  # fmt: skip
        return 0
    finally:
        registry.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
