"""Listing an S3 prefix into a snapshot, with its SHA256SUMS sidecar's checksums.

:class:`S3Lister` pages through ListObjectsV2 under the prefix (through
:class:`~prefetch.sources.s3.sender.S3Requests`, so on the seam when it can), keeps the keys
the spec wants, and reads a ``SHA256SUMS`` sidecar beside them into each file's checksums.
"""

from __future__ import annotations

import re

from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import SIDECAR_MANIFEST, ModelSpec, SourceURI
from prefetch.sources.base import listed_snapshot
from prefetch.sources.s3.listing import ListingPages, listed_objects
from prefetch.sources.s3.sender import S3Requests
from prefetch.support.errors import SourceChangedError, SourceError

_SIDECAR_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")

#: A SHA256SUMS sidecar is read up to this size (a line per file: ~100 bytes each).
MAX_SIDECAR_BYTES = 64 * 1024 * 1024


class S3Lister:
    """The snapshot of the objects under ``uri`` (``s3://bucket/prefix``), a file's path its
    key relative to the prefix."""

    def __init__(self, requests: S3Requests, uri: SourceURI) -> None:
        self._requests = requests
        self._uri = uri

    def resolve(self, spec: ModelSpec) -> Snapshot:
        bucket, prefix = self._uri.location, self._uri.path
        where = f"s3://{bucket}/{prefix}"
        files: list[RemoteFile] = []
        sidecar: RemoteFile | None = None
        seen_any = False
        token: str | None = None
        pages = ListingPages(where)
        while True:
            kwargs: dict[str, str | int] = {"Prefix": prefix, "MaxKeys": 1000}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._requests.list_page(f"listing {where}", **kwargs)
            for obj in listed_objects(page, where):
                key: str = obj["Key"]
                rel = key[len(prefix) :]
                if not rel or rel.endswith("/"):
                    continue  # the prefix itself, or a "folder" marker
                seen_any = True
                remote = RemoteFile(
                    path=rel,
                    size=int(obj["Size"]),
                    version=str(obj.get("ETag", "")).strip('"'),
                    locator=key,
                )
                if rel == SIDECAR_MANIFEST:
                    sidecar = remote
                elif spec.wants(rel):
                    files.append(remote)
            token = pages.next_token(page)
            if token is None:
                break
        if sidecar is not None and files:  # none wanted: the error below, the sidecar unread
            files = self._apply_sidecar(sidecar, files)
        return listed_snapshot(
            self._uri, spec, files, seen_any=seen_any, noun="object", where=where
        )

    def _apply_sidecar(self, sidecar: RemoteFile, files: list[RemoteFile]) -> list[RemoteFile]:
        what = f"reading s3://{self._uri.location}/{sidecar.locator}"
        body = self._requests.read_object(sidecar.locator, what, limit=MAX_SIDECAR_BYTES)
        if body is None:
            raise SourceChangedError(f"{what}: the object disappeared since it was listed")
        sums: dict[str, str] = {}
        for n, line in enumerate(body.decode("utf-8", "replace").splitlines(), 1):
            if not line.strip() or line.startswith("#"):
                continue
            m = _SIDECAR_LINE.match(line.rstrip("\r"))
            if m is None:
                raise SourceError(
                    f"{what}: line {n} is not '<sha256>  <path>' (sha256sum format): {line[:80]!r}"
                )
            sums[m.group(2).removeprefix("./")] = m.group(1).lower()
        return [
            f.with_(
                checksums=(*f.checksums, Checksum("sha256", sums[f.path], origin="sidecar")),
                blob_id=sums[f.path],
            )
            if f.path in sums
            else f
            for f in files
        ]
