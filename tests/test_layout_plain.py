"""Unit tests of the plain layout: files at DEST/<path>, records, delete on commit, forget."""

from __future__ import annotations

import builtins
import hashlib
import os
from pathlib import Path

import pytest

from prefetch.pipeline.layout.plain import PlainLayout, model_dir
from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.verify_at_rest import verify_local
from prefetch.support.errors import LayoutError

SOURCE = "s3://bucket/m"
SPEC = ModelSpec(source=parse_source_uri(SOURCE))
FILES = {"config.json": b'{"a": 1}', "sub/dir/w.bin": b"weights" * 100}


def remote(path: str, data: bytes, version: str = "v1") -> RemoteFile:
    checksum = Checksum("sha256", hashlib.sha256(data).hexdigest(), origin="sidecar")
    return RemoteFile(path, len(data), version=version, checksums=(checksum,))


def publish(layout: PlainLayout, f: RemoteFile, data: bytes) -> None:
    staged = layout.staging_dir() / f"{f.path.replace('/', '_')}.incomplete"
    staged.write_bytes(data)
    layout.publish(f, staged, f.checksums)


def pull(layout: PlainLayout, files: dict[str, bytes], *, delete: bool = False) -> list[str]:
    """What a sync does: publish what is not current, then commit the snapshot."""
    layout.prepare()
    remote_files = [remote(p, d) for p, d in sorted(files.items())]
    for f, data in zip(remote_files, [files[f.path] for f in remote_files], strict=True):
        if not layout.is_current(f):
            publish(layout, f, data)
    snapshot = Snapshot(source=SOURCE, revision_id="r1", files=tuple(remote_files))
    return layout.commit(snapshot, SPEC, delete=delete)


def test_publish_puts_the_file_at_its_path_and_makes_it_current(tmp_path: Path) -> None:
    layout = PlainLayout(tmp_path)
    pull(layout, FILES)
    assert {p: (tmp_path / p).read_bytes() for p in FILES} == FILES
    assert not any(layout.staging_dir().iterdir())
    fresh = PlainLayout(tmp_path)  # a new process reads the records
    assert all(fresh.is_current(remote(p, d)) for p, d in FILES.items())


def test_is_current_needs_the_same_version_and_size_and_the_file_on_disk(tmp_path: Path) -> None:
    layout = PlainLayout(tmp_path)
    pull(layout, FILES)
    data = FILES["config.json"]
    assert not layout.is_current(remote("config.json", data, version="v2"))
    assert not layout.is_current(remote("config.json", data + b" "))
    (tmp_path / "config.json").write_bytes(b"{}")  # shorter than recorded
    assert not layout.is_current(remote("config.json", data))
    (tmp_path / "config.json").unlink()
    assert not layout.is_current(remote("config.json", data))


def test_recorded_lists_the_committed_files_with_their_checksums(tmp_path: Path) -> None:
    pull(PlainLayout(tmp_path), FILES)
    records = {r.path: r for r in PlainLayout(tmp_path).recorded()}
    assert sorted(records) == sorted(FILES)
    for path, data in FILES.items():
        assert records[path].local == tmp_path / path
        assert records[path].size == len(data)
        assert records[path].version == "v1"
        assert records[path].checksums == remote(path, data).checksums


def test_commit_with_delete_removes_what_the_snapshot_no_longer_has(tmp_path: Path) -> None:
    layout = PlainLayout(tmp_path)
    pull(layout, {**FILES, "old/gone.bin": b"old"})
    deleted = pull(layout, FILES, delete=True)
    assert deleted == ["old/gone.bin"]
    assert not (tmp_path / "old").exists()  # its emptied directory is pruned
    assert sorted(r.path for r in layout.recorded()) == sorted(FILES)
    assert verify_local(PlainLayout(tmp_path)).ok


def test_commit_without_delete_keeps_files_the_snapshot_no_longer_has(tmp_path: Path) -> None:
    layout = PlainLayout(tmp_path)
    pull(layout, {**FILES, "old.bin": b"old"})
    assert pull(layout, FILES) == []
    assert (tmp_path / "old.bin").read_bytes() == b"old"


def test_commit_with_delete_keeps_files_the_filter_excludes_and_we_never_recorded(
    tmp_path: Path,
) -> None:
    (tmp_path / "notes.txt").write_text("the user's own")
    layout = PlainLayout(tmp_path)
    only_json = ModelSpec(source=parse_source_uri(SOURCE), include=("*.json",))
    layout.prepare()
    publish(layout, remote("config.json", FILES["config.json"]), FILES["config.json"])
    snapshot = Snapshot(source=SOURCE, revision_id="r1",
                        files=(remote("config.json", FILES["config.json"]),))  # fmt: skip
    assert layout.commit(snapshot, only_json, delete=True) == []
    assert (tmp_path / "notes.txt").read_text() == "the user's own"


def test_forget_deletes_the_file_so_the_next_sync_fetches_it_again(tmp_path: Path) -> None:
    layout = PlainLayout(tmp_path)
    pull(layout, FILES)
    layout.forget("sub/dir/w.bin")
    assert not (tmp_path / "sub/dir/w.bin").exists()
    assert (tmp_path / "config.json").exists()
    assert not layout.is_current(remote("sub/dir/w.bin", FILES["sub/dir/w.bin"]))
    # until it is fetched again, verify keeps naming it missing
    assert not verify_local(PlainLayout(tmp_path)).ok
    pull(layout, FILES)
    assert (tmp_path / "sub/dir/w.bin").read_bytes() == FILES["sub/dir/w.bin"]
    assert verify_local(PlainLayout(tmp_path)).ok


def test_forget_removes_a_link_in_the_files_place_never_its_target(tmp_path: Path) -> None:
    dest, outside = tmp_path / "dest", tmp_path / "outside.bin"
    outside.write_bytes(b"not ours")
    layout = PlainLayout(dest)
    pull(layout, FILES)
    (dest / "config.json").unlink()
    (dest / "config.json").symlink_to(outside)
    layout.forget("config.json")
    assert not (dest / "config.json").is_symlink()
    assert outside.read_bytes() == b"not ours"


def test_forget_refuses_a_symlinked_directory_on_the_way(tmp_path: Path) -> None:
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    layout = PlainLayout(dest)
    pull(layout, FILES)
    outside.mkdir()
    (outside / "w.bin").write_bytes(b"not ours")
    (dest / "sub/dir/w.bin").unlink()
    (dest / "sub/dir").rmdir()
    (dest / "sub/dir").symlink_to(outside)
    with pytest.raises(LayoutError, match="symbolic link"):
        layout.forget("sub/dir/w.bin")
    assert (outside / "w.bin").read_bytes() == b"not ours"


def test_forget_leaves_a_file_it_never_published_alone(tmp_path: Path) -> None:
    layout = PlainLayout(tmp_path)
    pull(layout, FILES)
    (tmp_path / "notes.txt").write_text("the user's own")
    layout.forget("notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "the user's own"


def test_a_model_in_a_shared_cache_gets_one_safe_folder(tmp_path: Path) -> None:
    assert model_dir(tmp_path, "llama") == tmp_path / "models" / "llama"
    for bad in ("", ".", "..", "a/b", "/abs", "x\n"):
        with pytest.raises(LayoutError):
            model_dir(tmp_path, bad)


def test_a_directory_where_a_file_belongs_is_refused_by_name(tmp_path: Path) -> None:
    layout = PlainLayout(tmp_path)
    layout.prepare()
    (tmp_path / "sub" / "dir" / "w.bin").mkdir(parents=True)
    f = remote("sub/dir/w.bin", b"weights")
    with pytest.raises(LayoutError, match=r"sub/dir/w\.bin: a directory is in the way"):
        publish(layout, f, b"weights")
    assert (tmp_path / "sub" / "dir" / "w.bin").is_dir()


def test_the_record_log_is_opened_once_per_commit_not_once_per_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publishing 1000 small files is one loop on the transfer's coordinator: each system call
    there also waits for the GIL behind the download threads, so the log stays open."""
    opened: list[str] = []
    real_open = os.open

    def counting_open(path: object, *args: object, **kwargs: object) -> int:
        if str(path).endswith("published.jsonl"):
            opened.append(str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    real_builtin_open = builtins.open

    def counting_builtin_open(path: object, *args: object, **kwargs: object) -> object:
        if str(path).endswith("published.jsonl"):
            opened.append(str(path))
        return real_builtin_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_builtin_open)
    layout = PlainLayout(tmp_path)
    files = {f"f{i}.bin": bytes([i]) * 10 for i in range(5)}
    pull(layout, files)
    assert len(opened) == 1
    assert all(PlainLayout(tmp_path).is_current(remote(p, d)) for p, d in files.items())
    pull(layout, {**files, "g.bin": b"g"})  # the next sync appends to a new log
    assert len(opened) == 2
    assert PlainLayout(tmp_path).is_current(remote("g.bin", b"g"))
