"""A directory on a mounted filesystem (NFS, Lustre/FSx, a PVC) as a model's source.

Listing walks the directory; every regular file is one :class:`RemoteFile` whose ``version``
is its identity ``<inode>-<mtime_ns>-<size>``: a file replaced (new inode), rewritten (new
mtime) or truncated (new size) is another version, so its partial download and resume journal
(named by path and version, see :func:`prefetch.pipeline.engine.transfer.staged_name`) are not
resumed from. Every ranged read checks the identity twice: when it opens the file, and with
``fstat`` on the same descriptor once its last byte is read; a change between them (or a file
shorter than listed) is :class:`SourceChangedError`, as a replaced S3 object is. (The limit: a write
in the same clock tick as the listed modification, ~4 ms, keeps the mtime; a file still being
written while it is listed can slip through that way.)

What is listed (docs/pulling.md): regular files, and symbolic links to regular files inside the
source root (copied as the files they point to); a link out of the root (or dangling) is
refused, never followed; links to directories are not descended into (a warning says so);
FIFOs, sockets and devices are refused with an error naming them (reading a FIFO would block),
unless the include/exclude patterns leave them out. ``SHA256SUMS`` at the root (``sha256sum``'s
output) is read, never copied: every file it lists must exist and match; files it does not
list are copied and reported unverified (size only), as an S3 object without a checksum is.

The source is never modified: nothing is written under it (the journal, lock and partial files
live under the destination, refused when it overlaps the source, see
:meth:`FileSource.refuse_destination`), files are opened read-only and with ``O_NOATIME``
where the kernel allows it (the owner, or root), so reading does not even touch access times.

Bytes reach the engine by ``pread`` into its buffer, or by ``copy_file_range`` straight into the
partial file (:meth:`_FileReader.copy_to`) when the engine needs no per-range hash of them.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from pathlib import Path

from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import SIDECAR_MANIFEST, ModelSpec, SourceURI
from prefetch.sources.base import listed_snapshot
from prefetch.support.errors import (
    AccessDeniedError,
    ConfigError,
    InvalidListingError,
    NotFoundError,
    SourceChangedError,
    SourceError,
    TransientSourceError,
)
from prefetch.support.paths import STATE_DIR

log = logging.getLogger(__name__)

#: A SHA256SUMS sidecar is read up to this size (a line per file: ~100 bytes each).
MAX_SIDECAR_BYTES = 64 * 1024 * 1024
#: ``<64 hex> <space or *><path>``; a leading backslash marks an escaped name (sha256sum's
#: output for a name holding a backslash or a newline).
_SIDECAR_LINE = re.compile(r"^(\\?)([0-9a-fA-F]{64}) [ *](.+)$")
#: Errors a network filesystem returns for a moment (a soft NFS mount timing out): retried.
_TRANSIENT = frozenset({errno.EIO, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR})
#: copy_file_range refusals that mean "not here" (across filesystems, a kernel or filesystem
#: without it): the engine falls back to pread and pwrite.
_NO_COPY_RANGE = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})
#: copy_file_range errors that are the destination's, not the source's.
_WRITE_SIDE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_NOATIME = getattr(os, "O_NOATIME", 0)


def identity(st: os.stat_result) -> str:
    """A file's version: what changes when it is replaced, rewritten or resized."""
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISBLK(mode) or stat.S_ISCHR(mode):
        return "a device"
    return "not a regular file"


class FileSource:
    """Reads the directory ``uri`` names (see the module's docstring)."""

    def __init__(self, uri: SourceURI) -> None:
        self._uri = uri
        self.root = Path("/" + uri.path)

    # -- the destination ---------------------------------------------------------------------

    def refuse_destination(self, folders: tuple[Path, ...]) -> None:
        """ConfigError when one of ``folders`` (where the pull writes: the model's folder and
        its state) is the source, inside it, or holds it: a file:// source is never written
        to, and a source inside the folder it is published to would be published over."""
        source = Path(os.path.realpath(self.root))
        for folder in folders:
            dest = Path(os.path.realpath(folder))
            if dest == source or dest.is_relative_to(source):
                raise ConfigError(
                    f"the destination {folder} is inside the source {self.root}: a file:// "
                    "source is never written to",
                    hint="choose a destination outside the source directory",
                )
            if source.is_relative_to(dest):
                raise ConfigError(
                    f"the source {self.root} is inside the destination {folder}",
                    hint="choose a destination that does not contain the source directory",
                )

    # -- resolve -----------------------------------------------------------------------------

    def resolve(self, spec: ModelSpec) -> Snapshot:
        real = self._open_root()
        files: list[RemoteFile] = []
        sidecar: Path | None = None
        seen_any = False
        for rel, path, st in self._walk(real, spec):
            seen_any = True
            if rel == SIDECAR_MANIFEST:
                sidecar = path
            elif spec.wants(rel):
                files.append(RemoteFile(rel, st.st_size, identity(st), locator=str(path),
                                        described=True))  # fmt: skip
        if sidecar is not None:  # before the "nothing wanted" check: it may name a missing file
            files = self._apply_sidecar(sidecar, files, spec)
        return listed_snapshot(
            self._uri, spec, files, seen_any=seen_any, noun="file", where=self.root,
            empty=f"{self.root}: the directory holds no files",
        )  # fmt: skip

    def _open_root(self) -> Path:
        """The root's real path (a link naming it is followed: the user named it), or one
        clear error: missing, not a directory, not readable."""
        root = self.root
        try:
            st = os.stat(root)
        except FileNotFoundError:
            raise NotFoundError(f"{root}: no such directory") from None
        except PermissionError:
            raise _denied(root, "cannot reach it") from None
        except OSError as exc:
            raise SourceError(f"{root}: {exc.strerror}") from exc
        if not stat.S_ISDIR(st.st_mode):
            raise SourceError(f"{root}: not a directory (a file:// source names a directory)")
        if not os.access(root, os.R_OK | os.X_OK):
            raise _denied(root, "cannot list it")
        return Path(os.path.realpath(root))

    def _walk(self, real: Path, spec: ModelSpec) -> list[tuple[str, Path, os.stat_result]]:
        """``(relative path, path to open, stat)`` of every file to list, depth first."""
        found: list[tuple[str, Path, os.stat_result]] = []
        stack: list[tuple[Path, str]] = [(real, "")]
        while stack:
            folder, prefix = stack.pop()
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except PermissionError:
                raise _denied(self.root / prefix, "cannot list it") from None
            except OSError as exc:
                raise SourceError(f"listing {self.root / prefix}: {exc.strerror}") from exc
            for entry in entries:
                rel = prefix + entry.name
                if not prefix and entry.name == STATE_DIR:
                    continue  # a prefetch destination's own state (the source is one)
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # gone since it was listed: not part of the snapshot
                except PermissionError:  # a folder readable but not searchable (no x bit)
                    raise _denied(self.root / prefix, "cannot reach its entries") from None
                if stat.S_ISDIR(st.st_mode):
                    stack.append((Path(entry.path), rel + "/"))
                elif stat.S_ISREG(st.st_mode):
                    found.append((rel, Path(entry.path), st))
                elif stat.S_ISLNK(st.st_mode):
                    target = self._link(real, Path(entry.path), rel, spec)
                    if target is not None:
                        found.append((rel, *target))
                elif spec.wants(rel):
                    raise InvalidListingError(
                        f"{self.root / rel}: {_kind(st.st_mode)}, not a regular file; "
                        "refusing to read it",
                        hint="leave it out with --exclude (exclude: in a config)",
                    )
        return found

    def _link(
        self, real: Path, link: Path, rel: str, spec: ModelSpec
    ) -> tuple[Path, os.stat_result] | None:
        """A symbolic link's target when it is a regular file inside the root; None for a link
        to a directory (not descended into) or one the patterns leave out; else an error."""
        target = Path(os.path.realpath(link))
        if not spec.wants(rel) and rel != SIDECAR_MANIFEST:
            return None
        if not target.is_relative_to(real):
            raise InvalidListingError(
                f"{self.root / rel}: a symbolic link to {target}, outside {self.root}; "
                "links out of the source are never followed",
                hint="copy the file into the directory, or leave it out with --exclude",
            )
        try:
            st = os.stat(target)
        except FileNotFoundError:
            raise InvalidListingError(f"{self.root / rel}: a dangling symbolic link") from None
        except OSError as exc:  # a loop (ELOOP), a target this user may not reach
            raise InvalidListingError(
                f"{self.root / rel}: a symbolic link that cannot be followed: {exc.strerror}"
            ) from None
        if stat.S_ISDIR(st.st_mode):
            log.warning("%s: a link to a directory, not followed", self.root / rel)
            return None
        if not stat.S_ISREG(st.st_mode):
            raise InvalidListingError(
                f"{self.root / rel}: a link to {_kind(st.st_mode)}; refusing to read it",
                hint="leave it out with --exclude (exclude: in a config)",
            )
        return target, st

    def _apply_sidecar(
        self, sidecar: Path, files: list[RemoteFile], spec: ModelSpec
    ) -> list[RemoteFile]:
        """Each file's sha256 from the sidecar (origin ``sidecar``: checked by the engine,
        never shadowed); a wanted file it lists that is not there is an error naming it."""
        where = self.root / SIDECAR_MANIFEST
        sums = parse_sidecar(_read_limited(sidecar, where), where)
        listed = {f.path for f in files}
        missing = sorted(p for p in sums if p not in listed and spec.wants(p))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise NotFoundError(
                f"{where} lists {missing[0]}{more}, which is not in {self.root}",
                hint="the directory is incomplete, or SHA256SUMS is out of date",
            )
        return [
            f.with_(
                checksums=(Checksum("sha256", sums[f.path], origin="sidecar"),),
                blob_id=sums[f.path],
            )
            if f.path in sums
            else f
            for f in files
        ]

    # -- describe and read -------------------------------------------------------------------

    def describe(self, file: RemoteFile) -> RemoteFile:
        return file  # the listing's stat said it all

    def open_range(self, file: RemoteFile, start: int, end: int) -> _FileReader:
        what = f"{self.root / file.path} bytes {start}-{end - 1}"
        try:
            fd = _open_read(file.locator)
        except FileNotFoundError:
            raise SourceChangedError(f"{what}: the file disappeared since it was listed") from None
        except OSError as exc:
            raise _read_error(what, exc) from exc
        reader = _FileReader(fd, file, start, end, what)
        try:
            reader.check()
        except BaseException:
            reader.close()
            raise
        return reader


class _FileReader:
    """One ranged read of a local file: ``pread`` into the engine's buffer, or
    ``copy_file_range`` into its partial file; the file's identity checked at the end."""

    def __init__(self, fd: int, file: RemoteFile, start: int, end: int, what: str) -> None:
        self._fd, self._file, self._pos, self._end, self._what = fd, file, start, end, what
        self._copy_refused = False

    def check(self) -> None:
        """SourceChangedError when the open file is not the version listed."""
        try:
            st = os.fstat(self._fd)
        except OSError as exc:
            raise _read_error(self._what, exc) from exc
        if identity(st) != self._file.version:
            raise SourceChangedError(f"{self._what}: the file changed during the download")

    def readinto(self, buf: memoryview, /) -> int:
        want = min(len(buf), self._end - self._pos)
        if want <= 0:
            return 0
        try:
            n = os.preadv(self._fd, [buf[:want]], self._pos)
        except OSError as exc:
            raise _read_error(self._what, exc) from exc
        return self._advance(n)

    def copy_to(self, fd: int, offset: int, length: int) -> int | None:
        """Copy up to ``length`` bytes of the range to ``fd`` at ``offset`` in the kernel
        (``copy_file_range``: no copy through this process); None when the kernel refuses it
        here (another filesystem, no support): the caller reads with :meth:`readinto`."""
        want = min(length, self._end - self._pos)
        if want <= 0:
            return 0
        if self._copy_refused:
            return None
        try:
            n = os.copy_file_range(self._fd, fd, want, self._pos, offset)
        except OSError as exc:
            if exc.errno in _NO_COPY_RANGE:
                self._copy_refused = True
                return None
            if exc.errno in _WRITE_SIDE:
                raise  # the destination's (the engine names it: out of space...)
            raise _read_error(self._what, exc) from exc
        return self._advance(n)

    def _advance(self, n: int) -> int:
        if n == 0:
            self.check()  # shorter than listed: changed (else the listing lied)
            raise SourceChangedError(f"{self._what}: the file is shorter than listed")
        self._pos += n
        if self._pos >= self._end:
            self.check()  # the last byte: was it all one version?
        return n

    def close(self) -> None:
        os.close(self._fd)


def _open_read(path: str) -> int:
    """``path`` opened read-only, without touching its access time where the kernel lets us
    (O_NOATIME: the file's owner, or root)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    if _NOATIME:
        try:
            return os.open(path, flags | _NOATIME)
        except PermissionError:
            pass
    return os.open(path, flags)


def _read_limited(path: Path, where: Path) -> bytes:
    try:
        fd = _open_read(str(path))
    except OSError as exc:
        raise _read_error(str(where), exc) from exc
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_SIDECAR_BYTES + 1)
    if len(data) > MAX_SIDECAR_BYTES:
        raise SourceError(f"{where}: larger than {MAX_SIDECAR_BYTES} bytes")
    return data


def parse_sidecar(body: bytes, where: Path | str) -> dict[str, str]:
    """``sha256sum``'s output as ``{path: hex}``: ``<hex>  <path>`` or ``<hex> *<path>``
    (binary mode), paths relative (``./`` dropped), escaped names (a leading ``\\``) unescaped;
    blank lines and ``#`` comments skipped. Hand-written: the format is a line each, and no
    library reads it."""
    sums: dict[str, str] = {}
    for n, line in enumerate(body.decode("utf-8", "replace").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = _SIDECAR_LINE.match(line.rstrip("\r"))
        if m is None:
            raise SourceError(
                f"{where}: line {n} is not '<sha256>  <path>' (sha256sum format): {line[:80]!r}"
            )
        path = m.group(3)
        if m.group(1):
            path = re.sub(r"\\(.)", lambda e: {"n": "\n", "r": "\r"}.get(e[1], e[1]), path)
        path = path.removeprefix("./")
        digest = m.group(2).lower()
        if sums.setdefault(path, digest) != digest:
            raise SourceError(f"{where}: {path} is listed twice with different sums")
    return sums


def _denied(path: Path, doing: str) -> AccessDeniedError:
    return AccessDeniedError(
        f"{path}: permission denied ({doing} as uid {os.geteuid()})",
        hint="make it readable to this user (the chart's agent runs as uid 65532)",
    )


def _read_error(what: str, exc: OSError) -> SourceError:
    if isinstance(exc, PermissionError):
        return AccessDeniedError(f"{what}: permission denied (reading as uid {os.geteuid()})")
    if exc.errno == errno.ESTALE:  # NFS: the file was replaced on the server
        return SourceChangedError(f"{what}: the file changed during the download (stale handle)")
    if exc.errno == errno.ELOOP:  # O_NOFOLLOW: a link put where a file was listed
        return SourceChangedError(f"{what}: the file was replaced by a link since it was listed")
    if exc.errno in _TRANSIENT:
        return TransientSourceError(f"{what}: {exc.strerror}")
    return SourceError(f"{what}: {exc.strerror}")
