"""The rules every path and ref name from a source must pass, in one place.

A source's listing names the files the tool will create under DEST, so a hostile or broken server
(or bucket) must not be able to name a file outside DEST, inside the tool's own state, or over
another listed file. :func:`check_listing` runs when a :class:`~prefetch.pipeline.snapshot.Snapshot`
is built, which every source's ``resolve`` does, so a new source gets the rules for free and a bad
listing is refused before any byte is fetched. :func:`ref_name_problem` holds git's ref-name rules
(``git check-ref-format``) as far as they matter for a revision that becomes a file under
``refs/``. Offending names appear in messages as ``repr`` gives them: control characters escaped.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from typing import Protocol

from prefetch.support.errors import InvalidListingError, UnsafePathError

#: The tool's own state in a plain layout (records, lock, partial downloads); no source path may
#: start with it.
STATE_DIR = ".prefetch"
#: The longest file name most Linux filesystems take (bytes of one path segment).
MAX_SEGMENT_BYTES = 255
_REF_FORBIDDEN = frozenset(" ~^:?*[\\")


#: C0 and C1 control characters and DEL: never part of a name a human meant. (One regex search
#: per path instead of a Python call per character: ~28 calls per file of a 1000-file pull.)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def path_problem(path: str) -> str | None:
    """Why ``path`` cannot be a relative file path inside a directory (None: it can).

    Refused: empty; a leading ``/``; empty, ``.`` or ``..`` segments (``a//b``, ``./a``,
    ``a/../b``, a trailing ``/``); control characters (a newline included); text that is not
    valid UTF-8; a segment longer than a file name can be."""
    if not isinstance(path, str) or not path:
        return "the path is empty"
    if path.startswith("/"):
        return "the path is absolute"
    bad = _CONTROL.search(path)
    if bad is not None:
        return f"the path contains the control character {bad.group()!r}"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "the path is not valid UTF-8"
    for segment in path.split("/"):
        if segment in ("", ".", ".."):
            return (
                f"the path has a {segment!r} segment"
                if segment
                else "the path has an empty segment"
            )
        if len(segment.encode("utf-8")) > MAX_SEGMENT_BYTES:
            return f"a segment is longer than {MAX_SEGMENT_BYTES} bytes"
    return None


def check_relative_path(path: str) -> str:
    """``path`` if it is a safe relative file path and not the tool's state; else
    :class:`UnsafePathError` naming it."""
    problem = path_problem(path)
    if problem is None and path.split("/", 1)[0] == STATE_DIR:
        problem = f"{STATE_DIR}/ is reserved for model-prefetch's own state"
    if problem is not None:
        raise UnsafePathError(
            f"the source lists an unsafe path {path!r}: {problem}",
            path=path,
            hint="nothing was downloaded; fix or remove the object at the source, "
            "or leave it out with --exclude",
        )
    return path


def file_dir_conflicts(paths: Iterable[str]) -> list[tuple[str, str]]:
    """Pairs ``(file, path_under_it)`` where one listed path is a directory of another
    (``a`` and ``a/b``): both cannot exist on disk. Sorted; one pair per clashing file."""
    listed = set(paths)
    found: dict[str, str] = {}
    for path in sorted(listed):
        parts = path.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if parent in listed and parent not in found:
                found[parent] = path
    return sorted(found.items())


class ListedFile(Protocol):
    """What :func:`check_listing` reads of a listed file (a snapshot's ``RemoteFile`` is one).

    A protocol rather than an import: the snapshot imports these rules, so this module names
    only the shape it needs and stays below it in the layers."""

    @property
    def path(self) -> str: ...

    @property
    def size(self) -> int: ...


def check_listing(files: Iterable[ListedFile]) -> None:
    """Refuse a snapshot's file list that cannot be laid out safely: an unsafe path, a negative
    size, a path listed twice (also as two spellings of one Unicode text), a file that another
    listed path needs as a directory.

    Paths that differ only in case are two files, as they are on the Linux file systems a cache
    lives on (ext4, XFS) and in a git repo; paths that differ only in Unicode normalisation
    (``é`` composed, NFC, or as ``e`` + a combining accent, NFD) print alike, so which one a
    reader opens would depend on how its name was typed: refused, naming both."""
    seen: set[str] = set()
    spellings: dict[str, str] = {}
    for f in files:
        check_relative_path(f.path)
        if not isinstance(f.size, int) or f.size < 0:
            raise InvalidListingError(
                f"the source lists {f.path!r} with an invalid size {f.size!r}"
            )
        if f.path in seen:
            raise UnsafePathError(f"the source lists {f.path!r} twice", path=f.path)
        seen.add(f.path)
        other = spellings.setdefault(unicodedata.normalize("NFC", f.path), f.path)
        if other != f.path:
            raise UnsafePathError(
                f"the source lists {other!r} and {f.path!r}: one name in two Unicode "
                "normalisations, which print alike",
                path=f.path,
                hint="nothing was downloaded; leave one of them out with --exclude",
            )
    for file, under in file_dir_conflicts(seen)[:1]:
        raise UnsafePathError(
            f"the source lists {file!r} both as a file and as a directory (of {under!r})",
            path=file,
            hint="nothing was downloaded; leave one of them out with --exclude",
        )


def ref_name_problem(ref: str) -> str | None:
    """Why ``ref`` is not a valid git ref name (None: it is), per ``git check-ref-format``
    as far as it matters here: the ref becomes a file under the cache's ``refs/``.

    >>> ref_name_problem("refs/pr/1") is None
    True
    >>> ref_name_problem("../../x")
    "it contains '..'"
    """
    if not ref:
        return "it is empty"
    bad = next((c for c in ref if _CONTROL.match(c) or c in _REF_FORBIDDEN), None)
    if bad is not None:
        return f"it contains {bad!r}"
    if ".." in ref:
        return "it contains '..'"
    if "@{" in ref or ref == "@":
        return "it contains '@{' or is '@'"
    if ref[0] in "/-":
        return f"it starts with {ref[0]!r}"
    if ref.endswith(("/", ".")):
        return f"it ends with {ref[-1]!r}"
    for component in ref.split("/"):
        if not component:
            return "it has an empty component ('//')"
        if component.startswith("."):
            return "a component starts with '.'"
        if component.endswith(".lock"):
            return "a component ends with '.lock'"
    return None


__all__ = [
    "STATE_DIR",
    "ListedFile",
    "check_listing",
    "check_relative_path",
    "file_dir_conflicts",
    "path_problem",
    "ref_name_problem",
]
