"""Each cache entry's usage record, ``usage.json`` in its state folder (``<entry>/.prefetch/``
for plain entries, ``.prefetch/hub/models--<org>--<name>/`` for Hub repos): when the config last
wanted the entry, whether it is pinned, and per model what was last synced and re-verified.
:class:`UsageRecords` reads it and writes each change atomically under one lock (the agent's
loop and its workers write concurrently)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Required, TypedDict, cast

from prefetch.pipeline.layout import HUB_DIR, PlainLayout, atomic_write, repo_state_dir
from prefetch.pipeline.spec import ModelSpec

# Its lines keep the logger name they have always had, so log queries keep matching.
log = logging.getLogger("prefetch.pipeline.store")

USAGE_FILE = "usage.json"

__all__ = ["USAGE_FILE", "ModelUsage", "UsageRecord", "UsageRecords"]


class ModelUsage(TypedDict, total=False):
    """One model's part of an entry's usage record (each key written when it happens)."""

    pin: bool
    spec: str  # the digest of the spec last synced
    source: str
    revision: str
    complete: bool
    synced_at: float
    files: int
    bytes: int
    verify_ok: bool
    verified_at: float


class UsageRecord(TypedDict, total=False):
    """An entry's ``usage.json``."""

    format: int
    models: Required[dict[str, ModelUsage]]  # by config model name
    last_used: float
    pinned: bool


class UsageRecords:
    """The usage records of the entries of ``cache_dir`` (each entry named by its directory).
    ``clock`` gives the times written."""

    def __init__(self, cache_dir: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.cache_dir = cache_dir
        self._clock = clock
        self._lock = threading.Lock()

    def is_hub_entry(self, entry_dir: Path) -> bool:
        return entry_dir.parent == self.cache_dir / HUB_DIR

    def state_dir(self, entry_dir: Path) -> Path:
        """Our state for an entry, where its layout keeps it: inside a plain entry, but outside
        ``hub/`` for Hub repos (huggingface_hub's cache scan must see pristine repo folders),
        beside the HfCacheLayout's records."""
        if self.is_hub_entry(entry_dir):
            return repo_state_dir(self.cache_dir, entry_dir.name)
        return PlainLayout(entry_dir).state

    def _path(self, entry_dir: Path) -> Path:
        return self.state_dir(entry_dir) / USAGE_FILE

    def read(self, entry_dir: Path) -> UsageRecord:
        """The entry's record as written (an empty one when missing or unreadable)."""
        try:
            data = json.loads(self._path(entry_dir).read_text())
        except (FileNotFoundError, NotADirectoryError):
            return {"format": 1, "models": {}}
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable usage record in %s: %s", entry_dir, exc)
            return {"format": 1, "models": {}}
        if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
            return {"format": 1, "models": {}}
        return cast(UsageRecord, data)  # as written; a model's record is type-checked where read

    def _update(self, entry_dir: Path, change: Callable[[UsageRecord], None]) -> None:
        with self._lock:
            data = self.read(entry_dir)
            change(data)
            data["pinned"] = any(bool(m.get("pin")) for m in data["models"].values())
            atomic_write(self._path(entry_dir), json.dumps(data, sort_keys=True).encode())

    def model(self, entry_dir: Path, name: str) -> ModelUsage:
        """The record of model ``name`` in the entry ({} when none)."""
        with self._lock:
            record = self.read(entry_dir)["models"].get(name)
        return ModelUsage(**record) if isinstance(record, dict) else {}

    def touch(self, entry_dir: Path, spec: ModelSpec, when: float | None) -> None:
        now = self._clock() if when is None else when

        def change(data: UsageRecord) -> None:
            data["last_used"] = now
            data["models"].setdefault(spec.name, {})["pin"] = spec.pin

        self._update(entry_dir, change)

    def record_pin(self, entry_dir: Path, spec: ModelSpec) -> bool:
        """Write ``spec``'s pin flag unless the record has it; returns whether it wrote."""
        with self._lock:
            record = self.read(entry_dir)["models"].get(spec.name)
        if isinstance(record, dict) and record.get("pin") is spec.pin:
            return False

        def change(data: UsageRecord) -> None:
            data["models"].setdefault(spec.name, {})["pin"] = spec.pin

        self._update(entry_dir, change)
        return True

    def record_sync(
        self,
        entry_dir: Path,
        spec: ModelSpec,
        *,
        digest: str,
        revision: str,
        files: int,
        bytes_total: int,
    ) -> None:
        now = self._clock()

        def change(data: UsageRecord) -> None:
            data["last_used"] = now
            rec = data["models"].setdefault(spec.name, {})
            rec.update(
                {
                    "spec": digest,
                    "source": str(spec.source),
                    "revision": revision,
                    "complete": True,
                    "synced_at": now,
                    "files": files,
                    "bytes": bytes_total,
                    "pin": spec.pin,
                }
            )
            if rec.get("verify_ok") is False:
                rec["verify_ok"] = True
                rec["verified_at"] = now

        self._update(entry_dir, change)

    def record_verify(self, entry_dir: Path, spec: ModelSpec, *, ok: bool) -> None:
        now = self._clock()

        def change(data: UsageRecord) -> None:
            rec = data["models"].setdefault(spec.name, {})
            rec.update({"verified_at": now, "verify_ok": ok})
            if not ok:
                rec["complete"] = False

        self._update(entry_dir, change)

    def set_last_used(self, entry_dir: Path, when: float) -> None:
        with self._lock:
            data = self.read(entry_dir)
            data["last_used"] = when
            atomic_write(self._path(entry_dir), json.dumps(data, sort_keys=True).encode())
