"""Pulling a Hub model through its S3 mirror (prefetch/sources/s3_mirror/source.py, ordered.py): the
cache is the one a Hub pull makes, huggingface_hub loads it offline, and the fallback rule (a mirror
lacking the commit or unreachable: the next source; wrong bytes or another repo: a failure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import urllib3

from prefetch.pipeline.layout.hf import HfCacheLayout
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import SyncResult, sync
from prefetch.sources import SourceSettings, open_source
from prefetch.sources.base import DescribesWhole
from prefetch.sources.hf.source import HubOptions
from prefetch.sources.s3.describe import SMALL_OBJECT
from prefetch.sources.s3.factory import make_s3_client
from prefetch.sources.s3_mirror.format import blob_key
from prefetch.support.errors import (
    ChecksumMismatchError,
    ConfigError,
    RevisionNotFoundError,
)

from .fakes.hubserver import HubServer
from .support import (
    FAST,
    HUB_REPO,
    clean_env,
    free_port,
    put,
    run_cli,
    server_files,
    write_mirror,
)

REPO = HUB_REPO


def pull(
    hub: HubServer,
    client: Any,
    dest: Path,
    *,
    mirrors: tuple[str, ...] = (),
    revision: str | None = None,
    hub_fallback: bool = True,
    repo: str = REPO,
) -> SyncResult:
    """An in-process pull of ``hf://repo`` through ``mirrors`` into the HF cache at ``dest``."""
    spec = ModelSpec(
        source=parse_source_uri(f"hf://{repo}"),
        revision=revision,
        mirrors=tuple(parse_source_uri(m) for m in mirrors),
        hub_fallback=hub_fallback,
    )
    pool = urllib3.PoolManager(maxsize=16, retries=False)
    options = HubOptions(endpoint=hub.endpoint, token=False, http=pool, retry=FAST.retry)
    try:
        source = open_source(spec, SourceSettings(s3_client=client, hub=options))
        return sync(spec, source, HfCacheLayout(dest, repo), FAST)
    finally:
        pool.clear()


def cache_tree(home: Path) -> dict[str, str]:
    """Everything under ``home/hub`` (what huggingface_hub reads): each file's bytes' sha1 or
    each symlink's target, by relative path."""
    import hashlib

    out: dict[str, str] = {}
    root = home / "hub"
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha1(p.read_bytes()).hexdigest()
    return out


def file_requests(hub: HubServer) -> list[str]:
    """The Hub requests that fetched file bytes or metadata (any, really: a mirror pull makes
    none)."""
    return [r.url_path for r in hub.requests]


def offline_load(hub_cache: Path, body: str, **params: Any) -> Any:
    """Run ``body`` with huggingface_hub in a fresh interpreter, HF_HUB_OFFLINE=1 and
    HF_HUB_CACHE=hub_cache (HF_HOME elsewhere, empty); the body fills ``out``."""
    script = "import json, sys\nimport huggingface_hub as hf\nparams = json.loads(sys.argv[1])\n"
    script += "out = {}\n" + body + "\nprint(json.dumps(out))\n"
    home = hub_cache.parent / "empty-hf-home"
    home.mkdir(exist_ok=True)
    env = clean_env(home, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_cache))
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(params)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=home,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the cache a mirror pull makes -----------------------------------------------------------------


@pytest.mark.parametrize("by", ["branch", "commit"])
def test_a_mirror_pull_publishes_exactly_what_a_hub_pull_publishes(
    hub: HubServer, s3_client: Any, bucket: str, tmp_path: Path, by: str
) -> None:
    sha = write_mirror(s3_client, bucket, "hf/acme/tiny/", hub)
    revision = "main" if by == "branch" else sha
    from_hub = pull(hub, s3_client, tmp_path / "hub-pulled", revision=revision)
    hub.clear_requests()
    mirror = f"s3://{bucket}/hf/acme/tiny/"
    from_mirror = pull(hub, s3_client, tmp_path / "mirror-pulled", mirrors=(mirror,),
                       revision=revision)  # fmt: skip
    assert file_requests(hub) == []  # not a single request to the Hub
    assert from_mirror.served_by == mirror and from_hub.served_by.startswith("hf://")
    assert from_mirror.revision == from_hub.revision == sha
    tree = cache_tree(tmp_path / "mirror-pulled")
    assert tree == cache_tree(tmp_path / "hub-pulled")
    refs = [p for p in tree if "/refs/" in p]
    assert refs == (["models--acme--tiny/refs/main"] if by == "branch" else [])
    # every file was checked against both recorded checksums: the Hub id and the CRC64NVME
    assert from_mirror.files_verified == len(server_files(hub))
    records = HfCacheLayout(tmp_path / "mirror-pulled", REPO).recorded()
    assert {r.path: sorted(c.algorithm for c in r.checksums) for r in records} == {
        path: sorted(["crc64nvme", "sha256" if f.sha256 else "git-sha1"])
        for path, f in hub.files(REPO).items()
    }


def test_huggingface_hub_loads_a_mirror_pulled_cache_offline_by_repo_branch_and_commit(
    hub: HubServer, s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    sha = write_mirror(s3_client, bucket, "m/", hub)
    pull(hub, s3_client, tmp_path / "home", mirrors=(f"s3://{bucket}/m/",))
    out = offline_load(
        tmp_path / "home" / "hub",
        """
from pathlib import Path
def tree(path):
    return {str(p.relative_to(path)): p.read_bytes().hex() for p in sorted(Path(path).rglob("*"))
            if p.is_file()}
out["by_repo"] = hf.snapshot_download(params["repo"], local_files_only=True)
out["by_branch"] = hf.snapshot_download(params["repo"], revision="main", local_files_only=True)
out["by_commit"] = hf.snapshot_download(params["repo"], revision=params["sha"],
                                        local_files_only=True)
out["config"] = Path(hf.hf_hub_download(params["repo"], "config.json", revision=params["sha"],
                                        local_files_only=True)).read_bytes().hex()
out["tree"] = tree(out["by_commit"])
out["warnings"] = [str(w) for w in hf.scan_cache_dir().warnings]
""",
        repo=REPO,
        sha=sha,
    )
    assert out["by_repo"] == out["by_branch"] == out["by_commit"]
    assert out["by_commit"].endswith(f"models--acme--tiny/snapshots/{sha}")
    expected = server_files(hub)
    assert out["tree"] == {p: data.hex() for p, data in expected.items()}
    assert out["config"] == expected["config.json"].hex()
    assert out["warnings"] == []


# -- what a mirror must never do: serve other bytes, another repo ---------------------------------


@pytest.mark.parametrize("victim", ["config.json", "model-00001-of-00002.safetensors"])
def test_a_mirror_object_altered_after_mirroring_fails_the_pull_without_falling_back(
    hub: HubServer, s3_client: Any, bucket: str, tmp_path: Path, victim: str
) -> None:
    write_mirror(s3_client, bucket, "m/", hub)
    original = hub.file(REPO, victim)
    assert victim in server_files(hub), sorted(server_files(hub))
    data = bytearray(original.read())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    put(s3_client, bucket, blob_key("m/", original.etag), bytes(data))
    hub.clear_requests()
    with pytest.raises(ChecksumMismatchError):
        pull(hub, s3_client, tmp_path / "home", mirrors=(f"s3://{bucket}/m/",))
    assert file_requests(hub) == []  # no silent fallback to the Hub
    repo = tmp_path / "home" / "hub" / "models--acme--tiny"
    assert not (repo / "refs").exists()
    assert list((repo / "snapshots").iterdir()) == []
    assert not any(p.name == original.etag for p in (repo / "blobs").iterdir())


def test_a_mirror_of_another_repo_is_refused_naming_both(
    hub: HubServer, s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    write_mirror(s3_client, bucket, "m/", hub, repo_id="other/model")
    hub.clear_requests()
    with pytest.raises(ConfigError) as e:
        pull(hub, s3_client, tmp_path / "home", mirrors=(f"s3://{bucket}/m/",))
    assert "other/model" in str(e.value) and REPO in str(e.value)
    assert file_requests(hub) == []


# -- the fallback rule ----------------------------------------------------------------------------


def test_a_mirror_without_the_commit_falls_back_to_the_hub(
    hub: HubServer, s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    result = pull(hub, s3_client, tmp_path / "home", mirrors=(f"s3://{bucket}/empty/",))
    assert result.served_by == f"hf://{REPO}"
    assert cache_tree(tmp_path / "home")  # published


def test_without_the_hub_fallback_a_mirror_lacking_the_commit_fails_as_not_found(
    hub: HubServer, s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    mirror = f"s3://{bucket}/empty/"
    with pytest.raises(RevisionNotFoundError, match="has no ref 'main'"):
        pull(hub, s3_client, tmp_path / "home", mirrors=(mirror,), hub_fallback=False)
    assert file_requests(hub) == []


def test_an_unreachable_mirror_falls_back_to_the_next_source(
    hub: HubServer, s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    dead = make_s3_client(
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        access_key="k",
        secret_key="s",
        connect_timeout=1,
        read_timeout=1,
    )
    result = pull(hub, dead, tmp_path / "home", mirrors=(f"s3://{bucket}/m/",))
    assert result.served_by == f"hf://{REPO}"


def test_a_pinned_commit_is_pulled_from_the_first_mirror_that_has_it(
    hub: HubServer, s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    old = write_mirror(s3_client, bucket, "both/", hub)
    write_mirror(s3_client, bucket, "second/", hub)
    new = hub.add_commit(REPO, {"config.json": b'{"v": 2}'}, inherit=True)
    write_mirror(s3_client, bucket, "second/", hub)
    hub.clear_requests()
    mirrors = (f"s3://{bucket}/both/", f"s3://{bucket}/second/")
    first = pull(hub, s3_client, tmp_path / "a", mirrors=mirrors, revision=old)
    assert first.served_by == mirrors[0]
    second = pull(hub, s3_client, tmp_path / "b", mirrors=mirrors, revision=new)
    assert second.served_by == mirrors[1] and second.revision == new
    assert file_requests(hub) == []


# -- the command line -----------------------------------------------------------------------------


def test_pull_with_mirror_says_which_source_served_in_json(
    hub: HubServer, s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    sha = write_mirror(s3_client, bucket, "m/", hub)
    env = {**s3_env, "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}
    mirror = f"s3://{bucket}/m/"
    proc = run_cli("pull", f"hf://{REPO}", str(tmp_path / "home"), "--mirror", mirror,
                   "--json", env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["served_by"] == mirror and summary["revision"] == sha
    proc = run_cli("pull", f"hf://{REPO}", str(tmp_path / "home2"), "--mirror",
                   f"s3://{bucket}/empty/", "--no-hub-fallback", env=env)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.startswith("Error: ") and "has no ref 'main'" in proc.stderr


def test_pulling_a_mirror_prefix_itself_publishes_the_hub_layout(
    hub: HubServer, s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    sha = write_mirror(s3_client, bucket, "m/", hub)
    proc = run_cli("pull", f"s3://{bucket}/m/", str(tmp_path / "home"), "--json", env=s3_env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["revision"] == sha
    from_hub = pull(hub, s3_client, tmp_path / "hub-pulled")
    assert from_hub.revision == sha
    assert cache_tree(tmp_path / "home") == cache_tree(tmp_path / "hub-pulled")


def test_pulling_a_mirror_prefix_takes_its_only_ref_when_it_has_no_main(
    hub: HubServer, s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    sha = write_mirror(s3_client, bucket, "m/", hub, refs=("v1.0",))
    proc = run_cli("pull", f"s3://{bucket}/m/", str(tmp_path / "home"), env=s3_env)
    assert proc.returncode == 0, proc.stderr
    refs = tmp_path / "home" / "hub" / "models--acme--tiny" / "refs"
    assert [p.name for p in refs.iterdir()] == ["v1.0"]
    assert (refs / "v1.0").read_text() == sha


# -- the spec's rules -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["s3://bkt/p/", "--mirror", "s3://mirrors/p/"], "--mirror: only for hf:// models"),
        (["hf://acme/tiny", "--mirror", "hf://acme/other"], "is not an s3:// URI"),
        (
            ["hf://acme/tiny", "--mirror", "s3://mirrors/p/", "--mirror", "s3://mirrors/p"],
            "listed twice",
        ),
        (["hf://acme/tiny", "--no-hub-fallback"], "--no-hub-fallback: turning the Hub fallback"),
    ],
)
def test_mirror_flags_that_make_no_sense_are_refused_naming_the_flags(
    args: list[str], words: str, tmp_path: Path
) -> None:
    proc = run_cli("pull", args[0], str(tmp_path / "d"), *args[1:],
                   env=clean_env(tmp_path / "home"))  # fmt: skip
    assert proc.returncode == 1
    assert words in proc.stderr, proc.stderr


# -- end to end, with the writer ------------------------------------------------------------------


@pytest.mark.slow
def test_prefetch_mirror_then_a_pull_through_the_mirror_makes_the_hub_pulls_cache(
    hub: HubServer, s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**s3_env, "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}
    mirror = f"s3://{bucket}/hf/acme/tiny/"
    proc = run_cli("mirror", f"hf://{REPO}@main", mirror, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    sha = json.loads(proc.stdout)["commit"]
    hub.clear_requests()
    proc = run_cli("pull", f"hf://{REPO}", str(tmp_path / "home"), "--mirror", mirror,
                   "--no-hub-fallback", "--json", env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["served_by"] == mirror
    assert file_requests(hub) == []
    from_hub = pull(hub, s3_client, tmp_path / "hub-pulled")
    assert from_hub.revision == sha
    assert cache_tree(tmp_path / "home") == cache_tree(tmp_path / "hub-pulled")


def test_a_copy_of_a_hugging_face_cache_folder_is_not_taken_for_a_mirror(
    s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    sha = "1" * 40
    put(s3_client, bucket, "raw/refs/main", sha.encode())
    put(s3_client, bucket, f"raw/snapshots/{sha}/config.json", b"{}")
    proc = run_cli("pull", f"s3://{bucket}/raw/", str(tmp_path / "d"), env=s3_env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "d" / "snapshots" / sha / "config.json").read_bytes() == b"{}"


def test_when_no_source_has_the_revision_the_error_names_why_each_could_not(
    hub: HubServer, s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    mirror = f"s3://{bucket}/empty/"
    with pytest.raises(RevisionNotFoundError) as e:
        pull(hub, s3_client, tmp_path / "home", mirrors=(mirror,), revision="no-such-branch")
    assert f"{mirror}: {mirror} has no ref 'no-such-branch'" in str(e.value)
    assert f"; hf://{REPO}" in str(e.value)


def test_a_mirror_describes_a_small_blob_with_its_bytes_and_checks_it_as_ever(
    hub: HubServer, s3_client: Any, bucket: str
) -> None:
    """The engine's whole-object path reaches the mirror's blobs (one GET for a small one, its
    bytes handed over), and the mirror's check of the blob's CRC64NVME still runs first."""
    write_mirror(s3_client, bucket, "m/", hub)
    spec = ModelSpec(
        source=parse_source_uri(f"hf://{REPO}"),
        mirrors=(parse_source_uri(f"s3://{bucket}/m/"),),
        hub_fallback=False,
    )
    pool = urllib3.PoolManager(maxsize=4, retries=False)
    options = HubOptions(endpoint=hub.endpoint, token=False, http=pool, retry=FAST.retry)
    source = open_source(spec, SourceSettings(s3_client=s3_client, hub=options))
    assert isinstance(source, DescribesWhole)
    files = {f.path: f for f in source.resolve(spec).files}
    described, body = source.describe_whole(files["config.json"])
    assert described.described and body == hub.file(REPO, "config.json").read()
    large = max(files.values(), key=lambda f: f.size)
    assert large.size > SMALL_OBJECT and source.describe_whole(large)[1] is None
    original = hub.file(REPO, "config.json")
    altered = b"x" * len(original.read())
    put(s3_client, bucket, blob_key("m/", original.etag), altered, ChecksumAlgorithm="CRC64NVME")
    with pytest.raises(ChecksumMismatchError, match="crc64nvme"):
        source.describe_whole(files["config.json"])
    pool.clear()
