"""The package's parts stay small enough to read whole (issue 31): no class over ~300 lines, no
function over ~60, no module over ~600. What is kept longer is named in :data:`KEPT` with the
reason; a part that grows past a limit, or a kept part that shrinks under it, fails here."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from .support import REPO_ROOT

PACKAGE = REPO_ROOT / "prefetch"
LIMITS = {"module": 600, "class": 300, "function": 60}

#: (kind, "path:qualified name") -> why it is kept longer than its limit
KEPT: dict[tuple[str, str], str] = {
    ("function", "prefetch/cli/pull.py:pull"): "a click command: one parameter per option "
    "(26 lines of signature), its body is the pipeline's composition",
    ("function", "prefetch/cli/mirror.py:mirror"): "a click command: one parameter per option "
    "(19 lines of signature), its body picks the writer for the destination",
}


def _parts(path: Path) -> Iterator[tuple[str, str, int]]:
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(REPO_ROOT).as_posix()
    yield "module", rel, len(text.splitlines())

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                assert child.end_lineno is not None
                yield kind, f"{rel}:{name}", child.end_lineno - child.lineno + 1
                yield from walk(child, f"{name}.")

    yield from walk(ast.parse(text), "")


def _measured() -> dict[tuple[str, str], int]:
    return {
        (kind, name): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        for kind, name, lines in _parts(path)
    }


def test_no_part_is_over_its_limit_unless_kept_with_a_reason() -> None:
    over = {
        key: lines
        for key, lines in _measured().items()
        if lines > LIMITS[key[0]] and key not in KEPT
    }
    assert not over, "over the limit (split it by job, or keep it in KEPT with why): " + ", ".join(
        f"{kind} {name} ({lines} lines > {LIMITS[kind]})"
        for (kind, name), lines in sorted(over.items())
    )


@pytest.mark.parametrize("key", sorted(KEPT))
def test_a_kept_part_is_still_over_its_limit(key: tuple[str, str]) -> None:
    """A kept entry that no longer applies is removed, so KEPT stays the true list."""
    lines = _measured().get(key)
    assert lines is not None, f"{key[0]} {key[1]} no longer exists: drop it from KEPT"
    assert lines > LIMITS[key[0]], f"{key[0]} {key[1]} is {lines} lines now: drop it from KEPT"
