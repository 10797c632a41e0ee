"""Generated model-like data for the demo, the tests, the fake Hub and the benchmark.

The one generator of model files: safetensors shards (a valid header describing one ``U8`` tensor,
then pseudo-random bytes), config/tokenizer JSON, a few small files, all determined by a seed and
written in bounded memory (4 MiB at a time, so multi-GiB shards cost no RAM); the same bytes as a
stream for uploads that need no local copy; and an uploader that stores files in S3 the ways real
uploads do: multipart with a CRC64NVME checksum, single-part with SHA256, plain.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import io
import json
import os
import random
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MiB = 1024 * 1024
BLOCK_SIZE = 4 * MiB
"""Random bytes are made one block at a time (and a block is re-used with stamps, see below)."""
PAGE_SIZE = 4096
GIT_BLOB_LIMIT = 10 * MiB
"""Files under this size also get a git blob sha1 (what the Hub calls a regular file's oid)."""


@dataclass(frozen=True)
class GeneratedFile:
    path: str  # relative path in the model
    local: Path
    size: int


@dataclass(frozen=True)
class WrittenDigests:
    """Digests computed while a file was written, so nobody reads it again to hash it."""

    sha256: str
    git_sha1: str | None  # of the git blob, for files under GIT_BLOB_LIMIT


OnWritten = Callable[[Path, WrittenDigests], None]
"""Told about every random file written (the fake Hub remembers the digests)."""


# ---------------------------------------------------------------------------------- random bytes


def random_blocks(size: int, seed: int | str) -> Iterator[bytes | bytearray]:
    """``size`` deterministic pseudo-random bytes, at most BLOCK_SIZE per item.

    Fast (GB/s): one random block from ``seed`` is re-used with a unique 8-byte stamp at the start
    of every 4 KiB page, so no two pages of a file (or of files with other seeds) are equal and a
    reader that confuses offsets is caught.
    """
    rng = random.Random(f"hubserver:{seed}")  # the prefix keeps the bytes of earlier versions
    salt = rng.getrandbits(40) << 24
    # A smaller file draws a smaller block: the same first bytes (whole 32-bit words), less work.
    block = rng.randbytes(min(BLOCK_SIZE, -(-size // PAGE_SIZE) * PAGE_SIZE))
    index = 0
    remaining = size
    while remaining > 0:
        buf = bytearray(block)
        words = memoryview(buf).cast("Q")
        pages = len(words) // (PAGE_SIZE // 8)
        first = salt + index * pages
        words[:: PAGE_SIZE // 8] = array.array("Q", range(first, first + pages))
        words.release()
        take = min(remaining, BLOCK_SIZE)
        yield buf if take == BLOCK_SIZE else buf[:take]
        remaining -= take
        index += 1


def random_bytes(size: int, seed: int | str) -> bytes:
    """:func:`random_blocks` joined: for small files kept in memory."""
    return b"".join(random_blocks(size, seed))


class RandomStream(io.RawIOBase):
    """The bytes of :func:`random_blocks` as a readable file, for uploads without a local copy."""

    def __init__(self, size: int, seed: int | str) -> None:
        self._blocks = random_blocks(size, seed)
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if not self._pending:
            block = next(self._blocks, None)
            if block is None:
                return 0
            self._pending = memoryview(block)
        n = min(len(b), len(self._pending))
        b[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def safetensors_header(size: int) -> bytes:
    """An 8-byte length + JSON header (space-padded to 8 bytes) for one U8 tensor filling a file
    of ``size`` bytes, or ``b""`` when ``size`` is too small to hold one."""

    def text(n: int) -> bytes:
        meta = {
            "__metadata__": {"format": "pt"},
            "weight": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]},
        }
        return json.dumps(meta, separators=(",", ":")).encode()

    # The payload length n has at most as many digits as size, so text(size) bounds the header.
    padded_len = len(text(size)) + (-(8 + len(text(size))) % 8)
    n = size - 8 - padded_len
    if n < 0:
        return b""
    header = text(n).ljust(padded_len)
    return struct.pack("<Q", padded_len) + header


def write_random_file(
    path: str | os.PathLike[str], size: int, seed: int | str, *, safetensors: bool = False
) -> WrittenDigests:
    """Write ``size`` bytes of :func:`random_blocks` (after a safetensors header describing the
    rest, with ``safetensors``); returns the digests computed on the way."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    sha256 = hashlib.sha256()
    git = hashlib.sha1(b"blob %d\0" % size) if size < GIT_BLOB_LIMIT else None
    header = safetensors_header(size) if safetensors else b""
    with open(out, "wb") as fh:
        for data in (header, *random_blocks(size - len(header), seed)):
            sha256.update(data)
            if git is not None:
                git.update(data)
            fh.write(data)
    return WrittenDigests(sha256.hexdigest(), git.hexdigest() if git is not None else None)


# ------------------------------------------------------------------------------------- the model


def shard_names(count: int) -> list[str]:
    """``model.safetensors`` alone, else ``model-0000i-of-0000N.safetensors``."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _text_files(seed: int, shards: Sequence[str], shard_sizes: Sequence[int]) -> dict[str, bytes]:
    """The model's small JSON/text files, determined by ``seed``."""
    rng = random.Random(f"hubserver-model:{seed}")
    vocab = {f"tok{i}_{rng.randrange(1 << 30):x}": i for i in range(256 + seed % 7)}
    texts: dict[str, bytes] = {
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
        b"*.bin filter=lfs diff=lfs merge=lfs -text\n",
        "config.json": json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 64 + seed % 32,
                "num_hidden_layers": 2,
                "vocab_size": len(vocab),
                "torch_dtype": "bfloat16",
                "seed": seed,
            },
            indent=2,
        ).encode(),
        "generation_config.json": json.dumps(
            {"bos_token_id": 1, "eos_token_id": 2, "temperature": round(rng.random(), 3)}
        ).encode(),
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"vocab": vocab}}).encode(),
        "tokenizer_config.json": json.dumps({"model_max_length": 4096}).encode(),
        "subdir/extra.txt": f"extra file for seed {seed}\n".encode()
        + rng.randbytes(64).hex().encode(),
        "subdir/nested/deep.json": json.dumps({"deep": True, "seed": seed}).encode(),
    }
    if len(shards) > 1:
        texts["model.safetensors.index.json"] = json.dumps(
            {
                "metadata": {"total_size": sum(shard_sizes)},
                "weight_map": {f"layer{i}.weight": name for i, name in enumerate(shards)},
            },
            indent=2,
        ).encode()
    return texts


def make_model_dir(
    directory: str | os.PathLike[str],
    *,
    seed: int = 0,
    shard_sizes: Sequence[int] = (3 << 20, 2 << 20),
    extra_files: Mapping[str, bytes] | None = None,
    small_files: int = 0,
    small_file_size: int = 100 * 1024,
    on_written: OnWritten | None = None,
) -> dict[str, Path]:
    """Write a small but realistic model repo to ``directory``; return ``{repo path: file}``.

    Files: ``.gitattributes``, ``config.json``, ``generation_config.json``, ``tokenizer.json``,
    ``tokenizer_config.json``, ``subdir/extra.txt``, ``subdir/nested/deep.json``, one shard per
    entry of ``shard_sizes`` (see :func:`shard_names`), for several shards
    ``model.safetensors.index.json``, ``small_files`` files ``extra/part-NNNN.bin`` and
    ``extra_files``. Contents depend only on ``seed``; shards are valid safetensors files of
    exactly the given sizes.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    shards = shard_names(len(shard_sizes))
    texts = _text_files(seed, shards, shard_sizes)
    texts.update(extra_files or {})
    out: dict[str, Path] = {}
    for rel, data in texts.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        out[rel] = target
    randoms = [(name, size, True) for name, size in zip(shards, shard_sizes, strict=True)]
    randoms += [(f"extra/part-{i:04d}.bin", small_file_size, False) for i in range(small_files)]
    for rel, size, safetensors in randoms:
        digests = write_random_file(root / rel, size, f"{seed}/{rel}", safetensors=safetensors)
        if on_written is not None:
            on_written(root / rel, digests)
        out[rel] = root / rel
    return dict(sorted(out.items()))


def generate_model(
    root: Path,
    total_size: int,
    *,
    shards: int = 3,
    small_files: int = 0,
    small_file_size: int = 100 * 1024,
    seed: int = 0,
) -> list[GeneratedFile]:
    """:func:`make_model_dir` with ``shards`` equal shards making about ``total_size`` bytes;
    returns its files."""
    shard_size = max(total_size // max(shards, 1), 2048)
    written = make_model_dir(
        root,
        seed=seed,
        shard_sizes=[shard_size] * max(shards, 1),
        small_files=small_files,
        small_file_size=small_file_size,
    )
    return [GeneratedFile(rel, path, path.stat().st_size) for rel, path in written.items()]


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
