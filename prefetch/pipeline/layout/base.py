"""What every layout shares: the Layout protocol, records, and the path checks.

A Layout owns every path under the destination. The engine writes partial files into
``staging_dir()`` (same filesystem, so publishing is one ``os.replace``), calls ``publish`` once per
verified file, then ``commit`` once per snapshot (records and, for the Hugging Face layout, refs are
written last, atomically). The layouts themselves live beside this module (``plain``, ``hf``); this
one imports neither, so each imports only it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NotRequired, Protocol, Required, TypedDict, cast

from prefetch.pipeline.snapshot import Checksum, ChecksumRecord, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec
from prefetch.support.errors import LayoutError, LockTimeoutError
from prefetch.support.paths import path_problem


@dataclass(frozen=True)
class RecordedFile:
    """A published file as recorded: where it is on disk and what it must hash to (every one of
    ``checksums``; empty: checked by size only)."""

    path: str  # relative path in the model
    local: Path
    size: int
    version: str
    checksums: tuple[Checksum, ...]


class Layout(Protocol):
    root: Path

    def prepare(self) -> None:
        """Create the layout's own directories (state, staging) before the lock is taken,
        refusing a symbolic link anywhere below the destination (LayoutError)."""
        ...

    def lock_path(self) -> Path: ...
    def staging_dir(self) -> Path: ...
    def is_current(self, file: RemoteFile) -> bool: ...
    def publish(self, file: RemoteFile, staged: Path, checksums: tuple[Checksum, ...]) -> None:
        """Move the verified ``staged`` file into place and record ``checksums`` (those it
        passed) for ``prefetch verify``; Transfer hands it over already fsynced."""
        ...

    def commit(
        self, snapshot: Snapshot, spec: ModelSpec, *, delete: bool, superseded_grace: float = 0.0
    ) -> list[str]:
        """Make ``snapshot`` the model's current copy; with ``delete``, remove what it no longer
        has (and, where a layout keeps snapshots, those a moved ref left behind at least
        ``superseded_grace`` seconds ago). Returns the removed paths."""
        ...

    def recorded(self) -> list[RecordedFile]: ...
    def model_path(self, snapshot: Snapshot) -> Path: ...
    def forget(self, path: str) -> None:
        """Delete the published copy of the recorded file ``path`` (a ``RecordedFile.path``, e.g.
        one that failed re-verification) so the next sync sees it missing and fetches it again.
        Never follows a symbolic link; a path not recorded is left alone."""
        ...


def safe_join(root: Path, relative: str) -> Path:
    """``root / relative`` for a relative POSIX path that stays inside root, with no directory
    below root that is a symbolic link (a planted link would lead reads, writes and deletes out
    of root); else LayoutError. The last component may be a link: the Hugging Face layout's
    snapshot files are ours, and replacing or removing a link never follows it."""
    problem = path_problem(relative)
    if problem is not None:
        raise LayoutError(f"refusing unsafe file path {relative!r}: {problem}")
    # The checks run on strings, not pathlib: one publish per small file calls this on the
    # transfer's coordinator, and pathlib's joinpath, relative_to and parts were ~2/3 of its
    # cost (issue 33, round 4). The same components are checked with the same lstat calls.
    _refuse_links_above(root, relative)
    # path_problem refused empty, "." and ".." segments and a leading "/": one join is the same
    # as joining segment by segment
    return root / relative


def _refuse_links_above(root: Path, relative: str) -> None:
    """LayoutError if a directory of ``relative`` (a checked path) below ``root`` is a link."""
    current = os.fspath(root)
    for part in relative.split("/")[:-1]:
        current = os.path.join(current, part)
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            return  # nothing further down exists yet
        if stat.S_ISLNK(mode):
            raise _symlink_error(Path(current), root)


def refuse_symlinks(root: Path, path: Path) -> Path:
    """``path`` (root itself or below it) if no existing component below ``root`` up to and
    including ``path`` is a symbolic link; else LayoutError naming it. ``root`` itself may be a
    link: the user chose it (a DEST on /mnt, say)."""
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            break  # nothing further down exists yet
        if stat.S_ISLNK(mode):
            raise _symlink_error(current, root)
    return path


def make_dirs_inside(root: Path, path: Path) -> Path:
    """``mkdir -p path`` for a ``path`` below ``root``, one component at a time, refusing any
    that exists as a symbolic link or a non-directory (LayoutError): the tool's directories never
    lead out of ``root``. ``root`` is created too, and may itself be a link."""
    root.mkdir(parents=True, exist_ok=True)
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(current)
        mode = os.lstat(current).st_mode
        if stat.S_ISLNK(mode):
            raise _symlink_error(current, root)
        if not stat.S_ISDIR(mode):
            raise LayoutError(f"cannot create the directory {current}: a file is in the way")
    return path


def _symlink_error(path: Path, root: Path) -> LayoutError:
    return LayoutError(
        f"refusing to write through {path}: it is a symbolic link, and model-prefetch never "
        f"follows links out of {root}",
        hint="remove the link (or make it a real directory), or choose a DEST that is the "
        "target itself",
    )


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: How often a waiting :func:`model_lock` tries the lock again.
_LOCK_POLL = 0.05


@contextlib.contextmanager
def model_lock(path: Path, *, timeout: float) -> Iterator[None]:
    """The per-model lock shared by the CLI and the agent: an exclusive ``flock`` on ``path``,
    waited for up to ``timeout`` seconds (LockTimeoutError after). Each holder opens the file
    itself, so two threads of one process exclude each other as two processes do, and the
    kernel drops the lock with the process (a killed pull never leaves it held).

    Written with ``fcntl`` rather than the filelock package, which does the same ``flock`` on
    Linux: importing filelock costs ~20 ms, a tenth of a no-op pull (bench/README.md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeoutError(
                        f"another pull of this model holds {path} (waited {timeout:.0f}s)"
                    ) from None
                time.sleep(_LOCK_POLL)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class FileRecord(TypedDict):
    """A published file's record (:func:`file_entry`)."""

    path: str
    size: int
    version: NotRequired[str]
    checksum: ChecksumRecord | None
    checksums: NotRequired[list[ChecksumRecord]]  # when there are several (see file_entry)
    blob: NotRequired[str]  # HfCacheLayout: the blob's name
    versions: NotRequired[list[str]]  # HfCacheLayout: every source version of this content


class SnapshotRecord(TypedDict, total=False):
    """HfCacheLayout: one snapshot we made."""

    files: dict[str, str]  # repo path -> blob
    source: str
    refs: list[str]  # every ref it was pulled for
    revision: str  # records written before ``refs``: the one ref
    superseded: float  # when a commit first found its refs moved away (Unix time)


class Records(TypedDict, total=False):
    """``manifest.json``: what a layout published. Read back as written (the manifest is
    replaced atomically, so only its top level is checked, by :meth:`RecordBook.load`)."""

    format: int
    entries: Required[dict[str, FileRecord]]  # key: the path (plain) or the blob (hf)
    snapshots: dict[str, SnapshotRecord]  # HfCacheLayout, by commit
    repo_id: str  # HfCacheLayout
    source: str  # PlainLayout: the snapshot in place
    revision_id: str  # PlainLayout
    files: list[str]  # PlainLayout: the snapshot's paths


class RecordBook:
    """What a layout published: ``manifest.json`` plus an append-only log of recent publishes.

    Publishes append one line (cheap, crash-safe); ``compact`` folds the log into the manifest
    atomically. Keys are layout-defined (a path, or a blob name). The log stays open from the
    first append to the next ``compact`` (or until the book is dropped): one ``write`` per
    publish instead of an open, a ``mkdir``, a close and the file object's own calls, which
    counts when 1000 small files publish one after another from the transfer's coordinator.
    """

    def __init__(self, state_dir: Path) -> None:
        self.manifest = state_dir / "manifest.json"
        self.log = state_dir / "published.jsonl"
        self._lock = threading.Lock()
        self._log_fd = -1
        # json.dumps(..., sort_keys=True) builds an encoder per call; one per book is the same
        # text for ~40% less CPU per publish (issue 33, round 4)
        self._encoder = json.JSONEncoder(sort_keys=True)

    def __del__(self) -> None:
        self._close_log()

    def load(self) -> Records:
        data: Records = {"format": 1, "entries": {}}
        with contextlib.suppress(FileNotFoundError):
            data = self._read_manifest()
        entries = data.setdefault("entries", {})
        with contextlib.suppress(FileNotFoundError):
            for line in self.log.read_text().splitlines():
                try:
                    item = json.loads(line)
                except json.JSONDecodeError:
                    break  # torn last line
                entries[item["key"]] = item["entry"]
        return data

    def _read_manifest(self) -> Records:
        """The manifest's records; LayoutError naming the file and the way out when it is not
        the JSON object we write (a crash cannot cause that: it is replaced atomically)."""
        try:
            data = json.loads(self.manifest.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            problem = f"not JSON ({exc})"
        else:
            if isinstance(data, dict) and isinstance(data.get("entries", {}), dict):
                return cast(Records, data)
            problem = "not the JSON object model-prefetch writes"
        raise LayoutError(
            f"the record of what was pulled, {self.manifest}, is corrupt: {problem}",
            hint=f"move it aside (mv {self.manifest} {self.manifest}.bad) and pull again: "
            "the model is then fetched and verified again",
        )

    def append(self, key: str, entry: FileRecord) -> None:
        line = (self._encoder.encode({"key": key, "entry": entry}) + "\n").encode()
        with self._lock:
            if self._log_fd < 0:
                self.log.parent.mkdir(parents=True, exist_ok=True)
                self._log_fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(self._log_fd, line)  # O_APPEND: one whole line per write, never interleaved

    def _close_log(self) -> None:
        fd, self._log_fd = self._log_fd, -1
        if fd >= 0:
            os.close(fd)

    def compact(self, data: Records) -> None:
        with self._lock:
            self._close_log()
            # one line: ``indent`` makes json use its pure-Python encoder, ~0.1 ms per record
            # (1000 small files: ~6% of the pull's CPU, issue 33); the C encoder otherwise
            atomic_write(self.manifest, json.dumps(data, sort_keys=True).encode())
            with contextlib.suppress(FileNotFoundError):
                self.log.unlink()


def file_entry(file: RemoteFile, checksums: tuple[Checksum, ...]) -> FileRecord:
    """A file's record. ``checksum`` keeps the first (strongest served) one, as records made
    before a file could need several checks had it, so an older reader still verifies by it;
    ``checksums`` has all of them (a CRC from S3 and a sidecar's sha256, say)."""
    entry: FileRecord = {
        "path": file.path,
        "size": file.size,
        "version": file.version,
        "checksum": checksums[0].to_json() if checksums else None,
    }
    if len(checksums) > 1:
        entry["checksums"] = [c.to_json() for c in checksums]
    return entry


def entry_checksums(entry: FileRecord) -> tuple[Checksum, ...]:
    """Every checksum a record holds; reads both forms of ``file_entry``."""
    raw = entry.get("checksums")
    if raw:
        return tuple(Checksum.from_json(c) for c in raw)
    single = entry.get("checksum")
    return (Checksum.from_json(single),) if single else ()
