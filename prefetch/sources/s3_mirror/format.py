"""The mirror format: how one Hub repository is laid out under one S3 prefix.

``prefetch mirror`` writes it and a pull through a mirror reads it; this module is the contract
between the two, pure (no I/O) so both sides and the tests share one definition::

    <prefix>blobs/<hub id>            the file's bytes, named by the Hub's id (LFS sha256, or
                                      the git blob sha1 of a non-LFS file), uploaded with a
                                      full-object CRC64NVME checksum
    <prefix>snapshots/<commit>.json   one commit's metadata (:class:`MirrorCommit`), written only
                                      after every blob it names exists and was checked: its
                                      presence means "this commit is complete"
    <prefix>refs/<ref>                the 40-hex commit the ref pointed to when mirrored
                                      (written after the snapshot JSON; a ref may contain '/')

Content addressing is why commits share unchanged files, why a moved branch only adds blobs and
why an old commit keeps working. Anything malformed is refused with
:class:`~prefetch.support.errors.InvalidListingError` naming where it was read, so a broken or
hostile mirror never gets a file fetched, let alone published.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from prefetch.support.errors import InvalidListingError
from prefetch.support.paths import path_problem, ref_name_problem
from prefetch.support.safejson import load_json

T = TypeVar("T")

#: The value of the metadata's ``format`` field; a reader refuses any other.
FORMAT = "model-prefetch-mirror/1"
#: The id kinds a file may carry: the git blob sha1 (non-LFS) or the LFS sha256.
ID_KINDS = {"git-sha1": 40, "sha256": 64}

_HEX = re.compile(r"^[0-9a-f]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
# base64 of the 8-byte CRC64NVME as S3 reports it: 12 characters ending in one '='
_CRC64_B64 = re.compile(r"^[A-Za-z0-9+/]{11}=$")
_BLOBS, _SNAPSHOTS, _REFS = "blobs/", "snapshots/", "refs/"


def blob_key(prefix: str, hub_id: str) -> str:
    """The key of a file's bytes: named by its Hub id, so every commit that has the same
    content shares the one object."""
    return f"{prefix}{_BLOBS}{hub_id}"


def snapshot_key(prefix: str, commit: str) -> str:
    """The key of one commit's metadata object."""
    return f"{prefix}{_SNAPSHOTS}{commit}.json"


def ref_key(prefix: str, ref: str) -> str:
    """The key holding the commit ``ref`` pointed to (``ref`` may contain '/')."""
    return f"{prefix}{_REFS}{ref}"


def refs_prefix(prefix: str) -> str:
    """The prefix under which every ref of a mirror lives (list it to find the refs)."""
    return f"{prefix}{_REFS}"


def snapshots_prefix(prefix: str) -> str:
    """The prefix under which every commit's metadata lives (its presence marks a mirror)."""
    return f"{prefix}{_SNAPSHOTS}"


def is_commit(text: str) -> bool:
    """Is ``text`` a full 40-hex lowercase commit sha (as the Hub and the refs give it)?"""
    return bool(_COMMIT.match(text))


def parse_ref_body(body: bytes, *, where: str) -> str:
    """The commit a ref object holds (40 hex, surrounding whitespace allowed)."""
    try:
        text = body.decode("ascii").strip()
    except UnicodeDecodeError:
        text = ""
    if not is_commit(text):
        raise InvalidListingError(
            f"the mirror ref {where} does not hold a 40-hex commit sha ({body[:60]!r})"
        )
    return text


@dataclass(frozen=True)
class MirrorFile:
    """One file of a mirrored commit: where it goes, how big it is, the Hub's id of its bytes
    (which names its blob) and the object's full-object CRC64NVME as S3 reports it."""

    path: str
    size: int
    id: str
    id_kind: str  # "git-sha1" or "sha256"
    crc64nvme: str  # base64, as S3 gives it

    def to_json(self) -> dict[str, str | int]:
        return {
            "path": self.path,
            "size": self.size,
            "id": self.id,
            "id_kind": self.id_kind,
            "crc64nvme": self.crc64nvme,
        }


@dataclass(frozen=True)
class MirrorCommit:
    """The metadata of one mirrored commit (``snapshots/<commit>.json``)."""

    repo_id: str
    commit: str
    ref: str  # what was asked for when mirrored: a branch, a tag, or the sha itself
    source: str  # where it was mirrored from, redacted (no credentials)
    mirrored_at: str  # RFC 3339 UTC
    files: tuple[MirrorFile, ...]  # sorted by path
    repo_type: str = "model"

    def to_json(self) -> bytes:
        """The metadata object's body: UTF-8 JSON, files sorted by path, stable key order."""
        body = {
            "format": FORMAT,
            "repo_id": self.repo_id,
            "repo_type": self.repo_type,
            "commit": self.commit,
            "ref": self.ref,
            "source": self.source,
            "mirrored_at": self.mirrored_at,
            "files": [f.to_json() for f in sorted(self.files, key=lambda f: f.path)],
        }
        return (json.dumps(body, indent=1, ensure_ascii=False) + "\n").encode("utf-8")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def parse_mirror_commit(body: bytes, *, where: str) -> MirrorCommit:
    """Parse a ``snapshots/<commit>.json`` body; ``where`` (its URI) names it in errors.

    Refuses what is not this format: not JSON, another ``format``, a field missing or of the
    wrong type, a commit that is not 40 hex, an unsafe path, a path listed twice, an id that
    does not fit its kind, a negative size, a CRC64NVME that is not S3's base64."""
    data = load_json(
        body, where=f"the mirror metadata {where}", max_bytes=64 << 20, error=InvalidListingError
    )
    if not isinstance(data, dict):
        raise InvalidListingError(f"the mirror metadata {where} is not a JSON object")
    fmt = data.get("format")
    if fmt != FORMAT:
        raise InvalidListingError(
            f"the mirror metadata {where} has format {fmt!r}, expected {FORMAT!r}",
            hint="it was written by another tool or another version of model-prefetch",
        )
    commit = _field(data, "commit", str, where)
    if not is_commit(commit):
        raise InvalidListingError(f"the mirror metadata {where}: commit {commit!r} is not 40 hex")
    repo_id = _field(data, "repo_id", str, where)
    if not _REPO_ID.match(repo_id) or ".." in repo_id:
        raise InvalidListingError(f"the mirror metadata {where}: {repo_id!r} is not a repo id")
    repo_type = _field(data, "repo_type", str, where)
    if repo_type != "model":
        raise InvalidListingError(
            f"the mirror metadata {where}: repo_type {repo_type!r} (only models are supported)"
        )
    ref = _field(data, "ref", str, where)
    problem = ref_name_problem(ref)
    if problem is not None:
        raise InvalidListingError(f"the mirror metadata {where}: ref {ref!r}: {problem}")
    raw_files = _field(data, "files", list, where)
    files = tuple(_parse_file(entry, where, i) for i, entry in enumerate(raw_files))
    _refuse_duplicates(files, where)
    return MirrorCommit(
        repo_id=repo_id,
        commit=commit,
        ref=ref,
        source=_field(data, "source", str, where),
        mirrored_at=_field(data, "mirrored_at", str, where),
        files=tuple(sorted(files, key=lambda f: f.path)),
        repo_type=repo_type,
    )


def _field(data: Mapping[str, object], name: str, kind: type[T], where: str) -> T:
    """``data[name]`` if present and of ``kind`` (a bool is not an int); else a clear error."""
    if name not in data:
        raise InvalidListingError(f"the mirror metadata {where} has no {name!r}")
    value = data[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidListingError(
            f"the mirror metadata {where}: {name!r} is {type(value).__name__}, "
            f"expected {kind.__name__}"
        )
    return value


def _parse_file(entry: object, where: str, index: int) -> MirrorFile:
    at = f"{where} files[{index}]"
    if not isinstance(entry, dict):
        raise InvalidListingError(f"the mirror metadata {at} is not an object")
    path = _field(entry, "path", str, at)
    problem = path_problem(path)
    if problem is not None:
        raise InvalidListingError(f"the mirror metadata {at}: unsafe path {path!r}: {problem}")
    size = _field(entry, "size", int, at)
    if size < 0:
        raise InvalidListingError(f"the mirror metadata {at}: {path!r} has size {size}")
    id_kind = _field(entry, "id_kind", str, at)
    if id_kind not in ID_KINDS:
        raise InvalidListingError(
            f"the mirror metadata {at}: id_kind {id_kind!r} is not one of {sorted(ID_KINDS)}"
        )
    hub_id = _field(entry, "id", str, at)
    if len(hub_id) != ID_KINDS[id_kind] or not _HEX.match(hub_id):
        raise InvalidListingError(
            f"the mirror metadata {at}: id {hub_id!r} of {path!r} is not a {id_kind} "
            f"({ID_KINDS[id_kind]} lowercase hex)"
        )
    crc = _field(entry, "crc64nvme", str, at)
    if not _CRC64_B64.match(crc):
        raise InvalidListingError(
            f"the mirror metadata {at}: crc64nvme {crc!r} of {path!r} is not base64 of 8 bytes"
        )
    return MirrorFile(path=path, size=size, id=hub_id, id_kind=id_kind, crc64nvme=crc)


def _refuse_duplicates(files: tuple[MirrorFile, ...], where: str) -> None:
    seen: set[str] = set()
    for f in files:
        if f.path in seen:
            raise InvalidListingError(f"the mirror metadata {where} lists {f.path!r} twice")
        seen.add(f.path)
