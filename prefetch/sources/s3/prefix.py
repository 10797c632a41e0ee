"""An ``s3://`` prefix as opened: read object by object
(:class:`~prefetch.sources.s3.source.S3Source`) unless resolving finds it is ``prefetch mirror``'s
output, then read as the mirror (:class:`~prefetch.sources.s3_mirror.source.MirrorSource`) and
published in the Hub's layout.

The probe is part of the resolve, the one place a snapshot is made: one listing of
``snapshots/`` more than a plain prefix costs, once per resolve (so once per sync)."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from prefetch.pipeline.retry import AdaptiveRate, RetryPolicy
from prefetch.pipeline.snapshot import RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, SourceURI
from prefetch.sources.base import RangeReader, Source
from prefetch.sources.s3.source import S3Source
from prefetch.sources.s3_mirror.source import MirrorSource
from prefetch.support.errors import AccessDeniedError

if TYPE_CHECKING:
    from prefetch.sources.s3.factory import LazyS3Client
    from prefetch.sources.s3.sdk import S3Client

log = logging.getLogger(__name__)

#: The layout a mirror prefix's snapshot is published in: the Hub's (its files are a commit's).
MIRROR_LAYOUT = "hf"


class S3PrefixSource:
    """The prefix ``uri``: ``probe`` (off when the plain layout was asked for) reads it as a
    mirror when it is one. ``client`` is the S3 client both read with (``prefetch mirror``
    lists the prefix with it too); :attr:`serving` is the source the last resolve chose."""

    def __init__(
        self,
        client: S3Client | LazyS3Client | Any,
        uri: SourceURI,
        *,
        retry: RetryPolicy | None = None,
        pace: AdaptiveRate | None = None,
        ca_bundle: str | None = None,
        probe: bool = True,
    ) -> None:
        self.client = client
        self._objects = S3Source(client, uri, retry=retry, pace=pace, ca_bundle=ca_bundle)
        self._mirror = (
            MirrorSource(client, uri, retry=retry, pace=pace, ca_bundle=ca_bundle)
            if probe
            else None
        )
        self._serving: S3Source | MirrorSource = self._objects
        self._lock = threading.Lock()

    @property
    def serving(self) -> Source:
        """The mirror when the last resolve found one, else the prefix's objects."""
        with self._lock:
            return self._serving

    def resolve(self, spec: ModelSpec) -> Snapshot:
        """The snapshot: the mirror's commit (its snapshot says it is published in the Hub's
        layout, under the repo id its metadata records) when the prefix is one, else the
        prefix's listing."""
        serving: S3Source | MirrorSource = self._objects
        if self._mirror is not None and self._mirror.is_mirror():
            serving = self._mirror
        with self._lock:
            self._serving = serving
        snapshot = serving.resolve(spec)
        if serving is self._mirror:
            return replace(snapshot, layout=MIRROR_LAYOUT)
        return snapshot

    def resolved(self) -> object:
        """What the last resolve chose (for :class:`~prefetch.sources.base.ReadsInWorkers`):
        ``"mirror"`` or ``"objects"``."""
        return "mirror" if self.serving is self._mirror else "objects"

    def adopt(self, resolved: object) -> None:
        """Read what another process's resolve chose (its :meth:`resolved`), without listing
        the prefix: the mirror sets up its signed path on its first read; the objects are
        read on the transport seam once one listing of a key has set it up, as a resolve's
        listing would (a listing the credentials may not make leaves them on botocore)."""
        serving: S3Source | MirrorSource = self._objects
        if resolved == "mirror" and self._mirror is not None:
            serving = self._mirror
        else:
            try:
                self._objects.ensure_signed_path()
            except AccessDeniedError as exc:
                log.debug("reads of the prefix stay on botocore: %s", exc)
        with self._lock:
            self._serving = serving

    def describe(self, file: RemoteFile) -> RemoteFile:
        return self.serving.describe(file)

    def describe_whole(
        self, file: RemoteFile, *, within: float | None = None
    ) -> tuple[RemoteFile, bytes | None]:
        """(:class:`~prefetch.sources.base.DescribesWhole`) what serves it, describing a small
        file by fetching it whole."""
        with self._lock:
            serving = self._serving
        return serving.describe_whole(file, within=within)

    def open_range(self, file: RemoteFile, start: int, end: int) -> RangeReader:
        return self.serving.open_range(file, start, end)
