"""Small download clients the benchmark runs as subprocesses (so each is measured on its own).

    python bench/clients.py boto3 --bucket B --prefix P --dest D [--concurrency N --chunk-size S]
        boto3's managed transfer (s3transfer, the machinery behind ``download_file``) with a tuned
        TransferConfig: every object of the prefix submitted to one TransferManager.
    python bench/clients.py snapshot --repo ORG/NAME
        ``huggingface_hub.snapshot_download`` with its default settings (HF_HOME and HF_ENDPOINT
        come from the environment; nothing else is changed).

S3 credentials and the endpoint come from the standard AWS_* environment variables.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

MiB = 1024 * 1024


def boto3_download(args: argparse.Namespace) -> int:
    import boto3
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    client = boto3.client(
        "s3",
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL"),
        region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        config=boto3.session.Config(max_pool_connections=args.concurrency + 4),
    )
    config = TransferConfig(
        multipart_threshold=args.chunk_size,
        multipart_chunksize=args.chunk_size,
        max_concurrency=args.concurrency,
        io_chunksize=args.io_chunk_size,
        use_threads=True,
    )
    prefix = args.prefix.strip("/") + "/"
    dest = Path(args.dest)
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=args.bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    with create_transfer_manager(client, config) as manager:
        futures = []
        for key in keys:
            target = dest / key[len(prefix) :]
            target.parent.mkdir(parents=True, exist_ok=True)
            futures.append(manager.download(args.bucket, key, str(target)))
        for fut in futures:
            fut.result()
    return 0


def snapshot(args: argparse.Namespace) -> int:
    from huggingface_hub import snapshot_download

    path = snapshot_download(args.repo)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("boto3")
    b.add_argument("--bucket", required=True)
    b.add_argument("--prefix", required=True)
    b.add_argument("--dest", required=True)
    b.add_argument("--concurrency", type=int, default=16)
    b.add_argument("--chunk-size", type=int, default=16 * MiB)
    b.add_argument("--io-chunk-size", type=int, default=1 * MiB)
    s = sub.add_parser("snapshot")
    s.add_argument("--repo", required=True)
    args = parser.parse_args(argv)
    return boto3_download(args) if args.cmd == "boto3" else snapshot(args)


if __name__ == "__main__":
    sys.exit(main())
