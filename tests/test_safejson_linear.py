"""Issue 29 item 2: :func:`prefetch.support.safejson.load_json` takes linear time on any input up to
the 1 MiB it allows (the depth pre-scan was quadratic on an unterminated string of escaped quotes:
26 s on 80 KB). The bound is a generous limit, not a benchmark: a quadratic scan takes hours."""

from __future__ import annotations

import time

import pytest

from prefetch.support.errors import SourceError
from prefetch.support.safejson import load_json

MIB = 1 << 20

WORST_CASES = {
    "escaped-quotes-unterminated": b'"' + b'\\"' * (MIB // 2 - 1),
    "quotes-and-backslash-end": b'"' + b'\\"' * (MIB // 2 - 2) + b"\\",
    "quote-runs": b'"\\' * (MIB // 2),
    "brackets-deep": b"[" * (MIB // 2) + b"]" * (MIB // 2),
    "brackets-flat": b"[]" * (MIB // 2),
    "strings-in-array": b"[" + b'"a",' * (MIB // 4 - 1) + b'""]',
}


@pytest.mark.timeout(30)  # a quadratic scan would take hours: fail, do not hang
@pytest.mark.parametrize("name", sorted(WORST_CASES))
def test_one_mebibyte_of_worst_case_input_is_read_under_a_second(name: str) -> None:
    data = WORST_CASES[name]
    assert len(data) <= MIB
    started = time.monotonic()
    try:
        load_json(data, where="the answer", max_bytes=MIB)
    except SourceError as exc:
        assert str(exc).startswith("the answer is ")
    assert time.monotonic() - started < 1.0


def test_the_depth_scan_still_ignores_brackets_inside_strings() -> None:
    assert load_json(b'["[[[[", "\\"]]", {"a": "{"}]', where="x", max_bytes=100, max_depth=2) == [
        "[[[[",
        '"]]',
        {"a": "{"},
    ]
    with pytest.raises(SourceError, match="nested 3 deep"):
        load_json(b'[[["\\\\"]]]', where="x", max_bytes=100, max_depth=2)
