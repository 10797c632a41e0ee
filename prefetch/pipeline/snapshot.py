"""Snapshot: an immutable description of one revision of a model at its source."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import NotRequired, TypedDict, Unpack

from prefetch.support.paths import check_listing


class ChecksumRecord(TypedDict):
    """A :class:`Checksum` as the layouts' records keep it (JSON)."""

    algorithm: str
    value: str
    encoding: NotRequired[str]
    part_sizes: NotRequired[list[int]]
    origin: NotRequired[str]


@dataclass(frozen=True)
class Checksum:
    """A checksum as the source states it.

    ``algorithm``: crc64nvme, crc32c, crc32, sha256, sha1, md5 or git-sha1.
    ``value``: as the source gives it: hex (md5 ETags, sha256 from the Hub or a sidecar, git-sha1)
    or base64 (S3 additional checksums); composite values end in ``-N``.
    ``part_sizes``: for composite checksums (multipart ETag, S3 COMPOSITE), the size of each part in
    order: the value is then the hash of the concatenated per-part digests. None: whole object.
    """

    algorithm: str
    value: str
    encoding: str = "hex"  # "hex" or "base64"
    part_sizes: tuple[int, ...] | None = None
    origin: str = ""  # where it came from, for messages: "s3-checksum", "etag", "sidecar", "hub"

    @property
    def composite(self) -> bool:
        return self.part_sizes is not None

    def describe(self) -> str:
        kind = f" composite of {len(self.part_sizes)} parts" if self.part_sizes else ""
        return f"{self.algorithm}{kind} ({self.origin})" if self.origin else self.algorithm

    def to_json(self) -> ChecksumRecord:
        d: ChecksumRecord = {"algorithm": self.algorithm, "value": self.value}
        if self.encoding != "hex":
            d["encoding"] = self.encoding
        if self.part_sizes is not None:
            d["part_sizes"] = list(self.part_sizes)
        if self.origin:
            d["origin"] = self.origin
        return d

    @classmethod
    def from_json(cls, d: ChecksumRecord) -> Checksum:
        parts = d.get("part_sizes")
        return cls(
            algorithm=d["algorithm"],
            value=d["value"],
            encoding=d.get("encoding", "hex"),
            part_sizes=tuple(parts) if parts is not None else None,
            origin=d.get("origin", ""),
        )


@dataclass(frozen=True)
class RemoteFile:
    """One file of a snapshot.

    ``version``: what pins this exact content at the source (S3 ETag, Hub blob id); ranged reads
    carry it so a replaced object is detected. ``checksums``: every checksum known, strongest
    first (Verify uses the first it can compute). ``blob_id``: the content's name in the Hugging
    Face cache (sha256 for LFS files, git blob sha1 otherwise), when known.
    """

    path: str
    size: int
    version: str = ""
    checksums: tuple[Checksum, ...] = ()
    blob_id: str | None = None
    #: source-private addressing (S3 key, Hub resolve URL), never interpreted elsewhere
    locator: str = ""
    described: bool = False  # True once the source filled in everything it can (S3: after HEAD)

    @property
    def checksum(self) -> Checksum | None:
        return self.checksums[0] if self.checksums else None

    def with_(self, **changes: Unpack[_FileChanges]) -> RemoteFile:
        return replace(self, **changes)


class _FileChanges(TypedDict, total=False):
    """What :meth:`RemoteFile.with_` may change: any of its fields."""

    path: str
    size: int
    version: str
    checksums: tuple[Checksum, ...]
    blob_id: str | None
    locator: str
    described: bool


@dataclass(frozen=True)
class Snapshot:
    """One revision of a model: its id and files (sorted by path)."""

    source: str  # the URI it was resolved from
    revision_id: str  # Hub commit sha, or a digest of the S3 listing
    files: tuple[RemoteFile, ...]
    requested_revision: str | None = None  # what the user asked for (branch/tag), if any
    repo_id: str | None = None  # the Hub repo id, when the snapshot belongs to one
    #: bytes fetched to resolve it (an OCI archive layer streamed and unpacked at resolve),
    #: counted in the sync's ``bytes_downloaded``
    fetched_bytes: int = field(default=0, compare=False)
    #: the layout the source's files must be published in whatever the spec says (an S3
    #: mirror prefix: ``"hf"``, its files are a Hub commit's), None: the spec's (see
    #: :func:`prefetch.pipeline.spec.layout_kind`)
    layout: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # every source builds one: a listing that cannot be laid out safely is refused here,
        # before any byte is fetched (see prefetch.support.paths)
        check_listing(self.files)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> RemoteFile:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)


def listing_digest(entries: list[tuple[str, int, str]]) -> str:
    """A stable 40-hex id for a listing of (path, size, version): changes iff the listing does."""
    h = hashlib.sha1()
    for path, size, version in sorted(entries):
        h.update(f"{path}\0{size}\0{version}\n".encode())
    return h.hexdigest()
