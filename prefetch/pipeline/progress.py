"""Progress reporting: one sink interface for the engine; a terminal bar, plain log lines, or none.

The engine calls the sink from many threads; implementations must be thread-safe and cheap.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Protocol, TextIO

from prefetch.support.redact import printable, redact
from prefetch.support.units import format_bytes, format_seconds


class ProgressSink(Protocol):
    def start(self, model: str, total_bytes: int, total_files: int) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def chunk_done(self) -> None: ...
    def file_done(self, path: str, size: int) -> None: ...
    def retry(self, reason: str) -> None: ...
    def checksum_failure(self, path: str) -> None: ...
    def finish(self) -> None: ...


class NullProgress:
    def start(self, model: str, total_bytes: int, total_files: int) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def chunk_done(self) -> None: ...
    def file_done(self, path: str, size: int) -> None: ...
    def retry(self, reason: str) -> None: ...
    def checksum_failure(self, path: str) -> None: ...
    def finish(self) -> None: ...


class TerminalProgress(NullProgress):
    """A one-line bar on a TTY (bytes, rate, ETA), redrawn at most ``interval`` seconds apart.

    Off a TTY it prints a plain line every ``interval`` seconds instead.
    """

    def __init__(self, stream: TextIO = sys.stderr, *, interval: float | None = None) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._interval = interval if interval is not None else (0.2 if self._tty else 10.0)
        self._lock = threading.Lock()
        self._done = 0
        self._files = 0
        self._total = 0
        self._total_files = 0
        self._model = ""
        self._t0 = time.monotonic()
        self._last = 0.0

    def start(self, model: str, total_bytes: int, total_files: int) -> None:
        with self._lock:
            self._model, self._total, self._total_files = model, total_bytes, total_files
            self._done, self._files = 0, 0
            self._t0 = time.monotonic()
        self._draw(force=True)

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes
        self._draw()

    def file_done(self, path: str, size: int) -> None:
        with self._lock:
            self._files += 1
        self._draw()

    def retry(self, reason: str) -> None:
        if not self._tty:
            self._stream.write(f"retrying: {printable(redact(reason))}\n")

    def finish(self) -> None:
        self._draw(force=True)
        if self._tty:
            self._stream.write("\n")
        self._stream.flush()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self._t0, 1e-6)
        rate = self._done / elapsed
        left = max(self._total - self._done, 0)
        eta = format_seconds(left / rate) if rate > 0 else "--:--"
        pct = 100.0 * self._done / self._total if self._total else 100.0
        return (
            f"{printable(self._model)} {pct:5.1f}% "
            f"{format_bytes(self._done)}/{format_bytes(self._total)} {format_bytes(rate)}/s "
            f"ETA {eta} files {self._files}/{self._total_files}"
        )

    def _draw(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self._interval:
            return
        with self._lock:
            self._last = now
            text = self.line()
        if self._tty:
            width = 30
            filled = int(width * self._done / self._total) if self._total else width
            bar = "#" * filled + "-" * (width - filled)
            self._stream.write(f"\r[{bar}] {text}\x1b[K")
        else:
            self._stream.write(text + "\n")
        self._stream.flush()
