"""``prefetch mirror``: the local Hub server (tests/fakes/hubserver.py) or an S3 mirror into
SeaweedFS, checked object by object with boto3 (CRC64NVME read back with ChecksumMode=ENABLED),
through the mirror format's own parser (prefetch.sources.s3_mirror.format)."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from awscrt import checksums as crt

from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.publish.s3_mirror import MirrorConfig, MirrorResult, S3Prefix, mirror_hub, mirror_s3
from prefetch.publish.s3_mirror.stream import part_size_for, plan_parts
from prefetch.sources.hf.source import HubOptions, open_hub_source
from prefetch.sources.s3.source import S3Source
from prefetch.sources.s3_mirror.format import MirrorCommit, blob_key, parse_mirror_commit, ref_key
from prefetch.support.errors import ChecksumMismatchError, ConfigError, InvalidListingError

from .fakes.hubserver import HubServer, make_model_dir
from .support import HUB_TOKEN, REPO_ROOT, kill_9_when, run_cli, server_files, upload
from .tls import TestCA

MiB = 1024 * 1024
REPO = "acme/mirrored"
#: Shards of several 5 MiB parts (multipart uploads) beside small files (one PutObject each).
SHARDS = (12 * MiB, 7 * MiB)
PREFIX = "hf/acme/mirrored/"
CONFIG = MirrorConfig(
    transfer=TransferConfig(
        concurrency=4, retry=RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05)
    ),
    part_size=5 * MiB,
)


@pytest.fixture(scope="module")
def mirror_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mirror-model")
    make_model_dir(root, seed=3, shard_sizes=SHARDS, extra_files={"empty.txt": b""})
    return root


@pytest.fixture
def hub(mirror_model: Path, test_ca: TestCA) -> Iterator[HubServer]:
    with HubServer(test_ca) as server:
        server.add_commit(REPO, mirror_model)
        yield server
        assert server.errors == []


def hub_mirror(
    hub: HubServer, client: Any, bucket: str, uri: str = f"hf://{REPO}", prefix: str = PREFIX
) -> MirrorResult:
    """Mirror ``uri`` from the local Hub in-process."""
    spec = ModelSpec(source=parse_source_uri(uri))
    pool = urllib3.PoolManager(maxsize=16, retries=False)
    options = HubOptions(endpoint=hub.endpoint, token=False, http=pool, retry=CONFIG.transfer.retry)
    try:
        source = open_hub_source(spec, options)
        return mirror_hub(spec, source, S3Prefix(client, bucket, prefix), CONFIG)
    finally:
        pool.clear()


def crc64nvme(data: bytes) -> str:
    return base64.b64encode(crt.crc64nvme(data).to_bytes(8, "big")).decode()


def read_back(client: Any, bucket: str, key: str) -> tuple[bytes, dict[str, Any]]:
    resp = client.get_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    return resp["Body"].read(), resp


def keys(client: Any, bucket: str, prefix: str = "") -> set[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def uploads_in_progress(client: Any, bucket: str) -> list[dict[str, Any]]:
    return list(client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def metadata(client: Any, bucket: str, commit: str, prefix: str = PREFIX) -> MirrorCommit:
    body, _ = read_back(client, bucket, f"{prefix}snapshots/{commit}.json")
    return parse_mirror_commit(body, where="test")


def assert_mirrored(hub: HubServer, client: Any, bucket: str, revision: str = "main") -> None:
    """Every file of ``revision`` is a blob named by its Hub id, byte-identical, with the
    FULL_OBJECT CRC64NVME of its bytes; the metadata records each file's path, size, id and CRC."""
    files = hub.files(REPO, revision)
    commit = hub.repos[REPO].resolve(revision)
    assert commit is not None
    meta = metadata(client, bucket, commit.sha)
    assert [f.path for f in meta.files] == sorted(files)
    for entry in meta.files:
        f = files[entry.path]
        data, resp = read_back(client, bucket, blob_key(PREFIX, f.etag))
        assert data == f.read(), entry.path
        assert resp.get("ChecksumCRC64NVME") == crc64nvme(data) == entry.crc64nvme, (
            entry,
            {k: v for k, v in resp.items() if k != "Body"},
        )
        assert resp.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT"
        assert (entry.size, entry.id) == (f.size, f.etag)
        assert entry.id_kind == ("sha256" if f.is_lfs else "git-sha1")


# -- parts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "part_size", "expected"),
    [
        (0, 16 * MiB, 16 * MiB),
        (16 * MiB * 10_000, 16 * MiB, 16 * MiB),  # exactly 10,000 parts
        (16 * MiB * 10_000 + 1, 16 * MiB, 17 * MiB),  # one byte more: the next whole MiB
        (5 * 1024**4, 5 * MiB, 525 * MiB),  # S3's largest object in at most 10,000 parts
    ],
)
def test_parts_grow_to_the_fewest_whole_mib_that_fit_in_10000(size, part_size, expected):  # type: ignore[no-untyped-def]
    assert part_size_for(size, part_size) == expected
    parts = plan_parts(size, expected)
    assert len(parts) <= 10_000 and sum(e - s for s, e in parts) == size


def test_part_sizes_outside_s3s_limits_are_refused_in_one_line(s3_env):  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="part size: must be between 5MiB and 5GiB"):
        MirrorConfig(part_size=4 * MiB)
    proc = run_cli("mirror", "hf://acme/x", "s3://bkt-x/p", "--part-size", "1MiB", env=s3_env)
    assert proc.returncode == 1
    assert proc.stderr.startswith("Error: part size: must be between 5MiB and 5GiB"), proc.stderr


# -- Hub to S3 ------------------------------------------------------------------------------------


def test_mirror_cli_writes_checked_blobs_metadata_and_ref(hub, s3_client, bucket, s3_env):  # type: ignore[no-untyped-def]
    env = {**s3_env, "HF_ENDPOINT": hub.endpoint}
    dest = f"s3://{bucket}/{PREFIX}"
    proc = run_cli("mirror", f"hf://{REPO}", dest, "--json", "--part-size", "5MiB", env=env)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    sha = hub.repos[REPO].branches["main"]
    total = sum(len(b) for b in server_files(hub, REPO).values())
    assert summary["repo_id"] == REPO and summary["commit"] == sha and summary["ref"] == "main"
    assert summary["destination"] == dest and summary["source"] == f"hf://{REPO}"
    assert summary["files"] == len(hub.files(REPO))
    assert summary["bytes_uploaded"] == total and summary["bytes_skipped"] == 0
    assert_mirrored(hub, s3_client, bucket)
    meta = metadata(s3_client, bucket, sha)
    assert (meta.repo_id, meta.commit, meta.ref, meta.source) == (REPO, sha, "main", f"hf://{REPO}")
    ref, _ = read_back(s3_client, bucket, ref_key(PREFIX, "main"))
    assert ref == sha.encode()
    assert uploads_in_progress(s3_client, bucket) == []


def test_mirroring_the_same_commit_again_uploads_nothing(hub, s3_client, bucket):  # type: ignore[no-untyped-def]
    first = hub_mirror(hub, s3_client, bucket)
    sha = hub.repos[REPO].branches["main"]
    key = f"{PREFIX}snapshots/{sha}.json"
    recorded = metadata(s3_client, bucket, sha)
    earlier = MirrorCommit(**{**recorded.__dict__, "mirrored_at": "2001-02-03T04:05:06Z"})
    s3_client.put_object(Bucket=bucket, Key=key, Body=earlier.to_json())
    again = hub_mirror(hub, s3_client, bucket)
    assert again.bytes_uploaded == 0 and again.blobs_uploaded == 0
    assert again.bytes_skipped == first.bytes_uploaded == first.bytes_total > 0
    assert metadata(s3_client, bucket, sha) == earlier  # the first record (and its time) is kept


def test_a_leftover_upload_of_a_blob_already_mirrored_is_aborted(hub, s3_client, bucket):  # type: ignore[no-untyped-def]
    hub_mirror(hub, s3_client, bucket)
    shard = hub.file(REPO, "model-00001-of-00002.safetensors")
    s3_client.create_multipart_upload(Bucket=bucket, Key=blob_key(PREFIX, shard.etag))
    again = hub_mirror(hub, s3_client, bucket)
    assert again.bytes_uploaded == 0 and again.uploads_aborted == 1
    assert uploads_in_progress(s3_client, bucket) == []


@pytest.mark.parametrize(
    ("path", "algorithm"),
    [("model-00001-of-00002.safetensors", "sha256"), ("tokenizer.json", "git-sha1")],
)
def test_a_corrupted_hub_byte_never_completes_an_upload(hub, s3_client, bucket, path, algorithm):  # type: ignore[no-untyped-def]
    f = hub.file(REPO, path)
    hub.faults.corrupt(f, offset=f.size - 10)  # in the last part: every other part is uploaded
    with pytest.raises(ChecksumMismatchError) as err:
        hub_mirror(hub, s3_client, bucket)
    assert err.value.path == path and err.value.algorithm.startswith(algorithm)
    assert blob_key(PREFIX, f.etag) not in keys(s3_client, bucket)
    assert not keys(s3_client, bucket, f"{PREFIX}snapshots/")
    assert not keys(s3_client, bucket, f"{PREFIX}refs/")
    # its upload is aborted (other files' uploads stay, for the next run to resume)
    assert blob_key(PREFIX, f.etag) not in {
        u["Key"] for u in uploads_in_progress(s3_client, bucket)
    }
    hub.faults.clear()
    hub_mirror(hub, s3_client, bucket)
    assert_mirrored(hub, s3_client, bucket)
    assert uploads_in_progress(s3_client, bucket) == []


def test_cut_connections_are_retried_from_the_last_byte_received(hub, s3_client, bucket):  # type: ignore[no-untyped-def]
    shard = hub.file(REPO, "model-00001-of-00002.safetensors")
    hub.faults.cut(after_bytes=300_000, count=2, port="cdn", file=shard)
    result = hub_mirror(hub, s3_client, bucket)
    assert result.retries == 2
    ranges = [r.headers.get("range") for r in hub.requests if r.port == "cdn" and r.method == "GET"]
    assert any(r and not r.startswith(("bytes=0-", "bytes=5242880-", "bytes=10485760-"))
               for r in ranges), ranges  # fmt: skip
    assert_mirrored(hub, s3_client, bucket)


class FlakyUploads:
    """An S3 client whose first UploadPart and first PutObject read half their body and then
    lose the connection."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.failed: list[str] = []

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._client, name)
        if name not in ("upload_part", "put_object"):
            return call

        def flaky(**kwargs: Any) -> Any:
            if name not in self.failed:
                self.failed.append(name)
                body = kwargs["Body"]
                if hasattr(body, "read"):
                    body.read(len(body) // 2)
                raise ConnectionResetError("connection reset by peer")
            return call(**kwargs)

        return flaky


def test_an_upload_cut_mid_body_is_sent_again_whole(hub, s3_client, bucket):  # type: ignore[no-untyped-def]
    flaky = FlakyUploads(s3_client)
    result = hub_mirror(hub, flaky, bucket)
    assert sorted(flaky.failed) == ["put_object", "upload_part"]
    assert result.bytes_uploaded == result.bytes_total
    assert_mirrored(hub, s3_client, bucket)


@pytest.mark.slow
def test_a_moved_branch_adds_its_commit_and_the_old_one_still_pulls(  # type: ignore[no-untyped-def]
    hub, s3_client, bucket, tmp_path, s3_env
):
    old = hub.repos[REPO].branches["main"]
    hub_mirror(hub, s3_client, bucket)
    old_meta, _ = read_back(s3_client, bucket, f"{PREFIX}snapshots/{old}.json")
    changed = make_model_dir(tmp_path / "v2", seed=3, shard_sizes=SHARDS)
    (tmp_path / "v2" / "config.json").write_text('{"model_type": "llama", "v": 2}\n')
    new = hub.add_commit(REPO, changed, branch="main")
    assert new != old
    moved = hub_mirror(hub, s3_client, bucket)
    assert moved.commit == new
    assert moved.bytes_uploaded == len(b'{"model_type": "llama", "v": 2}\n')  # config.json only
    ref, _ = read_back(s3_client, bucket, ref_key(PREFIX, "main"))
    assert ref == new.encode()
    assert read_back(s3_client, bucket, f"{PREFIX}snapshots/{old}.json")[0] == old_meta
    assert_mirrored(hub, s3_client, bucket, old)
    assert_mirrored(hub, s3_client, bucket, new)
    env = {**s3_env, "HF_ENDPOINT": hub.endpoint}
    home = tmp_path / "home"
    mirror = f"s3://{bucket}/{PREFIX}"
    proc = run_cli("pull", f"hf://{REPO}@{old}", str(home), "--mirror", mirror,
                   "--no-hub-fallback", "--json", env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["served_by"] == mirror
    snapshot = home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / old
    pulled = {p.relative_to(snapshot).as_posix(): p.read_bytes() for p in snapshot.rglob("*")
              if p.is_file()}  # fmt: skip
    assert pulled == server_files(hub, REPO, old)


def test_a_blob_without_a_crc64nvme_is_uploaded_again(hub, s3_client, bucket):  # type: ignore[no-untyped-def]
    config = hub.file(REPO, "config.json")
    key = blob_key(PREFIX, config.etag)
    s3_client.put_object(Bucket=bucket, Key=key, Body=config.read())  # no additional checksum
    result = hub_mirror(hub, s3_client, bucket)
    assert result.bytes_uploaded == result.bytes_total and result.blobs_skipped == 0
    assert_mirrored(hub, s3_client, bucket)


def test_a_stalled_read_is_abandoned_and_retried_by_the_engines_watchdog(hub, s3_client, bucket):  # type: ignore[no-untyped-def]
    shard = hub.file(REPO, "model-00002-of-00002.safetensors")
    hub.faults.throttle(20_000, count=1, port="cdn", file=shard)
    spec = ModelSpec(source=parse_source_uri(f"hf://{REPO}"))
    options = HubOptions(endpoint=hub.endpoint, token=False, retry=CONFIG.transfer.retry)
    stall = TransferConfig(concurrency=4, min_rate=1 * MiB, stall_window=0.5,
                           retry=CONFIG.transfer.retry)  # fmt: skip
    config = MirrorConfig(transfer=stall, part_size=5 * MiB)
    dest = S3Prefix(s3_client, bucket, PREFIX)
    result = mirror_hub(spec, open_hub_source(spec, options), dest, config)
    assert result.retries == 1
    assert_mirrored(hub, s3_client, bucket)


def test_mirroring_a_sha_writes_no_ref(hub, s3_client, bucket):  # type: ignore[no-untyped-def]
    sha = hub.repos[REPO].branches["main"]
    result = hub_mirror(hub, s3_client, bucket, f"hf://{REPO}@{sha}")
    assert result.ref == sha and metadata(s3_client, bucket, sha).ref == sha
    assert not keys(s3_client, bucket, f"{PREFIX}refs/")


# -- S3 to S3 -------------------------------------------------------------------------------------


def copy_mirror(client: Any, src_bucket: str, dst_bucket: str) -> MirrorResult:
    uri = parse_source_uri(f"s3://{src_bucket}/{PREFIX}")
    source = S3Source(client, uri)
    src = S3Prefix(client, src_bucket, PREFIX)
    return mirror_s3(source, src, S3Prefix(client, dst_bucket, PREFIX), CONFIG)


def test_s3_to_s3_copies_a_mirror_checked_against_its_recorded_ids(hub, s3_client, bucket):  # type: ignore[no-untyped-def]
    hub_mirror(hub, s3_client, bucket)
    second = f"{bucket[:50]}-copy"
    s3_client.create_bucket(Bucket=second)
    copied = copy_mirror(s3_client, bucket, second)
    sha = hub.repos[REPO].branches["main"]
    assert (copied.repo_id, copied.commit, copied.ref) == (REPO, sha, "main")
    assert copied.bytes_uploaded == copied.bytes_total > 0
    assert keys(s3_client, second) == keys(s3_client, bucket)
    for key in keys(s3_client, bucket):
        data, resp = read_back(s3_client, second, key)
        assert data == read_back(s3_client, bucket, key)[0]
        assert resp["ChecksumCRC64NVME"] == crc64nvme(data)
    assert copy_mirror(s3_client, bucket, second).bytes_uploaded == 0


def test_s3_to_s3_refuses_a_blob_altered_after_mirroring(hub, s3_client, bucket):  # type: ignore[no-untyped-def]
    hub_mirror(hub, s3_client, bucket)
    shard = hub.file(REPO, "model-00002-of-00002.safetensors")
    key = blob_key(PREFIX, shard.etag)
    data = bytearray(read_back(s3_client, bucket, key)[0])
    data[12345] ^= 1
    s3_client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    second = f"{bucket[:50]}-copy"
    s3_client.create_bucket(Bucket=second)
    with pytest.raises(ChecksumMismatchError) as err:
        copy_mirror(s3_client, bucket, second)
    assert err.value.path == shard.path
    assert key not in keys(s3_client, second)
    assert not keys(s3_client, second, f"{PREFIX}snapshots/")
    assert key not in {u["Key"] for u in uploads_in_progress(s3_client, second)}


def test_s3_to_s3_copies_a_plain_prefix_checked_against_what_s3_states(  # type: ignore[no-untyped-def]
    s3_client, bucket, tmp_path
):
    files = upload(s3_client, bucket, "plain", tmp_path, 30 * MiB, seed=4)
    second = f"{bucket[:50]}-copy"
    s3_client.create_bucket(Bucket=second)

    def copy() -> MirrorResult:
        source = S3Source(s3_client, parse_source_uri(f"s3://{bucket}/plain/"))
        src = S3Prefix(s3_client, bucket, "plain/")
        return mirror_s3(source, src, S3Prefix(s3_client, second, "copy/"), CONFIG)

    first = copy()
    assert first.bytes_uploaded == sum(len(b) for b in files.values())
    for path, data in files.items():
        got, resp = read_back(s3_client, second, f"copy/{path}")
        assert got == data and resp["ChecksumCRC64NVME"] == crc64nvme(data), path
    # objects whose source states a CRC64NVME (the multipart shards) are not copied again
    assert copy().bytes_skipped == sum(len(b) for p, b in files.items() if len(b) >= 8 * MiB) > 0


def test_s3_to_s3_refuses_a_prefix_mirroring_two_repos(hub, s3_client, bucket):  # type: ignore[no-untyped-def]
    hub_mirror(hub, s3_client, bucket)
    recorded = metadata(s3_client, bucket, hub.repos[REPO].branches["main"])
    other = MirrorCommit(**{**recorded.__dict__, "repo_id": "other/repo", "commit": "b" * 40})
    s3_client.put_object(Bucket=bucket, Key=f"{PREFIX}snapshots/{'b' * 40}.json",
                         Body=other.to_json())  # fmt: skip
    second = f"{bucket[:50]}-copy"
    s3_client.create_bucket(Bucket=second)
    with pytest.raises(InvalidListingError, match=f"several repos \\({REPO}, other/repo\\)"):
        copy_mirror(s3_client, bucket, second)
    assert not keys(s3_client, second)


# -- the command line -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["hf://acme/mirrored", "/tmp/somewhere"], "must be s3://bucket/prefix"),
        (["ftp://x/y", "s3://b-bucket/p"], "unsupported source URI"),
        (["hf://acme/mirrored", "s3://no-such-bucket-here/p"], "bucket does not exist"),
        (["hf://acme/absent", "s3://{bucket}/p"], "repository acme/absent not found"),
    ],
)
def test_mirror_errors_are_one_line(hub, bucket, s3_env, args, message):  # type: ignore[no-untyped-def]
    env = {**s3_env, "HF_ENDPOINT": hub.endpoint}
    proc = run_cli("mirror", *[a.format(bucket=bucket) for a in args], env=env)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("Error: ") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def uploaded_bytes(client: Any, bucket: str) -> int:
    """Bytes held by the parts of every multipart upload in progress."""
    total = 0
    for u in uploads_in_progress(client, bucket):
        try:
            parts = client.list_parts(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
        except client.exceptions.NoSuchUpload:
            continue  # completed (or aborted) since it was listed
        total += sum(p["Size"] for p in parts.get("Parts", []))
    return total


@pytest.mark.slow
def test_kill_9_mid_mirror_then_resume_reuses_the_uploaded_parts(
    s3_client, bucket, s3_env, tmp_path, test_ca
):  # type: ignore[no-untyped-def]
    src = tmp_path / "big"
    make_model_dir(src, seed=9, shard_sizes=(30 * MiB, 25 * MiB))
    with HubServer(test_ca) as hub:
        hub.add_commit(REPO, src)
        total = sum(f.size for f in hub.files(REPO).values())
        hub.faults.throttle(8 * MiB, port="cdn")  # ~4 s for the lot: time to kill it
        env = {**s3_env, "HF_ENDPOINT": hub.endpoint}
        args = [sys.executable, "-m", "prefetch.cli", "mirror", f"hf://{REPO}",
                f"s3://{bucket}/{PREFIX}", "--json", "--part-size", "5MiB",
                "--concurrency", "2"]  # fmt: skip
        proc = subprocess.Popen(args, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)  # fmt: skip
        kill_9_when(
            proc, lambda: uploaded_bytes(s3_client, bucket) >= total // 3, "mirror", interval=0.05
        )
        hub.faults.clear()
        left = {u["Key"] for u in uploads_in_progress(s3_client, bucket)}
        assert left, "the killed mirror left no upload to resume"
        shard = hub.file(REPO, "model-00001-of-00002.safetensors")
        shard_key = blob_key(PREFIX, shard.etag)
        # an abandoned empty duplicate, and an upload of another part size: both to be aborted
        s3_client.create_multipart_upload(Bucket=bucket, Key=shard_key)
        other = blob_key(PREFIX, hub.file(REPO, "model-00002-of-00002.safetensors").etag)
        odd = s3_client.create_multipart_upload(Bucket=bucket, Key=other)["UploadId"]
        s3_client.upload_part(Bucket=bucket, Key=other, UploadId=odd, PartNumber=1,
                              Body=shard.read(0, 6 * MiB))  # fmt: skip
        second = subprocess.run(args, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=120)  # fmt: skip
        assert second.returncode == 0, second.stderr
        summary = json.loads(second.stdout)
        assert summary["bytes_reused"] > 0, summary
        assert summary["bytes_uploaded"] < total, summary
        done = summary["bytes_uploaded"] + summary["bytes_reused"] + summary["bytes_skipped"]
        assert done == total, summary
        assert summary["uploads_aborted"] >= 2, summary
        assert uploads_in_progress(s3_client, bucket) == []
        assert_mirrored(hub, s3_client, bucket)


@pytest.mark.slow
def test_a_private_repo_mirrors_with_its_token_and_a_wrong_token_fails_in_one_line(  # type: ignore[no-untyped-def]
    mirror_model, s3_client, bucket, s3_env, test_ca
):
    with HubServer(test_ca, token=HUB_TOKEN) as hub:
        hub.add_commit(REPO, mirror_model)
        hub.add_repo(REPO, private=True)
        env = {**s3_env, "HF_ENDPOINT": hub.endpoint}
        dest = f"s3://{bucket}/{PREFIX}"
        wrong = "hf_WrongTokenValue_c0ffee"
        bad = run_cli("mirror", f"hf://{REPO}", dest, "--json", "--token", wrong, env=env)
        assert bad.returncode == 1
        assert bad.stderr.startswith("Error:") and "rejected the token" in bad.stderr, bad.stderr
        assert len([ln for ln in bad.stderr.splitlines() if ln.startswith("Error:")]) == 1
        assert json.loads(bad.stdout)["error_reason"] == "access_denied"
        assert wrong not in bad.stderr + bad.stdout
        assert not keys(s3_client, bucket)
        ok = run_cli("mirror", f"hf://{REPO}", dest, env={**env, "HF_TOKEN": HUB_TOKEN})
        assert ok.returncode == 0, ok.stderr
        assert f"{REPO}@main" in ok.stdout and HUB_TOKEN not in ok.stdout + ok.stderr
        assert_mirrored(hub, s3_client, bucket)


@pytest.mark.slow
def test_sigterm_stops_mid_read_keeping_the_uploads_for_the_next_run(  # type: ignore[no-untyped-def]
    s3_client, bucket, s3_env, tmp_path, test_ca
):
    src = tmp_path / "big"
    make_model_dir(src, seed=10, shard_sizes=(20 * MiB,))
    with HubServer(test_ca) as hub:
        hub.add_commit(REPO, src)
        hub.faults.throttle(1 * MiB, port="cdn")  # ~5 s a part
        env = {**s3_env, "HF_ENDPOINT": hub.endpoint}
        args = [sys.executable, "-m", "prefetch.cli", "mirror", f"hf://{REPO}",
                f"s3://{bucket}/{PREFIX}", "--json", "--part-size", "5MiB",
                "--concurrency", "2"]  # fmt: skip
        proc = subprocess.Popen(args, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and uploaded_bytes(s3_client, bucket) == 0:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=3)  # mid-read: not once the parts in flight end
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert proc.returncode == 1, err
        assert json.loads(out)["error_reason"] == "cancelled", out
        assert uploaded_bytes(s3_client, bucket) > 0  # kept for the next run
        assert not keys(s3_client, bucket, f"{PREFIX}snapshots/")
        hub.faults.clear()
        again = subprocess.run(args, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=120)  # fmt: skip
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["bytes_reused"] > 0
        assert_mirrored(hub, s3_client, bucket)


# -- how part bodies are sent --------------------------------------------------------------------


def signed_payload_of_a_part(client: Any) -> str:
    """The X-Amz-Content-SHA256 an UploadPart through ``client`` would carry (answered locally
    before anything is sent)."""
    seen: list[str] = []

    class EmptyBody:
        def stream(self, *_: Any, **__: Any) -> Iterator[bytes]:
            return iter([b""])

    def answer(request: Any, **_: Any) -> Any:
        from botocore.awsrequest import AWSResponse

        seen.append(request.headers["X-Amz-Content-SHA256"].decode())
        return AWSResponse(request.url, 200, {"ETag": '"e"'}, EmptyBody())

    client.meta.events.register("before-send.s3.UploadPart", answer)
    body = memoryview(b"part bytes " * 1000)
    S3Prefix(client, "bucket", "p/").upload_part("k", "u", 1, body, crt.crc64nvme(body))
    return seen[0]


def test_the_mirror_sends_parts_unsigned_over_https_where_their_crc64nvme_covers_them(  # type: ignore[no-untyped-def]
    monkeypatch,
):
    from prefetch.publish.s3_mirror.upload import make_writer_client
    from prefetch.sources.s3.factory import make_s3_client

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    keys = {"access_key": "a", "secret_key": "b", "region": "us-east-1"}
    https = make_writer_client(make_s3_client, "https://127.0.0.1:9", **keys)
    assert signed_payload_of_a_part(https) == "UNSIGNED-PAYLOAD"
    http = make_writer_client(make_s3_client, "http://127.0.0.1:9", **keys)
    assert len(signed_payload_of_a_part(http)) == 64  # the body's SHA256: signed, as botocore does
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # an endpoint we were not given
    from_config = make_writer_client(make_s3_client, None, **keys)
    assert len(signed_payload_of_a_part(from_config)) == 64


def test_a_part_body_hands_out_the_pooled_buffer_itself_not_copies() -> None:
    from prefetch.publish.s3_mirror.upload import _ViewBody

    buffer = bytearray(b"0123456789")
    body = _ViewBody(memoryview(buffer)[2:])
    first = body.read(3)
    assert isinstance(first, memoryview) and first.obj is buffer and bytes(first) == b"234"
    into = bytearray(4)
    assert body.readinto(into) == 4 and into == b"5678"
    assert bytes(body.read()) == b"9" and len(body.read(5)) == 0
    body.seek(0)
    assert bytes(body.read()) == b"23456789"  # a retry sends the part again from its start


def test_an_unsigned_mirror_stores_byte_identical_blobs_with_their_crc64nvme(  # type: ignore[no-untyped-def]
    hub, s3_server, bucket
):
    client = s3_server.client(sign_payloads=False)
    result = hub_mirror(hub, client, bucket)
    assert result.bytes_uploaded == result.bytes_total > 0
    assert_mirrored(hub, client, bucket)
