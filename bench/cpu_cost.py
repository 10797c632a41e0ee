"""CPU per file and CPU per GB of ``prefetch pull``, against s5cmd and 8 curl ranged GETs.

On a busy machine wall time is noise; the CPU a process spends (user+sys of it and its
children, from ``os.wait4``) is not. One local SeaweedFS holds ``--files`` x ``--file-size``
objects (single-part, SHA256, as bench/run.py's small-files test) and ``--size`` bytes in two
multipart CRC64NVME shards; the variants are alternated ``--runs`` times, each a fresh process
into a fresh destination:

  prefetch            ``prefetch pull URI DEST --json`` with the package of this tree
  base=DIR            the same with the package in DIR (``git worktree add DIR COMMIT``)
  s5cmd               ``s5cmd cp 's3://.../*' DEST/`` (small files only)
  curl                8 curl processes, 64 MiB ranged GETs (presigned) into /dev/null (large only)

    python bench/cpu_cost.py --runs 5 --baseline /tmp/perf-base
    python bench/cpu_cost.py --what large --size 1GiB --runs 3 --baseline /tmp/perf-base
    python bench/cpu_cost.py --tls --trust public ...  # HTTPS; the clients trust ~140 CAs

``--tls`` puts SeaweedFS behind HTTPS with the tests' private CA (tests/tls.py); ``--trust``
says which bundle every client is given (``SSL_CERT_FILE``, ``AWS_CA_BUNDLE``,
``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE``): that CA alone, or appended to the public store (as
a pull from a public endpoint trusts ~140 certificates: a TLS client loads them per context).

Both trees should be compiled first (``python -m compileall -q DIR/prefetch``): the venv sets
PYTHONDONTWRITEBYTECODE here, and compiling on every start is most of a small pull's start-up.
"""

from __future__ import annotations

import argparse
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

from datasets import BUCKET, s3_put_small, s3_upload_stream  # noqa: E402
from harness import MiB, say  # noqa: E402

from prefetch.demo.locals3 import SeaweedS3  # noqa: E402
from prefetch.support.units import parse_size  # noqa: E402
from tests.tls import TestCA  # noqa: E402

PREFETCH = "import sys; sys.argv[0] = 'prefetch'; from prefetch.cli import main; main()"


def curl_script(client: Any, keys: list[str], work: Path, streams: int = 8) -> Path:
    """A shell script running ``streams`` curl processes over 64 MiB ranges of ``keys``."""
    step = 64 * MiB
    jobs: list[tuple[str, int, int]] = []
    for key in keys:
        size = client.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
        url = client.generate_presigned_url(
            "get_object", Params={"Bucket": BUCKET, "Key": key}, ExpiresIn=24 * 3600
        )
        jobs += [(url, s, min(s + step, size) - 1) for s in range(0, size, step)]
    lines = []
    for i in range(streams):
        cfg = work / f"curl-{i}.cfg"
        entries = [
            f'url = "{u}"\nrange = "{s}-{e}"\noutput = "/dev/null"' for u, s, e in jobs[i::streams]
        ]
        cfg.write_text("\nnext\n".join(entries) + "\n")
        lines.append(f"curl -sS --fail -K {cfg} &")
    script = work / "curl.sh"
    script.write_text("\n".join(lines) + "\nwait\n")
    return script


def tls_server(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """SeaweedS3's HTTPS arguments for ``--tls`` (the tests' CA and certificate), else none."""
    if not args.tls:
        return {}
    ca = TestCA.create(work / "tls")
    return {
        "tls_cert": ca.cert_file,
        "tls_key": ca.key_file,
        "ca_file": ca.ca_file,
        "host": ca.host_for("s3"),
    }


def trust_env(ca_file: Path, trust: str, work: Path) -> dict[str, str]:
    """The variables naming the CA bundle every client verifies the server with: ``ca_file``
    alone, or (``public``) appended to certifi's copy of the public store."""
    bundle = ca_file
    if trust == "public":
        import certifi

        bundle = work / "public-and-private.pem"
        bundle.write_bytes(Path(certifi.where()).read_bytes() + ca_file.read_bytes())
    names = ("SSL_CERT_FILE", "AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
    return dict.fromkeys(names, str(bundle))


def command(variant: str, uri: str, dest: Path, endpoint: str, curl: Path | None) -> list[str]:
    if variant == "s5cmd":
        s5cmd = shutil.which("s5cmd") or str(Path(sys.executable).parent / "s5cmd")
        return [s5cmd, "--endpoint-url", endpoint, "cp", uri + "*", f"{dest}/"]
    if variant == "curl":
        assert curl is not None
        return ["bash", str(curl)]
    # -P: no current directory first on sys.path (run from the repository, ``-c`` would import
    # its package whatever PYTHONPATH names, and the 'base' row would measure this tree again)
    return [sys.executable, "-P", "-c", PREFETCH, "pull", uri, str(dest), "--json"]


def measure(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(CPU seconds of the process and the children it waited for, wall seconds)."""
    began = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])}... failed: {err.decode()[-2000:]}")
    return usage.ru_utime + usage.ru_stime, time.monotonic() - began


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--what", choices=("small", "large"), default="small")
    p.add_argument("--files", type=int, default=1000)
    p.add_argument("--file-size", default="100KiB")
    p.add_argument("--size", default="1GiB", help="the large shards' total (two shards)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--baseline", help="a tree whose prefetch package is the 'base' row")
    p.add_argument("--tls", action="store_true", help="SeaweedFS behind HTTPS (a private CA)")
    p.add_argument(
        "--trust",
        choices=("private", "public"),
        default="private",
        help="with --tls: the clients' CA bundle: the private CA, or the public store + it",
    )
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prefetch-cpu-"))
    try:
        with SeaweedS3(data_dir=work / "s3", **tls_server(a, work)) as server:
            client = server.client()
            client.create_bucket(Bucket=BUCKET)
            env = dict(os.environ, **server.aws_env(work), AWS_REGION="us-east-1")
            env["AWS_EC2_METADATA_DISABLED"] = "true"
            if server.ca_file is not None:
                env.update(trust_env(server.ca_file, a.trust, work))
            (work / "aws-config").write_text("[default]\nregion = us-east-1\n")
            (work / "aws-credentials").write_text("")
            curl = None
            if a.what == "small":
                say(f"uploading {a.files} x {a.file_size}")
                total = s3_put_small(client, "small", a.files, parse_size(a.file_size))
                uri, count, rival = f"s3://{BUCKET}/small/", a.files, "s5cmd"
            else:
                size = parse_size(a.size)
                keys = [f"large/shard-{i}.bin" for i in range(2)]
                for i, key in enumerate(keys):
                    say(f"uploading {key}")
                    s3_upload_stream(client, key, size // 2, i, 8 * MiB)
                curl = curl_script(client, keys, work)
                uri, count, total, rival = f"s3://{BUCKET}/large/", 2, size // 2 * 2, "curl"
            variants = {"prefetch": str(REPO)}
            if a.baseline:
                variants["base"] = a.baseline
            variants[rival] = ""
            cpu: dict[str, list[float]] = {v: [] for v in variants}
            for r in range(a.runs):
                for name, tree in variants.items():
                    dest = work / f"dest-{name}"
                    shutil.rmtree(dest, ignore_errors=True)
                    dest.mkdir()
                    run_env = dict(env, PYTHONPATH=tree) if tree else env
                    used, wall = measure(command(name, uri, dest, server.endpoint, curl), run_env)
                    cpu[name].append(used)
                    say(f"round {r + 1} {name}: {used:.3f} CPU-s, {wall:.2f} s")
            print(f"| {a.what} | CPU s per run | median | per file | per GB |")
            print("|---|---|--:|--:|--:|")
            for name, values in cpu.items():
                med = statistics.median(values)
                print(
                    f"| {name} | {', '.join(f'{v:.3f}' for v in values)} | {med:.3f} | "
                    f"{1000 * med / count:.3f} ms | {med / (total / 1e9):.3f} s |"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
