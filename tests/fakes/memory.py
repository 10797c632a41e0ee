"""A Source over bytes in memory, for engine and sync tests that need no server: it records every
ranged request (and describe) in order, answers with short reads like a socket, and can fail after
a given number of bytes."""

from __future__ import annotations

import hashlib
import threading
import zlib

from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec
from prefetch.support.errors import SourceError

SHORT_READ = 100 * 1024  # at most this many bytes per readinto, like a socket


class MemoryReader:
    def __init__(self, source: MemorySource, data: bytes, start: int) -> None:
        self._source, self._data, self._pos = source, data, start

    def readinto(self, buf: memoryview, /) -> int:
        with self._source.lock:
            left = self._source.fail_after - self._source.served
        if left <= 0:
            raise SourceError("the test source failed on purpose")
        n = min(len(buf), len(self._data) - self._pos, left, SHORT_READ)
        buf[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        with self._source.lock:
            self._source.served += n
        return n

    def close(self) -> None:
        pass


class MemorySource:
    """``objects`` maps paths to bytes; ``resolve`` lists them with their sha256."""

    def __init__(self, objects: dict[str, bytes], *, fail_after: int = 1 << 62) -> None:
        self.objects = objects
        self.fail_after = fail_after
        self.served = 0
        self.requests: list[tuple[str, int, int]] = []
        self.events: list[tuple[str, str]] = []  # ("describe" | "open", path), in order
        self.lock = threading.Lock()

    @property
    def opened(self) -> list[str]:
        """The path of every ranged request so far, in order."""
        with self.lock:
            return [path for path, _, _ in self.requests]

    def resolve(self, spec: ModelSpec) -> Snapshot:
        files = tuple(sha256_file(path, data) for path, data in sorted(self.objects.items()))
        return Snapshot(str(spec.source), "rev-1", files)

    def describe(self, file: RemoteFile) -> RemoteFile:
        with self.lock:
            self.events.append(("describe", file.path))
        return file

    def open_range(self, file: RemoteFile, start: int, end: int) -> MemoryReader:
        with self.lock:
            self.requests.append((file.path, start, end))
            self.events.append(("open", file.path))
        return MemoryReader(self, self.objects[file.path][:end], start)


def sha256_file(path: str, data: bytes) -> RemoteFile:
    digest = hashlib.sha256(data).hexdigest()
    return RemoteFile(
        path,
        len(data),
        version=digest[:16],
        checksums=(Checksum("sha256", digest, origin="test"),),
        described=True,
    )


def crc32_file(path: str, data: bytes) -> RemoteFile:
    value = zlib.crc32(data).to_bytes(4, "big").hex()
    return RemoteFile(
        path,
        len(data),
        version=value,
        checksums=(Checksum("crc32", value, origin="test"),),
        described=True,
    )
