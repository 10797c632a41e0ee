"""README stays true: its example config parses, and its test command is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from prefetch.agent.config import parse_config
from prefetch.cli import main

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_readme_agent_config_example_is_valid():
    blocks = [b.split("```", 1)[0] for b in README.split("```yaml\n")[1:]]
    block = next(b for b in blocks if "name: llama-3-1-70b-instruct-awq" in b)  # "The agent"
    config = parse_config(block)
    assert [m.name for m in config.models] == ["llama-3-1-70b-instruct-awq", "llama-8b-mirror"]
    assert config.models[1].repo_id == "meta-llama/Llama-3.1-8B-Instruct"


def test_quick_start_commands_exist_and_ci_runs_the_readme_test_command():
    quick = README.split("## Quick start", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    install, tests = quick.strip().splitlines()
    assert install.endswith("prefetch demo")
    assert CliRunner().invoke(main, ["demo", "--help"]).exit_code == 0
    ci = (REPO / ".ci" / "run").read_text()
    # CI makes a new venv on every run and runs README's command with its interpreter, verbatim.
    assert re.search(r'^python3 -m venv "\$venv"$', ci, re.MULTILINE)
    assert re.search(r'^py="\$venv/bin/python"$', ci, re.MULTILINE)
    assert re.search(r"""^"\$py" -m pip install .*-e '\.\[test\]'$""", ci, re.MULTILINE)
    assert tests.startswith("python ")
    with_venv = '"$py"' + tests.removeprefix("python")
    assert re.search(rf"^{re.escape(with_venv)}$", ci, re.MULTILINE), with_venv
