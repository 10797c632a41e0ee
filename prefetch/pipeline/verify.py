"""Checksum algorithms, and how each one is computed while data arrives or after it has landed.

Three ways to check a file, chosen from its checksum:

* ``crc``: a whole-object CRC (CRC64NVME, CRC32C, CRC32). Each chunk is CRC'd as it arrives, in
  any order, and the chunk CRCs are joined with awscrt's ``combine_*`` at the end: no re-read.
* ``parts``: a composite checksum (multipart ETag = MD5 of part MD5s; S3 COMPOSITE = hash of part
  hashes). The planner aligns chunks to part boundaries, each part is hashed as it arrives, and the
  part digests are hashed at the end: no re-read either.
* ``sequential``: a whole-object hash that must see the bytes in order (sha256, sha1, md5 of a
  single-part object, git blob sha1). Large files are fed in order as their pieces land (see
  ``prefetch.pipeline.engine.transfer``), small ones hashed once complete.

Which checksums are checked (:func:`checks_for`): the strongest one the serving source states, and
every one an independent record states (the ``SHA256SUMS`` sidecar). A sidecar is the only check
that does not come from the server that sent the bytes, so it is never shadowed by the server's
own checksum: a file may need two checks (a CRC per range and a sha256 in order), and every one of
them must agree.

Per-chunk results are small (a CRC or a few digests) and go into the resume journal, so a resumed
download never re-reads what it already checked.
"""

from __future__ import annotations

import base64
import errno
import functools
import hashlib
import mmap
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from prefetch.pipeline.snapshot import Checksum
from prefetch.support.errors import ChecksumMismatchError, ConfigError

_CrcFunctions = tuple[Callable[[bytes | memoryview, int], int], Callable[[int, int, int], int], int]


class _CrcTable(Mapping[str, _CrcFunctions]):
    """algorithm -> (crc, combine, width in bytes), from awscrt, whose functions take any buffer
    (bytes or a memoryview of the engine's buffer). awscrt is imported on first use: loading
    its native library is ~0.07 s of every command's start-up otherwise (a no-op pull hashes
    nothing)."""

    _NAMES = ("crc64nvme", "crc32c", "crc32")

    @functools.cached_property
    def _table(self) -> dict[str, _CrcFunctions]:
        from awscrt import checksums as crt

        return {
            "crc64nvme": (crt.crc64nvme, crt.combine_crc64nvme, 8),
            "crc32c": (crt.crc32c, crt.combine_crc32c, 4),
            "crc32": (crt.crc32, crt.combine_crc32, 4),
        }

    def __getitem__(self, algorithm: str) -> _CrcFunctions:
        return self._table[algorithm]

    def __contains__(self, algorithm: object) -> bool:
        return algorithm in self._NAMES

    def __iter__(self) -> Iterator[str]:
        return iter(self._NAMES)

    def __len__(self) -> int:
        return len(self._NAMES)


_CRC = _CrcTable()
_HASHLIB = {"sha256": hashlib.sha256, "sha1": hashlib.sha1, "md5": hashlib.md5}
ALGORITHMS = frozenset(_CRC) | frozenset(_HASHLIB) | {"git-sha1"}
#: Strongest first; Verify uses the first checksum of a file whose algorithm is known.
STRENGTH = ("sha256", "sha1", "git-sha1", "crc64nvme", "crc32c", "md5", "crc32")
#: Origins of checksums that do not come from the server that serves the bytes: always checked.
#: "mirror": a mirror's metadata (prefetch.sources.s3_mirror.format), recorded when the blob was
#: mirrored and checked against the Hub, so an object altered since then fails both of its checks.
INDEPENDENT_ORIGINS = frozenset({"sidecar", "mirror"})
READ_BUFFER = 4 * 1024 * 1024


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...
    def digest(self) -> bytes: ...


class _CrcHasher:
    """hashlib-style wrapper around awscrt's incremental CRC functions."""

    def __init__(self, algorithm: str) -> None:
        self._fn, _, self._width = _CRC[algorithm]
        self.value = 0
        self.length = 0

    def update(self, data: bytes | memoryview, /) -> None:
        self.value = self._fn(data, self.value)
        self.length += len(data)

    def digest(self) -> bytes:
        return self.value.to_bytes(self._width, "big")


def new_hasher(algorithm: str, *, size: int | None = None) -> Hasher:
    if algorithm in _CRC:
        return _CrcHasher(algorithm)
    if algorithm in _HASHLIB:
        return _HASHLIB[algorithm]()
    if algorithm == "git-sha1":
        if size is None:
            raise ValueError("git-sha1 needs the object size up front")
        h = hashlib.sha1()
        h.update(b"blob %d\0" % size)
        return h
    raise ConfigError(f"unknown checksum algorithm {algorithm!r}")


def encode(digest: bytes, encoding: str) -> str:
    return base64.b64encode(digest).decode() if encoding == "base64" else digest.hex()


def normalize(value: str, encoding: str) -> str:
    value = value.strip().strip('"')
    return value.lower() if encoding == "hex" else value


def mode_of(checksum: Checksum) -> str:
    if checksum.part_sizes is not None:
        return "parts"
    if checksum.algorithm in _CRC:
        return "crc"
    return "sequential"


def pick(checksums: Iterable[Checksum]) -> Checksum | None:
    """The first checksum whose algorithm is known (sources list strongest first)."""
    for c in checksums:
        if c.algorithm in ALGORITHMS:
            return c
    return None


def checks_for(checksums: Iterable[Checksum]) -> tuple[Checksum, ...]:
    """Every checksum Verify computes for a file, and all of them must agree.

    The rule: the strongest known checksum the serving source states (its other ones add no
    independence, only cost), plus every known checksum from an independent record (a
    ``SHA256SUMS`` sidecar), which the server's own checksum must never shadow. Served first,
    so a clean file is reported by its strongest served algorithm; duplicates are dropped.
    """
    known = [c for c in checksums if c.algorithm in ALGORITHMS]
    served = pick(c for c in known if c.origin not in INDEPENDENT_ORIGINS)
    chosen = ([served] if served else []) + [c for c in known if c.origin in INDEPENDENT_ORIGINS]
    unique: list[Checksum] = []
    for c in chosen:
        key = (c.algorithm, normalize(c.value, c.encoding), c.encoding, c.part_sizes)
        if all((u.algorithm, normalize(u.value, u.encoding), u.encoding, u.part_sizes) != key
               for u in unique):  # fmt: skip
            unique.append(c)
    return tuple(unique)


def inline_check(checks: Sequence[Checksum]) -> Checksum | None:
    """The check computed per range while bytes arrive (and that chunks align to): a CRC or
    composite one when there is one, else the first (sequential) check."""
    for c in checks:
        if mode_of(c) != "sequential":
            return c
    return checks[0] if checks else None


# ---- inline hashing: per chunk, while the bytes arrive -------------------------------------


def part_bounds(part_sizes: Sequence[int]) -> list[tuple[int, int]]:
    bounds, pos = [], 0
    for size in part_sizes:
        bounds.append((pos, pos + size))
        pos += size
    return bounds


class ChunkHasher:
    """Hashes one chunk's bytes as they arrive, in order within the chunk.

    ``feed(data)`` takes the chunk's next bytes, contiguous with what it already saw (the chunk
    starts at ``start``, so no offset is passed). ``result()`` is JSON-able: ``[crc, length]``
    for crc mode, a list of hex part digests for parts mode; for sequential mode the file's
    encoded checksum value when the chunk is the whole file (``file_size`` given and equal to
    ``end - start``), else None (the file is hashed in order elsewhere).
    """

    def __init__(
        self, checksum: Checksum | None, start: int, end: int, file_size: int | None = None
    ) -> None:
        self._mode = mode_of(checksum) if checksum else "none"
        self._algorithm = checksum.algorithm if checksum else ""
        self._encoding = checksum.encoding if checksum else "hex"
        self._pos = start
        self._parts: list[tuple[int, int]] = []
        self._digests: list[str] = []
        self._current: Hasher | None = None
        self._current_end = end
        if self._mode == "crc":
            self._current = new_hasher(self._algorithm)
        elif self._mode == "sequential" and start == 0 and end == file_size:
            self._mode = "whole"
            self._current = new_hasher(self._algorithm, size=file_size)
        elif self._mode == "parts":
            assert checksum is not None and checksum.part_sizes is not None
            self._parts = [
                (s, e) for s, e in part_bounds(checksum.part_sizes) if s < end and e > start
            ]
            if self._parts and (self._parts[0][0] != start or self._parts[-1][1] != end):
                raise ValueError("chunk is not aligned to part boundaries")
            self._next_part()

    def _next_part(self) -> None:
        if self._parts:
            _, self._current_end = self._parts.pop(0)
            self._current = new_hasher(self._algorithm)
        else:
            self._current = None

    @property
    def needs_bytes(self) -> bool:
        """Does :meth:`feed` use the bytes? (No check per range, or a sequential one hashed
        from the written file: the bytes may go to the file without passing through here.)"""
        return self._mode not in ("none", "sequential")

    def feed(self, data: memoryview) -> None:
        if self._mode in ("none", "sequential"):
            return
        if self._mode in ("crc", "whole"):
            assert self._current is not None
            self._current.update(data)
            return
        while len(data):
            assert self._current is not None
            take = min(len(data), self._current_end - self._pos)
            self._current.update(data[:take])
            self._pos += take
            data = data[take:]
            if self._pos == self._current_end:
                self._digests.append(self._current.digest().hex())
                self._next_part()

    def result(self) -> object:
        if self._mode == "crc":
            assert isinstance(self._current, _CrcHasher)
            return [self._current.value, self._current.length]
        if self._mode == "parts":
            return list(self._digests)
        if self._mode == "whole":
            assert self._current is not None
            return encode(self._current.digest(), self._encoding)
        return None


def finish_inline(checksum: Checksum, chunk_results: Sequence[object]) -> str:
    """Join per-chunk results (in file order) into the file's checksum value."""
    mode = mode_of(checksum)
    if mode == "crc":
        _, combine, width = _CRC[checksum.algorithm]
        crc = 0
        for i, result in enumerate(chunk_results):
            value, length = _crc_result(result)
            crc = value if i == 0 else combine(crc, value, length)
        return encode(crc.to_bytes(width, "big"), checksum.encoding)
    if mode == "parts":
        digests = [bytes.fromhex(d) for res in chunk_results for d in _part_results(res)]
        return _composite(checksum, digests)
    raise ValueError("sequential checksums are not computed inline")


def _crc_result(result: object) -> tuple[int, int]:
    """A crc chunk's result, ``[crc, length]`` (see ChunkHasher.result; read back from the
    journal as JSON, hence checked)."""
    if isinstance(result, list | tuple) and len(result) == 2:
        value, length = result
        if isinstance(value, int) and isinstance(length, int):
            return value, length
    raise ValueError(f"not a crc chunk result: {result!r}")


def _part_results(result: object) -> list[str]:
    """A parts chunk's result: its parts' hex digests (see ChunkHasher.result)."""
    if isinstance(result, list) and all(isinstance(d, str) for d in result):
        return [str(d) for d in result]
    raise ValueError(f"not a parts chunk result: {result!r}")


def _composite(checksum: Checksum, part_digests: Sequence[bytes]) -> str:
    outer = new_hasher(checksum.algorithm)
    for d in part_digests:
        outer.update(d)
    return f"{encode(outer.digest(), checksum.encoding)}-{len(part_digests)}"


# ---- hashing a whole file in memory ---------------------------------------------------------


def values_of(checks: Sequence[Checksum], data: bytes) -> list[str]:
    """The value of each of ``checks`` over ``data``, a whole file held in memory (a small
    file its describe fetched whole): one hash call over the bytes per check (per part, for a
    composite one), no chunk hashers and no read back."""
    return [_value_of(c, data) for c in checks]


def _value_of(checksum: Checksum, data: bytes) -> str:
    if checksum.part_sizes is not None:
        view = memoryview(data)
        digests = []
        for start, end in part_bounds(checksum.part_sizes):
            h = new_hasher(checksum.algorithm)
            h.update(view[start:end])
            digests.append(h.digest())
        return _composite(checksum, digests)
    h = new_hasher(checksum.algorithm, size=len(data))
    h.update(data)
    return encode(h.digest(), checksum.encoding)


# ---- hashing a file on disk ----------------------------------------------------------------


def hash_file(
    path: Path, checksum: Checksum, *, reader: Callable[[int], None] | None = None
) -> str:
    """Compute ``checksum``'s value over the file at ``path`` (any mode): :func:`hash_file_all`
    for one checksum. ``reader`` is called with the byte count of each read (for progress and
    rate limiting)."""
    return hash_file_all(path, [checksum], reader=reader)[0]


def hash_file_all(
    path: Path, checksums: Sequence[Checksum], *, reader: Callable[[int], None] | None = None
) -> list[str]:
    """The values of several checksums of the file at ``path``, computed in one read of it
    (a record with a CRC and a sidecar sha256 costs one pass over the disk, not two)."""
    size = os.path.getsize(path)
    hashers = [ChunkHasher(c, 0, size, size) for c in checksums]
    buf = bytearray(max(min(READ_BUFFER, size), 1))
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        pos = 0
        while pos < size:
            n = os.preadv(fd, [view[: min(len(view), size - pos)]], pos)
            if n == 0:
                raise OSError(errno.EIO, f"{path} is shorter than {size} bytes")
            for h in hashers:
                h.feed(view[:n])
            pos += n
            if reader is not None:
                reader(n)
    finally:
        os.close(fd)
    return [_whole_value(c, h) for c, h in zip(checksums, hashers, strict=True)]


def _whole_value(checksum: Checksum, hasher: ChunkHasher) -> str:
    """The encoded value of a ChunkHasher that saw a whole file."""
    if mode_of(checksum) == "sequential":
        value = hasher.result()
        assert isinstance(value, str)
        return value
    return finish_inline(checksum, [hasher.result()])


class MultiHasher:
    """Feeds the same bytes to several hashers: one read-back pass serves every sequential
    checksum of a file (say the server's sha1 and a sidecar's sha256)."""

    def __init__(self, hashers: dict[str, Hasher]) -> None:
        self.hashers = hashers

    def update(self, data: bytes | memoryview, /) -> None:
        for h in self.hashers.values():
            h.update(data)

    def digest(self) -> bytes:
        raise TypeError("MultiHasher has one digest per algorithm: use .hashers")


def hash_range(h: Hasher, path: Path, start: int, end: int, direct: bool = True) -> None:
    """Feed bytes [start, end) of the file at ``path`` to ``h``.

    ``direct``: read with O_DIRECT where the filesystem allows: the engine writes large files with
    O_DIRECT, and reading them back through the page cache would cost more CPU than the hash itself.
    """
    if end <= start:
        return
    align = 4096
    fd = -1
    if direct:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except (OSError, AttributeError):
            direct = False
    if fd < 0:
        fd = os.open(path, os.O_RDONLY)
    buf = mmap.mmap(-1, READ_BUFFER)  # page-aligned, as O_DIRECT reads need
    view = memoryview(buf)
    try:
        pos = start
        while pos < end:
            base = pos - pos % align if direct else pos
            want = min(READ_BUFFER, end - base)
            if direct:
                want = -(-want // align) * align  # whole blocks; a read past EOF comes back short
            try:
                n = os.preadv(fd, [view[:want]], base)
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                os.close(fd)  # O_DIRECT opened but refused: read through the page cache
                fd = os.open(path, os.O_RDONLY)
                direct = False
                continue
            if n <= pos - base:
                raise OSError(errno.EIO, f"{path} is shorter than {end} bytes")
            stop = min(n, end - base)
            h.update(view[pos - base : stop])
            pos = base + stop
    finally:
        os.close(fd)
        view.release()
        buf.close()


def check(path: str, checksum: Checksum, actual: str) -> None:
    """Raise ChecksumMismatchError unless ``actual`` equals the expected value."""
    expected = normalize(checksum.value, checksum.encoding)
    if normalize(actual, checksum.encoding) != expected:
        raise ChecksumMismatchError(path, checksum.describe(), expected, actual)
