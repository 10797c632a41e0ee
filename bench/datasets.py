"""The data the tools download: a generated model-like data set, served from S3 and a local Hub.

Every byte comes from prefetch.demo.modelgen (the one generator of model files).

Where it lives on the servers (one bucket, one prefix per test) is named here once, so the tools'
commands (bench/tools.py) and the uploads agree.
"""

from __future__ import annotations

import argparse
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import MiB, say

from prefetch.demo.modelgen import RandomStream, generate_model, random_bytes

BUCKET = "bench"
MODEL_PREFIX = "model"
SMALL_PREFIX = "small"
SCALE_PREFIX = "scale"
HUB_REPO = "acme/bench"


def s3_upload_stream(client: Any, key: str, size: int, seed: int, part_size: int) -> None:
    from boto3.s3.transfer import TransferConfig as S3Config

    cfg = S3Config(multipart_threshold=part_size, multipart_chunksize=part_size, max_concurrency=4)
    client.upload_fileobj(
        io.BufferedReader(RandomStream(size, seed), 4 * MiB),
        BUCKET,
        key,
        Config=cfg,
        ExtraArgs={"ChecksumAlgorithm": "CRC64NVME"},
    )


def s3_put_small(client: Any, prefix: str, count: int, size: int) -> int:
    """``count`` objects of ``size`` bytes, single-part with SHA256 (as real uploads of mid-size
    files are); returns the bytes uploaded."""
    blobs = [(f"{prefix}/file-{i:05d}.bin", random_bytes(size, f"small/{i}")) for i in range(count)]

    def put(item: tuple[str, bytes]) -> None:
        client.put_object(Bucket=BUCKET, Key=item[0], Body=item[1], ChecksumAlgorithm="SHA256")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, blobs))
    return count * size


@dataclass
class DataSet:
    root: Path
    total: int
    files: int
    shards: int
    shard_size: int
    small_files: int
    small_file_size: int
    part_size: int


def make_dataset(args: argparse.Namespace, root: Path) -> tuple[DataSet, Any]:
    shards = args.shards or max(1, round(args.size / (768 * MiB)))
    say(
        f"generating {shards} shard(s) of ~{args.size // shards / MiB:.0f} MiB "
        f"+ {args.model_small_files} small files under {root}"
    )
    files = generate_model(
        root,
        args.size,
        shards=shards,
        small_files=args.model_small_files,
        small_file_size=args.model_small_file_size,
    )
    total = sum(f.size for f in files)
    data = DataSet(
        root,
        total,
        len(files),
        shards,
        args.size // shards,
        args.model_small_files,
        args.model_small_file_size,
        args.part_size,
    )
    return data, files
