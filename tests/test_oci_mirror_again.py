"""Issue 29 item 12: ``prefetch mirror hf:// oci://`` run again uploads nothing already there,
the small git-tracked (non-LFS) files included (they were uploaded again: 3 of 5 blobs).
A real docker-registry: what it answers to a HEAD of a blob it holds is the point."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.publish.oci_push import mirror_to_oci
from prefetch.sources.hf.source import HubOptions, open_hub_source

from .fakes.hubserver import HubServer, make_model_repo
from .fakes.registry import Registry

RETRY = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.1)


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubServer]:
    with HubServer() as server:
        make_model_repo(server, "acme/tiny", tmp_path / "src", seed=11)
        yield server


def test_mirroring_a_hub_commit_again_uploads_nothing(registry: Registry, hub: HubServer) -> None:
    spec = ModelSpec(source=parse_source_uri("hf://acme/tiny"))
    pool = urllib3.PoolManager(maxsize=8, retries=False)
    source = open_hub_source(spec, HubOptions(endpoint=hub.endpoint, token=False, http=pool))
    snapshot = source.resolve(spec)
    git_tracked = [
        f for f in snapshot.files if not (f.checksum and f.checksum.algorithm == "sha256")
    ]
    assert git_tracked  # the case at hand: files the Hub knows by their git blob id only
    http = urllib3.PoolManager(maxsize=8, retries=False)
    dst = f"oci://{registry.host}/mirror/again:main"
    first = mirror_to_oci(source, snapshot, dst, http=http, retry=RETRY, concurrency=4)
    assert first.blobs_uploaded == len(snapshot.files) + 1
    again = mirror_to_oci(source, snapshot, dst, http=http, retry=RETRY, concurrency=4)
    assert again.ref == first.ref
    assert (again.blobs_uploaded, again.bytes_uploaded) == (0, 0)
    assert again.blobs_skipped == len(snapshot.files) + 1
