"""Human-friendly sizes and durations: parsing for flags/config, formatting for messages."""

from __future__ import annotations

import math
import re
import time

from prefetch.support.errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
#: The patterns below are ASCII-only and use no look-around, so the chart's JSON Schema (read
#: by Helm's Go regexp) and this module (Python's re) accept exactly the same strings.
_WS = r"[\t\n\v\f\r ]*"
_NUMBER = r"[0-9]+(\.[0-9]+)?"


def _any_case(word: str) -> str:
    return "".join(f"[{c.lower()}{c.upper()}]" for c in word)


_UNITS = "|".join(_any_case(u) for u in sorted(_SIZE_UNITS, key=len, reverse=True) if u)
#: A size as a string: a number, then one of the units (any case), blanks around.
SIZE_PATTERN = rf"^{_WS}({_NUMBER}){_WS}({_UNITS})?{_WS}$"
_DURATION_UNIT = "|".join(sorted(_DURATION_UNITS, key=len, reverse=True))
_STEP = rf"{_NUMBER}({_DURATION_UNIT})"
_NONZERO_STEP = rf"([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)({_DURATION_UNIT})"
#: A duration as a string: steps like 1h30m (blanks around), or 0 / off / never / "" (off).
DURATION_PATTERN = rf"^({_WS}({_STEP})+{_WS}|0|off|never)?$"
#: A duration string of more than zero seconds.
POSITIVE_DURATION_PATTERN = rf"^{_WS}({_STEP})*{_NONZERO_STEP}({_STEP})*{_WS}$"
_SIZE_RE = re.compile(SIZE_PATTERN)


def _integers_from(n: int) -> str:
    """A regex of the whole numbers >= ``n`` (no leading zeros)."""
    digits = str(n)
    alternatives = [f"[1-9][0-9]{{{len(digits)},}}"]  # more digits than n
    for i, d in enumerate(digits):
        rest = len(digits) - i - 1
        if rest == 0:
            alternatives.append(f"{digits[:i]}[{d}-9]")
        elif d != "9":
            alternatives.append(f"{digits[:i]}[{int(d) + 1}-9][0-9]{{{rest}}}")
    return "|".join(alternatives)


def size_pattern_at_least(least: int) -> str:
    """The size strings of at least ``least`` bytes whose whole part says so alone (``64KiB``,
    ``1MB``; not ``0.5MiB``, which a schema then refuses though it is larger): a subset of
    :data:`SIZE_PATTERN`, with no arithmetic a regex cannot do."""
    by_unit = []
    for unit, factor in _SIZE_UNITS.items():
        whole = _integers_from(max(1, -(-least // factor)))
        by_unit.append(rf"0*({whole})(\.[0-9]+)?{_WS}{_any_case(unit)}")
    return rf"^{_WS}({'|'.join(by_unit)}){_WS}$"


_DURATION_RE = re.compile(DURATION_PATTERN)
_STEP_RE = re.compile(rf"([0-9]+(?:\.[0-9]+)?)({_DURATION_UNIT})")


def parse_size(value: str | int, *, field: str = "size") -> int:
    """'16MiB' -> 16777216. Bare numbers are bytes."""
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{field}: must not be negative, got {value}")
        return value
    m = _SIZE_RE.fullmatch(str(value))
    if m is None:
        raise ConfigError(f"{field}: not a size: {value!r} (use e.g. 64MiB, 1GiB, 1048576)")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(3) or "").lower()])


def parse_duration(value: str | int | float | None, *, field: str = "duration") -> float | None:
    """'10m' / '1h30m' / 90 -> seconds; None, 0, '0' and 'off' -> None (disabled)."""
    if value is None or value in (0, "0", "off", "never", ""):
        return None
    if isinstance(value, int | float):
        if math.isnan(value):  # YAML's .nan: every comparison with it is false
            raise ConfigError(f"{field}: not a duration: {value} (use e.g. 30s, 10m, 24h)")
        if value < 0:
            raise ConfigError(f"{field}: must not be negative, got {value}")
        return float(value)
    if _DURATION_RE.fullmatch(value) is None:
        raise ConfigError(f"{field}: not a duration: {value!r} (use e.g. 30s, 10m, 24h)")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in _STEP_RE.findall(value))


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
