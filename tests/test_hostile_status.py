"""Hostile review, issue 22: ``prefetch status`` reads annotations written by anything. A bad
note is reported on its own node's row (the other nodes still listed), names are escaped, and
nothing ends in a traceback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefetch.support.constants import PROGRESS_ANNOTATION

from .fakes.k8s_stub import KubeStub, running_stub
from .test_status_cmd import kubeconfig, status, warming_node

GOOD = {"v": 1, "at": "2026-12-04T10:00:00Z", "ready": False, "prefix": "x", "taint": "t"}


@pytest.fixture
def stub() -> Iterator[KubeStub]:
    yield from running_stub()


def note(**models: Any) -> str:
    return json.dumps({**GOOD, "models": [dict(name="m", phase="syncing", **models)]})


BAD_NOTES = {
    "nan": note(done=float("nan")),
    "infinity": note(total=float("inf")),
    "huge float": note(done=1).replace('"done": 1', '"done": 1e999'),
    "huge int": note(done=1).replace('"done": 1', '"done": ' + "9" * 5000),
    "big int": note(total=10**30),
    "wrong type": note(done="8 GiB"),
    "models not a list": json.dumps({**GOOD, "models": 5}),
    "model not an object": json.dumps({**GOOD, "models": ["llama"]}),
    "ready not a bool": json.dumps({**GOOD, "ready": "yes", "models": []}),
    "deep": '{"v": 1, "models": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "not json": "{",
    "too large": json.dumps({**GOOD, "models": [], "pad": "x" * 300_000}),
}


@pytest.mark.parametrize("case", list(BAD_NOTES))
def test_a_bad_note_is_reported_on_its_node_and_the_others_are_listed(
    stub: KubeStub, tmp_path: Path, case: str
) -> None:
    warming_node(stub, "a-good-node", written_ago=5)
    stub.add_node("b-bad-node", annotations={PROGRESS_ANNOTATION: BAD_NOTES[case]})
    config = str(kubeconfig(tmp_path / "kc", stub.url))

    result = status("--kubeconfig", config)
    assert result.exit_code == 0, result.output
    assert result.exception is None
    lines = result.stdout.splitlines()
    bad = [line for line in lines if line.startswith("b-bad-node")]
    assert len(bad) == 1 and "(unreadable agent report: " in bad[0], result.stdout
    assert any(line.startswith("a-good-node") for line in lines)

    doc = json.loads(status("--kubeconfig", config, "-o", "json").stdout)
    second = next(n for n in doc["nodes"] if n["node"] == "b-bad-node")
    assert second["report"] is False and second["problem"].startswith("unreadable agent report")


def test_names_cannot_drive_the_terminal_or_forge_a_row(stub: KubeStub, tmp_path: Path) -> None:
    evil = "llama\nforged-node  yes  off  qwen  ready"
    hostile = json.dumps(
        {
            **GOOD,
            "models": [
                {"name": evil, "phase": "syncing\x1b[2J\x07", "reason": "r\rX\u202eY"},
            ],
        }
    )
    stub.add_node("gpu-1", annotations={PROGRESS_ANNOTATION: hostile})

    result = status("--kubeconfig", str(kubeconfig(tmp_path / "kc", stub.url)))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 2  # the header and one row: nothing forged
    assert not any(c in result.stdout for c in "\x1b\x07\r\u202e")
    assert "llama\\nforged-node" in lines[1] and "\\x1b[2J\\x07" in lines[1]
