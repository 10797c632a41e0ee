"""README stays true: its links resolve, its commands parse, its test command is what CI runs
(and the agent page's example config parses)."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from prefetch.agent.config import parse_config
from prefetch.cli import main

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_the_agent_page_config_example_is_valid():
    agent_page = (REPO / "docs" / "agent.md").read_text()
    blocks = [b.split("```", 1)[0] for b in agent_page.split("```yaml\n")[1:]]
    block = next(b for b in blocks if "name: llama-3-1-70b-instruct-awq" in b)
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


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # no code comments
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


def test_every_relative_link_of_readme_and_docs_resolves_with_its_anchor():
    checked = 0
    for page in PAGES:
        for target in _LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto: ... (tests talk to no network)
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.name}: {target} does not exist"
            if anchor:
                assert anchor in _anchors(file), f"{page.name}: no heading for {target}"
            checked += 1
    assert checked >= 10  # README links every docs page


def test_readme_links_a_page_for_each_topic_it_dropped():
    for page in ("pulling", "mirrors", "agent", "time-to-serve", "operations", "deploy",
                 "performance", "architecture", "fleet-cost", "upgrading"):  # fmt: skip
        assert f"](docs/{page}.md)" in README, page


def test_readme_is_an_introduction():
    assert len(README.splitlines()) <= 150


def _sh_commands(text: str) -> list[str]:
    """The command lines of the ``sh`` blocks (comments dropped, ``&&`` chains split)."""
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.DOTALL):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines += [part.strip() for part in line.split("&&")]
    return lines


def _parses(argv: list[str]) -> None:
    """``prefetch ARGS`` parses: the command exists and its options and arguments are valid
    (click's own parser; nothing runs, so commands that need a server or the network count)."""
    import click

    group = click.Context(main, info_name="prefetch")
    command = main.get_command(group, argv[0])
    assert command is not None, argv
    command.make_context(argv[0], argv[1:], parent=group)


def test_every_command_of_readme_parses_or_is_an_install():
    import shlex
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    seen = set()
    for line in _sh_commands(README):
        argv = shlex.split(line)
        if argv[0] == "prefetch":
            _parses(argv[1:])
        elif argv[:3] == ["pip", "install", "-e"]:
            extra = re.fullmatch(r"\.(?:\[(\w+)\])?", argv[3])
            assert extra, line
            assert extra[1] is None or extra[1] in extras["optional-dependencies"], line
        else:
            assert line == "python -m pytest -q -ra", line  # CI runs it (test above)
        seen.add(argv[0])
    assert seen == {"pip", "prefetch", "python"}
