"""The resume journal beside each ``.incomplete`` file.

One JSON line of header (what the partial file is: source version, size, chunk plan, checksum),
then one line per finished chunk with its inline hash result. A chunk is journaled only after its
bytes were written, so after ``kill -9`` the next run re-fetches exactly the chunks without a line.
A header that no longer matches (object changed, other chunk size) means: start the file over.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import TextIO


class Journal:
    def __init__(self, path: Path, header: dict[str, object]) -> None:
        self.path = path
        self.header = header
        #: chunk index -> what the chunk's hasher gave (JSON: a hex digest, a list of them, ...)
        self.done: dict[int, object] = {}
        self._lock = threading.Lock()
        self._fh: TextIO | None = None

    @classmethod
    def open(
        cls, path: Path, header: dict[str, object], *, partial_exists: bool, persist: bool = True
    ) -> Journal:
        """Load a matching journal (keeping its finished chunks) or start a fresh one.

        ``persist=False`` keeps it in memory only (a file of one chunk has nothing to resume:
        the chunk is either all there or fetched again); a journal left on disk is ignored and
        removed with the file.
        """
        journal = cls(path, header)
        if not persist:
            return journal
        if partial_exists and path.exists():
            journal.done = _load(path, header)
        # Always start from a clean file: the header and the records that stand. A journal left by
        # a crash may end in a torn line, and a record appended after it would be lost with it.
        lines = [json.dumps(header, sort_keys=True)]
        lines += [json.dumps({"i": i, "r": r}) for i, r in sorted(journal.done.items())]
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, path)
        journal._fh = path.open("a", buffering=1)
        return journal

    def record(self, index: int, result: object) -> None:
        line = json.dumps({"i": index, "r": result}) + "\n"
        with self._lock:
            self.done[index] = result
            if self._fh is not None:
                self._fh.write(line)
                self._fh.flush()

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def remove(self) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _load(path: Path, header: dict[str, object]) -> dict[int, object]:
    done: dict[int, object] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    if not lines:
        return {}
    try:
        if json.loads(lines[0]) != json.loads(json.dumps(header)):
            return {}
    except json.JSONDecodeError:
        return {}
    for line in lines[1:]:
        try:
            entry = json.loads(line)
            done[int(entry["i"])] = entry["r"]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            break  # a torn last line from a crash: everything before it stands
    return done
