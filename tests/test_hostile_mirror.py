"""Hostile review, issue 22: the mirror writer never mixes two repos in one prefix."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefetch.mirror_format import ref_key

from .fakes.hubserver import HubServer, make_model_dir
from .support import run_cli

FIRST, SECOND = "acme/first", "acme/second"
PREFIX = "shared/"


@pytest.fixture
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    with HubServer() as server:
        for seed, repo in enumerate((FIRST, SECOND), 1):
            root = tmp_path_factory.mktemp(f"model-{seed}")
            make_model_dir(root, seed=seed, shard_sizes=(64 * 1024,))
            server.add_commit(repo, root)
        yield server


def keys(client: Any, bucket: str) -> set[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def test_mirror_refuses_a_prefix_holding_another_repos_mirror(
    hub: HubServer, s3_client: Any, bucket: str, s3_env: dict[str, str]
) -> None:
    env = {**s3_env, "HF_ENDPOINT": hub.endpoint}
    dest = f"s3://{bucket}/{PREFIX}"
    assert run_cli("mirror", f"hf://{FIRST}", dest, env=env).returncode == 0
    before = keys(s3_client, bucket)
    main = s3_client.get_object(Bucket=bucket, Key=ref_key(PREFIX, "main"))["Body"].read()

    proc = run_cli("mirror", f"hf://{SECOND}", dest, env=env)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("Error: "), proc.stderr
    assert FIRST in lines[0] and SECOND in lines[0] and dest in lines[0]
    assert "Traceback" not in proc.stderr
    assert keys(s3_client, bucket) == before  # nothing written: no blob, commit or ref
    again = s3_client.get_object(Bucket=bucket, Key=ref_key(PREFIX, "main"))["Body"].read()
    assert again == main


def test_mirroring_the_same_repo_again_into_its_prefix_still_works(
    hub: HubServer, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**s3_env, "HF_ENDPOINT": hub.endpoint}
    dest = f"s3://{bucket}/{PREFIX}"
    assert run_cli("mirror", f"hf://{FIRST}", dest, env=env).returncode == 0
    proc = run_cli("mirror", f"hf://{FIRST}", dest, env=env)
    assert proc.returncode == 0, proc.stderr
