"""``--help`` (issue 34): every command ends with numbered examples that parse, ``prefetch
--help`` shows whole one-line summaries, and ``pull`` groups its options."""

from __future__ import annotations

import re
import shlex

import click
import pytest
from click.testing import CliRunner

from prefetch.cli import main


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path under ``group`` (``("cache", "key")``...), groups included."""
    ctx = click.Context(group, info_name="prefetch")
    found = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        found.append((*prefix, name))
        if isinstance(command, click.Group):
            found += _commands(command, (*prefix, name))
    return found


COMMANDS = [(), *_commands(main)]


def _help(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(main, [*path, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    return result.output


def _parses(argv: list[str]) -> None:
    """``prefetch ARGV`` parses with click's own parser (nothing runs)."""
    ctx: click.Context = click.Context(main, info_name="prefetch")
    command: click.Command = main
    while argv and isinstance(command, click.Group):
        sub = command.get_command(ctx, argv[0])
        assert sub is not None, argv
        ctx, command, argv = click.Context(sub, info_name=argv[0], parent=ctx), sub, argv[1:]
    try:
        command.make_context(ctx.info_name, argv, parent=ctx.parent)
    except click.exceptions.Exit as done:  # --help: parsed, and it prints the help
        assert done.exit_code == 0


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "prefetch")
def test_every_help_ends_with_numbered_examples_that_parse(path: tuple[str, ...]) -> None:
    text = _help(path)
    examples = text.split("\nExamples:\n", 1)[1]
    numbers = re.findall(r"^  (\d+)\) ", examples, re.MULTILINE)
    assert numbers == [str(n) for n in range(1, len(numbers) + 1)] and numbers, examples
    lines = re.findall(r"^     \$ (.+)$", examples, re.MULTILINE)
    assert len(lines) == len(numbers)
    for line in lines:
        argv = shlex.split(line)
        assert argv[0] == "prefetch", line
        _parses(argv[1:])


def test_the_top_level_help_shows_every_summary_whole_on_one_line() -> None:
    text = _help(())
    rows = text.split("\nCommands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    names = [row.split()[0] for row in rows]
    assert names == [p[0] for p in COMMANDS if len(p) == 1]  # no continuation lines
    for row in rows:
        assert not row.rstrip().endswith("..."), row
        assert row.rstrip().endswith("."), row  # a whole sentence
        assert len(row) <= 80


def test_pull_groups_its_options() -> None:
    text = _help(("pull",))
    sections = re.findall(r"^(\w[\w ]*):$", text, re.MULTILINE)
    assert sections == [
        "Source", "Destination", "Performance", "Verification", "Output", "Other options",
        "Examples",
    ]  # fmt: skip
    performance = text.split("\nPerformance:\n", 1)[1].split("\n\n", 1)[0]
    assert "--concurrency" in performance and "--chunk-size" in performance
    assert "--include" in text.split("\nSource:\n", 1)[1].split("\n\n", 1)[0]
    assert "--json" in text.split("\nOutput:\n", 1)[1].split("\n\n", 1)[0]


def test_a_bad_example_would_be_caught() -> None:
    with pytest.raises(click.UsageError):
        _parses(["pull", "s3://b/p"])  # DEST missing
    with pytest.raises(click.UsageError):
        _parses(["pull", "s3://b/p", "/d", "--no-such-option"])
