"""The S3 sync path end to end against a real local S3 server (SeaweedFS)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from awscrt import checksums as crt

from prefetch.demo.modelgen import generate_model, tree_bytes, upload_model
from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.progress import NullProgress
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import sync
from prefetch.pipeline.verify_at_rest import verify_local
from prefetch.sources.s3.describe import SMALL_OBJECT
from prefetch.sources.s3.factory import make_s3_client
from prefetch.sources.s3.source import S3Source
from prefetch.support.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    InsufficientSpaceError,
    MissingChecksumError,
    NoMatchingFilesError,
    SourceChangedError,
)

from .fakes.s3proxy import S3FaultProxy
from .support import FAST, journaled_bytes, put, run_cli
from .support import pull_s3 as pull

MiB = 1024 * 1024


def put_multipart(
    client: Any, bucket: str, key: str, data: bytes, part: int, **kwargs: Any
) -> dict[str, Any]:
    up = client.create_multipart_upload(Bucket=bucket, Key=key, **kwargs)
    parts = []
    algorithm = kwargs.get("ChecksumAlgorithm")
    for n, off in enumerate(range(0, len(data), part), 1):
        extra = {"ChecksumAlgorithm": algorithm} if algorithm else {}
        r = client.upload_part(
            Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=n,
            Body=data[off : off + part], **extra,
        )  # fmt: skip
        entry = {"PartNumber": n, "ETag": r["ETag"]}
        for field in ("ChecksumCRC64NVME", "ChecksumCRC32C", "ChecksumCRC32", "ChecksumSHA256",
                      "ChecksumSHA1"):  # fmt: skip
            if field in r:
                entry[field] = r[field]
        parts.append(entry)
    return client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=up["UploadId"], MultipartUpload={"Parts": parts}
    )


# -- happy paths -------------------------------------------------------------------------------


def test_pull_patterns_nested_empty_many_small_and_large(s3_client, bucket, tmp_path):
    rnd = os.urandom
    objects = {
        "model/config.json": b'{"a": 1}',
        "model/empty.txt": b"",
        "model/sub/dir/nested.safetensors": rnd(3 * MiB + 17),
        "model/big.safetensors": rnd(5 * MiB + 3),  # > 4 chunks of 1 MiB
        "model/skip.bin": rnd(1000),
        **{f"model/small/f{i:03d}.json": rnd(100 + i) for i in range(120)},
        "other/config.json": b"not in the prefix",
    }
    for key, data in objects.items():
        put(s3_client, bucket, key, data)
    dest = tmp_path / "dest"
    result = pull(s3_client, f"s3://{bucket}/model", dest, include=("*.json", "*.safetensors",
                  "empty.txt"), exclude=("skip.*",))  # fmt: skip
    expected = {
        k.removeprefix("model/"): v
        for k, v in objects.items()
        if k.startswith("model/") and not k.endswith("skip.bin")
    }
    assert tree_bytes(dest) == expected
    assert result.files == len(expected)
    assert result.bytes_downloaded == sum(len(v) for v in expected.values())
    assert result.files_verified == len(expected)  # every plain PUT has an MD5 ETag
    assert verify_local(PlainLayout(dest)).ok


def test_pattern_matching_nothing_is_a_clear_error(s3_client, bucket, tmp_path):
    put(s3_client, bucket, "m/config.json", b"{}")
    with pytest.raises(NoMatchingFilesError, match="matches the include/exclude"):
        pull(s3_client, f"s3://{bucket}/m/", tmp_path / "d", include=("*.gguf",))
    with pytest.raises(NoMatchingFilesError, match="no objects under"):
        pull(s3_client, f"s3://{bucket}/nothing-here/", tmp_path / "d")
    assert not (tmp_path / "d" / "config.json").exists()


def test_second_pull_downloads_nothing_and_changed_object_is_refetched(s3_client, bucket, tmp_path):
    put(s3_client, bucket, "m/a.bin", os.urandom(2 * MiB))
    put(s3_client, bucket, "m/b.bin", os.urandom(1000))
    dest = tmp_path / "d"
    first = pull(s3_client, f"s3://{bucket}/m", dest)
    assert first.bytes_downloaded == 2 * MiB + 1000
    again = pull(s3_client, f"s3://{bucket}/m", dest)
    assert again.bytes_downloaded == 0 and again.up_to_date
    new = os.urandom(1000)
    put(s3_client, bucket, "m/b.bin", new)
    third = pull(s3_client, f"s3://{bucket}/m", dest)
    assert third.bytes_downloaded == 1000 and third.files_downloaded == 1
    assert (dest / "b.bin").read_bytes() == new


def test_delete_removes_files_gone_from_the_source(s3_client, bucket, tmp_path):
    put(s3_client, bucket, "m/keep.json", b"{}")
    put(s3_client, bucket, "m/sub/gone.json", b"{}")
    dest = tmp_path / "d"
    pull(s3_client, f"s3://{bucket}/m", dest)
    s3_client.delete_object(Bucket=bucket, Key="m/sub/gone.json")
    kept = pull(s3_client, f"s3://{bucket}/m", dest)
    assert (dest / "sub/gone.json").exists() and kept.deleted == []
    result = pull(s3_client, f"s3://{bucket}/m", dest, config=FAST)
    spec = ModelSpec(source=parse_source_uri(f"s3://{bucket}/m"))
    result = sync(spec, S3Source(s3_client, spec.source), PlainLayout(dest), FAST, delete=True)
    assert result.deleted == ["sub/gone.json"]
    assert sorted(tree_bytes(dest)) == ["keep.json"]


# -- checksums ---------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["CRC64NVME", "CRC32C", "CRC32", "SHA256", "SHA1"])
def test_single_part_additional_checksums(s3_client, bucket, tmp_path, algorithm):
    data = os.urandom(3 * MiB + 5)
    put(s3_client, bucket, "m/w.bin", data, ChecksumAlgorithm=algorithm)
    result = pull(s3_client, f"s3://{bucket}/m", tmp_path / "d")
    assert result.checksum_algorithms == {algorithm.lower(): 1}
    assert (tmp_path / "d/w.bin").read_bytes() == data


def proxied_client(s3_server: Any, proxy: S3FaultProxy) -> Any:
    """A client of the local server that sends every request through ``proxy``."""
    return make_s3_client(endpoint_url=proxy.endpoint, access_key=s3_server.access_key,
                          secret_key=s3_server.secret_key)  # fmt: skip


def test_small_objects_cost_one_request_each(test_ca, s3_server, s3_client, bucket, tmp_path):
    """Objects up to 1 MiB are described by one GET (checksum headers included) whose body the
    engine writes (DescribesWhole): no HEAD, no second GET; larger ones get a HEAD and ranged
    GETs. Counted where the requests arrive, whichever path sent them."""
    small = {f"m/s{i}.json": os.urandom(1000 * (i + 1)) for i in range(3)}
    for key, data in small.items():
        put(s3_client, bucket, key, data, ChecksumAlgorithm="SHA256")
    large = os.urandom(3 * MiB)
    put(s3_client, bucket, "m/large.bin", large, ChecksumAlgorithm="CRC32C")
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        result = pull(proxied_client(s3_server, proxy), f"s3://{bucket}/m", tmp_path / "d")
    calls = [(method, key) for method, key, _ in proxy.requests]
    assert result.files_verified == 4
    for key, data in small.items():
        assert [method for method, k in calls if k == key] == ["GET"], key
        assert (tmp_path / "d" / key.removeprefix("m/")).read_bytes() == data
    assert [method for method, k in calls if k == "m/large.bin"].count("HEAD") == 1
    assert (tmp_path / "d/large.bin").read_bytes() == large


def test_multipart_crc64nvme_full_object(s3_client, bucket, tmp_path):
    data = os.urandom(11 * MiB + 123)
    put_multipart(s3_client, bucket, "m/w.bin", data, 5 * MiB, ChecksumAlgorithm="CRC64NVME",
                  ChecksumType="FULL_OBJECT")  # fmt: skip
    head = s3_client.head_object(Bucket=bucket, Key="m/w.bin", ChecksumMode="ENABLED")
    expected = base64.b64encode(crt.crc64nvme(data).to_bytes(8, "big")).decode()
    assert head["ChecksumCRC64NVME"] == expected  # the server computes what we compute
    result = pull(s3_client, f"s3://{bucket}/m", tmp_path / "d")
    assert result.checksum_algorithms == {"crc64nvme": 1}
    assert (tmp_path / "d/w.bin").read_bytes() == data


def test_a_full_object_checksum_needs_no_part_layout_request(
    test_ca, s3_server, s3_client, bucket, tmp_path
):
    """The part sizes of a multipart object (a HEAD ?partNumber=1) are asked for only when a
    check needs them: a composite checksum does, a FULL_OBJECT CRC64NVME (checked instead of
    the multipart ETag) does not."""
    full, composite = os.urandom(11 * MiB + 123), os.urandom(11 * MiB + 1)
    put_multipart(s3_client, bucket, "m/full.bin", full, 5 * MiB, ChecksumAlgorithm="CRC64NVME",
                  ChecksumType="FULL_OBJECT")  # fmt: skip
    put_multipart(s3_client, bucket, "m/composite.bin", composite, 5 * MiB,
                  ChecksumAlgorithm="SHA256")  # fmt: skip
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        result = pull(proxied_client(s3_server, proxy), f"s3://{bucket}/m", tmp_path / "d")
    heads = {
        key: [query for method, k, query in proxy.requests if method == "HEAD" and k == key]
        for key in ("m/full.bin", "m/composite.bin")
    }
    assert heads == {"m/full.bin": [""], "m/composite.bin": ["", "partNumber=1"]}
    assert result.checksum_algorithms == {"crc64nvme": 1, "sha256": 1}
    assert (tmp_path / "d/full.bin").read_bytes() == full
    assert (tmp_path / "d/composite.bin").read_bytes() == composite


def test_multipart_sha256_composite(s3_client, bucket, tmp_path):
    data = os.urandom(12 * MiB + 1)
    put_multipart(s3_client, bucket, "m/w.bin", data, 5 * MiB, ChecksumAlgorithm="SHA256")
    head = s3_client.head_object(Bucket=bucket, Key="m/w.bin", ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"].endswith("-3")
    result = pull(s3_client, f"s3://{bucket}/m", tmp_path / "d")
    assert result.checksum_algorithms == {"sha256": 1}
    assert verify_local(PlainLayout(tmp_path / "d")).checked == ["w.bin"]


def test_multipart_etag_without_additional_checksum(s3_client, bucket, tmp_path):
    data = os.urandom(12 * MiB + 7)
    put_multipart(s3_client, bucket, "m/w.bin", data, 5 * MiB)
    etag = s3_client.head_object(Bucket=bucket, Key="m/w.bin")["ETag"].strip('"')
    parts = [hashlib.md5(data[o : o + 5 * MiB]).digest() for o in range(0, len(data), 5 * MiB)]
    assert etag == hashlib.md5(b"".join(parts)).hexdigest() + "-3"
    result = pull(s3_client, f"s3://{bucket}/m", tmp_path / "d")
    assert result.checksum_algorithms == {"md5": 1}
    assert (tmp_path / "d/w.bin").read_bytes() == data


def test_sidecar_sha256sums_and_require_checksum(s3_client, bucket, tmp_path):
    a, b = os.urandom(2 * MiB), os.urandom(100)
    put_multipart(s3_client, bucket, "m/a.bin", a, 5 * MiB)
    put(s3_client, bucket, "m/b.bin", b)
    sums = f"{hashlib.sha256(a).hexdigest()}  a.bin\n{hashlib.sha256(b).hexdigest()} *b.bin\n"
    put(s3_client, bucket, "m/SHA256SUMS", sums.encode())
    result = pull(s3_client, f"s3://{bucket}/m", tmp_path / "d")
    assert result.files == 2  # the sidecar itself is metadata, not a model file
    assert result.files_verified == 2
    # a wrong line in the sidecar is caught
    bad = f"{hashlib.sha256(b'x').hexdigest()}  b.bin\n"
    put(s3_client, bucket, "n/b.bin", b, ChecksumAlgorithm="CRC32")
    put(s3_client, bucket, "n/SHA256SUMS", bad.encode())
    spec = ModelSpec(source=parse_source_uri(f"s3://{bucket}/n"))
    snap = S3Source(s3_client, spec.source).resolve(spec)
    assert snap.files[0].checksums[-1].origin == "sidecar"


def test_require_checksum_refuses_files_without_one(s3_client, bucket, tmp_path):
    # a single-part object whose ETag is not an MD5 (as with SSE-KMS): no checksum at all
    put(s3_client, bucket, "m/a.bin", b"abc")
    source_spec = ModelSpec(source=parse_source_uri(f"s3://{bucket}/m"))
    source = S3Source(s3_client, source_spec.source)
    real_describe = source.describe_whole  # (a small object: described with its bytes)

    def no_checksums(f, *, within=None):  # type: ignore[no-untyped-def]
        described, body = real_describe(f, within=within)
        return described.with_(checksums=()), body

    source.describe_whole = no_checksums  # type: ignore[method-assign]
    strict = TransferConfig(chunk_size=MiB, require_checksum=True)
    with pytest.raises(MissingChecksumError, match=r"a\.bin"):
        sync(source_spec, source, PlainLayout(tmp_path / "d"), strict)
    assert not (tmp_path / "d" / "a.bin").exists()
    lax = sync(source_spec, source, PlainLayout(tmp_path / "d"), FAST)
    assert lax.files_unverified == ["a.bin"] and lax.files_verified == 0


@pytest.mark.parametrize("kind", ["md5", "crc64nvme-multipart", "sha256-composite"])
def test_corrupted_byte_is_detected_and_not_published(
    test_ca, s3_server, s3_client, bucket, tmp_path, kind
):
    data = os.urandom(12 * MiB + 9)
    if kind == "md5":
        put(s3_client, bucket, "m/w.bin", data)
    elif kind == "crc64nvme-multipart":
        put_multipart(s3_client, bucket, "m/w.bin", data, 5 * MiB,
                      ChecksumAlgorithm="CRC64NVME", ChecksumType="FULL_OBJECT")  # fmt: skip
    else:
        put_multipart(s3_client, bucket, "m/w.bin", data, 5 * MiB, ChecksumAlgorithm="SHA256")
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        proxy.faults.flip_key = "m/w.bin"
        proxy.faults.flip_offset = 7 * MiB + 3
        client = make_s3_client(endpoint_url=proxy.endpoint, access_key=s3_server.access_key,
                                secret_key=s3_server.secret_key)  # fmt: skip
        dest = tmp_path / "d"
        with pytest.raises(ChecksumMismatchError) as err:
            pull(client, f"s3://{bucket}/m", dest)
        assert err.value.path == "w.bin" and err.value.expected != err.value.actual
        assert not (dest / "w.bin").exists()
        assert not any((dest / ".prefetch/partial").iterdir())  # bad data deleted
        # the corruption was transient: one retry of the file inside a pull fixes it
        proxy.faults.flip_times = 1
        result = pull(client, f"s3://{bucket}/m", dest)
        assert result.checksum_failures == 1 and result.files_verified == 1
        assert (dest / "w.bin").read_bytes() == data


def test_connection_cut_mid_body_is_retried_from_the_last_byte(test_ca, s3_server, s3_client,
                                                               bucket, tmp_path):  # fmt: skip
    data = os.urandom(3 * MiB)
    put(s3_client, bucket, "m/w.bin", data, ChecksumAlgorithm="CRC32C")
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        proxy.faults.cut_key = "m/w.bin"
        proxy.faults.cut_after = 100_000
        proxy.faults.cut_times = 3
        client = make_s3_client(endpoint_url=proxy.endpoint, access_key=s3_server.access_key,
                                secret_key=s3_server.secret_key)  # fmt: skip
        result = pull(client, f"s3://{bucket}/m", tmp_path / "d")
    assert result.retries >= 3
    assert (tmp_path / "d/w.bin").read_bytes() == data
    # retries resume mid-chunk: far less than 3 extra chunks were transferred
    assert result.bytes_downloaded == len(data)


def test_throttling_and_5xx_are_retried_with_backoff(
    test_ca, s3_server, s3_client, bucket, tmp_path
):
    data = os.urandom(2 * MiB + 1)
    put(s3_client, bucket, "m/w.bin", data)
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        proxy.faults.refuse_key = "m/w.bin"
        proxy.faults.refuse_statuses = (503, 500)  # SlowDown, InternalError
        proxy.faults.refuse_times = 4
        result = pull(proxied_client(s3_server, proxy), f"s3://{bucket}/m", tmp_path / "d")
    assert proxy.faults.refuse_times == 0 and result.retries == 4
    assert (tmp_path / "d/w.bin").read_bytes() == data


# -- a changing source -------------------------------------------------------------------------


def test_object_replaced_during_pull_is_detected_never_mixed(s3_client, bucket, tmp_path):
    old = os.urandom(6 * MiB)
    put(s3_client, bucket, "m/w.bin", old)
    replaced = threading.Event()

    class ReplaceAfterFirstBytes(NullProgress):
        def advance(self, nbytes: int) -> None:
            if not replaced.is_set():
                replaced.set()
                put(s3_client, bucket, "m/w.bin", os.urandom(6 * MiB))  # same size

    spec = ModelSpec(source=parse_source_uri(f"s3://{bucket}/m"))
    one_at_a_time = TransferConfig(concurrency=1, chunk_size=1 * MiB)
    dest = tmp_path / "d"
    with pytest.raises(SourceChangedError, match="changed"):
        sync(spec, S3Source(s3_client, spec.source), PlainLayout(dest), one_at_a_time,
             progress=ReplaceAfterFirstBytes())  # fmt: skip
    assert not (dest / "w.bin").exists()
    assert not any((dest / ".prefetch/partial").iterdir())  # the mixed partial is gone
    result = pull(s3_client, f"s3://{bucket}/m", dest)  # the next pull gets the new object whole
    assert (dest / "w.bin").read_bytes() == s3_client.get_object(Bucket=bucket, Key="m/w.bin")[
        "Body"
    ].read()
    assert result.files_verified == 1


# -- errors ------------------------------------------------------------------------------------


def test_unknown_bucket_and_bad_credentials(s3_server, s3_client, tmp_path):
    with pytest.raises(BucketNotFoundError):
        pull(s3_client, "s3://no-such-bucket-xyz/m", tmp_path / "d")
    bad = make_s3_client(endpoint_url=s3_server.endpoint, access_key=s3_server.access_key,
                         secret_key="wrong")  # fmt: skip
    with pytest.raises(AccessDeniedError, match="access denied"):
        pull(bad, "s3://anything/m", tmp_path / "d")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pull", "s3:/nobucket", "{dest}"], "malformed S3 URI"),
        (["pull", "ftp://bucket/x", "{dest}"], "unsupported source URI"),
        (["pull", "s3://no-such-bucket-cli/x", "{dest}"], "bucket does not exist"),
        (["pull", "s3://{bucket}/nothing/", "{dest}"], "no objects under"),
        (["pull", "s3://{bucket}/m/", "{dest}", "--include", "*.gguf"], "matches the include"),
        (["pull", "s3://{bucket}/m/", "{file}/sub"], "cannot create the destination"),
        (["pull", "s3://{bucket}/m/", "{dest}", "--chunk-size", "lots"], "not a size"),
        (["verify", "{dest}"], "does not exist"),
    ],
)
def test_cli_errors_are_one_line_and_nonzero(s3_client, bucket, s3_env, tmp_path, args, message):
    put(s3_client, bucket, "m/config.json", b"{}")
    (tmp_path / "afile").write_text("x")
    fmt = {"dest": str(tmp_path / "dest"), "bucket": bucket, "file": str(tmp_path / "afile")}
    if args[0] == "verify":
        fmt["dest"] = str(tmp_path / "missing")
    proc = run_cli(*[a.format(**fmt) for a in args], env=s3_env)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("Error:") or "Error:" in proc.stderr.splitlines()[-1]


def test_cli_access_denied_never_prints_the_secret(s3_client, bucket, s3_env):
    put(s3_client, bucket, "m/config.json", b"{}")
    env = dict(s3_env, AWS_SECRET_ACCESS_KEY="wrong-secret-value")
    proc = run_cli("pull", f"s3://{bucket}/m", "/tmp/never-created-dest-x", env=env)
    assert proc.returncode == 1
    assert "access denied" in proc.stderr and "Hint:" in proc.stderr
    assert "wrong-secret-value" not in proc.stderr + proc.stdout


def test_cli_pull_json_and_verify_detects_bit_rot(s3_client, bucket, s3_env, tmp_path):
    files = generate_model(tmp_path / "src", 20 * MiB, shards=2)
    upload_model(s3_client, bucket, "llama", files, create_bucket=False)
    dest = tmp_path / "dest"
    proc = run_cli("pull", f"s3://{bucket}/llama", str(dest), "--json", env=s3_env)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    for key in ("files", "bytes_total", "bytes_downloaded", "files_verified",
                "checksum_algorithms", "seconds"):  # fmt: skip
        assert key in summary
    assert summary["files"] == summary["files_verified"] == len(files)
    assert summary["bytes_downloaded"] == summary["bytes_total"] == sum(f.size for f in files)
    assert summary["checksum_algorithms"]["crc64nvme"] == 2
    ok = run_cli("verify", str(dest), env=s3_env)
    assert ok.returncode == 0, ok.stderr
    shard = dest / files[-2].path if files[-2].path.endswith("safetensors") else None
    shard = next(dest.glob("*.safetensors"))
    with open(shard, "r+b") as fh:
        fh.seek(12345)
        byte = fh.read(1)
        fh.seek(12345)
        fh.write(bytes([byte[0] ^ 1]))
    bad = run_cli("verify", str(dest), env=s3_env)
    assert bad.returncode == 1
    assert shard.name in bad.stderr and "crc64nvme" in bad.stderr


# -- crash, concurrency, disk ------------------------------------------------------------------


@pytest.mark.slow
def test_resume_after_sigkill_fetches_less_than_30_percent(test_ca, s3_server, s3_client, bucket,
                                                           s3_env, tmp_path):  # fmt: skip
    total = 64 * MiB
    files = generate_model(tmp_path / "src", total, shards=2)
    upload_model(s3_client, bucket, "big", files, create_bucket=False, part_size=8 * MiB)
    dest = tmp_path / "dest"
    partial = dest / ".prefetch" / "partial"
    args = [sys.executable, "-m", "prefetch.cli", "pull", f"s3://{bucket}/big", str(dest),
            "--json", "--concurrency", "2", "--chunk-size", "4MiB"]  # fmt: skip
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        # slow enough (about 4 s) that the kill lands mid-transfer even on a loaded machine
        proxy.faults.throttle_bps = 8 * MiB
        env = dict(s3_env, AWS_ENDPOINT_URL=proxy.endpoint)
        proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                published = sum(f.stat().st_size for f in dest.glob("*.safetensors"))
                if journaled_bytes(partial) + published >= 0.8 * total:
                    break
                time.sleep(0.01)
            assert proc.poll() is None, "the pull finished before it could be killed"
            proc.kill()
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
    second = subprocess.run(args, env=s3_env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout)
    assert summary["bytes_downloaded"] < 0.3 * summary["bytes_total"], summary
    assert summary["resumed_bytes"] > 0
    check = subprocess.run([sys.executable, "-m", "prefetch.cli", "verify", str(dest)],
                           env=s3_env, capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stderr


def test_two_concurrent_pulls_of_the_same_model(s3_client, bucket, s3_env, tmp_path):
    files = generate_model(tmp_path / "src", 48 * MiB, shards=3)
    upload_model(s3_client, bucket, "m", files, create_bucket=False)
    dest = tmp_path / "dest"
    args = [sys.executable, "-m", "prefetch.cli", "pull", f"s3://{bucket}/m", str(dest), "--json"]
    procs = [subprocess.Popen(args, env=s3_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    downloaded = sorted(json.loads(o)["bytes_downloaded"] for o, _ in outs)
    assert downloaded == [0, sum(f.size for f in files)]  # one pulled, the other waited
    assert tree_bytes(dest) == {f.path: f.local.read_bytes() for f in files}


@pytest.fixture
def small_fs_mib() -> int:
    """conftest's ``small_fs``, 160 MiB here."""
    return 160


def test_not_enough_space_is_refused_before_starting(s3_client, bucket, small_fs):
    put(s3_client, bucket, "m/big.bin", os.urandom(1 * MiB))
    s3_client.copy_object  # noqa: B018 (the size check needs a big listing; fake it with many)
    for i in range(3):
        put(s3_client, bucket, f"m/w{i}.bin", os.urandom(40 * MiB))
    with pytest.raises(InsufficientSpaceError, match=r"needs 121\.0 MiB"):
        pull(s3_client, f"s3://{bucket}/m", small_fs / "d")
    assert list((small_fs / "d").glob("*.bin")) == []


def test_disk_filling_up_mid_pull_leaves_resumable_state(s3_client, bucket, small_fs):
    for i in range(3):
        put(s3_client, bucket, f"m/w{i}.bin", os.urandom(20 * MiB))
    ballast = small_fs / "ballast"

    class FillDisk(NullProgress):
        def start(self, model: str, total_bytes: int, total_files: int) -> None:
            # after the up-front check passed, something else fills the disk
            with open(ballast, "wb") as fh:
                try:
                    while True:
                        fh.write(b"\0" * MiB)
                        fh.flush()
                except OSError:
                    pass

    spec = ModelSpec(source=parse_source_uri(f"s3://{bucket}/m"))
    dest = small_fs / "d"
    with pytest.raises(InsufficientSpaceError, match="no space left"):
        sync(spec, S3Source(s3_client, spec.source), PlainLayout(dest), FAST, progress=FillDisk())
    assert not any(dest.glob("w*.bin"))  # nothing half-written where a complete file belongs
    ballast.unlink()
    result = pull(s3_client, f"s3://{bucket}/m", dest)
    assert result.files_verified == 3
    assert verify_local(PlainLayout(dest)).ok


def test_progress_bar_on_a_terminal_and_none_in_a_pipe(s3_client, bucket, s3_env, tmp_path):
    import pty

    put(s3_client, bucket, "m/w.bin", os.urandom(8 * MiB))
    args = [sys.executable, "-m", "prefetch.cli", "pull", f"s3://{bucket}/m", str(tmp_path / "d")]
    pid, fd = pty.fork()
    if pid == 0:  # child: stdout and stderr are the terminal
        os.execvpe(args[0], args, s3_env)
    out = b""
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        out += data
    _, status = os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "\r[" in text and "ETA" in text and "MiB/s" in text and "100.0%" in text
    piped = run_cli("pull", f"s3://{bucket}/m", str(tmp_path / "e"), env=s3_env)
    assert piped.returncode == 0 and "ETA" not in piped.stderr


def test_hash_and_question_mark_are_key_characters_of_an_s3_prefix(s3_client, bucket, tmp_path):
    """Before: s3://b/models#1/ was read as the prefix models/ (urlsplit's fragment), and
    pulled every model under models/ instead of the one asked for."""
    objects = {
        "models#1/w.bin": b"one",
        "models?v=2/w.bin": b"two",
        "models/other/w.bin": b"not asked for",
    }
    for key, data in objects.items():
        put(s3_client, bucket, key, data)
    assert parse_source_uri(f"s3://{bucket}/models#1/").path == "models#1/"
    one, two = tmp_path / "one", tmp_path / "two"
    pull(s3_client, f"s3://{bucket}/models#1/", one)
    pull(s3_client, f"s3://{bucket}/models?v=2", two)
    assert tree_bytes(one) == {"w.bin": b"one"}
    assert tree_bytes(two) == {"w.bin": b"two"}
    with pytest.raises(ConfigError, match=r"'#' and '\?' are in no repo id"):
        parse_source_uri("hf://org/name#main")


def test_a_small_object_is_described_with_its_bytes_by_one_get_else_by_a_head(
    test_ca, s3_server, s3_client, bucket
):
    """S3's DescribesWhole: an object up to SMALL_OBJECT bytes is described by one GET of the
    whole object, its bytes handed to the caller (nothing kept for a later read); a larger
    one, or a plain describe, by a HEAD. Both describes state the same checksums."""
    data, large = os.urandom(5000), os.urandom(SMALL_OBJECT + 1)
    put(s3_client, bucket, "w/a.json", data, ChecksumAlgorithm="SHA256")
    put(s3_client, bucket, "w/b.bin", large, ChecksumAlgorithm="CRC32C")
    spec = ModelSpec(source=parse_source_uri(f"s3://{bucket}/w"))
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        source = S3Source(proxied_client(s3_server, proxy), spec.source)
        files = {f.path: f for f in source.resolve(spec).files}
        described, body = source.describe_whole(files["a.json"])
        assert body == data and described.described
        assert source.describe(files["a.json"]).checksums == described.checksums
        assert source.describe_whole(files["b.bin"])[1] is None
        reader = source.open_range(described, 0, len(data))  # from the server, not memory
        reader.close()
    calls = [(method, key) for method, key, _ in proxy.requests if key.startswith("w/")]
    assert calls == [("GET", "w/a.json"), ("HEAD", "w/a.json"), ("HEAD", "w/b.bin"),
                     ("GET", "w/a.json")]  # fmt: skip
