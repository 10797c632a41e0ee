"""The Hub sync path end to end against tests/fakes/hubserver.py (hub and CDN ports on
127.0.0.1), the result checked by huggingface_hub itself in a subprocess (it reads its environment
at import), plus the Hub source's HTTP checks against canned responses."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3

from prefetch.cli.pull import pull_spec
from prefetch.demo.modelgen import generate_model, tree_bytes, upload_model
from prefetch.pipeline.engine.plan import staged_name
from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout.hf import HfCacheLayout
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.snapshot import Checksum, RemoteFile
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import SyncResult, sync
from prefetch.pipeline.verify_at_rest import verify_local
from prefetch.sources.hf.source import HubOptions, HubSource, open_hub_source
from prefetch.sources.http.transport import parse_retry_after
from prefetch.support.errors import (
    AccessDeniedError,
    ChecksumMismatchError,
    ConfigError,
    NoMatchingFilesError,
    NotFoundError,
    RepoNotFoundError,
    RevisionNotFoundError,
    SourceChangedError,
    SourceError,
    TransientSourceError,
)

from .fakes.hubserver import HubServer, make_model_dir, write_random_file
from .support import (
    FAST,
    HUB_REPO,
    HUB_SHARDS,
    HUB_TOKEN,
    clean_env,
    hf_check,
    journaled_bytes,
    kill_9_when,
    run_cli,
    server_files,
)
from .tls import TestCA

MiB = 1024 * 1024
REPO = HUB_REPO
SHARDS = HUB_SHARDS
TOKEN = HUB_TOKEN

# -- fixtures and helpers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_extra_files() -> dict[str, bytes]:
    """An empty file too: the Hub serves it and the layouts must keep it."""
    return {"empty.txt": b""}


@pytest.fixture
def hub(model_dir: Path, test_ca: TestCA) -> Iterator[HubServer]:
    with HubServer(test_ca, tree_page_size=4) as server:
        server.add_commit(REPO, model_dir)
        yield server
        assert server.errors == []


def pull(
    hub: HubServer,
    dest: Path,
    uri: str = f"hf://{REPO}",
    *,
    config: TransferConfig = FAST,
    token: str | None = None,
    delete: bool = False,
    superseded_grace: float = 0.0,
    **spec_kwargs: Any,
) -> SyncResult:
    spec = ModelSpec(source=parse_source_uri(uri), **spec_kwargs)
    pool = urllib3.PoolManager(maxsize=16, retries=False)
    options = HubOptions(endpoint=hub.endpoint, token=token or False, http=pool, retry=config.retry)
    assert spec.repo_id is not None
    layout = HfCacheLayout(dest, spec.repo_id)
    try:
        source = open_hub_source(spec, options)
        return sync(spec, source, layout, config, delete=delete, superseded_grace=superseded_grace)
    finally:
        pool.clear()


def snapshot_tree(snapshot: Path) -> dict[str, bytes]:
    """Files under a snapshot folder (symlinks followed), by relative path."""
    return {
        p.relative_to(snapshot).as_posix(): p.read_bytes()
        for p in sorted(snapshot.rglob("*"))
        if p.is_file()
    }


def on_disk(hub: HubServer, repo: str, home: Path) -> int:
    """Bytes of ``repo`` safely on disk: published blobs plus journaled chunks, never counting a
    file twice (a blob is renamed in just before its journal is removed)."""
    partial = home / ".prefetch/hub" / ("models--" + repo.replace("/", "--")) / "partial"
    done = 0
    for f in hub.files(repo).values():  # blobs first: a journal gone now is gone below too
        journal = (partial / staged_name(RemoteFile(f.path, f.size, version=f.etag))).with_suffix(
            ".journal"
        )
        if (repo_dir(home, repo) / "blobs" / f.etag).exists() and not journal.exists():
            done += f.size
    while True:
        try:
            return done + journaled_bytes(partial)
        except FileNotFoundError:  # a journal removed while it was read
            continue


def repo_dir(home: Path, repo: str = REPO) -> Path:
    return home / "hub" / ("models--" + repo.replace("/", "--"))


# -- the layout, as huggingface_hub reads it --------------------------------------------------


def test_layout_is_what_huggingface_hub_reads_offline(hub: HubServer, tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = pull(hub, home)
    sha = hub.repos[REPO].branches["main"]
    repo = repo_dir(home)
    snapshot = repo / "snapshots" / sha
    assert result.revision == sha and result.path == str(snapshot)
    assert snapshot_tree(snapshot) == server_files(hub)  # byte-identical, nested, empty file
    assert sorted(p.name for p in repo.iterdir()) == ["blobs", "refs", "snapshots"]  # pristine
    assert (repo / "refs/main").read_bytes() == sha.encode()  # no trailing newline
    deep = snapshot / "subdir/nested/deep.json"
    blob = hub.file(REPO, "subdir/nested/deep.json").blob_id
    assert os.readlink(deep) == f"../../../../blobs/{blob}"  # relative, depth-correct
    shard = hub.file(REPO, "model-00001-of-00002.safetensors")
    assert os.readlink(snapshot / shard.path) == f"../../blobs/{shard.sha256}"
    assert result.checksum_algorithms == {"sha256": 2, "git-sha1": 9}
    total = sum(len(b) for b in server_files(hub).values())

    out = hf_check(
        home,
        """
        out["by_branch"] = hf.snapshot_download(params["repo"])
        out["by_sha"] = hf.snapshot_download(params["repo"], revision=params["sha"])
        with open(hf.hf_hub_download(params["repo"], "config.json")) as fh:
            out["config"] = fh.read()
        info = hf.scan_cache_dir()
        out["warnings"] = [str(w) for w in info.warnings]
        out["repos"] = [
            [r.repo_id, r.size_on_disk, r.nb_files, [sorted(v.refs) for v in r.revisions]]
            for r in info.repos
        ]
        """,
        repo=REPO,
        sha=sha,
    )
    assert out["by_branch"] == out["by_sha"] == str(snapshot)
    assert out["config"].encode() == hub.file(REPO, "config.json").read()
    assert out["warnings"] == []
    blob_bytes = sum({f.etag: f.size for f in hub.files(REPO).values()}.values())
    assert blob_bytes == total  # no duplicate content in this repo
    assert out["repos"] == [[REPO, total, len(server_files(hub)), [["main"]]]]

    # huggingface_hub's own checksum verification (it lists the tree from the Hub) agrees
    checked = hf_check(
        home,
        """
        v = hf.HfApi().verify_repo_checksums(params["repo"], revision="main",
                                              cache_dir=params["cache"])
        out.update(checked=v.checked_count, mismatches=v.mismatches, missing=v.missing_paths,
                   extra=v.extra_paths)
        """,
        endpoint=hub.endpoint,
        repo=REPO,
        cache=str(home / "hub"),
    )
    assert checked == {"checked": len(server_files(hub)), "mismatches": [], "missing": [],
                       "extra": []}  # fmt: skip
    assert verify_local(HfCacheLayout(home, REPO)).ok


def test_include_exclude_tag_and_sha_pulls(hub: HubServer, tmp_path: Path) -> None:
    sha = hub.repos[REPO].branches["main"]
    hub.add_tag(REPO, "v1.0")
    home = tmp_path / "home"
    by_tag = pull(hub, home, f"hf://{REPO}@v1.0", include=("*.json",), exclude=("deep.json",))
    snapshot = repo_dir(home) / "snapshots" / sha
    assert sorted(snapshot_tree(snapshot)) == [
        "config.json", "generation_config.json", "model.safetensors.index.json",
        "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    assert by_tag.files == 5
    assert sorted(p.name for p in (repo_dir(home) / "refs").iterdir()) == ["v1.0"]
    assert (repo_dir(home) / "refs/v1.0").read_text() == sha

    other = tmp_path / "other"
    by_sha = pull(hub, other, f"hf://{REPO}", revision=sha, include=("subdir/*",))
    assert sorted(snapshot_tree(repo_dir(other) / "snapshots" / sha)) == [
        "subdir/extra.txt",
        "subdir/nested/deep.json",
    ]
    assert by_sha.revision == sha and not (repo_dir(other) / "refs").exists()  # no ref needed
    revisions = [r.url_path for r in hub.requests if "/revision/" in r.url_path]
    assert revisions == [f"/api/models/{REPO}/revision/v1.0"]  # the sha pull resolved nothing

    out = hf_check(
        home,
        """
        out["tag"] = hf.snapshot_download(params["repo"], revision="v1.0")
        out["sha"] = hf.snapshot_download(params["repo"], revision=params["sha"],
                                          cache_dir=params["other"])
        out["warnings"] = [str(w) for w in hf.scan_cache_dir().warnings]
        """,
        repo=REPO,
        sha=sha,
        other=str(other / "hub"),
    )
    assert out == {"tag": str(snapshot), "sha": str(repo_dir(other) / "snapshots" / sha),
                   "warnings": []}  # fmt: skip
    with pytest.raises(NoMatchingFilesError, match="include/exclude"):
        pull(hub, home, include=("*.gguf",))


def test_second_revision_shares_unchanged_blobs(hub: HubServer, tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = pull(hub, home)
    sha1 = first.revision
    shard = "model-00002-of-00002.safetensors"
    new_shard = tmp_path / "new.safetensors"
    write_random_file(new_shard, SHARDS[1], "second revision", safetensors=True)
    new_config = b'{"architectures": ["LlamaForCausalLM"], "revision": 2}'
    sha2 = hub.add_commit(
        REPO, {shard: new_shard, "config.json": new_config}, inherit=True, delete=["empty.txt"]
    )
    hub.clear_requests()
    second = pull(hub, home)  # no --delete: the old snapshot stays
    assert second.revision == sha2 and second.files_downloaded == 2
    assert second.bytes_downloaded == SHARDS[1] + len(new_config)  # only the changed files
    cdn_paths = {r.url_path for r in hub.requests if r.port == "cdn"}
    assert cdn_paths == {f"/cdn/{hub.file(REPO, shard).sha256}"}
    repo = repo_dir(home)
    assert (repo / "refs/main").read_text() == sha2
    snap1, snap2 = repo / "snapshots" / sha1, repo / "snapshots" / sha2
    assert snapshot_tree(snap1) == server_files(hub, revision=sha1)  # the old one is intact
    assert snapshot_tree(snap2) == server_files(hub, revision=sha2)
    same = "model-00001-of-00002.safetensors"
    assert (snap1 / same).resolve() == (snap2 / same).resolve()  # stored once
    assert len(list((repo / "blobs").iterdir())) == len({
        f.etag for rev in (sha1, sha2) for f in hub.files(REPO, rev).values()
    })  # fmt: skip
    out = hf_check(
        home,
        """
        out["paths"] = [hf.snapshot_download(params["repo"], revision=r) for r in params["revs"]]
        out["main"] = hf.snapshot_download(params["repo"])
        out["warnings"] = [str(w) for w in hf.scan_cache_dir().warnings]
        """,
        repo=REPO,
        revs=[sha1, sha2],
    )
    assert out == {"paths": [str(snap1), str(snap2)], "main": str(snap2), "warnings": []}
    assert pull(hub, home).up_to_date
    report = verify_local(HfCacheLayout(home, REPO))
    assert report.ok and any("@" in p for p in report.checked)  # both snapshots are recorded


def test_delete_prunes_the_snapshot_a_moved_branch_left_behind(
    hub: HubServer, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    sha1 = pull(hub, home).revision
    hub.repos[REPO].tags["v1"] = sha1
    tag = pull(hub, home, revision="v1")  # a tag naming the same commit keeps it
    assert tag.revision == sha1
    sha2 = hub.add_commit(REPO, {"config.json": b'{"revision": 2}'}, inherit=True)
    second = pull(hub, home, delete=True)
    repo = repo_dir(home)
    assert second.deleted == [] and (repo / "snapshots" / sha1).is_dir()  # refs/v1 names it
    (repo / "refs/v1").unlink()  # the tag is gone from this cache: nothing names sha1 any more
    # within the grace period the old snapshot stays (a reader may be opening its files) ...
    assert pull(hub, home, delete=True, superseded_grace=3600).deleted == []
    assert (repo / "snapshots" / sha1).is_dir()
    # ... and at the first sync after it, it goes, with the blobs only it linked
    third = pull(hub, home, delete=True)
    expected = sorted(f"{p}@{sha1[:12]}" for p in server_files(hub, revision=sha1))
    assert sorted(third.deleted) == expected
    assert not (repo / "snapshots" / sha1).exists()
    assert [p.name for p in (repo / "snapshots").iterdir()] == [sha2]
    blobs = {p.name for p in (repo / "blobs").iterdir()}
    assert blobs == {f.etag for f in hub.files(REPO, sha2).values()}
    out = hf_check(
        home,
        """
        out["main"] = hf.snapshot_download(params["repo"])
        out["warnings"] = [str(w) for w in hf.scan_cache_dir().warnings]
        try:
            hf.snapshot_download(params["repo"], revision=params["old"])
            out["old"] = "found"
        except Exception as exc:
            out["old"] = type(exc).__name__
        """,
        repo=REPO,
        old=sha1,
    )
    assert out["main"] == str(repo / "snapshots" / sha2) and out["warnings"] == []
    assert out["old"] != "found"
    assert verify_local(HfCacheLayout(home, REPO)).ok
    assert pull(hub, home, delete=True).up_to_date


def test_delete_removes_links_not_in_the_revision_and_unreferenced_blobs(
    hub: HubServer, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    pull(hub, home)
    result = pull(hub, home, include=("*.json",), delete=True)
    snapshot = Path(result.path)
    assert sorted(snapshot_tree(snapshot)) == sorted(p for p in server_files(hub) if
                                                     p.endswith(".json"))  # fmt: skip
    assert "model-00001-of-00002.safetensors" in result.deleted
    assert not (snapshot / "subdir/extra.txt").exists()
    assert (snapshot / "subdir/nested/deep.json").is_symlink()
    kept = {f.etag for p, f in hub.files(REPO).items() if p.endswith(".json")}
    assert {p.name for p in (repo_dir(home) / "blobs").iterdir()} == kept
    out = hf_check(home, "out['w'] = [str(w) for w in hf.scan_cache_dir().warnings]")
    assert out == {"w": []}
    assert verify_local(HfCacheLayout(home, REPO)).ok


# -- authentication and errors ----------------------------------------------------------------


def test_token_goes_to_the_hub_only_and_bad_tokens_fail_in_one_line(
    model_dir: Path, tmp_path: Path, test_ca: TestCA
) -> None:
    with HubServer(test_ca, token=TOKEN, small_file_redirect=True) as hub:
        hub.add_commit(REPO, model_dir)
        hub.add_repo(REPO, private=True)
        dest = tmp_path / "home"
        env = clean_env(tmp_path / "hf-home", HF_ENDPOINT=hub.endpoint, HF_TOKEN=TOKEN)
        ok = run_cli("pull", f"hf://{REPO}", str(dest), "--json", env=env)
        assert ok.returncode == 0, ok.stderr
        summary = json.loads(ok.stdout)
        assert summary["files"] == summary["files_verified"] == len(server_files(hub))
        hub_requests = [r for r in hub.requests if r.port == "hub"]
        cdn_requests = [r for r in hub.requests if r.port == "cdn"]
        assert cdn_requests and all(r.authorization is None for r in cdn_requests)
        assert all(r.authorization == f"Bearer {TOKEN}" for r in hub_requests)
        assert any("/api/resolve-cache/" in r.url_path for r in hub_requests)  # same-origin hop
        assert snapshot_tree(Path(summary["path"])) == server_files(hub)

        wrong = "hf_WrongTokenValue_c0ffee"
        cases = [
            (dict(env, HF_TOKEN=wrong), [], "rejected the token"),
            (dict(env, HF_TOKEN=TOKEN), ["--token", wrong], "rejected the token"),
            ({k: v for k, v in env.items() if k != "HF_TOKEN"}, [], "without a token"),
        ]
        for case_env, extra, message in cases:
            bad = run_cli("pull", f"hf://{REPO}", str(tmp_path / "d2"), *extra, env=case_env)
            assert bad.returncode == 1
            assert message in bad.stderr, bad.stderr
            assert bad.stderr.startswith("Error:") and "Traceback" not in bad.stderr
            assert len([ln for ln in bad.stderr.splitlines() if ln.startswith("Error:")]) == 1
            assert wrong not in bad.stderr + bad.stdout and TOKEN not in bad.stderr + bad.stdout
        # a token file in HF_HOME is found the way huggingface_hub finds it
        (tmp_path / "hf-home").mkdir(exist_ok=True)
        (tmp_path / "hf-home" / "token").write_text(TOKEN)
        again = run_cli("pull", f"hf://{REPO}", str(dest), "--json", env=cases[2][0])
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["up_to_date"] is True
        assert hub.errors == []


def test_gated_repo_says_the_token_lacks_access(
    model_dir: Path, tmp_path: Path, test_ca: TestCA
) -> None:
    with HubServer(test_ca) as hub:
        hub.add_commit(REPO, model_dir)
        hub.add_repo(REPO, gated=True, allowed_tokens={TOKEN})
        with pytest.raises(AccessDeniedError, match="gated repository and the token has no"):
            pull(hub, tmp_path / "h", token="hf_other")
        with pytest.raises(AccessDeniedError, match="gated repository and no token"):
            pull(hub, tmp_path / "h")
        assert pull(hub, tmp_path / "h", token=TOKEN).files_verified == len(server_files(hub))


def test_repo_and_revision_not_found(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(RepoNotFoundError, match="acme/nope not found"):
        pull(hub, tmp_path / "h", "hf://acme/nope")
    with pytest.raises(RevisionNotFoundError, match="'no-such-branch' not found"):
        pull(hub, tmp_path / "h", revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        pull(hub, tmp_path / "h", revision="0" * 40)
    env = clean_env(tmp_path / "hf-home", HF_ENDPOINT=hub.endpoint)
    proc = run_cli("pull", f"hf://{REPO}@nope", str(tmp_path / "h"), env=env)
    assert proc.returncode == 1 and proc.stderr.startswith("Error:")
    assert "revision 'nope' not found" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "h" / "hub").exists()


# -- faults -----------------------------------------------------------------------------------


def test_429_with_retry_after_is_retried_and_honoured(hub: HubServer, tmp_path: Path) -> None:
    hub.faults.rate_limit(count=1, retry_after=0.3, path="/revision/")  # the metadata call
    hub.faults.rate_limit(count=2, retry_after=0.3, port="cdn")  # ranged reads
    one_at_a_time = TransferConfig(
        concurrency=1, chunk_size=MiB, buffer_size=256 * 1024,
        retry=RetryPolicy(attempts=4, base_delay=0.01, max_delay=1.0),
    )  # fmt: skip
    t0 = time.monotonic()
    result = pull(hub, tmp_path / "h", config=one_at_a_time)
    assert time.monotonic() - t0 >= 0.9  # three waits of Retry-After, not a 10 ms backoff
    assert result.retries == 2 and result.files_verified == len(server_files(hub))
    assert [r.status for r in hub.requests if r.faults] == [429, 429, 429]


def test_a_stalled_metadata_call_times_out_and_is_retried(hub: HubServer) -> None:
    # a server that never answers the tree call: the call is bounded by a deadline, retried
    stall = hub.faults.delay(30, count=None, path="/tree/")
    spec = ModelSpec(source=parse_source_uri(f"hf://{REPO}"))
    pool = urllib3.PoolManager(maxsize=4, retries=False)
    options = HubOptions(
        endpoint=hub.endpoint, token=False, http=pool, metadata_timeout=0.5,
        retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05),
    )  # fmt: skip
    with pytest.raises(TransientSourceError) as info:
        open_hub_source(spec, options).resolve(spec)
    assert str(info.value).startswith(f"listing {REPO}@")
    assert "giving up after 2 attempts" in str(info.value) and "no answer within 0.5 s" in str(
        info.value
    )
    assert stall.hits == 2  # timed out, retried, timed out
    hub.faults.clear()
    assert open_hub_source(spec, options).resolve(spec).files


def test_connection_cut_mid_body_resumes_from_the_last_byte(hub: HubServer, tmp_path: Path):  # type: ignore[no-untyped-def]
    shard = hub.file(REPO, "model-00001-of-00002.safetensors")
    hub.faults.cut(after_bytes=300_000, count=3, port="cdn", file=shard)
    hub.faults.cut(after_bytes=1000, count=1, port="hub", path="tokenizer.json")
    result = pull(hub, tmp_path / "h")
    assert result.retries == 4
    assert result.bytes_downloaded == result.bytes_total  # no byte fetched twice
    resumed = [r.headers["range"] for r in hub.requests if r.port == "cdn" and "range" in r.headers]
    assert any(rng.startswith("bytes=300000-") for rng in resumed), resumed
    snapshot = repo_dir(tmp_path / "h") / "snapshots" / result.revision
    assert snapshot_tree(snapshot) == server_files(hub)


@pytest.mark.parametrize(
    ("path", "algorithm"),
    [("model-00002-of-00002.safetensors", "sha256"), ("tokenizer.json", "git-sha1")],
)
def test_corrupted_byte_is_caught_and_never_published(hub, tmp_path, path, algorithm):  # type: ignore[no-untyped-def]
    f = hub.file(REPO, path)
    rule = hub.faults.corrupt(f, offset=f.size // 2)
    home = tmp_path / "h"
    with pytest.raises(ChecksumMismatchError) as err:
        pull(hub, home)
    assert err.value.path == path and err.value.algorithm.startswith(algorithm)
    assert rule.hits == 2  # the file was fetched once more before failing loudly
    assert not (repo_dir(home) / "blobs" / f.etag).exists()
    assert not (repo_dir(home) / "snapshots").exists() or not any(
        (repo_dir(home) / "snapshots").iterdir()
    )
    hub.faults.clear()
    hub.faults.corrupt(f, offset=7, count=1)  # a transient corruption: the retry fixes it
    result = pull(hub, home)
    assert result.checksum_failures == 1
    assert snapshot_tree(repo_dir(home) / "snapshots" / result.revision) == server_files(hub)


def test_verify_cli_on_the_hf_layout_names_a_flipped_byte(hub: HubServer, tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = clean_env(tmp_path / "hf-home", HF_ENDPOINT=hub.endpoint)
    proc = run_cli("pull", f"hf://{REPO}", str(home), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    ok = run_cli("verify", str(home), env=env)
    assert ok.returncode == 0, ok.stderr
    assert f"{len(server_files(hub))} files verified" in ok.stdout
    shard = hub.file(REPO, "model-00001-of-00002.safetensors")
    with open(repo_dir(home) / "blobs" / shard.sha256, "r+b") as fh:
        fh.seek(4321)
        byte = fh.read(1)
        fh.seek(4321)
        fh.write(bytes([byte[0] ^ 1]))
    bad = run_cli("verify", str(home), env=env)
    assert bad.returncode == 1
    assert shard.path in bad.stderr and "sha256" in bad.stderr


def test_plain_layout_from_the_hub_and_option_conflicts(hub: HubServer, tmp_path: Path) -> None:
    env = clean_env(tmp_path / "hf-home", HF_ENDPOINT=hub.endpoint)
    dest = tmp_path / "plain"
    proc = run_cli("pull", f"hf://{REPO}", str(dest), "--layout", "plain", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert tree_bytes(dest) == server_files(hub) and not (dest / "hub").exists()
    assert run_cli("verify", str(dest), env=env).returncode == 0
    s3 = "s3://bucket/m"
    assert pull_spec(s3, **OPTS)[1] == "plain"
    assert pull_spec(s3, **{**OPTS, "hf_repo": "org/m"})[1] == "hf"
    assert pull_spec(f"hf://{REPO}@v1", **OPTS)[0].revision == "v1"
    for uri, change, message in [
        (s3, {"revision": "main"}, "--revision is for hf://"),
        (s3, {"hf_revision": "a" * 40}, "needs --hf-repo"),
        (s3, {"layout_name": "hf"}, "--layout hf needs --hf-repo"),
        (f"hf://{REPO}", {"hf_repo": "org/m"}, "are for S3 sources"),
        (f"hf://{REPO}@v1", {"revision": "v2"}, "two revisions"),
    ]:
        with pytest.raises(ConfigError, match=message):
            pull_spec(uri, **{**OPTS, **change})


OPTS: dict[str, Any] = dict(
    name="", include=(), exclude=(), revision=None, hf_repo=None, hf_revision=None,
    layout_name=None,
)  # fmt: skip


@pytest.mark.slow
def test_resume_after_sigkill_fetches_less_than_30_percent(tmp_path: Path, test_ca: TestCA) -> None:
    src = tmp_path / "src"
    make_model_dir(src, seed=5, shard_sizes=(64 * MiB, 64 * MiB))
    total_dir = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    with HubServer(test_ca) as hub:
        hub.add_commit("acme/big", src)
        hub.faults.throttle(40 * MiB, port="cdn")  # ~2 s for the lot: time to kill it
        home = tmp_path / "home"
        env = clean_env(tmp_path / "hf-home", HF_ENDPOINT=hub.endpoint)
        args = [sys.executable, "-m", "prefetch.cli", "pull", "hf://acme/big", str(home),
                "--json", "--concurrency", "2", "--chunk-size", "4MiB"]  # fmt: skip
        proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        almost = 0.8 * total_dir
        kill_9_when(proc, lambda: on_disk(hub, "acme/big", home) >= almost, "pull", interval=0.002)
        hub.faults.clear()
        second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stderr
        summary = json.loads(second.stdout)
        assert summary["bytes_total"] == total_dir
        assert summary["bytes_downloaded"] < 0.3 * summary["bytes_total"], summary
        assert summary["resumed_bytes"] > 0
        check = run_cli("verify", str(home), env=env)
        assert check.returncode == 0, check.stderr
        assert snapshot_tree(Path(summary["path"])) == server_files(hub, "acme/big")


# -- S3 mirrors -------------------------------------------------------------------------------


def test_s3_mirror_with_hf_repo_loads_offline(s3_client, bucket, s3_env, tmp_path):  # type: ignore[no-untyped-def]
    files = generate_model(tmp_path / "src", 20 * MiB, shards=2, small_files=1)
    upload_model(s3_client, bucket, "llama", files, create_bucket=False)
    home = tmp_path / "home"
    proc = run_cli("pull", f"s3://{bucket}/llama", str(home), "--hf-repo", "acme/llama", "--json",
                   env=s3_env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    repo = repo_dir(home, "acme/llama")
    snapshot = repo / "snapshots" / summary["revision"]
    assert summary["path"] == str(snapshot)
    assert snapshot_tree(snapshot) == {f.path: f.local.read_bytes() for f in files}
    assert (repo / "refs/main").read_text() == summary["revision"]
    names = sorted(p.name for p in (repo / "blobs").iterdir())
    by_sha256 = [n for n in names if not n.startswith("s3-")]  # the SHA256-checksummed object
    assert len(by_sha256) == 1 and len(names) == len(files)
    for name in by_sha256:
        assert hashlib.sha256((repo / "blobs" / name).read_bytes()).hexdigest() == name
    out = hf_check(
        home,
        """
        out["main"] = hf.snapshot_download("acme/llama")
        out["warnings"] = [str(w) for w in hf.scan_cache_dir().warnings]
        """,
    )
    assert out == {"main": str(snapshot), "warnings": []}
    again = run_cli("pull", f"s3://{bucket}/llama", str(home), "--hf-repo", "acme/llama",
                    "--json", env=s3_env)  # fmt: skip
    assert json.loads(again.stdout)["up_to_date"] is True
    ok = run_cli("verify", str(home), env=s3_env)
    assert ok.returncode == 0, ok.stderr
    plain = run_cli("pull", f"s3://{bucket}/llama", str(tmp_path / "p"), "--layout", "hf",
                    env=s3_env)  # fmt: skip
    assert plain.returncode == 1 and "--hf-repo" in plain.stderr


# -- the source's HTTP checks, against canned responses ----------------------------------------

ENDPOINT = "http://hub.test"
COMMIT = "c" * 40
BLOB = "a" * 64
DATA = bytes(range(256)) * 40  # 10240 bytes


class CannedHttp:
    """A urllib3-like client answering from a list of (status, headers, body) by URL prefix."""

    def __init__(self, answers: dict[str, list[tuple[int, dict[str, str], bytes]]]) -> None:
        self.answers = answers
        self.sent: list[tuple[str, dict[str, str]]] = []

    def request(self, method: str, url: str, **kwargs: Any) -> urllib3.HTTPResponse:
        self.sent.append((url, dict(kwargs["headers"])))
        assert kwargs["redirect"] is False and kwargs["preload_content"] is False
        for prefix, queue in self.answers.items():
            if url.startswith(prefix):
                status, headers, body = queue.pop(0) if len(queue) > 1 else queue[0]
                return urllib3.HTTPResponse(
                    body=io.BytesIO(body), headers=headers, status=status, preload_content=False
                )
        raise AssertionError(f"unexpected request {url}")


def canned_source(
    http: CannedHttp, token: str | None = "hf_secret"
) -> tuple[HubSource, RemoteFile]:
    source = HubSource(parse_source_uri("hf://acme/x"), endpoint=ENDPOINT, token=token, http=http)
    file = RemoteFile(
        path="w.bin", size=len(DATA), version=BLOB, checksums=(Checksum("sha256", BLOB),),
        blob_id=BLOB, locator=f"{ENDPOINT}/acme/x/resolve/{COMMIT}/w.bin", described=True,
    )  # fmt: skip
    return source, file


def redirect(location: str, **extra: str) -> tuple[int, dict[str, str], bytes]:
    return 302, {"Location": location, "X-Repo-Commit": COMMIT, "X-Linked-Etag": f'"{BLOB}"',
                 "X-Linked-Size": str(len(DATA)), **extra}, b""  # fmt: skip


def partial(start: int, end: int, total: int = len(DATA), **extra: str):  # type: ignore[no-untyped-def]
    headers = {
        "Content-Range": f"bytes {start}-{end - 1}/{total}",
        "Content-Length": str(end - start),
        "ETag": '"whatever-the-cdn-says"',  # a CDN's own ETag is not the blob id
        **extra,
    }
    return 206, headers, DATA[start:end]


def read_all(source: HubSource, file: RemoteFile, start: int, end: int) -> bytes:
    reader = source.open_range(file, start, end)
    buf = memoryview(bytearray(4096))
    out = bytearray()
    try:
        while len(out) < end - start:
            n = reader.readinto(buf)
            assert n > 0
            out += buf[:n]
    finally:
        reader.close()
    return bytes(out)


def test_redirects_token_only_to_the_hub_origin_and_cached_location() -> None:
    cdn = "https://cdn.test/blob?Expires=9999999999&Signature=s3cr3t"
    http = CannedHttp({f"{ENDPOINT}/": [redirect(cdn)], "https://cdn.test/": [partial(0, 100)]})
    source, file = canned_source(http)
    assert read_all(source, file, 0, 100) == DATA[:100]
    http.answers["https://cdn.test/"] = [partial(100, 300)]
    assert read_all(source, file, 100, 300) == DATA[100:300]
    urls = [u for u, _ in http.sent]
    assert urls == [file.locator, cdn, cdn]  # the second chunk skipped the redirect
    assert http.sent[0][1]["Authorization"] == "Bearer hf_secret"
    assert all("Authorization" not in h for u, h in http.sent if u.startswith("https://cdn"))
    assert http.sent[1][1]["Range"] == "bytes=0-99"
    # an expired location (403) is resolved again once
    http.answers["https://cdn.test/"] = [(403, {}, b"expired"), partial(300, 400)]
    assert read_all(source, file, 300, 400) == DATA[300:400]
    assert [u for u, _ in http.sent][3:] == [cdn, file.locator, cdn]


@pytest.mark.parametrize(
    ("answer", "error", "message"),
    [
        (partial(0, 100, total=len(DATA) + 1), SourceChangedError, "not the size the listing"),
        (partial(0, 100, **{"Content-Length": "101"}), SourceChangedError, "body is 101"),
        ((200, {}, DATA), SourceError, "ignored the Range header"),
        ((416, {}, b""), SourceChangedError, "shorter than"),
        ((429, {"Retry-After": "7"}, b""), TransientSourceError, "rate limited"),
        ((503, {}, b""), TransientSourceError, "answered 503"),
        ((404, {}, b""), NotFoundError, "no such file"),
        ((403, {}, b""), AccessDeniedError, "refused the download"),
    ],
)
def test_cdn_answers_that_are_refused(answer, error, message) -> None:  # type: ignore[no-untyped-def]
    cdn = "https://cdn.test/blob?Signature=s3cr3t"
    http = CannedHttp({f"{ENDPOINT}/": [redirect(cdn)], "https://cdn.test/": [answer]})
    source, file = canned_source(http)
    with pytest.raises(error, match=message) as err:
        read_all(source, file, 0, 100)
    assert "s3cr3t" not in str(err.value) and "hf_secret" not in str(err.value)
    if isinstance(err.value, TransientSourceError) and answer[0] == 429:
        assert err.value.retry_after == 7


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"X-Repo-Commit": "d" * 40}, "served commit"),
        ({"X-Linked-Etag": '"' + "b" * 64 + '"'}, "blob id"),
        ({"X-Linked-Size": "5"}, "says 5 bytes"),
    ],
)
def test_hub_pins_commit_blob_and_size(headers: dict[str, str], message: str) -> None:
    status, base, _ = redirect("https://cdn.test/blob")
    http = CannedHttp({f"{ENDPOINT}/": [(status, {**base, **headers}, b"")]})
    source, file = canned_source(http)
    with pytest.raises(SourceChangedError, match=message):
        read_all(source, file, 0, 100)


def test_a_body_longer_than_the_range_is_caught() -> None:
    # no Content-Length (chunked): the body must end where the range does
    status, headers, _ = partial(0, 100, ETag=f'"{BLOB}"')
    del headers["Content-Length"]
    http = CannedHttp({f"{ENDPOINT}/": [(status, headers, DATA[:101])]})
    source, file = canned_source(http)
    with pytest.raises(SourceChangedError, match="longer than the range"):
        read_all(source, file, 0, 100)
    # served by the Hub itself: its ETag must be the blob id
    http = CannedHttp({f"{ENDPOINT}/": [partial(0, 100, ETag='"' + "e" * 64 + '"')]})
    source, file = canned_source(http, token=None)
    with pytest.raises(SourceChangedError, match="blob id"):
        read_all(source, file, 0, 100)
    assert "Authorization" not in http.sent[0][1]


def test_retry_after_forms() -> None:
    assert parse_retry_after("3") == 3.0 and parse_retry_after("0.5") == 0.5
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    later = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 < (parse_retry_after(later) or 0) <= 31
