"""Pushing to a registry: a Hub commit as a ModelPack artifact, and an oci:// -> oci:// copy by
digest; both read back by the OCI source (and the push's manifest checked as ModelPack)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.layout.hf import HfCacheLayout
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import sync
from prefetch.publish.oci_push import layer_media_type, mirror_to_oci
from prefetch.sources import open_source
from prefetch.sources.hf.source import HubOptions, open_hub_source
from prefetch.sources.oci.source import open_oci_source
from prefetch.support.errors import ChecksumMismatchError

from .fakes.hubserver import HubServer, make_model_repo
from .tls import TestCA

RETRY = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.1)
CONFIG = TransferConfig(concurrency=4, chunk_size=1 << 20, buffer_size=64 * 1024, retry=RETRY)


@pytest.fixture
def hub(tmp_path: Path, test_ca: TestCA) -> Iterator[tuple[HubServer, str]]:
    with HubServer(test_ca) as server:
        sha = make_model_repo(server, "acme/tiny", tmp_path / "src", seed=7)
        yield server, sha


def hub_source(server: HubServer):  # type: ignore[no-untyped-def]
    spec = ModelSpec(source=parse_source_uri("hf://acme/tiny"))
    pool = urllib3.PoolManager(maxsize=8, retries=False)
    source = open_hub_source(spec, HubOptions(endpoint=server.endpoint, token=False, http=pool))
    return spec, source


def test_a_hub_commit_is_pushed_as_modelpack_and_pulled_back(registry, hub, tmp_path):
    server, sha = hub
    spec, source = hub_source(server)
    snapshot = source.resolve(spec)
    http = urllib3.PoolManager(maxsize=8, retries=False)
    dst = f"oci://{registry.host}/mirror/tiny:main"
    result = mirror_to_oci(source, snapshot, dst, http=http, retry=RETRY, concurrency=4)
    assert result.commit == sha and result.blobs_uploaded == len(snapshot.files) + 1
    # the manifest is a ModelPack artifact with every file annotated
    digest = result.ref.split("@", 1)[1]
    body = http.request(
        "GET", f"{registry.url}/v2/mirror/tiny/manifests/{digest}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    ).data  # fmt: skip
    doc = json.loads(body)
    assert doc["artifactType"] == "application/vnd.cncf.model.manifest.v1+json"
    assert doc["config"]["mediaType"] == "application/vnd.cncf.model.config.v1+json"
    paths = sorted(layer["annotations"]["org.cncf.model.filepath"] for layer in doc["layers"])
    assert paths == sorted(f.path for f in snapshot.files)
    # pulled back, HF layout: the same bytes as the Hub's
    pulled = ModelSpec(source=parse_source_uri(f"oci://{registry.host}/mirror/tiny:main"),
                       hf_repo="acme/tiny")  # fmt: skip
    home = tmp_path / "home"
    sync(pulled, open_source(pulled), HfCacheLayout(home, "acme/tiny"), CONFIG)
    snap = home / "hub/models--acme--tiny/snapshots" / digest.split(":", 1)[1]
    for f in snapshot.files:
        assert (snap / f.path).read_bytes() == server.file("acme/tiny", f.path).read()
    # again: every blob is there already
    again = mirror_to_oci(source, snapshot, dst, http=http, retry=RETRY, concurrency=4)
    assert again.ref == result.ref
    lfs = [f for f in snapshot.files if f.checksum and f.checksum.algorithm == "sha256"]
    assert again.blobs_skipped >= len(lfs) + 1


def test_bytes_that_do_not_match_the_hub_id_are_never_committed(registry, hub):
    server, _ = hub
    spec, source = hub_source(server)
    snapshot = source.resolve(spec)
    shard = next(f for f in snapshot.files if f.path.endswith(".safetensors"))
    server.faults.corrupt(server.file("acme/tiny", shard.path), offset=10, count=None)
    http = urllib3.PoolManager(maxsize=8, retries=False)
    with pytest.raises(ChecksumMismatchError):
        mirror_to_oci(source, snapshot, f"oci://{registry.host}/mirror/bad:main", http=http,
                      retry=RETRY, concurrency=2)  # fmt: skip
    head = http.request("HEAD", f"{registry.url}/v2/mirror/bad/blobs/sha256:{shard.checksum.value}")
    assert head.status == 404
    assert http.request("HEAD", f"{registry.url}/v2/mirror/bad/manifests/main").status == 404


def test_an_oci_artifact_is_copied_by_digest(registry, hub, tmp_path):
    server, _ = hub
    spec, source = hub_source(server)
    http = urllib3.PoolManager(maxsize=8, retries=False)
    first = mirror_to_oci(source, source.resolve(spec), f"oci://{registry.host}/a/tiny:v1",
                          http=http, retry=RETRY, concurrency=4)  # fmt: skip
    digest = first.ref.split("@", 1)[1]
    src = ModelSpec(source=parse_source_uri(f"oci://{registry.host}/a/tiny:v1"))
    copy = mirror_to_oci(open_oci_source(src, http=http), None, f"oci://{registry.host}/b/tiny:v2",
                         http=http, retry=RETRY, concurrency=4)  # fmt: skip
    assert copy.ref == f"v2@{digest}"  # the same manifest bytes, so the same digest
    pulled = ModelSpec(source=parse_source_uri(f"oci://{registry.host}/b/tiny@{digest}"))
    result = sync(pulled, open_source(pulled), PlainLayout(tmp_path / "d"), CONFIG)
    assert result.files_verified == result.files


def test_layer_media_types_by_file_name():
    assert layer_media_type("model-00001-of-00002.safetensors").endswith("weight.v1.raw")
    assert layer_media_type("config.json").endswith("weight.config.v1.raw")
    assert layer_media_type("README.md").endswith("doc.v1.raw")
    assert layer_media_type("LICENSE").endswith("doc.v1.raw")
    assert layer_media_type("modeling_x.py").endswith("code.v1.raw")


def test_prefetch_mirror_from_the_hub_to_a_registry_then_pull(registry, hub, tmp_path):
    server, sha = hub
    env = {**os.environ, "HF_ENDPOINT": server.endpoint, "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_TOKEN", None)
    dst = f"oci://{registry.host}/cli/tiny:main"
    run = subprocess.run(
        [sys.executable, "-m", "prefetch.cli", "mirror", "hf://acme/tiny", dst, "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["commit"] == sha and summary["ref"].startswith("main@sha256:")
    home = tmp_path / "home"
    pull = subprocess.run(
        [sys.executable, "-m", "prefetch.cli", "pull", dst, str(home), "--hf-repo", "acme/tiny",
         "--json"], capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert pull.returncode == 0, pull.stderr
    snap = Path(json.loads(pull.stdout)["path"])
    for path, f in server.files("acme/tiny").items():
        assert (snap / path).read_bytes() == f.read()
    bad = subprocess.run(
        [sys.executable, "-m", "prefetch.cli", "mirror", "s3://bucket/p/", dst],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and bad.stderr.startswith("Error: "), bad.stderr
    assert "hf:// or oci://" in bad.stderr
