"""prefetch/demo/modelgen.py: the one generator of model files (tests, fake Hub, demo,
benchmark)."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest

from prefetch.demo.modelgen import (
    BLOCK_SIZE,
    RandomStream,
    generate_model,
    make_model_dir,
    random_bytes,
    write_random_file,
)

MiB = 1024 * 1024
SIZES = [0, 1, 4095, 4096, 5000, BLOCK_SIZE, BLOCK_SIZE + 7, 2 * BLOCK_SIZE + 4096 * 3 + 1]


@pytest.mark.parametrize("size", SIZES)
def test_the_stream_and_the_file_carry_the_same_bytes(tmp_path: Path, size: int) -> None:
    digests = write_random_file(tmp_path / "f", size, "s")
    streamed = io.BufferedReader(RandomStream(size, "s"), 1 << 20).read()
    assert streamed == (tmp_path / "f").read_bytes() == random_bytes(size, "s")
    assert digests.sha256 == hashlib.sha256(streamed).hexdigest()
    assert digests.git_sha1 == hashlib.sha1(b"blob %d\0" % size + streamed).hexdigest()


def test_a_shorter_file_is_a_prefix_of_a_longer_one_with_the_same_seed() -> None:
    longer = random_bytes(BLOCK_SIZE + 10_000, 7)
    for size in (1, 4096, 10_001, BLOCK_SIZE - 1):
        assert random_bytes(size, 7) == longer[:size]
    assert random_bytes(10_000, 8) != longer[:10_000]


def test_files_of_ten_mib_and_more_get_no_git_blob_digest(tmp_path: Path) -> None:
    assert write_random_file(tmp_path / "big", 10 * MiB, "s").git_sha1 is None


def test_generate_model_is_determined_by_the_seed(tmp_path: Path) -> None:
    files = generate_model(tmp_path / "a", 3 * MiB, shards=3, small_files=2, small_file_size=1000)
    again = generate_model(tmp_path / "b", 3 * MiB, shards=3, small_files=2, small_file_size=1000)
    other = generate_model(tmp_path / "c", 3 * MiB, shards=3, small_files=2, seed=1,
                           small_file_size=1000)  # fmt: skip
    content = {f.path: f.local.read_bytes() for f in files}
    assert content == {f.path: f.local.read_bytes() for f in again}
    assert content != {f.path: f.local.read_bytes() for f in other}
    shards = [f for f in files if f.path.endswith(".safetensors")]
    assert [(f.path, f.size) for f in shards] == [
        (f"model-0000{i}-of-00003.safetensors", MiB) for i in (1, 2, 3)
    ]
    assert [(f.path, f.size) for f in files if f.path.startswith("extra/")] == [
        ("extra/part-0000.bin", 1000),
        ("extra/part-0001.bin", 1000),
    ]
    assert all(f.size == f.local.stat().st_size for f in files)
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= set(content)


def test_every_random_file_written_is_reported_with_its_digests(tmp_path: Path) -> None:
    seen: dict[str, str] = {}
    files = make_model_dir(
        tmp_path,
        seed=2,
        shard_sizes=(5000, 6000),
        small_files=1,
        small_file_size=300,
        on_written=lambda path, d: seen.__setitem__(path.name, d.sha256),
    )
    assert seen == {
        name: hashlib.sha256(files[rel].read_bytes()).hexdigest()
        for rel, name in [
            ("model-00001-of-00002.safetensors", "model-00001-of-00002.safetensors"),
            ("model-00002-of-00002.safetensors", "model-00002-of-00002.safetensors"),
            ("extra/part-0000.bin", "part-0000.bin"),
        ]
    }
