"""The Hub repo folder on disk, as huggingface_hub reads it offline: ``blobs/``, ``snapshots/``
of relative symlinks and ``refs/``. :class:`HubRepoTree` changes it so that a reader never sees
it half done: a new snapshot is built beside its place and renamed in, a removed one is renamed
out of sight first, a ref is written atomically, a crashed commit's temporaries are cleared;
and it finds the blobs no snapshot links. What is recorded about them, and when each change is
due, is :class:`~prefetch.pipeline.layout.hf.HfCacheLayout`'s business."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from prefetch.pipeline.layout.base import atomic_write, fsync_file, make_dirs_inside, safe_join
from prefetch.support.errors import LayoutError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
#: The suffix of a snapshot being built or removed (hidden, and cleared after a crash).
TMP_SUFFIX = ".incomplete"

__all__ = [
    "TMP_SUFFIX",
    "HubRepoTree",
    "fsync_dir",
    "move_into",
    "points_to",
    "safe_name",
    "walk_files",
]


def safe_name(name: str, what: str) -> str:
    """``name`` if it is one safe file name (a blob, a commit); else LayoutError."""
    if not _NAME.match(name):
        raise LayoutError(f"refusing unsafe {what} {name!r}")
    return name


class HubRepoTree:
    """The folder ``root`` (``hub/models--org--name``) of the cache ``cache_dir``."""

    def __init__(self, cache_dir: Path, root: Path) -> None:
        self.cache_dir = cache_dir
        self.blobs = root / "blobs"
        self.snapshots = root / "snapshots"
        self.refs = root / "refs"

    def make_dir(self, path: Path) -> Path:
        """Create ``path`` (below the cache) refusing symlinked components, see make_dirs_inside."""
        return make_dirs_inside(self.cache_dir, path)

    def blob_path(self, blob: str) -> Path:
        return self.blobs / safe_name(blob, "blob name")

    def place_snapshot(self, final: Path, links: dict[str, str]) -> None:
        """Make the snapshot dir ``final`` link each path of ``links`` to its blob: built aside
        and renamed in when new, its links replaced one by one when it exists."""
        if final.is_dir():
            self.link_all(final, links)
        else:
            self._create_snapshot(final, links)

    def link_all(self, snapshot_dir: Path, links: dict[str, str]) -> None:
        for path, blob in links.items():
            self._link(safe_join(snapshot_dir, path), blob)

    def _link(self, link: Path, blob: str) -> None:
        """Point ``link`` at the blob with a relative symlink, atomically (tmp + replace)."""
        target = os.path.relpath(self.blob_path(blob), link.parent)
        if link.is_symlink() and os.readlink(link) == target:
            return
        if link.is_dir() and not link.is_symlink():
            raise LayoutError(f"cannot link {link}: a directory is in the way")
        self.make_dir(link.parent)
        tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.symlink(target, tmp)
        os.replace(tmp, link)

    def _create_snapshot(self, final: Path, links: dict[str, str]) -> None:
        """Build the snapshot next to its final place (same depth, so the relative links are
        right) and rename it in: it appears complete or not at all."""
        tmp = final.with_name(f".{final.name}.{os.getpid()}{TMP_SUFFIX}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.link_all(tmp, links)
        for dirpath, _, _ in os.walk(tmp):
            fsync_dir(Path(dirpath))
        try:
            os.rename(tmp, final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # someone else made it meanwhile: fill it in
            self.link_all(final, links)
        fsync_dir(self.snapshots)

    def remove_leftovers(self) -> None:
        """Hidden temporaries of a crashed commit (we hold the model's lock: none is live)."""
        for p in self.snapshots.glob(f".*{TMP_SUFFIX}"):
            shutil.rmtree(p, ignore_errors=True)
        if self.refs.is_dir():
            for p in self.refs.rglob(".*.tmp"):
                with contextlib.suppress(OSError):
                    p.unlink()

    def delete_extra(self, snapshot_dir: Path, wanted: set[str]) -> list[str]:
        """Remove the files of ``snapshot_dir`` not in ``wanted`` (and emptied dirs)."""
        deleted: list[str] = []
        for path in sorted(walk_files(snapshot_dir)):
            if path not in wanted:
                (snapshot_dir / path).unlink()
                deleted.append(path)
        for dirpath, _, _ in sorted(os.walk(snapshot_dir), key=lambda t: -len(t[0])):
            if Path(dirpath) != snapshot_dir:
                with contextlib.suppress(OSError):
                    Path(dirpath).rmdir()
        return deleted

    def remove_snapshot(self, commit: str) -> None:
        """Hide the snapshot under a temporary name first (huggingface_hub never sees it half
        removed; a crash leaves it for :meth:`remove_leftovers`), then delete it."""
        final = self.snapshots / safe_name(commit, "snapshot id")
        doomed = final.with_name(f".{final.name}.{os.getpid()}{TMP_SUFFIX}")
        try:
            os.rename(final, doomed)
        except FileNotFoundError:
            return
        fsync_dir(self.snapshots)
        shutil.rmtree(doomed, ignore_errors=True)

    def ref_targets(self) -> set[str]:
        """The commits the repo's refs (``refs/main``, ``refs/pr/1``, ...) point to."""
        out: set[str] = set()
        for path in self.refs.rglob("*") if self.refs.is_dir() else ():
            if path.is_file() and not path.name.startswith("."):
                with contextlib.suppress(OSError, UnicodeDecodeError):
                    out.add(path.read_text().strip())
        return out

    def remove_unlinked(self, blobs: Iterable[str]) -> list[str]:
        """Delete those of ``blobs`` that no snapshot (ours or not) links any more; returns
        them."""
        referenced: set[str] = set()
        blobs_dir = os.path.abspath(self.blobs)
        for snap in self.snapshots.iterdir() if self.snapshots.is_dir() else ():
            for path in walk_files(snap):
                link = snap / path
                if link.is_symlink():
                    target = os.path.abspath(os.path.join(link.parent, os.readlink(link)))
                    if os.path.dirname(target) == blobs_dir:
                        referenced.add(os.path.basename(target))
        gone = sorted(set(blobs) - referenced)
        for blob in gone:
            with contextlib.suppress(FileNotFoundError):
                self.blob_path(blob).unlink()
        return gone

    def write_ref(self, ref: str, commit: str) -> None:
        path = safe_join(self.refs, ref)
        with contextlib.suppress(OSError):
            if path.read_text() == commit:
                return
        self.make_dir(path.parent)
        atomic_write(path, commit.encode())
        fsync_dir(path.parent)


def move_into(staged: Path, target: Path) -> None:
    """Rename into place; across filesystems (a ``hub/`` on another volume) copy then rename."""
    try:
        os.replace(staged, target)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.copyfile(staged, tmp)
        fsync_file(tmp)
        os.replace(tmp, target)
        staged.unlink()


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def walk_files(root: Path) -> Iterator[str]:
    """Relative paths of the files and symlinks under ``root`` (symlinks not followed)."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if Path(dirpath, d).is_symlink()]:
            yield Path(dirpath, name).relative_to(root).as_posix()


def points_to(link: Path, blob: Path) -> bool:
    try:
        return os.path.realpath(link) == os.path.realpath(blob)
    except OSError:
        return False
