"""Registry mirrors of an ``oci://`` model: the digest from the origin, the bytes from the first
mirror that has them (see :class:`OciMirrors`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from prefetch.pipeline.snapshot import RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, SourceURI
from prefetch.sources.base import RangeReader, RemembersArchives, Source
from prefetch.support.errors import RangeIgnoredError, SourceError
from prefetch.support.redact import redact

log = logging.getLogger("prefetch.sources.oci")  # the OCI source's log, as before the split


class RegistrySource(Source, RemembersArchives, Protocol):
    """What :class:`OciMirrors` needs of each registry it reads (the origin's and every
    mirror's :class:`~prefetch.sources.oci.source.OciSource`), named here so this module does
    not import the source that imports it."""

    @property
    def uri(self) -> SourceURI: ...

    def pin(self, digest: str) -> None: ...

    def fetch_manifest(self, reference: str) -> tuple[bytes, str, str | None]: ...


class OciMirrors:
    """An ``oci://`` model with registry mirrors: the manifest digest comes from the origin
    (the URI's own digest, or its tag resolved there, once), then each mirror is asked for that
    digest in order and the origin last (:class:`~prefetch.sources.ordered.OrderedSource`'s
    fallback rule). A mirror serves only bytes that hash to the origin's digests, so it cannot
    change what is published; with a tag and the origin down nothing can be pulled (pin the
    digest to pull through a mirror alone).

    Blobs are content-addressed, so each may come from any of them: a blob the source that
    served the manifest lacks (a Spegel peer set, a cache filled partly) or cannot serve now is
    read from the next one in order, and that answer is remembered for the rest of the sync.

    A mirror that answers a range of a blob with ``200`` and the whole blob (a pull-through
    cache that does not hold it yet: distribution with ``proxy: remoteurl``) lacks it for this
    sync: the blob is read from the next source. Taking the whole body instead would move the
    whole blob once per chunk (quadratic in the chunks of a large layer) or serialise the
    layer into one stream without resume; the cache fills itself from that request anyway,
    so the next pull reads the blob from it."""

    def __init__(
        self,
        origin: RegistrySource,
        mirrors: Sequence[RegistrySource],
        *,
        origin_fallback: bool = True,
    ) -> None:
        from prefetch.sources.ordered import OrderedSource

        self._origin = origin
        candidates: list[tuple[str, Source]] = [(str(m.uri), m) for m in mirrors]
        if origin_fallback:
            candidates.append((str(origin.uri), origin))
        self._ordered = OrderedSource(candidates)
        self._sources = [*mirrors, *([origin] if origin_fallback else [])]
        self._first = 0  # the source that served the manifest
        self._lacking: set[tuple[int, str]] = set()  # (source, blob) that failed
        self._lock = threading.Lock()

    def remember_archives(self, records: Path, is_current: Callable[[RemoteFile], bool]) -> None:
        for source in self._sources:
            source.remember_archives(records, is_current)

    def write_archive_records(self) -> None:
        for source in self._sources:
            source.write_archive_records()

    def staged_bytes_read(self) -> int:
        return sum(source.staged_bytes_read() for source in self._sources)

    def resolve(self, spec: ModelSpec) -> Snapshot:
        reference = self._origin.uri.revision or "latest"
        if not reference.startswith("sha256:"):
            _, reference, _ = self._origin.fetch_manifest(reference)
        for source in self._sources:
            source.pin(reference)
        snapshot = self._ordered.resolve(spec)
        for i, source in enumerate(self._sources):
            if snapshot.source.startswith(f"oci://{source.uri.location}/{source.uri.path}@"):
                self._first = i
        return snapshot

    def describe(self, file: RemoteFile) -> RemoteFile:
        return file

    def open_range(self, file: RemoteFile, start: int, end: int) -> RangeReader:
        if not file.locator.startswith("sha256:"):  # an archive member, staged by its reader
            return self._ordered.open_range(file, start, end)
        from prefetch.sources.ordered import FALLBACK_ERRORS

        failure: SourceError | None = None
        for i in range(self._first, len(self._sources)):
            with self._lock:
                if (i, file.locator) in self._lacking:
                    continue
            try:
                return self._sources[i].open_range(file, start, end)
            except SourceError as exc:
                if not isinstance(exc, (*FALLBACK_ERRORS, RangeIgnoredError)):
                    raise
                failure = exc
                with self._lock:
                    self._lacking.add((i, file.locator))
                if i + 1 < len(self._sources):
                    log.warning(
                        "%s: %s cannot serve it (%s); reading it from %s", file.path,
                        self._sources[i].uri, redact(str(exc)), self._sources[i + 1].uri,
                    )  # fmt: skip
        if failure is None:  # every source failed this blob earlier in the sync
            with self._lock:
                self._lacking.clear()
            return self._sources[self._first].open_range(file, start, end)
        raise failure
