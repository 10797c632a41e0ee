"""The sidecar rule: every stated checksum that can be computed must agree.

A ``SHA256SUMS`` sidecar is the one check that does not come from the server that sent the bytes,
so it is checked even when the server states a checksum of its own, and both results are recorded
so that ``prefetch verify`` holds the file to both.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from awscrt import checksums as crt
from click.testing import CliRunner

from prefetch.cli import main
from prefetch.pipeline import verify
from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.snapshot import Checksum, RemoteFile
from prefetch.pipeline.spec import parse_source_uri
from prefetch.pipeline.verify_at_rest import verify_local
from prefetch.sources.s3.source import S3Source
from prefetch.support.errors import ChecksumMismatchError

from .support import fast_config, pull_s3

MiB = 1024 * 1024
FAST = fast_config(concurrency=4, attempts=2)


def pull(client: Any, uri: str, dest: Path, config: TransferConfig = FAST):  # type: ignore[no-untyped-def]
    return pull_s3(client, uri, dest, config=config)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def crc64nvme_b64(data: bytes) -> str:
    return base64.b64encode(crt.crc64nvme(data).to_bytes(8, "big")).decode()


def put_multipart(client: Any, bucket: str, key: str, data: bytes, part: int) -> None:
    up = client.create_multipart_upload(Bucket=bucket, Key=key)
    parts = []
    for n, off in enumerate(range(0, len(data), part), 1):
        r = client.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=n,
                               Body=data[off : off + part])  # fmt: skip
        parts.append({"PartNumber": n, "ETag": r["ETag"]})
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=up["UploadId"], MultipartUpload={"Parts": parts}
    )


# -- the rule -----------------------------------------------------------------------------------


def test_the_sidecar_is_checked_beside_the_strongest_served_checksum():
    crc = Checksum("crc64nvme", "AAAAAAAAAAA=", encoding="base64", origin="s3-checksum")
    md5 = Checksum("md5", "0" * 32, origin="etag")
    side = Checksum("sha256", "a" * 64, origin="sidecar")
    assert verify.checks_for([crc, md5, side]) == (crc, side)
    assert verify.checks_for([side]) == (side,)
    assert verify.checks_for([crc, md5]) == (crc,)
    # a served sha256 equal to the sidecar's is one check; a different one is two (both must hold)
    same = Checksum("sha256", "A" * 64, origin="s3-checksum")
    other = Checksum("sha256", "b" * 64, origin="s3-checksum")
    assert verify.checks_for([same, side]) == (same,)
    assert verify.checks_for([other, side]) == (other, side)
    assert verify.checks_for([Checksum("xxh3", "1", origin="sidecar")]) == ()


# -- pull ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind",
    ["crc64nvme, in-order sha256", "md5 etag, one chunk", "multipart etag, parts"],
)
def test_a_wrong_sidecar_fails_the_pull_even_when_the_server_states_a_checksum(
    s3_client, bucket, tmp_path, kind
):
    if kind.startswith("crc64nvme"):
        data = os.urandom(9 * MiB + 5)  # large: sha256 fed in order while the pieces land
        s3_client.put_object(Bucket=bucket, Key="m/w.bin", Body=data,
                             ChecksumAlgorithm="CRC64NVME")  # fmt: skip
        served = "crc64nvme"
    elif kind.startswith("md5"):
        data = os.urandom(300 * 1024)
        s3_client.put_object(Bucket=bucket, Key="m/w.bin", Body=data)
        served = "md5"
    else:
        data = os.urandom(11 * MiB)
        put_multipart(s3_client, bucket, "m/w.bin", data, 5 * MiB)
        served = "md5"
    described = S3Source(s3_client, parse_source_uri(f"s3://{bucket}/m")).describe(
        RemoteFile("w.bin", len(data), locator="m/w.bin")
    )
    assert described.checksums[0].algorithm == served  # the server does state its own checksum
    wrong = sha256(data + b"x")
    s3_client.put_object(Bucket=bucket, Key="m/SHA256SUMS", Body=f"{wrong}  w.bin\n".encode())
    dest = tmp_path / "d"
    with pytest.raises(ChecksumMismatchError) as err:
        pull(s3_client, f"s3://{bucket}/m", dest)
    assert err.value.path == "w.bin"
    assert err.value.algorithm.startswith("sha256") and "sidecar" in err.value.algorithm
    assert err.value.expected == wrong and err.value.actual == sha256(data)
    assert not (dest / "w.bin").exists()
    assert not list((dest / ".prefetch" / "partial").glob("*"))  # the bad bytes were deleted


def test_a_correct_sidecar_is_checked_and_recorded_beside_the_crc(s3_client, bucket, tmp_path):
    big, small = os.urandom(9 * MiB + 5), b'{"a": 1}'
    s3_client.put_object(Bucket=bucket, Key="m/big.bin", Body=big, ChecksumAlgorithm="CRC64NVME")
    s3_client.put_object(Bucket=bucket, Key="m/c.json", Body=small, ChecksumAlgorithm="CRC64NVME")
    sums = f"{sha256(big)}  big.bin\n{sha256(small)}  c.json\n"
    s3_client.put_object(Bucket=bucket, Key="m/SHA256SUMS", Body=sums.encode())
    dest = tmp_path / "d"
    result = pull(s3_client, f"s3://{bucket}/m", dest)
    assert result.files_verified == 2
    assert result.checksum_algorithms == {"crc64nvme": 2, "sha256": 2}
    entry = json.loads((dest / ".prefetch" / "manifest.json").read_text())["entries"]["big.bin"]
    assert [(c["algorithm"], c.get("origin")) for c in entry["checksums"]] == [
        ("crc64nvme", "s3-checksum"),
        ("sha256", "sidecar"),
    ]
    assert entry["checksum"]["algorithm"] == "crc64nvme"  # what older readers verify by
    assert verify_local(PlainLayout(dest)).checked == ["big.bin", "c.json"]


# -- verify -------------------------------------------------------------------------------------


def published(tmp_path: Path, data: bytes, *checksums: Checksum) -> Path:
    """A plain-layout tree holding ``w.bin`` recorded with ``checksums``."""
    layout = PlainLayout(tmp_path / "tree")
    staged = tmp_path / "staged"
    staged.write_bytes(data)
    layout.publish(RemoteFile("w.bin", len(data), version="e1"), staged, checksums)
    (layout.state / "manifest.json").write_text(
        json.dumps({"format": 1, "entries": layout.book.load()["entries"], "files": ["w.bin"]})
    )
    (layout.state / "published.jsonl").unlink()
    return layout.root


def test_verify_holds_a_file_to_the_sidecar_sha256_as_well_as_its_crc(tmp_path):
    data = os.urandom(100_000)
    crc = Checksum("crc64nvme", crc64nvme_b64(data), encoding="base64", origin="s3-checksum")
    wrong = Checksum("sha256", sha256(b"other"), origin="sidecar")
    root = published(tmp_path, data, crc, wrong)
    report = verify_local(PlainLayout(root))
    assert not report.ok
    (failure,) = report.failures
    assert isinstance(failure, ChecksumMismatchError) and failure.algorithm == "sha256 (sidecar)"
    cli = CliRunner().invoke(main, ["verify", str(root)])
    assert cli.exit_code == 1 and "sha256 (sidecar)" in cli.stderr


def test_verify_reads_records_made_with_a_single_checksum(tmp_path):
    data = os.urandom(50_000)
    root = tmp_path / "tree"
    (root / ".prefetch").mkdir(parents=True)
    (root / "w.bin").write_bytes(data)
    checksum = {"algorithm": "sha256", "value": sha256(data), "origin": "sidecar"}
    old = {"path": "w.bin", "size": len(data), "version": "e1", "checksum": checksum}
    manifest = {"format": 1, "entries": {"w.bin": old}, "files": ["w.bin"]}
    (root / ".prefetch" / "manifest.json").write_text(json.dumps(manifest))
    assert verify_local(PlainLayout(root)).checked == ["w.bin"]
    (root / "w.bin").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    (failure,) = verify_local(PlainLayout(root)).failures
    assert isinstance(failure, ChecksumMismatchError) and failure.path == "w.bin"
