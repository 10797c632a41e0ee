"""Human-friendly sizes and durations: parsing for flags/config, formatting for messages."""

from __future__ import annotations

import re
import time

from prefetch.errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_size(value: str | int, *, field: str = "size") -> int:
    """'16MiB' -> 16777216. Bare numbers are bytes."""
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{field}: must not be negative, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"{field}: not a size: {value!r} (use e.g. 64MiB, 1GiB, 1048576)")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_duration(value: str | int | float | None, *, field: str = "duration") -> float | None:
    """'10m' / '1h30m' / 90 -> seconds; None, 0, '0' and 'off' -> None (disabled)."""
    if value is None or value in (0, "0", "off", "never", ""):
        return None
    if isinstance(value, int | float):
        if value < 0:
            raise ConfigError(f"{field}: must not be negative, got {value}")
        return float(value)
    text = str(value).strip()
    if not text or _DURATION_RE.sub("", text) != "":
        raise ConfigError(f"{field}: not a duration: {value!r} (use e.g. 30s, 10m, 24h)")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION_RE.findall(text))


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_seconds(s: float) -> str:
    s = max(0, int(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


def iso_utc(ts: float | None) -> str | None:
    """A unix time as ``2026-12-03T16:15:17Z`` (None stays None), for logs and /readyz."""
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
