"""The Store: what is in a cache directory, how it is used, and making room.

A cache directory (the agent's ``cacheDir``, = ``HF_HOME`` for vLLM) holds two kinds of entries,
each the unit of listing and eviction:

* ``hub/models--<org>--<name>/``: a Hugging Face cache repo (models with a Hub repo id);
* ``models/<name>/``: a plain directory (every other model).

Each entry keeps a small usage record, ``usage.json`` in its state folder (``<entry>/.prefetch/``
for plain entries, ``.prefetch/hub/models--<org>--<name>/`` for Hub repos), written by the agent
(the mount is ``noatime``, so access times say nothing): when it was last wanted by the config,
whether it is pinned, and per model what was last synced (spec digest, revision, complete) and
re-verified (:mod:`prefetch.pipeline.store_usage`). Eviction renames the entry into ``.trash/``
under the model's lock (readers see it vanish at once) and then deletes it.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import psutil

from prefetch.pipeline.layout import (
    HUB_DIR,
    MODELS_DIR,
    HfCacheLayout,
    Layout,
    PlainLayout,
    RecordBook,
    check_repo_folder,
    is_repo_folder,
    layout_for,
    make_dirs_inside,
    model_dir,
    model_lock,
    repo_id_of,
)
from prefetch.pipeline.spec import ModelSpec
from prefetch.pipeline.store_usage import ModelUsage, UsageRecords
from prefetch.support.errors import LayoutError

log = logging.getLogger(__name__)

TRASH_DIR = ".trash"


class CachedModelJson(TypedDict):
    """:meth:`CachedModel.to_json`: one entry as ``ls --json`` and ``gc --json`` print it."""

    key: str
    kind: str
    path: str
    name: str
    repo_id: str | None
    size: int
    revision: str | None
    models: list[str]
    last_used: str | None
    pinned: bool
    verified: bool | None
    verified_at: str | None
    wanted: bool | None
    wanted_by: list[str]


@dataclass
class CachedModel:
    """One cache entry as found on disk."""

    key: str  # "models/<name>" or "hub/models--org--name"
    kind: str  # "plain" or "hub"
    path: Path
    name: str  # plain: the directory name; hub: the repo id
    repo_id: str | None
    size: int
    revision: str | None
    models: tuple[str, ...]  # config model names recorded as living here
    last_used: float | None
    pinned: bool
    complete: bool | None  # last sync finished, no re-verification failed since (None: unknown)
    verified_at: float | None
    wanted: bool | None = None  # None: no config to compare with
    wanted_by: tuple[str, ...] = field(default_factory=tuple)

    @property
    def lru_key(self) -> float:
        if self.last_used is not None:
            return self.last_used
        try:
            return self.path.stat().st_mtime
        except OSError:
            return 0.0

    def to_json(self) -> CachedModelJson:
        return {
            "key": self.key,
            "kind": self.kind,
            "path": str(self.path),
            "name": self.name,
            "repo_id": self.repo_id,
            "size": self.size,
            "revision": self.revision,
            "models": list(self.models),
            "last_used": _iso(self.last_used),
            "pinned": self.pinned,
            "verified": self.complete,
            "verified_at": _iso(self.verified_at),
            "wanted": self.wanted,
            "wanted_by": list(self.wanted_by),
        }


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


class Store:
    """The entries of one cache directory. Thread-safe for the agent's loop and its workers."""

    def __init__(self, cache_dir: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.cache_dir = Path(cache_dir)
        #: Each entry's usage.json (its last use, pins, what was synced and verified).
        self._usage = UsageRecords(self.cache_dir, clock=clock)

    # -- where things are ----------------------------------------------------------------------

    def entry_key(self, spec: ModelSpec) -> str:
        """``hub/models--<org>--<name>`` or ``models/<name>``: the entry ``spec`` lives in."""
        return self._key(self.entry_dir(spec))

    def entry_dir(self, spec: ModelSpec) -> Path:
        return self.layout(spec).root

    def layout(self, spec: ModelSpec) -> Layout:
        return layout_for(spec, self.cache_dir, shared=True)

    def _key(self, entry_dir: Path) -> str:
        return entry_dir.relative_to(self.cache_dir).as_posix()

    def _is_hub_entry(self, entry_dir: Path) -> bool:
        return self._usage.is_hub_entry(entry_dir)

    def _state_dir(self, entry_dir: Path) -> Path:
        return self._usage.state_dir(entry_dir)

    # -- usage records (:class:`UsageRecords`) ---------------------------------------------------

    def usage(self, spec: ModelSpec) -> ModelUsage:
        """The usage record of ``spec`` in its entry ({} when none)."""
        return self._usage.model(self.entry_dir(spec), spec.name)

    def touch(self, spec: ModelSpec, when: float | None = None) -> None:
        """Record that the config wants ``spec`` now (its entry's last use), and its pin flag."""
        self._usage.touch(self.entry_dir(spec), spec, when)

    def record_pin(self, spec: ModelSpec) -> bool:
        """Record the config's pin flag for ``spec`` if its entry is in the cache.

        The pin must follow the config whenever it is loaded, not only when bytes are synced: a
        pin added to a model already cached would otherwise go unrecorded, and once the model
        left the config it would be evicted although pinned (and an unpin would never free it).
        Writes only when the record differs; returns whether it did.
        """
        entry = self.entry_dir(spec)
        if not entry.is_dir():
            return False
        return self._usage.record_pin(entry, spec)

    def record_sync(
        self, spec: ModelSpec, *, digest: str, revision: str, files: int, bytes_total: int
    ) -> None:
        self._usage.record_sync(
            self.entry_dir(spec),
            spec,
            digest=digest,
            revision=revision,
            files=files,
            bytes_total=bytes_total,
        )

    def record_verify(self, spec: ModelSpec, *, ok: bool) -> None:
        self._usage.record_verify(self.entry_dir(spec), spec, ok=ok)

    def set_last_used(self, key: str, when: float) -> None:
        """Set an entry's last use (for tests and operators moving entries up or down the LRU)."""
        self._usage.set_last_used(self._safe_entry_dir(key), when)

    def copy_intact(self, spec: ModelSpec, digest: str) -> bool:
        """Does the cache hold a complete, verified copy of ``spec`` (by its records; stat only)?"""
        rec = self.usage(spec)
        if rec.get("spec") != digest or not rec.get("complete") or rec.get("verify_ok") is False:
            return False
        try:
            records = self.layout(spec).recorded()
        except Exception as exc:  # the layout cannot read its own records: not intact
            log.warning("%s: cannot read the cached records: %s", spec.name, exc)
            return False
        if not records:
            return False
        for r in records:
            try:
                if r.local.stat().st_size != r.size:
                    return False
            except OSError:
                return False
        return True

    # -- listing -------------------------------------------------------------------------------

    def list(self, wanted: Iterable[ModelSpec] | None = None) -> list[CachedModel]:
        """Every entry on disk, sorted by key; ``wanted`` (the config's models) marks each."""
        wanted_by: dict[str, list[str]] | None = None
        if wanted is not None:
            wanted_by = {}
            for spec in wanted:
                wanted_by.setdefault(self.entry_key(spec), []).append(spec.name)
        out: list[CachedModel] = []
        for kind, entry in self._entry_dirs():
            model = self._describe(kind, entry)
            if wanted_by is not None:
                names = wanted_by.get(model.key, [])
                model.wanted = bool(names)
                model.wanted_by = tuple(names)
            out.append(model)
        return sorted(out, key=lambda m: m.key)

    def _entry_dirs(self) -> Iterator[tuple[str, Path]]:
        for kind, sub, accept in (
            ("hub", HUB_DIR, is_repo_folder),
            ("plain", MODELS_DIR, lambda n: not n.startswith(".")),
        ):
            base = self.cache_dir / sub
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                for d in sorted(base.iterdir()):
                    usable = accept(d.name) and d.is_dir() and not d.is_symlink()
                    if usable and not self._holds_nothing(d):
                        yield kind, d

    def _holds_nothing(self, entry: Path) -> bool:
        """Nothing recorded, nothing partial, no file of its own: what a sync leaves when it
        made the entry only to hold the model's lock and stopped before its first byte (making
        room failed, a stop). Such an entry is not counted (listing, usage, eviction) rather
        than deleted: the lock file in it may be another process's, waited on right now."""
        state = self._state_dir(entry)
        try:
            if RecordBook(state).load()["entries"]:
                return False
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                if any((state / "partial").iterdir()):
                    return False
            return not _has_a_file(entry, skip=state)
        except (OSError, LayoutError):
            return False  # unreadable: count it, as before

    def _describe(self, kind: str, entry: Path) -> CachedModel:
        usage = self._usage.read(entry)
        records = {k: v for k, v in usage["models"].items() if isinstance(v, dict)}
        synced = [r for r in records.values() if r.get("spec")]
        complete = (
            all(bool(r.get("complete")) and r.get("verify_ok") is not False for r in synced)
            if synced
            else None
        )
        verified = [float(r["verified_at"]) for r in synced if r.get("verified_at")]
        verified += [float(r["synced_at"]) for r in synced if r.get("synced_at")]
        revision = None
        if kind == "hub":
            repo_id = repo_id_of(entry.name)
            name = repo_id
            revision = _hub_refs(entry) or None
        else:
            repo_id = None
            name = entry.name
            with contextlib.suppress(Exception):
                revision = PlainLayout(entry).book.load().get("revision_id")
        if revision is None and synced:
            revision = synced[0].get("revision")
        last_used = usage.get("last_used")
        return CachedModel(
            key=self._key(entry),
            kind=kind,
            path=entry,
            name=name,
            repo_id=repo_id,
            size=tree_size(entry),
            revision=revision,
            models=tuple(sorted(records)),
            last_used=float(last_used) if last_used is not None else None,
            pinned=bool(usage.get("pinned")),
            complete=complete,
            verified_at=max(verified) if verified else None,
        )

    def entry(self, key: str) -> CachedModel | None:
        for m in self.list():
            if m.key == key:
                return m
        return None

    # -- space and eviction ----------------------------------------------------------------------

    def free_bytes(self) -> int:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        return int(psutil.disk_usage(str(self.cache_dir)).free)

    def eviction_candidates(
        self,
        wanted: Iterable[ModelSpec],
        *,
        busy: Iterable[str] = (),
        include_pinned: bool = False,
    ) -> builtins.list[CachedModel]:  # `list` here would name the method above
        """Entries no model in ``wanted`` maps to, not pinned, not ``busy`` (keys), LRU first."""
        skip = set(busy)
        entries = [
            m
            for m in self.list(wanted)
            if not m.wanted and m.key not in skip and (include_pinned or not m.pinned)
        ]
        return sorted(entries, key=lambda m: (m.lru_key, m.key))

    def evict(self, entry: CachedModel, *, lock_timeout: float = 10.0) -> int:
        """Remove one entry under its model lock; returns the bytes it held."""
        path = self._safe_entry_dir(entry.key)
        lock = self._lock_path(entry)
        trash_dir = make_dirs_inside(self.cache_dir, self.cache_dir / TRASH_DIR)
        trash = trash_dir / f"{path.name}.{time.time_ns()}"
        with model_lock(lock, timeout=lock_timeout):
            if not path.exists():
                return 0
            os.rename(path, trash)
            state = self._state_dir(path)
            if self._is_hub_entry(path) and state.is_dir():
                # a Hub entry's records and partials live outside it: drop them too, but keep
                # the lock file we hold
                for item in state.iterdir():
                    if item != lock:
                        if item.is_dir():
                            shutil.rmtree(item, ignore_errors=True)
                        else:
                            item.unlink(missing_ok=True)
        shutil.rmtree(trash, ignore_errors=True)
        log.info(
            "evicted %s (%d bytes)",
            entry.key,
            entry.size,
            extra={"model": entry.name, "phase": "evict", "bytes": entry.size},
        )
        return entry.size

    def empty_trash(self) -> None:
        """Finish evictions a crash interrupted."""
        shutil.rmtree(self.cache_dir / TRASH_DIR, ignore_errors=True)

    def _lock_path(self, entry: CachedModel) -> Path:
        if entry.kind == "hub" and entry.repo_id is not None:
            return HfCacheLayout(self.cache_dir, entry.repo_id).lock_path()
        return PlainLayout(entry.path).lock_path()

    def _safe_entry_dir(self, key: str) -> Path:
        """The directory of the entry ``key``, its name checked as its layout checks names
        (LayoutError for a key that names no entry, or an entry that is a symlink)."""
        top, _, name = key.partition("/")
        try:
            if top == HUB_DIR:
                path = self.cache_dir / HUB_DIR / check_repo_folder(name)
            elif top == MODELS_DIR:
                path = model_dir(self.cache_dir, name)
            else:
                raise LayoutError(f"unknown top folder {top!r}")
        except LayoutError as exc:
            raise LayoutError(f"not a cache entry: {key!r}") from exc
        if path.is_symlink():
            raise LayoutError(f"refusing to touch {path}: it is a symlink")
        return path


def _hub_refs(entry: Path) -> str:
    refs = entry / "refs"
    parts: list[str] = []
    with contextlib.suppress(OSError):
        for ref in sorted(p for p in refs.rglob("*") if p.is_file()):
            with contextlib.suppress(OSError):
                parts.append(f"{ref.relative_to(refs).as_posix()}={ref.read_text().strip()[:12]}")
    return ",".join(parts)


def _has_a_file(root: Path, *, skip: Path) -> bool:
    """Is there anything but directories under ``root`` (``skip`` and what is below it aside)?"""
    for dirpath, dirnames, filenames in os.walk(root):
        if filenames:
            return True
        dirnames[:] = [d for d in dirnames if Path(dirpath, d) != skip]
    return False


def tree_size(root: Path) -> int:
    """Bytes of the regular files under ``root`` (symlinks not followed: hub blobs count once)."""
    total = 0
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(Path(e.path))
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total
