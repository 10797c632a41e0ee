"""Generated model-like data for the demo, the tests and the benchmark.

Safetensors-like shards (an 8-byte little-endian header length, a JSON header, random bytes) plus
config/tokenizer JSON, written to disk in bounded memory, and an uploader that stores them in S3
the ways real uploads do: multipart with a CRC64NVME checksum, single-part with SHA256, plain.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MiB = 1024 * 1024


@dataclass(frozen=True)
class GeneratedFile:
    path: str  # relative path in the model
    local: Path
    size: int


def _random_file(path: Path, size: int, rng: random.Random, header: bytes = b"") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(header)
        left = size - len(header)
        while left > 0:
            n = min(left, 4 * MiB)
            fh.write(rng.randbytes(n))
            left -= n


def _safetensors_header(size: int, index: int) -> bytes:
    body = max(size - 1024, 0)
    tensor = {"dtype": "BF16", "shape": [body // 2], "data_offsets": [0, body]}
    meta = {
        "__metadata__": {"format": "pt", "shard": str(index)},
        f"model.layers.{index}.weight": tensor,
    }
    text = json.dumps(meta).encode()
    text += b" " * (1024 - 8 - len(text)) if len(text) < 1016 else b""
    return struct.pack("<Q", len(text)) + text


def generate_model(
    root: Path,
    total_size: int,
    *,
    shards: int = 3,
    small_files: int = 0,
    small_file_size: int = 100 * 1024,
    seed: int = 0,
) -> list[GeneratedFile]:
    """Write a model of about ``total_size`` bytes under ``root``; returns its files."""
    rng = random.Random(seed)
    files: list[tuple[str, Path, int]] = []

    def add_json(rel: str, obj: Any) -> None:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(obj, indent=2))
        files.append((rel, p, p.stat().st_size))

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}
    add_json("config.json", {**config, "num_hidden_layers": shards, "seed": seed})
    add_json("generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
    add_json("tokenizer_config.json", {"tokenizer_class": "LlamaTokenizer"})
    vocab = {f"tok{i}": i for i in range(2000)}
    add_json("tokenizer.json", {"version": "1.0", "model": {"type": "BPE", "vocab": vocab}})
    index_map = {}
    shard_size = max(total_size // max(shards, 1), 2048)
    for i in range(1, shards + 1):
        rel = f"model-{i:05d}-of-{shards:05d}.safetensors"
        p = root / rel
        _random_file(p, shard_size, rng, _safetensors_header(shard_size, i))
        files.append((rel, p, shard_size))
        index_map[f"model.layers.{i}.weight"] = rel
    add_json("model.safetensors.index.json", {"metadata": {"total_size": shard_size * shards},
                                              "weight_map": index_map})  # fmt: skip
    for i in range(small_files):
        rel = f"extra/part-{i:04d}.bin"
        p = root / rel
        _random_file(p, small_file_size, rng)
        files.append((rel, p, small_file_size))
    return [GeneratedFile(rel, p, size) for rel, p, size in sorted(files)]


def upload_model(
    client: Any,
    bucket: str,
    prefix: str,
    files: list[GeneratedFile],
    *,
    multipart_threshold: int = 8 * MiB,
    part_size: int = 8 * MiB,
    create_bucket: bool = True,
) -> None:
    """Upload like real tools do: large files multipart with CRC64NVME (FULL_OBJECT), mid-size
    files single-part with SHA256, small JSON plain (MD5 ETag only)."""
    from boto3.s3.transfer import TransferConfig as S3TransferConfig

    if create_bucket:
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
    cfg = S3TransferConfig(
        multipart_threshold=multipart_threshold,
        multipart_chunksize=part_size,
        max_concurrency=4,
        use_threads=True,
    )
    prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
    for f in files:
        key = prefix + f.path
        if f.size >= multipart_threshold:
            client.upload_file(
                str(f.local), bucket, key, Config=cfg,
                ExtraArgs={"ChecksumAlgorithm": "CRC64NVME"},
            )  # fmt: skip
        elif f.size >= 64 * 1024:
            with open(f.local, "rb") as fh:
                client.put_object(Bucket=bucket, Key=key, Body=fh, ChecksumAlgorithm="SHA256")
        else:
            with open(f.local, "rb") as fh:
                client.put_object(Bucket=bucket, Key=key, Body=fh.read())


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> content), skipping model-prefetch state."""
    out: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".prefetch"]
        for name in filenames:
            p = Path(dirpath, name)
            out[p.relative_to(root).as_posix()] = p.read_bytes()
    return out
