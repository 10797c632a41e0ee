"""Watching the config file for changes, ConfigMap volumes included.

The kubelet updates a mounted ConfigMap by writing a new ``..<timestamp>/`` directory, pointing a
temporary symlink at it and renaming that over ``..data``; ``models.yaml`` itself is a symlink to
``..data/models.yaml`` and never changes. So the *directory holding the path we were given* is
watched (not the resolved file), and any change in it (create, move, delete, write) is reported.
The agent then re-reads the file and compares bytes, so spurious events cost one read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from watchdog.events import (
    EVENT_TYPE_CLOSED_NO_WRITE,
    EVENT_TYPE_OPENED,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

log = logging.getLogger(__name__)
_IGNORED = frozenset({EVENT_TYPE_OPENED, EVENT_TYPE_CLOSED_NO_WRITE})


class _Handler(FileSystemEventHandler):
    def __init__(self, on_change: Callable[[], None]) -> None:
        self._on_change = on_change

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in _IGNORED:  # our own reads of the file
            return
        self._on_change()


class ConfigWatcher:
    """Calls ``on_change`` (from a watchdog thread) whenever the config's directory changes."""

    def __init__(self, path: Path, on_change: Callable[[], None]) -> None:
        # abspath, not resolve: the symlink's own directory is the one the kubelet swaps in.
        self.directory = Path(os.path.abspath(path)).parent
        self._on_change = on_change
        self._observer: BaseObserver | None = None

    def start(self) -> bool:
        """Start watching; False (and one warning) when it cannot, e.g. out of inotify watches."""
        observer = Observer()
        try:
            observer.schedule(_Handler(self._on_change), str(self.directory), recursive=False)
            observer.start()
        except OSError as exc:
            log.warning(
                "cannot watch %s for config changes (%s); polling it instead", self.directory, exc
            )
            return False
        self._observer = observer
        return True

    def stop(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            observer.join(timeout=5)
