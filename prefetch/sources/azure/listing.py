"""A List Blobs answer read defensively: expat as a stream, a document type declaration or an
entity refused, nesting and texts bounded (the reasons are :mod:`prefetch.sources.s3.listing`'s),
each blob's name, size, ETag and Content-MD5 kept, and the marker of the next page."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prefetch.sources.s3.listing import ListingXmlReader, MalformedListingPage

#: EnumerationResults > Blobs > Blob > Properties > Content-Length is 5 deep.
_MAX_DEPTH = 8
_PROPERTIES = frozenset({"Content-Length", "Etag", "Content-MD5", "BlobType"})


@dataclass(frozen=True)
class ListedBlob:
    name: str
    size: int
    etag: str
    content_md5: str  # base64, "" when the blob has none
    blob_type: str


@dataclass(frozen=True)
class BlobPage:
    blobs: tuple[ListedBlob, ...]
    next_marker: str  # "" on the last page


def parse_blob_page(body: bytes) -> BlobPage:
    """One List Blobs page (``EnumerationResults``)."""
    reader = _Reader()
    reader.read(body)
    if reader.root != "EnumerationResults":
        raise MalformedListingPage("not an EnumerationResults")
    return BlobPage(tuple(reader.blobs), reader.next_marker)


class _Reader(ListingXmlReader):
    def __init__(self) -> None:
        super().__init__()
        self.fields: dict[str, str] = {}
        self.blobs: list[ListedBlob] = []
        self.next_marker = ""

    def doctype(self, *_: object) -> None:
        raise MalformedListingPage("a document type or entity declaration (refused)")

    entity = doctype

    def start(self, name: str, _attributes: Mapping[str, str]) -> None:
        self.path.append(name)
        if len(self.path) > _MAX_DEPTH:
            raise MalformedListingPage(f"elements nested more than {_MAX_DEPTH} deep")
        if len(self.path) == 1:
            self.root = name
        elif self.path[1:] == ["Blobs", "Blob"]:
            self.fields = {}
        if self._wanted():
            self.buffer, self.buffered = [], 0

    def _wanted(self) -> bool:
        where = self.path[1:]
        return (
            where == ["NextMarker"]
            or where == ["Blobs", "Blob", "Name"]
            or (where[:3] == ["Blobs", "Blob", "Properties"] and len(where) == 4
                and where[3] in _PROPERTIES)
        )  # fmt: skip

    def end(self, _name: str) -> None:
        where = self.path[1:]
        value = "".join(self.buffer) if self.buffer is not None else None
        self.buffer = None
        if value is not None:
            if where == ["NextMarker"]:
                self.next_marker = value.strip()
            else:
                self.fields[where[-1]] = value
        elif where == ["Blobs", "Blob"]:
            self.blobs.append(_blob(len(self.blobs) + 1, self.fields))
        self.path.pop()


def _blob(n: int, fields: Mapping[str, str]) -> ListedBlob:
    name = fields.get("Name", "")
    if not name:
        raise MalformedListingPage(f"blob {n} has no Name")
    size = fields.get("Content-Length", "").strip()
    if not size.isascii() or not size.isdigit() or len(size) > 19:
        raise MalformedListingPage(f"the size of {name[:200]!r} is {size[:40]!r}, not a byte count")
    return ListedBlob(
        name=name,
        size=int(size),
        etag=fields.get("Etag", "").strip(),
        content_md5=fields.get("Content-MD5", "").strip(),
        blob_type=fields.get("BlobType", "").strip(),
    )
