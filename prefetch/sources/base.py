"""The one small protocol every source implements; nothing else in the package knows a backend."""

from __future__ import annotations

from typing import Protocol

from prefetch.snapshot import RemoteFile, Snapshot
from prefetch.spec import ModelSpec


class RangeReader(Protocol):
    """An open ranged read: fill buffers until the range is exhausted (readinto returns 0)."""

    def readinto(self, buf: memoryview, /) -> int: ...
    def close(self) -> None: ...


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
