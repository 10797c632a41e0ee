"""Hostile review, issue 22: the mirror writer never mixes two repos in one prefix."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefetch.sources.s3_mirror.format import ref_key

from .fakes.hubserver import HubServer, make_model_dir
from .support import run_cli
from .tls import TestCA

FIRST, SECOND = "acme/first", "acme/second"
PREFIX = "shared/"


@pytest.fixture
def hub(tmp_path_factory: pytest.TempPathFactory, test_ca: TestCA) -> Iterator[HubServer]:
    with HubServer(test_ca) as server:
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


# -- a mirror's metadata, tampered with ------------------------------------------------------------


def mirrored(hub: HubServer, s3_client: Any, bucket: str, env: dict[str, str]) -> dict[str, Any]:
    """Mirror FIRST into PREFIX; its commit and metadata."""
    assert run_cli("mirror", f"hf://{FIRST}", f"s3://{bucket}/{PREFIX}", env=env).returncode == 0
    commit = s3_client.get_object(Bucket=bucket, Key=ref_key(PREFIX, "main"))["Body"].read()
    key = f"{PREFIX}snapshots/{commit.decode()}.json"
    meta = json.loads(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    return {"commit": commit.decode(), "key": key, "meta": meta}


def tamper(case: str, s3_client: Any, bucket: str, m: dict[str, Any]) -> None:
    meta, put = m["meta"], s3_client.put_object
    big = max(meta["files"], key=lambda f: f["size"])
    if case == "ref-to-missing-commit":
        put(Bucket=bucket, Key=ref_key(PREFIX, "main"), Body=b"d" * 40)
    elif case == "ref-not-a-sha":
        put(Bucket=bucket, Key=ref_key(PREFIX, "main"), Body=b"main\n")
    elif case == "foreign-commit":  # the object of one commit describes another
        meta["commit"] = "e" * 40
        put(Bucket=bucket, Key=m["key"], Body=json.dumps(meta).encode())
    elif case == "lying-size":
        big["size"] += 1
        put(Bucket=bucket, Key=m["key"], Body=json.dumps(meta).encode())
    elif case == "lying-id":  # another blob's bytes under this id
        other = min(meta["files"], key=lambda f: f["size"])
        body = s3_client.get_object(Bucket=bucket, Key=f"{PREFIX}blobs/{other['id']}")["Body"]
        put(Bucket=bucket, Key=f"{PREFIX}blobs/{big['id']}", Body=body.read())
    elif case == "duplicate-path":
        meta["files"].append(dict(meta["files"][0]))
        put(Bucket=bucket, Key=m["key"], Body=json.dumps(meta).encode())
    elif case == "unsafe-path":
        meta["files"][0]["path"] = "../../etc/evil"
        put(Bucket=bucket, Key=m["key"], Body=json.dumps(meta).encode())
    elif case == "short-id":
        meta["files"][0]["id"] = meta["files"][0]["id"][:12]
        put(Bucket=bucket, Key=m["key"], Body=json.dumps(meta).encode())
    elif case == "wrong-id-kind":
        f = meta["files"][0]
        f["id_kind"] = "sha256" if f["id_kind"] == "git-sha1" else "git-sha1"
        put(Bucket=bucket, Key=m["key"], Body=json.dumps(meta).encode())
    else:
        raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("ref-to-missing-commit", "has no commit dddddddddddd"),
        ("ref-not-a-sha", "does not hold a 40-hex commit sha"),
        ("foreign-commit", "describes commit eeeeeeeeeeee"),
        ("lying-size", "bytes"),
        ("lying-id", ""),
        ("duplicate-path", "twice"),
        ("unsafe-path", "unsafe path"),
        ("short-id", "is not a"),
        ("wrong-id-kind", "is not a"),
    ],
)
def test_a_tampered_mirror_is_one_clear_error_and_nothing_is_published(
    hub: HubServer,
    s3_client: Any,
    bucket: str,
    s3_env: dict[str, str],
    tmp_path: Path,
    case: str,
    words: str,
) -> None:
    env = {**s3_env, "HF_ENDPOINT": hub.endpoint}
    m = mirrored(hub, s3_client, bucket, env)
    tamper(case, s3_client, bucket, m)
    home = tmp_path / "hf-home"
    proc = run_cli("pull", f"s3://{bucket}/{PREFIX}", str(home), "--attempts", "1", env=env)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("Error: ")]
    assert len(errors) == 1 and words in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    published = [p for p in home.rglob("*") if p.is_file() and "snapshots" in p.parts]
    assert published == []
    assert not (tmp_path / "etc").exists()
