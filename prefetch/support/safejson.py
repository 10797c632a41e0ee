"""JSON from outside, read with bounds: size, nesting depth, and numbers that are numbers.

The standard library's :func:`json.loads` accepts ``NaN``/``Infinity``, turns ``1e999`` into
``inf``, and recurses once per nesting level, so a document of ten thousand ``[`` ends in a
``RecursionError``. Hub answers, a mirror's metadata and the agent's node annotation are written
by someone else: :func:`load_json` reads them into plain values or raises one error naming the
document (``where``) and what is wrong with it. Hand-written because no well-kept library offers
a depth bound on the standard parser (orjson's is fixed at 1024 and it is not a dependency): the
depth is checked before parsing by a scan that is linear in the text for any input (strings
removed by one pattern that matches from every quote it starts at, so it never re-scans; the
brackets left over are summed in C by :func:`itertools.accumulate`).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import NoReturn

from prefetch.support.errors import PrefetchError, SourceError

__all__ = ["MAX_DEPTH", "load_json"]

#: Deeper than anything the Hub, a mirror or the agent writes (they nest 3 or 4 levels).
MAX_DEPTH = 32
#: A string with its escapes, or an unterminated one up to the end of the text: the possessive
#: loop stops only at a quote, a lone backslash before the end, or the end, and each of those
#: completes the match, so a match started at a quote never fails and the text is read once.
#: (A pattern requiring the closing quote re-read the rest of the text from every quote of an
#: unterminated string: quadratic time.)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class _Refused(ValueError):
    """A value the document may not hold (raised from the parser's hooks)."""


def load_json(
    data: bytes | str,
    *,
    where: str,
    max_bytes: int,
    max_depth: int = MAX_DEPTH,
    error: type[PrefetchError] = SourceError,
) -> object:
    """``data`` parsed, or ``error("<where>: ...")`` when it is larger than ``max_bytes``,
    nested deeper than ``max_depth``, not JSON, or holds NaN, an infinity or an out-of-range
    number."""
    if len(data) > max_bytes:
        raise error(f"{where} is {len(data)} bytes of JSON, more than the {max_bytes} allowed")
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise error(f"{where} is not JSON (not UTF-8: {exc.reason} at byte {exc.start})") from None
    depth = _depth(text)
    if depth > max_depth:
        raise error(f"{where} is JSON nested {depth} deep, more than the {max_depth} allowed")
    try:
        return json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except _Refused as exc:
        raise error(f"{where} is not JSON ({exc})") from None
    except json.JSONDecodeError as exc:
        raise error(
            f"{where} is not JSON ({exc.msg}: line {exc.lineno} column {exc.colno})"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise error(f"{where} is not JSON ({type(exc).__name__})") from None


def _depth(text: str) -> int:
    """The deepest bracket nesting outside strings (unbalanced text is left to the parser)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _constant(name: str) -> NoReturn:
    raise _Refused(f"{name} is no JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} is out of range")
    return value


def _int(text: str) -> int:
    if len(text) > 40:  # far beyond any size, time or count; int() of it costs quadratic time
        raise _Refused(f"the number {text[:40]}... is out of range")
    return int(text)
