"""prefetch/pipeline/verify.py: the hashers, CRC combination per range, composite checksums, which
checks a file gets (checks_for / inline_check), value encoding, and check()'s errors."""

from __future__ import annotations

import base64
import hashlib
import os
import zlib
from pathlib import Path

import pytest
from awscrt import checksums as crt

from prefetch.pipeline import verify
from prefetch.pipeline.engine.plan import plan_chunks
from prefetch.pipeline.snapshot import Checksum
from prefetch.support.errors import ChecksumMismatchError, ConfigError

MiB = 1024 * 1024
DATA = bytes(range(256)) * 41 + b"tail"  # 10500 bytes: not a multiple of anything handy
CRC_WIDTH = {"crc64nvme": 8, "crc32c": 4, "crc32": 4}
CRC_FN = {"crc64nvme": crt.crc64nvme, "crc32c": crt.crc32c, "crc32": crt.crc32}


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def crc_checksum(algorithm: str, data: bytes) -> Checksum:
    """The whole-object CRC as S3 states it (base64 of the big-endian value)."""
    value = CRC_FN[algorithm](data).to_bytes(CRC_WIDTH[algorithm], "big")
    return Checksum(algorithm, b64(value), "base64", origin="s3-checksum")


def hash_chunks(checksum: Checksum, data: bytes, bounds: list[tuple[int, int]]) -> list[object]:
    """Per-chunk results as the engine journals them, chunks hashed in the order given."""
    results: dict[int, object] = {}
    for start, end in bounds:
        h = verify.ChunkHasher(checksum, start, end, len(data))
        h.feed(memoryview(data)[start:end])
        results[start] = h.result()
    return [results[start] for start in sorted(results)]


# -- the hashers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("algorithm", "reference"),
    [
        ("sha256", lambda d: hashlib.sha256(d).digest()),
        ("sha1", lambda d: hashlib.sha1(d).digest()),
        ("md5", lambda d: hashlib.md5(d).digest()),
        ("git-sha1", lambda d: hashlib.sha1(b"blob %d\0" % len(d) + d).digest()),
        ("crc64nvme", lambda d: crt.crc64nvme(d).to_bytes(8, "big")),
        ("crc32c", lambda d: crt.crc32c(d).to_bytes(4, "big")),
        ("crc32", lambda d: zlib.crc32(d).to_bytes(4, "big")),
    ],
)
def test_every_algorithm_hashes_incrementally_like_its_reference(algorithm, reference) -> None:  # type: ignore[no-untyped-def]
    h = verify.new_hasher(algorithm, size=len(DATA))
    for i in range(0, len(DATA), 777):  # fed in uneven pieces
        h.update(memoryview(DATA)[i : i + 777])
    assert h.digest() == reference(DATA)


def test_a_git_blob_hasher_needs_the_size_and_unknown_algorithms_are_config_errors() -> None:
    with pytest.raises(ValueError, match="size"):
        verify.new_hasher("git-sha1")
    with pytest.raises(ConfigError, match="unknown checksum algorithm 'xxh3'"):
        verify.new_hasher("xxh3")


def test_a_multi_hasher_feeds_every_hasher_and_has_no_single_digest() -> None:
    multi = verify.MultiHasher({"sha256": hashlib.sha256(), "md5": hashlib.md5()})
    multi.update(DATA[:100])
    multi.update(memoryview(DATA)[100:])
    assert multi.hashers["sha256"].digest() == hashlib.sha256(DATA).digest()
    assert multi.hashers["md5"].digest() == hashlib.md5(DATA).digest()
    with pytest.raises(TypeError, match="one digest per algorithm"):
        multi.digest()


# -- CRC combination per range --------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["crc64nvme", "crc32c", "crc32"])
@pytest.mark.parametrize(
    "bounds",
    [
        [(0, 10500)],
        [(0, 1), (1, 10500)],
        [(0, 4096), (4096, 8192), (8192, 10499), (10499, 10500)],
        [(0, 5000), (5000, 5001), (5001, 10500)],
    ],
    ids=["whole", "first-byte", "pages-and-last-byte", "one-byte-middle"],
)
def test_crc_ranges_hashed_in_any_order_combine_to_the_object_crc(algorithm, bounds) -> None:  # type: ignore[no-untyped-def]
    checksum = crc_checksum(algorithm, DATA)
    results = hash_chunks(checksum, DATA, list(reversed(bounds)))  # the last range lands first
    assert verify.finish_inline(checksum, results) == checksum.value
    verify.check("w.bin", checksum, verify.finish_inline(checksum, results))


def test_a_crc_range_result_is_the_crc_and_length_of_that_range() -> None:
    checksum = crc_checksum("crc32c", DATA)
    h = verify.ChunkHasher(checksum, 100, 300)
    h.feed(memoryview(DATA)[100:150])
    h.feed(memoryview(DATA)[150:300])
    assert h.result() == [crt.crc32c(DATA[100:300]), 200]


def test_a_flipped_byte_in_one_range_changes_the_combined_crc() -> None:
    checksum = crc_checksum("crc64nvme", DATA)
    bad = bytearray(DATA)
    bad[6000] ^= 1
    results = hash_chunks(checksum, bytes(bad), [(0, 5000), (5000, 10500)])
    with pytest.raises(ChecksumMismatchError, match=r"w\.bin: crc64nvme"):
        verify.check("w.bin", checksum, verify.finish_inline(checksum, results))


# -- composite checksums --------------------------------------------------------------------------


def composite(algorithm: str, data: bytes, parts: tuple[int, ...], encoding: str) -> Checksum:
    """A composite value built the way S3 does: hash of the part digests, then ``-N``."""
    digests, pos = [], 0
    for size in parts:
        h = verify.new_hasher(algorithm)
        h.update(data[pos : pos + size])
        digests.append(h.digest())
        pos += size
    outer = verify.new_hasher(algorithm)
    for d in digests:
        outer.update(d)
    value = f"{verify.encode(outer.digest(), encoding)}-{len(parts)}"
    return Checksum(algorithm, value, encoding, part_sizes=parts, origin="s3-checksum")


@pytest.mark.parametrize(
    ("algorithm", "encoding"), [("md5", "hex"), ("sha256", "base64"), ("crc32c", "base64")]
)
def test_composite_checksums_inline_and_from_disk_agree(algorithm, encoding, tmp_path) -> None:  # type: ignore[no-untyped-def]
    parts = (4000, 4000, 2500)
    checksum = composite(algorithm, DATA, parts, encoding)
    assert verify.mode_of(checksum) == "parts"
    inline = verify.finish_inline(checksum, hash_chunks(checksum, DATA, [(0, 8000), (8000, 10500)]))
    path = tmp_path / "f"
    path.write_bytes(DATA)
    assert inline == verify.hash_file(path, checksum) == checksum.value
    assert verify.hash_file_all(path, [checksum]) == [checksum.value]


def test_a_composite_chunk_that_splits_a_part_is_refused() -> None:
    checksum = composite("md5", DATA, (4000, 6500), "hex")
    with pytest.raises(ValueError, match="aligned"):
        verify.ChunkHasher(checksum, 0, 5000)


def test_a_composite_checksum_says_how_many_parts_it_joins() -> None:
    checksum = composite("md5", DATA, (4000, 4000, 2500), "hex")
    assert checksum.describe() == "md5 composite of 3 parts (s3-checksum)"


# -- which checks a file gets ---------------------------------------------------------------------


def test_checks_for_keeps_the_strongest_served_checksum_and_every_sidecar_one() -> None:
    crc = crc_checksum("crc64nvme", DATA)
    etag = Checksum("md5", hashlib.md5(DATA).hexdigest(), origin="etag")
    hub = Checksum("sha256", hashlib.sha256(DATA).hexdigest(), origin="hub")
    side = Checksum("sha256", hashlib.sha256(DATA).hexdigest().upper(), origin="sidecar")
    assert verify.checks_for([hub, crc, etag]) == (hub,)
    assert verify.checks_for([crc, etag, side]) == (crc, side)
    assert verify.checks_for([hub, side]) == (hub,)  # the same value, differently cased: once
    assert verify.checks_for([Checksum("xxh3", "1"), etag]) == (etag,)
    assert verify.checks_for([]) == ()


def test_inline_check_prefers_a_check_computed_per_range() -> None:
    crc = crc_checksum("crc32c", DATA)
    parts = composite("md5", DATA, (5000, 5500), "hex")
    sha = Checksum("sha256", hashlib.sha256(DATA).hexdigest(), origin="sidecar")
    assert verify.inline_check((sha, crc)) == crc
    assert verify.inline_check((sha, parts)) == parts
    assert verify.inline_check((sha,)) == sha
    assert verify.inline_check(()) is None


def test_a_sequential_checksum_is_computed_inline_only_for_a_whole_file_chunk() -> None:
    sha = Checksum("sha256", hashlib.sha256(DATA).hexdigest(), origin="hub")
    whole = verify.ChunkHasher(sha, 0, len(DATA), len(DATA))
    whole.feed(memoryview(DATA))
    assert whole.result() == sha.value
    part = verify.ChunkHasher(sha, 0, 5000, len(DATA))
    part.feed(memoryview(DATA)[:5000])
    assert part.result() is None
    with pytest.raises(ValueError, match="sequential"):
        verify.finish_inline(sha, [None])


def test_hash_file_all_computes_several_checksums_in_one_read(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(DATA)
    checks = [
        crc_checksum("crc64nvme", DATA),
        Checksum("sha256", hashlib.sha256(DATA).hexdigest(), origin="sidecar"),
        composite("sha1", DATA, (6000, 4500), "hex"),
    ]
    reads: list[int] = []
    assert verify.hash_file_all(path, checks, reader=reads.append) == [c.value for c in checks]
    assert sum(reads) == len(DATA)  # one pass, not one per checksum


# -- encoding and check() -------------------------------------------------------------------------


def test_encode_gives_hex_or_base64() -> None:
    digest = bytes.fromhex("00ff10")
    assert verify.encode(digest, "hex") == "00ff10"
    assert verify.encode(digest, "base64") == "AP8Q"


def test_normalize_strips_quotes_and_space_and_lowercases_only_hex() -> None:
    assert verify.normalize(' "ABCdef-2" \n', "hex") == "abcdef-2"
    assert verify.normalize('"AP8Q"', "base64") == "AP8Q"  # base64 is case-sensitive


def test_check_accepts_a_quoted_uppercase_etag() -> None:
    etag = Checksum("md5", '"' + hashlib.md5(DATA).hexdigest().upper() + '"', origin="etag")
    verify.check("w.bin", etag, hashlib.md5(DATA).hexdigest())


def test_check_names_the_file_the_checksum_and_both_values() -> None:
    crc = crc_checksum("crc32c", DATA)
    with pytest.raises(ChecksumMismatchError) as err:
        verify.check("dir/w.bin", crc, "AAAAAA==")
    assert (err.value.path, err.value.expected, err.value.actual) == (
        "dir/w.bin",
        crc.value,
        "AAAAAA==",
    )
    assert err.value.algorithm == "crc32c (s3-checksum)"
    assert str(err.value) == (
        f"checksum mismatch for dir/w.bin: crc32c (s3-checksum) expected {crc.value}, got AAAAAA=="
    )


def test_base64_values_differing_only_in_case_do_not_match() -> None:
    crc = crc_checksum("crc64nvme", DATA)
    swapped = crc.value.swapcase()
    assert swapped != crc.value
    with pytest.raises(ChecksumMismatchError):
        verify.check("w.bin", crc, swapped)


# -- moved from test_units.py ---------------------------------------------------------------------


def test_crc_chunks_combine_to_the_whole_object_crc():
    data = os.urandom(5 * MiB + 123)
    checksum = Checksum(
        "crc64nvme", base64.b64encode(crt.crc64nvme(data).to_bytes(8, "big")).decode(), "base64"
    )
    results = []
    for start, end in plan_chunks(len(data), MiB, checksum):
        h = verify.ChunkHasher(checksum, start, end)
        view = memoryview(data)[start:end]
        h.feed(view[:1000])  # fed in pieces, as the socket delivers them
        h.feed(view[1000:])
        results.append(h.result())
    verify.check("x", checksum, verify.finish_inline(checksum, results))


def test_multipart_etag_parts_are_hashed_inline_and_chunks_align_to_parts():
    part = 5 * MiB
    data = os.urandom(12 * MiB + 7)
    digests = [hashlib.md5(data[o : o + part]).digest() for o in range(0, len(data), part)]
    etag = hashlib.md5(b"".join(digests)).hexdigest() + "-3"
    checksum = Checksum("md5", etag, part_sizes=(part, part, len(data) - 2 * part))
    chunks = plan_chunks(len(data), 3 * MiB, checksum)
    assert chunks == [(0, part), (part, 2 * part), (2 * part, len(data))]
    chunks = plan_chunks(len(data), 8 * MiB, checksum)
    assert chunks == [(0, 2 * part), (2 * part, len(data))]  # two parts in one chunk
    results = []
    for start, end in chunks:
        h = verify.ChunkHasher(checksum, start, end)
        h.feed(memoryview(data)[start:end])
        results.append(h.result())
    assert verify.finish_inline(checksum, results) == etag
    with pytest.raises(ValueError, match="aligned"):
        verify.ChunkHasher(checksum, 1, part)


def test_hash_file_modes_and_mismatch_message(tmp_path):
    data = b"hello world\n" * 1000
    path = tmp_path / "f"
    path.write_bytes(data)
    git = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    assert verify.hash_file(path, Checksum("git-sha1", git)) == git
    sha = hashlib.sha256(data).hexdigest()
    assert verify.hash_file(path, Checksum("sha256", sha)) == sha
    crc32c = base64.b64encode(crt.crc32c(data).to_bytes(4, "big")).decode()
    assert verify.hash_file(path, Checksum("crc32c", crc32c, "base64")) == crc32c
    with pytest.raises(ChecksumMismatchError) as err:
        verify.check("f", Checksum("sha256", "0" * 64, origin="sidecar"), sha)
    assert err.value.expected == "0" * 64 and err.value.actual == sha
    assert "sha256 (sidecar)" in str(err.value) and "f" in str(err.value)


def test_pick_prefers_the_first_known_algorithm():
    assert verify.pick([Checksum("xxh3", "1"), Checksum("crc32", "2")]) == Checksum("crc32", "2")
    assert verify.pick([]) is None


@pytest.mark.parametrize(
    "checksum",
    [
        Checksum("sha256", "x", encoding="base64"),
        Checksum("sha1", "x"),
        Checksum("git-sha1", "x"),
        Checksum("md5", "x"),
        Checksum("crc64nvme", "x", encoding="base64"),
        Checksum("crc32c", "x", encoding="base64"),
        Checksum("crc32", "x"),
        Checksum("md5", "x-3", part_sizes=(4000, 4000, 1234)),
        Checksum("sha256", "x-2", encoding="base64", part_sizes=(5000, 4234)),
    ],
)
def test_values_of_bytes_in_memory_are_the_values_of_the_same_file_on_disk(
    checksum: Checksum, tmp_path: Path
) -> None:
    """The whole-object path hashes a small file's bytes in memory, one call per check: the
    same values hash_file_all reads back from the written file, in every mode."""
    data = os.urandom(9234)
    (tmp_path / "f").write_bytes(data)
    expected = verify.hash_file_all(tmp_path / "f", [checksum, checksum])
    assert verify.values_of([checksum, checksum], data) == expected
    assert verify.values_of([], data) == []
