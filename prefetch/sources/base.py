"""The one small protocol every source implements; nothing else in the package knows a backend."""

from __future__ import annotations

import contextlib
import http.client
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from prefetch.pipeline.snapshot import RemoteFile, Snapshot, listing_digest
from prefetch.pipeline.spec import ModelSpec, SourceURI
from prefetch.support.errors import NoMatchingFilesError


@runtime_checkable
class RemembersArchives(Protocol):
    """A source that unpacks archives at resolve (OCI ``tar`` layers): told, before it
    resolves, the folder where it records what each archive unpacked to, and how to ask
    whether a file is published at its version, so an unchanged archive whose files are all
    in place is neither fetched nor unpacked again."""

    def remember_archives(
        self, records: Path, is_current: Callable[[RemoteFile], bool]
    ) -> None: ...

    def write_archive_records(self) -> None:
        """Write the records of what this resolve unpacked (the caller made the folder's
        parent, safely)."""
        ...

    def staged_bytes_read(self) -> int:
        """Bytes its readers served from what it unpacked (local copies, not fetched: the
        archive's own bytes are counted once, in ``Snapshot.fetched_bytes``)."""
        ...


@runtime_checkable
class ReadsLocalTree(Protocol):
    """A source reading a directory of this machine (``file://``): told, before it resolves,
    the folders the sync writes to (the model's folder and its state), so it refuses a
    destination overlapping it (it is never written to)."""

    def refuse_destination(self, folders: tuple[Path, ...]) -> None: ...


@runtime_checkable
class ReadsInWorkers(Protocol):
    """A source whose resolved files another process can read (``prefetch pull --processes``):
    that process opens its own source from the same spec and settings (the front door,
    :func:`prefetch.sources.open_source`) and, instead of resolving again, ``adopt``s what this
    one's resolve found, as ``resolved()`` states it (a small picklable value)."""

    def resolved(self) -> object: ...

    def adopt(self, resolved: object) -> None:
        """Read the files of the snapshot another process resolved (``resolved``: its source's
        ``resolved()``), set up as a resolve would have (may make a request)."""
        ...


@runtime_checkable
class DescribesWhole(Protocol):
    """A source whose describe of a small file can bring the file's bytes with it (S3: one GET
    of the whole object, which answers the checksum headers a HEAD would): the engine checks
    and writes those bytes as they are (one write, no ranged read), see
    :mod:`prefetch.pipeline.engine.whole`. Any other source is described, then read in ranges."""

    def describe_whole(
        self, file: RemoteFile, *, within: float | None = None
    ) -> tuple[RemoteFile, bytes | None]:
        """``describe(file)`` and, when the source fetched the file whole to describe it, its
        bytes: exactly ``file.size`` of them, of the version the description states. None: it
        was only described (too large to fetch in one request here, a multipart object...).
        The caller asks only for files it can hold in memory. ``within``: the seconds the
        bytes of such a fetch may take to arrive (the engine's stall rule for a body of the
        file's size; None: the source's own bound)."""
        ...


class RangeReader(Protocol):
    """An open ranged read: fill buffers until the range is exhausted (readinto returns 0).

    A reader never returns more than the range: a body that runs past it raises. A reader may
    also have ``abort()``: callable from any thread, it makes a ``readinto`` blocked on the
    network return (0 or an error) at once; the engine's watchdog uses it (stop, stall, deadline).
    A reader of a local file may have ``copy_to(fd, offset, length) -> int | None``: copy the
    range's next bytes into ``fd`` at ``offset`` in the kernel (None: not possible here, read
    instead); the engine uses it for ranges it need not hash as they arrive.
    """

    def readinto(self, buf: memoryview, /) -> int: ...
    def close(self) -> None: ...


def range_answer_problem(
    start: int,
    end: int,
    size: int,
    status: int | None,
    content_range: str | None,
    content_length: int | str | None,
) -> str | None:
    """What is wrong with the answer to a GET of bytes ``[start, end)`` of a ``size``-byte object,
    or None when it is exactly that range: status 206, ``Content-Range: bytes start-(end-1)/size``
    and, when stated, a Content-Length of ``end - start``. Anything else (a server that ignored
    the Range and sent the whole object with 200, another range, another total) would write the
    wrong bytes at this offset, so it must be refused, never "fixed up"."""
    expected = f"bytes {start}-{end - 1}/{size}"
    if status != 206:
        return f"the server answered {status}, not 206 (it ignored the Range header)"
    got = content_range.strip() if content_range is not None else None
    if got != expected:
        problem = f"the server answered Content-Range {got!r}, expected {expected!r}"
        if got is not None and not got.endswith(f"/{size}"):
            problem += " (the file is not the size the listing stated)"
        return problem
    if content_length is not None and str(content_length).strip() != str(end - start):
        return f"the body is {str(content_length).strip()} bytes, the range is {end - start}"
    return None


def listed_snapshot(
    uri: SourceURI,
    spec: ModelSpec,
    files: list[RemoteFile],
    *,
    seen_any: bool,
    noun: str,
    where: str | Path,
    empty: str | None = None,
) -> Snapshot:
    """The snapshot of a listing read as it is now (an object-store prefix, a directory):
    ``files``, the wanted ones, sorted by path, under the listing's digest (or under
    ``spec.hf_revision``, the commit the Hub layout publishes under). NoMatchingFilesError when
    nothing was listed (``seen_any`` false: ``empty``, by default "no {noun}s under {where}")
    or nothing listed is wanted."""
    if not seen_any:
        raise NoMatchingFilesError(empty or f"no {noun}s under {where}")
    if not files:
        raise NoMatchingFilesError(
            f"no {noun} under {where} matches the include/exclude patterns",
            hint=f"include={list(spec.include)} exclude={list(spec.exclude)}",
        )
    files = sorted(files, key=lambda f: f.path)
    digest = listing_digest([(f.path, f.size, f.version) for f in files])
    return Snapshot(
        source=str(uri),
        revision_id=spec.hf_revision or digest,
        files=tuple(files),
        repo_id=spec.repo_id,
    )


def shutdown_socket(sock: object) -> None:
    """Shut ``sock`` down for reading and writing, so that a read blocked on it in another
    thread returns now. ``shutdown`` and not ``close``: closing a descriptor another thread is
    blocked on does not wake it on Linux.

    A TLS socket is shut down under its TLS layer (the plain socket's ``shutdown``):
    ``ssl.SSLSocket.shutdown`` also drops the socket's TLS state, after which a read returns the
    TLS records still queued in the kernel as they are, and an HTTP client then parses ciphertext
    as a status line (``BadStatusLine('\\x17\\x03\\x03...')``) or, worse, as body bytes. Shut
    down underneath, a read returns what the server sent, decrypted, or the end of the stream."""
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


def shutdown_socket_of(response: object) -> None:
    """Shut down the socket under an ``http.client`` response (or a urllib3 response wrapping
    one) so that a read blocked on it in another thread returns now (see
    :func:`shutdown_socket`)."""
    for candidate in (response, getattr(response, "_fp", None)):
        if isinstance(candidate, http.client.HTTPResponse):
            sock = getattr(getattr(candidate.fp, "raw", None), "_sock", None)
            if isinstance(sock, socket.socket):
                shutdown_socket(sock)
                return
    conn = getattr(response, "_connection", None)
    shutdown_socket(getattr(conn, "sock", None))


class Source(Protocol):
    """A backend (S3, the Hub). Methods are thread-safe; errors are PrefetchError subclasses.

    * ``resolve``: list the snapshot the spec names (cheap: one listing, no per-file requests).
    * ``describe``: fill in what a download of one file needs beyond the listing (S3: checksums
      and part layout from a HEAD); returns the file unchanged when the listing had it all.
    * ``open_range``: start reading bytes ``[start, end)`` of the exact version in ``file``; a
      changed object raises SourceChangedError, a retryable failure TransientSourceError.
    """

    def resolve(self, spec: ModelSpec) -> Snapshot: ...
    def describe(self, file: RemoteFile) -> RemoteFile: ...
    def open_range(self, file: RemoteFile, start: int, end: int) -> RangeReader: ...
