"""Archive layers (``tar``, ``tar+gzip``, ``tar+zstd``) unpacked safely into a staging folder.

An archive has no random access once compressed, so a tar layer is not read by the chunk engine
directly: :func:`unpack_layer` streams the blob once, hashing the bytes as they arrive (the
layer's digest and size are checked at the end: a layer that does not match is refused and its
staging removed), and writes each member under the staging folder with its own sha256, which the
engine then checks again as it copies the member into place like any other file.

What is refused, before or while writing (UnsafePathError, nothing published): a member path
that is absolute, has ``..`` or is the tool's state (the rules of :mod:`prefetch.support.paths`); a
symbolic or hard link whose target leaves the layer (a link inside it is published as a copy
of its target); device files and FIFOs; unpacked bytes beyond ``max_unpacked`` (a decompression
bomb, or more than the staging folder has room for: the caller says which, ``limit_reason``),
counted from each member's header before its bytes are written, so a bomb stops at the bound.
``tarfile``'s own extraction is not used: members are written here, one regular file at a time,
so nothing but regular files ever reaches the disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import io
import os
import posixpath
import shutil
import stat
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol, cast

from prefetch.support.errors import ChecksumMismatchError, SourceError, UnsafePathError
from prefetch.support.paths import path_problem

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

_PIECE = 1024 * 1024


class Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


@dataclass(frozen=True)
class StagedMember:
    path: str  # relative to the model's root
    size: int
    sha256: str
    staged: Path


class _HashingReader(io.RawIOBase):
    """The blob's bytes as they arrive, hashed and counted; more than ``size`` is refused."""

    def __init__(self, body: Readable, size: int, what: str) -> None:
        self._body = body
        self._size = size
        self._what = what
        self.hasher = hashlib.sha256()
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: WriteableBuffer, /) -> int:
        view = memoryview(buf).cast("B")
        data = self._body.read(len(view))
        if not data:
            return 0
        self.count += len(data)
        if self.count > self._size:
            raise SourceError(f"{self._what}: the blob is longer than its descriptor's size")
        self.hasher.update(data)
        view[: len(data)] = data
        return len(data)

    def drain(self) -> None:
        while self.readinto(bytearray(_PIECE)):
            pass


def _decompressed(raw: IO[bytes], kind: str, what: str) -> IO[bytes]:
    if kind == "tar":
        return raw
    if kind == "tar+gzip":
        return cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))
    import zstandard  # imported for the layers that need it

    reader: IO[bytes] = zstandard.ZstdDecompressor().stream_reader(raw)
    return reader


def member_path(name: str, what: str) -> str:
    """A member's path relative to the model's root (``./`` dropped), or UnsafePathError."""
    path = name
    while path.startswith("./"):
        path = path[2:]
    path = path.rstrip("/")
    problem = path_problem(path) if path else "it is empty"
    if problem is not None or path.startswith("/"):
        raise UnsafePathError(
            f"{what}: the archive member {name!r} cannot be unpacked safely ({problem})",
            path=name,
        )
    return path


def _link_target(member: tarfile.TarInfo, path: str, what: str) -> str:
    """Where a link member points, relative to the root; refused when that leaves the layer."""
    target = member.linkname
    if member.issym():
        joined = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
    else:  # a hard link names another member
        joined = posixpath.normpath(target)
    if target.startswith("/") or joined == ".." or joined.startswith("../"):
        raise UnsafePathError(
            f"{what}: the archive member {path!r} links to {target!r}, out of the destination",
            path=path,
        )
    return member_path(joined, what)


def unpack_layer(
    body: Readable,
    *,
    kind: str,
    size: int,
    digest_hex: str,
    staging: Path,
    what: str,
    max_unpacked: int,
    limit_reason: str = "",
) -> list[StagedMember]:
    """Unpack the layer ``body`` (its blob's bytes) under ``staging``; see the module doc."""
    raw = _HashingReader(body, size, what)
    buffered = io.BufferedReader(raw, _PIECE)
    members: dict[str, StagedMember] = {}
    links: list[tuple[str, str]] = []
    unpacked = 0  # member bytes so far: each member's header says its size before its bytes
    try:
        stream = _decompressed(buffered, kind, what)
        with tarfile.open(fileobj=stream, mode="r|") as archive:
            for path, member, fileobj in _members(archive, what):
                if member.isdir():
                    continue
                if member.issym() or member.islnk():
                    links.append((path, _link_target(member, path, what)))
                    continue
                if not member.isfile():
                    raise UnsafePathError(
                        f"{what}: the archive member {path!r} is not a regular file, directory "
                        "or link (device files and FIFOs are refused)",
                        path=path,
                    )
                unpacked += member.size
                if unpacked > max_unpacked:
                    why = f": {limit_reason}" if limit_reason else ""
                    raise SourceError(
                        f"{what}: unpacks to more than {max_unpacked} bytes{why} (refused)"
                    )
                members[path] = _write(fileobj, staging / path, member.size, path, what)
        # the rest of the blob (tar padding) counts for its digest: hashed a piece at a time
        # (read whole, 384 MiB of padding once took 800 MB of memory)
        while buffered.read(_PIECE):
            pass
        raw.drain()
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, OSError) as exc:
        if isinstance(exc, UnsafePathError):
            raise
        raise SourceError(f"{what}: not a readable {kind} archive: {exc}") from exc
    if raw.count != size:
        raise SourceError(f"{what}: the blob is {raw.count} bytes, its descriptor says {size}")
    actual = raw.hasher.hexdigest()
    if actual != digest_hex:
        raise ChecksumMismatchError(what, "sha256", digest_hex, actual)
    for path, target in links:
        source = members.get(target)
        if source is None:
            raise UnsafePathError(
                f"{what}: the archive member {path!r} links to {target!r}, which it does not "
                "hold as a file",
                path=path,
            )
        members[path] = StagedMember(path, source.size, source.sha256, source.staged)
    return sorted(members.values(), key=lambda m: m.path)


def _members(
    archive: tarfile.TarFile, what: str
) -> Iterator[tuple[str, tarfile.TarInfo, IO[bytes] | None]]:
    for member in archive:
        path = member_path(member.name, what)
        yield path, member, archive.extractfile(member) if member.isfile() else None


def _write(
    fileobj: IO[bytes] | None, target: Path, size: int, path: str, what: str
) -> StagedMember:
    if fileobj is None:
        raise SourceError(f"{what}: {path!r} has no content")
    if target.exists():
        raise UnsafePathError(f"{what}: the archive holds {path!r} twice", path=path)
    target.parent.mkdir(parents=True, exist_ok=True)
    hasher = hashlib.sha256()
    written = 0
    with target.open("xb") as out:
        while piece := fileobj.read(_PIECE):
            hasher.update(piece)
            out.write(piece)
            written += len(piece)
    if written != size:
        raise SourceError(f"{what}: {path!r} ended after {written} of {size} bytes")
    return StagedMember(path, size, hasher.hexdigest(), target)


def remove_staging(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


#: A staging folder's owner holds an exclusive ``flock`` on this file for as long as it lives:
#: the kernel releases it when the process dies however it dies (kill -9, OOM), so a folder
#: whose lock can be taken belongs to no one. (A pid written in a file would be wrong across
#: pid namespaces, and after pid reuse.)
OWNER_FILE = ".owner"
STAGING_PREFIX = "prefetch-oci-"
#: A folder with no owner file this old is a leftover too (written before owner files, or by a
#: process killed between making the folder and locking it).
_UNOWNED_AGE = 3600.0


def staging_parent(base: str | None) -> Path:
    """Where staging folders are made: ``base``, else the temp folder."""
    return Path(base or tempfile.gettempdir())


def new_staging(base: str | None) -> tuple[Path, int]:
    """A new staging folder under ``base`` (None: the temp folder) and the descriptor of its
    held owner lock (closed, the folder is anyone's to reclaim)."""
    root = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=staging_parent(base)))
    fd = os.open(root / OWNER_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return root, fd


def reclaim_stale_staging(parent: Path) -> list[Path]:
    """Remove the staging folders under ``parent`` that this user owns and no live process
    holds (a pull killed while a layer was staged left them); the ones removed."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if entry.name.startswith(STAGING_PREFIX) and _abandoned(entry):
                remove_staging(Path(entry.path))
                removed.append(Path(entry.path))
    return removed


def _abandoned(entry: os.DirEntry[str]) -> bool:
    try:
        info = entry.stat(follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False  # not ours to remove (another user's, or a link planted in /tmp)
        fd = os.open(os.path.join(entry.path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return time.time() - info.st_mtime > _UNOWNED_AGE
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its owner lives
    finally:
        os.close(fd)
    return True


def release_staging(root: Path, fd: int) -> None:
    """Remove a staging folder this process made, then let go of its lock."""
    remove_staging(root)
    with contextlib.suppress(OSError):
        os.close(fd)


class StagedReader:
    """A range of a staged member, read from the local disk (see :class:`RangeReader`)."""

    def __init__(
        self, path: Path, start: int, end: int, count: Callable[[int], None] = lambda n: None
    ) -> None:
        self._file = path.open("rb")
        self._file.seek(start)
        self._left = end - start
        self._count = count  # bytes served from the local disk, not fetched

    def readinto(self, buf: memoryview, /) -> int:
        if self._left <= 0:
            return 0
        n = self._file.readinto(buf[: self._left] if len(buf) > self._left else buf)
        if not n:
            raise SourceError(f"{self._file.name}: the staged file is shorter than listed")
        self._left -= n
        self._count(n)
        return n

    def close(self) -> None:
        self._file.close()
