"""Unit tests of the Hugging Face cache layout: paths, blob names, links, refs, records, delete."""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import shutil
from pathlib import Path

import pytest

from prefetch.pipeline.layout import PlainLayout, layout_for
from prefetch.pipeline.layout.hf import HfCacheLayout, hub_layouts, repo_folder, repo_id_of
from prefetch.pipeline.layout.hf_tree import HubRepoTree
from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.verify_at_rest import verify_local
from prefetch.support.errors import LayoutError

REPO = "org/model"
C1, C2 = "1" * 40, "2" * 40


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hub_file(path: str, data: bytes, *, lfs: bool = False) -> RemoteFile:
    blob = hashlib.sha256(data).hexdigest() if lfs else git_sha1(data)
    checksum = Checksum("sha256" if lfs else "git-sha1", blob, origin="hub")
    return RemoteFile(path, len(data), version=blob, checksums=(checksum,), blob_id=blob)


def s3_file(path: str, data: bytes, etag: str, *checksums: Checksum) -> RemoteFile:
    sidecar = [c.value for c in checksums if c.origin == "sidecar"]
    return RemoteFile(path, len(data), version=etag, checksums=checksums,
                      blob_id=sidecar[0] if sidecar else None)  # fmt: skip


def publish(layout: HfCacheLayout, f: RemoteFile, data: bytes, checksum: Checksum | None = None):  # type: ignore[no-untyped-def]
    staged = layout.staging_dir() / f"{f.path.replace('/', '_')}.incomplete"
    staged.parent.mkdir(parents=True, exist_ok=True)
    staged.write_bytes(data)
    chosen = checksum if checksum is not None else f.checksum
    layout.publish(f, staged, (chosen,) if chosen is not None else ())
    assert not staged.exists()


def snap(commit: str, *files: RemoteFile, source: str = f"hf://{REPO}", rev: str | None = "main"):  # type: ignore[no-untyped-def]
    return Snapshot(source=source, revision_id=commit, files=tuple(files), requested_revision=rev,
                    repo_id=REPO)  # fmt: skip


SPEC = ModelSpec(source=parse_source_uri(f"hf://{REPO}"))
FILES = {
    "config.json": b'{"a": 1}',
    "a/b/c/deep.txt": b"deep",
    "model.safetensors": os.urandom(5000),
}


def pull_files(layout: HfCacheLayout, commit: str, files: dict[str, bytes], **kw) -> list[str]:  # type: ignore[no-untyped-def]
    remote = [hub_file(p, d, lfs=p.endswith(".safetensors")) for p, d in files.items()]
    for f, data in zip(remote, files.values(), strict=True):
        if not layout.is_current(f):
            publish(layout, f, data)
    return layout.commit(snap(commit, *remote, rev=kw.pop("rev", "main")), SPEC, **kw)


# -- names and paths --------------------------------------------------------------------------


def test_repo_folder_names_and_unsafe_ids() -> None:
    assert repo_folder("org/model") == "models--org--model"
    assert repo_folder("gpt2") == "models--gpt2"
    assert repo_id_of("models--org--model") == "org/model"
    for bad in ("../x", "org/../x", "a--b/c", "a/b/c", "", "/abs", "org/"):
        with pytest.raises(LayoutError):
            repo_folder(bad)


def test_paths_our_state_lives_outside_hub(tmp_path: Path) -> None:
    layout = HfCacheLayout(tmp_path, REPO)
    assert layout.root == tmp_path / "hub/models--org--model"
    for ours in (layout.lock_path(), layout.staging_dir(), layout.book.manifest):
        assert ours.is_relative_to(tmp_path / ".prefetch/hub/models--org--model")
    assert layout.model_path(snap(C1)) == layout.root / "snapshots" / C1
    with pytest.raises(LayoutError):
        layout.model_path(snap("../escape"))
    hf_spec = ModelSpec(source=parse_source_uri(f"hf://{REPO}"))
    mirror = ModelSpec(source=parse_source_uri("s3://bucket/m"), hf_repo="org/mirror")
    assert isinstance(layout_for(hf_spec, tmp_path, shared=True), HfCacheLayout)
    assert layout_for(mirror, tmp_path, shared=True).root == tmp_path / "hub/models--org--mirror"
    plain = layout_for(ModelSpec(source=parse_source_uri("s3://bucket/m")), tmp_path, shared=True)
    assert isinstance(plain, PlainLayout)


# -- publish and commit -----------------------------------------------------------------------


def test_links_are_relative_and_depth_correct_and_ref_has_no_newline(tmp_path: Path) -> None:
    layout = HfCacheLayout(tmp_path, REPO)
    pull_files(layout, C1, FILES, delete=False)
    snapshot = layout.snapshots / C1
    deep = snapshot / "a/b/c/deep.txt"
    assert os.readlink(deep) == f"../../../../../blobs/{git_sha1(b'deep')}"
    sha = hashlib.sha256(FILES["model.safetensors"]).hexdigest()
    assert os.readlink(snapshot / "model.safetensors") == f"../../blobs/{sha}"
    assert {p: (snapshot / p).read_bytes() for p in FILES} == FILES
    assert (layout.refs / "main").read_bytes() == C1.encode()
    assert sorted(p.name for p in layout.root.iterdir()) == ["blobs", "refs", "snapshots"]
    assert not list(layout.snapshots.glob(".*"))  # no temporaries left


def test_refs_for_tags_none_for_a_sha_and_main_for_s3_mirrors(tmp_path: Path) -> None:
    layout = HfCacheLayout(tmp_path, REPO)
    pull_files(layout, C1, FILES, delete=False, rev="refs/pr/1")
    assert (layout.refs / "refs/pr/1").read_text() == C1
    pull_files(layout, C2, FILES, delete=False, rev=None)  # asked for by sha: no ref
    assert sorted(p.relative_to(layout.refs).as_posix() for p in layout.refs.rglob("*")
                  if p.is_file()) == ["refs/pr/1"]  # fmt: skip
    mirror = HfCacheLayout(tmp_path, "org/mirror")
    data = b"weights"
    f = s3_file("w.bin", data, "etag1", Checksum("crc32", "x"))
    publish(mirror, f, data)
    s3_spec = ModelSpec(source=parse_source_uri("s3://bucket/m/"), hf_repo="org/mirror")
    mirror.commit(snap(C1, f, source="s3://bucket/m/", rev=None), s3_spec, delete=False)
    assert (mirror.refs / "main").read_bytes() == C1.encode()


def test_a_new_snapshot_appears_complete_or_not_at_all(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    layout = HfCacheLayout(tmp_path, REPO)
    final = layout.snapshots / C1
    seen: list[bool] = []
    real_link = HubRepoTree._link

    def link(self: HubRepoTree, path: Path, blob: str) -> None:
        seen.append(final.exists())
        real_link(self, path, blob)

    monkeypatch.setattr(HubRepoTree, "_link", link)
    leftover = layout.snapshots / f".{C1}.999.incomplete"
    leftover.mkdir(parents=True)  # a crashed commit's temporary
    pull_files(layout, C1, FILES, delete=False)
    assert seen == [False] * len(FILES) and final.is_dir() and not leftover.exists()


def test_shared_blobs_is_current_only_for_our_records(tmp_path: Path) -> None:
    layout = HfCacheLayout(tmp_path, REPO)
    pull_files(layout, C1, FILES, delete=False)
    again = HfCacheLayout(tmp_path, REPO)  # a fresh process reads the records
    assert all(again.is_current(hub_file(p, d, lfs=p.endswith(".safetensors")))
               for p, d in FILES.items())  # fmt: skip
    # a blob that is on disk with the right name but was not verified by us is fetched again
    foreign = b"somebody else's download"
    (layout.blobs / git_sha1(foreign)).write_bytes(foreign)
    assert not again.is_current(hub_file("x.txt", foreign))
    # a truncated blob is not current either
    cfg = hub_file("config.json", FILES["config.json"])
    (layout.blobs / cfg.version).write_bytes(b"{")
    assert not again.is_current(cfg)


def test_delete_keeps_blobs_other_snapshots_link(tmp_path: Path) -> None:
    layout = HfCacheLayout(tmp_path, REPO)
    pull_files(layout, C1, FILES, delete=False, rev="v1")
    foreign = layout.blobs / ("f" * 40)
    foreign.write_bytes(b"not ours")
    changed = {"config.json": b'{"a": 2}', "model.safetensors": FILES["model.safetensors"]}
    deleted = pull_files(layout, C2, changed, delete=True)
    assert deleted == []  # a new snapshot has nothing extra; C1 is another ref's (v1)
    assert (layout.snapshots / C1 / "a/b/c/deep.txt").read_bytes() == b"deep"  # C1 untouched
    # narrowing C1 with --delete removes its extra links and the blobs nothing links any more
    deleted = pull_files(layout, C1, {"config.json": FILES["config.json"]}, delete=True, rev="v1")
    assert deleted == ["a/b/c/deep.txt", "model.safetensors"]
    assert not (layout.snapshots / C1 / "a").exists()
    assert not (layout.blobs / git_sha1(b"deep")).exists()
    sha = hashlib.sha256(FILES["model.safetensors"]).hexdigest()
    assert (layout.blobs / sha).exists()  # still linked from C2
    assert foreign.exists()  # never ours: left alone
    assert verify_local(layout).ok


def test_a_moved_ref_prunes_what_it_left_behind_after_the_grace(  # type: ignore[no-untyped-def]
    tmp_path: Path, monkeypatch
) -> None:
    layout = HfCacheLayout(tmp_path, REPO)
    pull_files(layout, C1, FILES, delete=True)
    changed = {"config.json": b'{"a": 2}', "model.safetensors": FILES["model.safetensors"]}
    assert pull_files(layout, C2, changed, delete=False) == []  # no --delete: C1 stays
    clock = [1_000_000.0]
    monkeypatch.setattr("prefetch.pipeline.layout.hf.time.time", lambda: clock[0])
    # the first commit that finds C1 superseded starts its grace; C1 stays meanwhile
    assert pull_files(layout, C2, changed, delete=True, superseded_grace=60) == []
    clock[0] += 59
    assert pull_files(layout, C2, changed, delete=True, superseded_grace=60) == []
    assert (layout.snapshots / C1).is_dir()
    clock[0] += 1
    deleted = pull_files(layout, C2, changed, delete=True, superseded_grace=60)
    assert deleted == [f"{p}@{C1[:12]}" for p in sorted(FILES)]
    assert sorted(p.name for p in layout.snapshots.iterdir()) == [C2]
    sha = hashlib.sha256(FILES["model.safetensors"]).hexdigest()
    assert sorted(p.name for p in layout.blobs.iterdir()) == sorted(
        [git_sha1(b'{"a": 2}'), sha]
    )  # only C1's own blobs went; the shard both link stays
    assert list(layout.book.load()["snapshots"]) == [C2]
    assert verify_local(layout).ok


def test_prune_spares_snapshots_another_ref_names_and_other_refs_snapshots(
    tmp_path: Path,
) -> None:
    layout = HfCacheLayout(tmp_path, REPO)
    C3 = "3" * 40
    pull_files(layout, C1, FILES, delete=True)  # main -> C1
    pull_files(layout, C1, FILES, delete=True, rev="v1")  # and the tag v1 -> C1
    pull_files(layout, C3, FILES, delete=True, rev="pr/1")  # another ref's snapshot
    assert pull_files(layout, C2, FILES, delete=True) == []  # main -> C2; v1 still names C1
    assert sorted(p.name for p in layout.snapshots.iterdir()) == [C1, C2, C3]
    (layout.refs / "v1").unlink()
    deleted = pull_files(layout, C2, FILES, delete=True)
    assert deleted == [f"{p}@{C1[:12]}" for p in sorted(FILES)]
    assert sorted(p.name for p in layout.snapshots.iterdir()) == [C2, C3]  # pr/1's stays


def test_prune_reads_records_that_kept_one_revision(tmp_path: Path) -> None:
    layout = HfCacheLayout(tmp_path, REPO)
    pull_files(layout, C1, FILES, delete=True)
    data = layout.book.load()
    data["snapshots"][C1] = {**data["snapshots"][C1], "revision": "main"}
    del data["snapshots"][C1]["refs"]  # as an older version wrote it
    layout.book.compact(data)
    assert len(pull_files(layout, C2, FILES, delete=True)) == len(FILES)
    assert not (layout.snapshots / C1).exists()


def test_an_interrupted_prune_leaves_no_snapshot_half_removed(  # type: ignore[no-untyped-def]
    tmp_path: Path, monkeypatch
) -> None:
    layout = HfCacheLayout(tmp_path, REPO)
    pull_files(layout, C1, FILES, delete=True)

    rmtree = shutil.rmtree

    def crash(path, **kw):  # type: ignore[no-untyped-def]
        if Path(path).name.startswith(f".{C1}"):  # the old snapshot's removal: "crash"
            raise KeyboardInterrupt
        rmtree(path, **kw)

    monkeypatch.setattr("prefetch.pipeline.layout.hf_tree.shutil.rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        pull_files(layout, C2, FILES, delete=True)
    monkeypatch.undo()
    # the old snapshot was renamed out of sight before its removal began
    assert sorted(p.name for p in layout.snapshots.iterdir() if not p.name.startswith(".")) == [C2]
    assert (layout.refs / "main").read_text() == C2
    pull_files(layout, C2, FILES, delete=True)  # the next commit finishes the job
    assert sorted(p.name for p in layout.snapshots.iterdir()) == [C2]
    assert verify_local(layout).ok


def test_recorded_labels_verify_and_forget(tmp_path: Path) -> None:
    layout = HfCacheLayout(tmp_path, REPO)
    pull_files(layout, C1, FILES, delete=False)
    assert sorted(r.path for r in layout.recorded()) == sorted(FILES)
    pull_files(layout, C2, {**FILES, "config.json": b"{}"}, delete=False)
    labels = sorted(r.path for r in layout.recorded())
    assert labels == sorted([f"{p}@{C1[:12]}" for p in FILES] + [f"config.json@{C2[:12]}"])
    shard = next(r for r in layout.recorded() if r.path.startswith("model.safetensors"))
    with open(os.path.realpath(shard.local), "r+b") as fh:
        fh.write(b"X")
    report = verify_local(layout)
    assert [e.path for e in report.failures] == [shard.path]  # type: ignore[attr-defined]
    layout.forget(shard.path)
    assert not os.path.exists(shard.local)
    f = hub_file("model.safetensors", FILES["model.safetensors"], lfs=True)
    assert not HfCacheLayout(tmp_path, REPO).is_current(f)
    assert [lay.repo_id for lay in hub_layouts(tmp_path)] == [REPO]


# -- blob names of S3 mirrors -----------------------------------------------------------------


def test_s3_blob_names(tmp_path: Path) -> None:
    layout = HfCacheLayout(tmp_path, "org/mirror")
    data = b"some weights"
    sha = hashlib.sha256(data).hexdigest()
    b64 = base64.b64encode(hashlib.sha256(data).digest()).decode()
    full = Checksum("sha256", b64, encoding="base64", origin="s3-checksum")
    composite = Checksum("sha256", b64 + "-2", encoding="base64", part_sizes=(6, 6))
    sidecar = Checksum("sha256", sha, origin="sidecar")
    crc = Checksum("crc64nvme", "AAAAAAAAAAA=", encoding="base64")
    staged = tmp_path / "staged"
    staged.write_bytes(data)
    name = layout.blob_name
    assert name(s3_file("w", data, "e1", full), full, staged) == sha
    assert name(s3_file("w", data, "e1-2", composite), composite, staged) == "s3-e1-2-12"
    assert name(s3_file("w", data, "e1", crc, sidecar), sidecar, staged) == sha  # verified
    # a sidecar sha256 that the engine did not check does not name the blob
    assert name(s3_file("w", data, "e1", crc, sidecar), crc, staged) == "s3-e1-12"
    odd = name(s3_file("w", data, "a b/c", crc), crc, staged)
    assert odd.startswith("s3-") and "/" not in odd and odd.endswith("-12")
    assert name(s3_file("w", data, "", crc), crc, staged) == sha  # no ETag: hash the content
    # a Hub file is always named by its blob id
    hub = hub_file("w", data, lfs=True)
    assert name(hub, None, staged) == sha


def test_publish_across_filesystems_copies_then_renames(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    layout = HfCacheLayout(tmp_path, REPO)
    real_replace = os.replace
    calls: list[str] = []

    def replace(src, dst):  # type: ignore[no-untyped-def]
        calls.append(str(src))
        if str(src).endswith(".incomplete"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    f = hub_file("config.json", b"{}")
    publish(layout, f, b"{}")
    assert (layout.blobs / f.version).read_bytes() == b"{}"
    assert not list(layout.blobs.glob(".*"))


def test_one_blob_from_two_source_versions_stays_current_for_both(tmp_path: Path) -> None:
    layout = HfCacheLayout(tmp_path, "org/mirror")
    data = b"the same weights twice"
    sidecar = Checksum("sha256", hashlib.sha256(data).hexdigest(), origin="sidecar")
    a = s3_file("a.bin", data, "etag-a", sidecar)
    b = s3_file("b.bin", data, "etag-b-2", sidecar)
    publish(layout, a, data)
    publish(layout, b, data)
    assert len(list(layout.blobs.iterdir())) == 1
    fresh = HfCacheLayout(tmp_path, "org/mirror")
    assert fresh.is_current(a) and fresh.is_current(b)
    fresh.commit(snap(C1, a, b, source="s3://bucket/m/", rev=None), SPEC, delete=True)
    assert (fresh.snapshots / C1 / "a.bin").resolve() == (fresh.snapshots / C1 / "b.bin").resolve()
    assert [r.path for r in fresh.recorded()] == ["a.bin"]  # the shared blob is checked once
