"""CPU per S3 object request: botocore's ``get_object`` against the S3 source's transport seam
with each of its two signers.

One local SeaweedFS, ``--objects`` objects of ``--size`` bytes; ``--requests`` whole-object
GETs on 16 threads per mode, the modes alternated ``--rounds`` times in one process; the CPU
time of the process (user+sys) per request is reported, body read included. ``seam-botocore``
is the path the S3 source takes with botocore's credential chain (prefetch/sources/s3/sdk.py:
botocore's signer, set up from a listing as the source sets it up, on the seam's pool);
``seam-static`` the one it takes with static keys (prefetch/sources/s3/direct.py: signed here,
no botocore). Four floors, not paths the engine takes (see :func:`floors`): the same signed
request on urllib3's pool and on urllib3's connection (what the seam cannot go below while it
stays on urllib3), on the standard library's ``http.client`` (one connection per thread, no
timeout), and on a bare socket, the response head split by hand (issue 33: what a
small-object fetcher that owns its connections could save per request).

    python bench/request_cost.py --rounds 3
    python bench/request_cost.py --rounds 5 --modes seam-static,"urllib3 pool"
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

if TYPE_CHECKING:
    from prefetch.sources.s3.direct import S3Bucket

BUCKET = "cost"


def modes(client: Any, server: Any) -> dict[str, Callable[[str], None]]:
    """mode name -> one whole-object GET of a key, body read to the end."""
    from prefetch.pipeline.spec import parse_source_uri
    from prefetch.sources.s3.direct import S3Bucket
    from prefetch.sources.s3.factory import lazy_s3_client
    from prefetch.sources.s3.source import S3Source

    source = S3Source(client, parse_source_uri(f"s3://{BUCKET}/k/"))
    source.ensure_signed_path()  # a listing: botocore's signer, as a pull sets it up
    chained = source.objects_for("k/00000")
    assert isinstance(chained, S3Bucket), "the seam cannot be set up for this client"

    def botocore_get(key: str) -> None:
        body = client.get_object(Bucket=BUCKET, Key=key, ChecksumMode="ENABLED")["Body"]
        body.read()
        body.close()

    static = lazy_s3_client(
        endpoint_url=server.endpoint, access_key=server.access_key,
        secret_key=server.secret_key, region="us-east-1", max_pool_connections=32,
    ).direct_bucket(BUCKET)  # fmt: skip
    assert static is not None, "static keys cannot be used for these settings"

    def seam_get(bucket: S3Bucket) -> Callable[[str], None]:
        def get(key: str) -> None:
            answer = bucket.send("GET", key, headers={"x-amz-checksum-mode": "ENABLED"})
            answer.read(1 << 30)
            answer.release()

        return get

    return {
        "botocore": botocore_get,
        **floors(static, server),
        "seam-botocore": seam_get(chained),
        "seam-static": seam_get(static),
    }


def floors(bucket: S3Bucket, server: Any) -> dict[str, Callable[[str], None]]:
    """The same signed GET on urllib3's pool (``urlopen`` of the path, nothing of the seam's),
    on urllib3's connection (``request`` and ``getresponse``, one connection per thread, no
    pool), on http.client, and on a bare socket with the head split by hand (plain HTTP,
    keep-alive; bench only: no TLS, no proxy, no error handling). The first two are what the
    seam cannot go below while it stays on urllib3 (issue 33, round 2)."""
    import http.client
    import socket
    import threading
    from urllib.parse import urlsplit

    import urllib3

    from prefetch.sources.s3.direct import StaticCredentials, StaticKeySigner

    signer = StaticKeySigner(StaticCredentials(server.access_key, server.secret_key))
    where = urlsplit(bucket.base_url)
    local = threading.local()
    pool = urllib3.HTTPConnectionPool(where.hostname or "", where.port, maxsize=32)
    no_retries = urllib3.Retry(total=False, redirect=False)
    timeout = urllib3.Timeout(connect=10, read=60)

    def signed(key: str) -> tuple[str, dict[str, str]]:
        url = bucket.base_url + key
        headers = {"x-amz-checksum-mode": "ENABLED"}
        return urlsplit(url).path, signer.sign("GET", url, bucket.region, headers)

    def pool_get(key: str) -> None:
        path, headers = signed(key)
        resp = pool.urlopen(
            "GET", path, headers=headers, retries=no_retries, redirect=False, timeout=timeout,
            preload_content=False, release_conn=False, decode_content=False,
        )  # fmt: skip
        resp.read(1 << 30)
        resp.release_conn()

    def connection_get(key: str) -> None:
        if not hasattr(local, "u3"):
            local.u3 = urllib3.connection.HTTPConnection(where.hostname or "", where.port)
        path, headers = signed(key)
        local.u3.timeout = 60
        local.u3.request("GET", path, headers=headers, preload_content=False)
        local.u3.getresponse().read(1 << 30)

    def stdlib_get(key: str) -> None:
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection(where.hostname or "", where.port)
        path, headers = signed(key)
        local.conn.request("GET", path, headers=headers)
        local.conn.getresponse().read()

    def socket_get(key: str) -> None:
        if not hasattr(local, "sock"):
            local.sock = socket.create_connection((where.hostname or "", where.port or 80))
            local.file = local.sock.makefile("rb")
        path, headers = signed(key)
        lines = [f"GET {path} HTTP/1.1", f"host: {where.netloc}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        local.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        length = 0
        while (line := local.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = bytearray(length)
        view, got = memoryview(body), 0
        while got < length:
            got += local.file.readinto(view[got:])

    return {
        "urllib3 pool": pool_get,
        "urllib3 connection": connection_get,
        "http.client": stdlib_get,
        "socket": socket_get,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--objects", type=int, default=200)
    p.add_argument("--size", type=int, default=100 * 1024, help="bytes per object")
    p.add_argument("--requests", type=int, default=1000, help="GETs per mode and round")
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", help="comma-separated modes to run (default: all)")
    args = p.parse_args()

    from prefetch.demo.locals3 import SeaweedS3
    from prefetch.demo.modelgen import random_bytes

    with SeaweedS3() as server:
        client = server.client(max_pool_connections=args.threads + 8)
        client.create_bucket(Bucket=BUCKET)
        keys = [f"k/{i:05d}" for i in range(args.objects)]
        for key in keys:
            client.put_object(Bucket=BUCKET, Key=key, Body=random_bytes(args.size, key))
        work = [keys[i % len(keys)] for i in range(args.requests)]
        per_request: dict[str, list[float]] = {}
        with ThreadPoolExecutor(args.threads) as pool:
            for round_no in range(1, args.rounds + 1):
                for name, get in modes(client, server).items():
                    if args.modes and name not in args.modes.split(","):
                        continue
                    list(pool.map(get, work[:50]))  # connections open, code warm
                    c0, t0 = time.process_time(), time.monotonic()
                    list(pool.map(get, work))
                    cpu, wall = time.process_time() - c0, time.monotonic() - t0
                    per_request.setdefault(name, []).append(1000 * cpu / len(work))
                    print(f"round {round_no} {name:18s} {wall:6.2f}s wall, "
                          f"{1000 * cpu / len(work):.2f} ms CPU per request",
                          file=sys.stderr)  # fmt: skip
    print(f"`python bench/request_cost.py --rounds {args.rounds}` ({args.requests} GETs of "
          f"{args.size} bytes per mode and round, {args.threads} threads)\n")  # fmt: skip
    print("| path | ms CPU per request (median) | rounds |\n|---|--:|---|")
    for name, values in per_request.items():
        rounds = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {name} | {statistics.median(values):.2f} | {rounds} |")


if __name__ == "__main__":
    main()
