"""A ListObjectsV2 answer read defensively, and a listing's pages followed with bounds.

:func:`parse_list_page` reads one page with ``xml.parsers.expat`` as a stream: a document type
declaration is refused outright (S3 never sends one; it is where entity expansion and external
entities start), nesting is bounded, each text is bounded, and an entry without a ``Key`` or with
a ``Size`` that is not a byte count is a :class:`MalformedListingPage` saying so. Hand-written on
expat, not ``xml.etree``: ElementTree expands internal entities (one entity referenced a million
times in a 4 MiB page grows to ~0.5 GB) and builds the whole tree; ``defusedxml`` would refuse
the entities but is one more dependency for the same three expat handlers set here.

:class:`ListingPages` is what a paging loop asks for the next continuation token: it refuses a
truncated page without one, a token seen before (a server answering A, B, A, ... would list for
ever) and more than :data:`MAX_PAGES` pages.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import NotRequired, TypedDict
from urllib.parse import unquote_plus
from xml.parsers import expat

from prefetch.support.errors import InvalidListingError

__all__ = [
    "MAX_PAGES",
    "ListPage",
    "ListingEntry",
    "ListingPages",
    "ListingXmlReader",
    "MalformedListingPage",
    "listed_objects",
    "parse_list_page",
]

#: A listing is followed for at most this many pages (10 million keys at 1000 a page).
MAX_PAGES = 10_000
#: ListBucketResult > Contents > Owner > ID is 4 deep; S3 nests no deeper.
_MAX_DEPTH = 8
#: A key is at most 1024 bytes (3 times that URL-encoded); tokens and ETags are shorter.
_MAX_TEXT = 16 * 1024
_CONTENTS_FIELDS = frozenset({"Key", "Size", "ETag"})
_PAGE_FIELDS = frozenset({"IsTruncated", "NextContinuationToken", "EncodingType"})


class ListingEntry(TypedDict):
    """One ``Contents`` entry of a page, as :func:`listed_objects` checked it (``ETag`` is
    botocore's as the endpoint sent it: read with ``str()``)."""

    Key: str
    Size: int
    ETag: NotRequired[str]


class ListPage(TypedDict):
    """A ListObjectsV2 answer in botocore's shape, as :func:`parse_list_page` reads it."""

    Contents: list[ListingEntry]
    CommonPrefixes: list[dict[str, str]]
    IsTruncated: bool
    NextContinuationToken: NotRequired[str]


class MalformedListingPage(ValueError):
    """A listing page that is not a ListObjectsV2 answer this reader accepts."""


def parse_list_page(body: bytes) -> ListPage:
    """A ListObjectsV2 answer (``encoding-type=url``) in botocore's shape: ``Contents`` (Key,
    Size, ETag), ``CommonPrefixes``, ``IsTruncated``, ``NextContinuationToken``, keys decoded."""
    reader = _PageReader()
    reader.read(body)
    return reader.page()


class ListingXmlReader:
    """The expat handlers a listing page's reader shares (S3's, Azure's): :meth:`read` streams
    a page through them, an external entity is refused, the element path is kept and each text
    a subclass keeps (its ``start`` sets ``buffer``) is bounded. A subclass refuses a document
    type or an entity declaration in its words and reads its elements."""

    def __init__(self) -> None:
        self.path: list[str] = []
        self.root: str | None = None
        self.buffer: list[str] | None = None
        self.buffered = 0

    def read(self, body: bytes) -> None:
        """The whole page through the handlers (MalformedListingPage: not XML, or refused)."""
        parser = expat.ParserCreate()
        parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
        parser.StartDoctypeDeclHandler = self.doctype
        parser.EntityDeclHandler = self.entity
        parser.ExternalEntityRefHandler = self.external
        parser.StartElementHandler = self.start
        parser.EndElementHandler = self.end
        parser.CharacterDataHandler = self.text
        try:
            parser.Parse(body, True)
        except expat.ExpatError as exc:
            raise MalformedListingPage(f"not XML ({expat.errors.messages[exc.code]})") from None

    def doctype(self, *_: object) -> None:
        raise NotImplementedError

    def entity(self, *_: object) -> None:
        raise NotImplementedError

    def external(self, *_: object) -> int:
        raise MalformedListingPage("an external entity reference (refused)")

    def start(self, tag: str, _attributes: Mapping[str, str]) -> None:
        raise NotImplementedError

    def end(self, _tag: str) -> None:
        raise NotImplementedError

    def text(self, data: str) -> None:
        if self.buffer is not None:
            self.buffered += len(data)
            if self.buffered > _MAX_TEXT:
                raise MalformedListingPage(f"<{self.path[-1]}> longer than {_MAX_TEXT} characters")
            self.buffer.append(data)


class _PageReader(ListingXmlReader):
    """The expat handlers: the fields of a page, gathered as the elements stream by."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: dict[str, str] = {}  # the page's own (IsTruncated, ...)
        self.entry: dict[str, str] | None = None  # the Contents being read
        self.contents: list[dict[str, str]] = []
        self.prefixes: list[str] = []

    # -- refused ------------------------------------------------------------------------------

    def doctype(self, *_: object) -> None:
        raise MalformedListingPage("a document type declaration (S3 sends none; refused)")

    def entity(self, *_: object) -> None:
        raise MalformedListingPage("an entity declaration (refused)")

    # -- elements -----------------------------------------------------------------------------

    def start(self, tag: str, _attributes: Mapping[str, str]) -> None:
        name = tag.rsplit("}", 1)[-1]
        self.path.append(name)
        depth = len(self.path)
        if depth > _MAX_DEPTH:
            raise MalformedListingPage(f"elements nested more than {_MAX_DEPTH} deep")
        if depth == 1:
            self.root = name
            if name != "ListBucketResult":
                raise MalformedListingPage(f"not a ListBucketResult: <{name[:40]}>")
        elif depth == 2 and name == "Contents":
            self.entry = {}
        elif self._wanted():
            self.buffer, self.buffered = [], 0

    def _wanted(self) -> bool:
        parent, name = self.path[-2] if len(self.path) > 1 else "", self.path[-1]
        depth = len(self.path)
        if depth == 2:
            return name in _PAGE_FIELDS
        if depth == 3 and parent == "Contents":
            return name in _CONTENTS_FIELDS
        return depth == 3 and parent == "CommonPrefixes" and name == "Prefix"

    def end(self, _tag: str) -> None:
        name = self.path[-1]
        value = "".join(self.buffer) if self.buffer is not None else None
        self.buffer = None
        depth = len(self.path)
        self.path.pop()
        if value is not None and depth == 2:
            self.fields[name] = value
        elif value is not None and depth == 3 and self.path[-1] == "Contents":
            assert self.entry is not None
            self.entry[name] = value
        elif value is not None and depth == 3:
            self.prefixes.append(value)
        elif depth == 2 and name == "Contents":
            assert self.entry is not None
            self.contents.append(self.entry)
            self.entry = None

    # -- the page -----------------------------------------------------------------------------

    def page(self) -> ListPage:
        encoded = self.fields.get("EncodingType", "").strip().lower() == "url"
        decode: Callable[[str], str] = unquote_plus if encoded else (lambda s: s)
        page: ListPage = {
            "Contents": [_entry(n, e, decode) for n, e in enumerate(self.contents, 1)],
            "CommonPrefixes": [{"Prefix": decode(p)} for p in self.prefixes],
            "IsTruncated": self.fields.get("IsTruncated", "").strip().lower() == "true",
        }
        if "NextContinuationToken" in self.fields:
            page["NextContinuationToken"] = self.fields["NextContinuationToken"]
        if page["IsTruncated"] and not page.get("NextContinuationToken"):
            # listing on from nothing would list the first page again, for ever
            raise MalformedListingPage("a truncated listing page without a continuation token")
        return page


def _entry(n: int, fields: Mapping[str, str], decode: Callable[[str], str]) -> ListingEntry:
    if "Key" not in fields or not fields["Key"]:
        raise MalformedListingPage(f"entry {n} (<Contents>) has no Key")
    key = decode(fields["Key"])
    size = fields.get("Size", "").strip()
    if not size.isascii() or not size.isdigit() or len(size) > 19:
        raise MalformedListingPage(f"the Size of {key[:200]!r} is {size[:40]!r}, not a byte count")
    return {"Key": key, "Size": int(size), "ETag": fields.get("ETag", "")}


def listed_objects(page: Mapping[str, object], where: str) -> list[ListingEntry]:
    """The ``Contents`` of a page (botocore's or :func:`parse_list_page`'s), each with a
    non-empty ``Key`` and a whole, non-negative ``Size``: InvalidListingError naming ``where``
    (the prefix the user asked for) otherwise. botocore's parser passes through whatever the
    endpoint sent, so an entry without a Key would be a ``KeyError`` further on."""
    contents = page.get("Contents") or []
    if not isinstance(contents, list):
        raise InvalidListingError(f"listing {where}: Contents is not a list")
    for n, obj in enumerate(contents, 1):
        key = obj.get("Key") if isinstance(obj, Mapping) else None
        if not isinstance(key, str) or not key:
            raise InvalidListingError(f"listing {where}: entry {n} has no Key")
        size = obj.get("Size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidListingError(
                f"listing {where}: the Size of {key[:200]!r} is {str(size)[:40]!r}, not a "
                "byte count"
            )
    return contents


class ListingPages:
    """The continuation tokens of one listing (``where``: the prefix the user asked for, for
    errors), checked as a paging loop follows them."""

    def __init__(self, where: str, *, max_pages: int = MAX_PAGES) -> None:
        self._where = where
        self._max_pages = max_pages
        self._pages = 0
        self._seen: set[bytes] = set()  # digests: a hostile token may be long

    def next_token(self, page: Mapping[str, object]) -> str | None:
        """The token to list on with after ``page``; None when the listing is complete."""
        self._pages += 1
        if not page.get("IsTruncated"):
            return None
        token = page.get("NextContinuationToken")
        if not token or not isinstance(token, str):
            raise InvalidListingError(
                f"listing {self._where}: a truncated page without a continuation token "
                "(listing on would start over, for ever)"
            )
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        if digest in self._seen:
            raise InvalidListingError(
                f"listing {self._where}: the server sent a continuation token it had sent "
                f"before (page {self._pages}): the listing would never end"
            )
        if self._pages >= self._max_pages:
            raise InvalidListingError(
                f"listing {self._where}: more than {self._max_pages} pages; not listing on"
            )
        self._seen.add(digest)
        return token
