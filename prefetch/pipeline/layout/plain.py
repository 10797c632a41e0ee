"""The plain layout: a model's files at ``DEST/<path>``, our state in ``DEST/.prefetch/``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from prefetch.pipeline.layout.base import (
    FileRecord,
    RecordBook,
    RecordedFile,
    entry_checksums,
    file_entry,
    make_dirs_inside,
    safe_join,
)
from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec
from prefetch.support.errors import LayoutError
from prefetch.support.paths import STATE_DIR, path_problem

MODELS_DIR = "models"  # a shared cache's plain models: <cache_dir>/models/<name>/


def model_dir(cache_dir: Path, name: str) -> Path:
    """Where the plain model ``name`` lives in a shared cache (the agent's ``cacheDir``):
    ``cache_dir/models/<name>``; LayoutError unless ``name`` is one safe folder name."""
    problem = path_problem(name)
    if problem is None and "/" in name:
        problem = "not a single folder name"
    if problem is not None:
        raise LayoutError(f"not a model folder in the cache: {name!r}: {problem}")
    return Path(cache_dir) / MODELS_DIR / name


class PlainLayout:
    """Files at ``DEST/<path>``, state in ``DEST/.prefetch/`` (records, partials, lock)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = root / STATE_DIR
        self.book = RecordBook(self.state)
        self._entries: dict[str, FileRecord] | None = None
        #: Directories this layout made or checked (make_dirs_inside) since its last commit: a
        #: model of 1000 files in one folder checks that folder once, not once per file.
        self._dirs_made: set[Path] = set()

    def lock_path(self) -> Path:
        return self.state / "lock"

    def staging_dir(self) -> Path:
        return self.state / "partial"

    def prepare(self) -> None:
        make_dirs_inside(self.root, self.staging_dir())

    def model_path(self, snapshot: Snapshot) -> Path:
        return self.root

    def _loaded(self) -> dict[str, FileRecord]:
        if self._entries is None:
            self._entries = self.book.load()["entries"]
        return self._entries

    def is_current(self, file: RemoteFile) -> bool:
        entry = self._loaded().get(file.path)
        if entry is None or entry.get("version") != file.version or entry["size"] != file.size:
            return False
        try:
            return safe_join(self.root, file.path).stat().st_size == file.size
        except FileNotFoundError:
            return False

    def publish(self, file: RemoteFile, staged: Path, checksums: tuple[Checksum, ...]) -> None:
        target = safe_join(self.root, file.path)
        if target.parent not in self._dirs_made:
            self._dirs_made.add(make_dirs_inside(self.root, target.parent))
        try:
            os.replace(staged, target)
        except IsADirectoryError:
            raise LayoutError(f"cannot publish {file.path}: a directory is in the way") from None
        entry = file_entry(file, checksums)
        self.book.append(file.path, entry)
        self._loaded()[file.path] = entry

    def commit(
        self, snapshot: Snapshot, spec: ModelSpec, *, delete: bool, superseded_grace: float = 0.0
    ) -> list[str]:
        # one copy updated in place: no snapshots to supersede
        data = self.book.load()
        entries = data["entries"]
        wanted = {f.path for f in snapshot.files}
        deleted: list[str] = []
        if delete:
            for path in sorted(self._local_files()):
                if path not in wanted and (spec.wants(path) or path in entries):
                    safe_join(self.root, path).unlink()
                    entries.pop(path, None)
                    deleted.append(path)
            _prune_empty_dirs(self.root, skip=self.state)
        data["source"] = snapshot.source
        data["revision_id"] = snapshot.revision_id
        data["files"] = sorted(wanted)
        self.book.compact(data)
        self._entries = entries
        self._dirs_made.clear()  # deletions may have pruned them
        return deleted

    def _local_files(self) -> Iterator[str]:
        for dirpath, dirnames, filenames in os.walk(self.root):
            if Path(dirpath) == self.root and STATE_DIR in dirnames:
                dirnames.remove(STATE_DIR)
            for name in filenames:
                yield Path(dirpath, name).relative_to(self.root).as_posix()

    def recorded(self) -> list[RecordedFile]:
        data = self.book.load()
        entries = data["entries"]
        paths = data.get("files", sorted(entries))
        return [
            RecordedFile(
                path=p,
                local=safe_join(self.root, p),
                size=entries[p]["size"],
                version=entries[p].get("version", ""),
                checksums=entry_checksums(entries[p]),
            )
            for p in paths
            if p in entries
        ]

    def forget(self, path: str) -> None:
        """Delete the published file of the recorded ``path`` (it failed re-verification): with
        it gone ``is_current`` is false, so the next sync fetches it again and its publish
        rewrites the record. The record stays until then, so ``prefetch verify`` keeps reporting
        the file missing. A link in its place is removed itself, never what it points to; a
        symlinked directory on the way is refused (LayoutError); a path we did not publish is
        left alone."""
        if path not in self.book.load()["entries"]:
            return
        with contextlib.suppress(FileNotFoundError):
            safe_join(self.root, path).unlink()  # unlink never follows the last component
        self._entries = None
        self._dirs_made.clear()


def _prune_empty_dirs(root: Path, *, skip: Path) -> None:
    for dirpath, _, _ in sorted(os.walk(root), key=lambda t: -len(t[0])):
        p = Path(dirpath)
        if p in (root, skip) or skip in p.parents:
            continue
        with contextlib.suppress(OSError):
            p.rmdir()


__all__ = ["MODELS_DIR", "PlainLayout", "model_dir"]
