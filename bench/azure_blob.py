"""``prefetch pull az://`` against Microsoft's own Python SDK (azure-storage-blob), same data,
same Azurite, alternating: wall and client CPU per GB, and the no-op.

Why: the bytes of az:// go through the project's HTTP seam with SharedKey signed by hand
(prefetch/sources/azure/auth.py); this measures that choice against the SDK doing the same.
Azurite (``PREFETCH_TEST_AZURITE`` or ``azurite-blob`` on PATH) serves HTTPS with a throwaway
CA. ``--size`` bytes in two shards plus small JSON, uploaded with the SDK twice: with
``Content-MD5`` set on each blob (``md5/``) and in blocks without it (``blocks/``). Variants,
each a fresh process into a fresh destination, ``--runs`` rounds:

  prefetch         ``prefetch pull az://devstoreaccount1/bench/<set>/ DEST --json``
  prefetch-noverify  the same with ``--no-verify`` (what the checks cost; a blob without
                   Content-MD5 is still read in 4 MiB ranges, each checked: the source does
                   that whatever the engine's ``--no-verify``)
  sdk              list, then ``download_blob(max_concurrency=16).readinto(file)`` per blob
  sdk-validate     the same with ``validate_content=True`` (an MD5 per 4 MiB chunk)
  noop-prefetch    ``prefetch pull`` again into a complete destination
  noop-sdk         the least an SDK-based no-op costs: import, client, one listing

It also prints what MD5 itself costs on this machine (hashlib, 1 GiB in memory, CPU s per GB):
the floor of any client that checks every byte against an MD5.

    python bench/azure_blob.py --size 1GiB --runs 3
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
sys.path.insert(0, str(REPO / "bench"))

from harness import MiB, run_measured, say  # noqa: E402

from prefetch.demo.modelgen import random_bytes  # noqa: E402
from prefetch.support.units import parse_size  # noqa: E402

ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
SDK = """
import sys, os
from azure.storage.blob import BlobServiceClient
endpoint, ca, prefix, dest, mode = sys.argv[1:6]
key = {"account_name": "devstoreaccount1", "account_key": os.environ["AZURE_STORAGE_KEY"]}
svc = BlobServiceClient(endpoint, credential=key, connection_verify=ca)
c = svc.get_container_client("bench")
for b in c.list_blobs(name_starts_with=prefix):
    if mode == "list":
        continue
    path = os.path.join(dest, b.name[len(prefix):])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        c.download_blob(b.name, max_concurrency=16, validate_content=mode == "validate").readinto(f)
"""


def azurite_program() -> str:
    chosen = os.environ.get("PREFETCH_TEST_AZURITE", "")
    for candidate in (Path(chosen), Path(chosen) / "node_modules/.bin/azurite-blob"):
        if chosen and candidate.is_file():
            return str(candidate)
    found = shutil.which("azurite-blob")
    if not found:
        sys.exit("Azurite not found: npm install azurite@3.37.0, set PREFETCH_TEST_AZURITE")
    return found


def start(work: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(str(work / "ca.pem"))
    cert.private_key_pem.write_to_path(str(work / "key.pem"))
    (work / "cert.pem").write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
    port = 10977
    proc = subprocess.Popen(
        [azurite_program(), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location",
         str(work / "data"), "--cert", str(work / "cert.pem"), "--key", str(work / "key.pem"),
         "--skipApiVersionCheck", "--disableProductStyleUrl", "--loose", "--silent",
         "--disableTelemetry"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(3)
    return proc, f"https://127.0.0.1:{port}/{ACCOUNT}", str(work / "ca.pem")


def upload(endpoint: str, ca: str, size: int) -> None:
    import hashlib

    from azure.storage.blob import BlobServiceClient, ContentSettings

    svc = BlobServiceClient(endpoint, credential={"account_name": ACCOUNT, "account_key": KEY},
                            connection_verify=ca)  # fmt: skip
    c = svc.get_container_client("bench")
    c.create_container()
    files = {
        "config.json": b'{"architectures": ["X"]}',
        "tokenizer.json": random_bytes(2 * MiB, "bench tokenizer"),
        "model-1.safetensors": random_bytes(size // 2, "bench shard 1"),
        "model-2.safetensors": random_bytes(size - size // 2, "bench shard 2"),
    }
    for rel, data in files.items():
        md5 = ContentSettings(content_md5=bytearray(hashlib.md5(data).digest()))
        c.upload_blob(f"md5/{rel}", data, content_settings=md5, max_concurrency=4)
        c.upload_blob(f"blocks/{rel}", data, max_concurrency=4)


def md5_cpu_per_gb() -> float:
    """CPU seconds hashlib's MD5 (OpenSSL) takes per 10^9 bytes here, over 1 GiB in memory."""
    import hashlib

    block = random_bytes(64 * MiB, "bench md5 rate")
    h = hashlib.md5()
    began = time.process_time()
    for _ in range(16):
        h.update(block)
    return (time.process_time() - began) / (16 * 64 * MiB / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="bench-azure-"))
    proc, endpoint, ca = start(work)
    try:
        say(f"uploading {size} bytes twice to Azurite")
        upload(endpoint, ca, size)
        env = {**os.environ, "AZURE_STORAGE_BLOB_ENDPOINT": endpoint, "AZURE_STORAGE_KEY": KEY,
               "SSL_CERT_FILE": ca, "REQUESTS_CA_BUNDLE": ca, "PYTHONPATH": str(REPO)}  # fmt: skip
        py = sys.executable
        rows: dict[str, list[tuple[float, float]]] = {}
        for n in range(args.runs):
            for dataset in ("md5", "blocks"):
                variants = {
                    f"prefetch {dataset}": [py, "-m", "prefetch.cli", "pull",
                                            f"az://{ACCOUNT}/bench/{dataset}/", "{dest}", "--json"],
                    f"prefetch-noverify {dataset}": [py, "-m", "prefetch.cli", "pull",
                                                     f"az://{ACCOUNT}/bench/{dataset}/", "{dest}",
                                                     "--json", "--no-verify"],
                    f"sdk {dataset}": [py, "-c", SDK, endpoint, ca, f"{dataset}/", "{dest}",
                                       "plain"],
                    f"sdk-validate {dataset}": [py, "-c", SDK, endpoint, ca, f"{dataset}/",
                                                "{dest}", "validate"],
                }  # fmt: skip
                for name, argv in variants.items():
                    dest = work / "dest"
                    shutil.rmtree(dest, ignore_errors=True)
                    dest.mkdir()
                    cmd = [str(dest) if a == "{dest}" else a for a in argv]
                    wall, user, system, *_rest = run_measured(
                        [cmd], env=env, logs=work / "logs" / name.replace(" ", "-"),
                        timeout=900, server_pids=[proc.pid],
                    )  # fmt: skip
                    landed = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file()
                                 and ".prefetch" not in p.parts)  # fmt: skip
                    assert landed >= size, (name, landed)
                    rows.setdefault(name, []).append((wall, user + system))
                    say(f"round {n + 1} {name}: {wall:.2f} s, CPU {user + system:.2f} s")
                    if name.startswith("prefetch ") and dataset == "md5":
                        noop = [*cmd]
                        w, u, s, *_ = run_measured([noop], env=env, logs=work / "logs" / "noop",
                                                   timeout=120, server_pids=[proc.pid])  # fmt: skip
                        rows.setdefault("noop-prefetch", []).append((w, u + s))
                        lister = [py, "-c", SDK, endpoint, ca, "md5/", str(dest), "list"]
                        w, u, s, *_ = run_measured([lister], env=env, logs=work / "logs" / "list",
                                                   timeout=120, server_pids=[proc.pid])  # fmt: skip
                        rows.setdefault("noop-sdk", []).append((w, u + s))
        gb = size / 1e9
        print(f"MD5 (hashlib, in memory) on this machine: {md5_cpu_per_gb():.2f} CPU s per GB")
        print(f"| variant | wall s (median of {args.runs}) | client CPU s | CPU s per GB |")
        print("|---|---|---|---|")
        for name, got in rows.items():
            wall = statistics.median(w for w, _ in got)
            cpu = statistics.median(c for _, c in got)
            per_gb = "" if name.startswith("noop") else f"{cpu / gb:.2f}"
            print(f"| {name} | {wall:.2f} | {cpu:.2f} | {per_gb} |")
        print(json.dumps({k: v for k, v in rows.items()}), file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
