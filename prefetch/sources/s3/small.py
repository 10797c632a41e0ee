"""Small objects fetched whole by describe, kept in memory for their first read.

An object up to :data:`SMALL_OBJECT` bytes is described by one GET of the whole object instead of
a HEAD (the GET answers the same checksum headers); its bytes wait here for ``open_range``, so a
small file costs one request instead of two. At most :data:`SMALL_BUDGET` bytes wait at any time.
"""

from __future__ import annotations

import threading

from prefetch.pipeline.snapshot import RemoteFile

#: Objects up to this size are described by one GET of the whole object (see the module's notes).
SMALL_OBJECT = 1024 * 1024
#: At most this many bytes of small objects wait for their read at any time.
SMALL_BUDGET = 64 * 1024 * 1024


class SmallBodies:
    """The bodies describe fetched, by (key, ETag), within a budget of bytes reserved first."""

    def __init__(self, budget: int = SMALL_BUDGET) -> None:
        self._bodies: dict[tuple[str, str], bytes] = {}  # (key, etag) -> body
        self._reserved = 0
        self._budget = budget
        self._lock = threading.Lock()

    def reserve(self, size: int) -> bool:
        """Room for a body of ``size`` bytes, if the budget has it."""
        with self._lock:
            if self._reserved + size > self._budget:
                return False
            self._reserved += size
            return True

    def release(self, size: int) -> None:
        """Give back a reservation whose body will not be kept."""
        with self._lock:
            self._reserved -= size

    def keep(self, key: str, version: str, data: bytes) -> None:
        """Keep the body of a reservation for the read of ``key`` at ``version``."""
        with self._lock:
            self._bodies[(key, version)] = data

    def take(self, file: RemoteFile) -> bytes | None:
        """The body describe fetched, once; later reads of the file go to the server."""
        with self._lock:
            data = self._bodies.pop((file.locator, file.version), None)
            if data is not None:
                self._reserved -= len(data)
        return data


class BytesReader:
    """A range of an object already in memory (a small object fetched whole by describe)."""

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._pos = 0

    def readinto(self, buf: memoryview, /) -> int:
        n = min(len(buf), len(self._data) - self._pos)
        buf[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._data = memoryview(b"")
