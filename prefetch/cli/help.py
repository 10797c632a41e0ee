"""``--help`` as users of s5cmd and ``hf download`` expect it: options in named groups (source,
destination, performance, verification, output), numbered examples at the end, and a group's
command list with whole one-line summaries (click cuts them at the terminal's width).

Hand-written because click has no option groups, and click-option-group (the library that adds
them) changes how options are declared: two small overrides of click's own formatting hooks
keep every declaration as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

#: (title, names of the parameters under it), in the order ``--help`` shows them.
OptionGroups = Sequence[tuple[str, Sequence[str]]]
#: (what it does, the command line): shown numbered under "Examples".
Examples = Sequence[tuple[str, str]]


class HelpCommand(click.Command):
    """A command whose help groups its options and ends with numbered examples."""

    def __init__(
        self,
        *args: Any,
        option_groups: OptionGroups = (),
        examples: Examples = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.option_groups = option_groups
        self.examples = examples

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        write_option_groups(self, self.option_groups, ctx, formatter)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_epilog(ctx, formatter)
        write_examples(self.examples, formatter)


class HelpGroup(click.Group):
    """A group whose command list shows every summary whole, and whose help ends with
    numbered examples. Its subcommands are :class:`HelpCommand` unless they say otherwise."""

    command_class = HelpCommand

    def __init__(self, *args: Any, examples: Examples = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.examples = examples

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=1_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_epilog(ctx, formatter)
        write_examples(self.examples, formatter)


HelpGroup.group_class = HelpGroup  # a group's subgroups format the same way


def write_option_groups(
    command: click.Command,
    groups: OptionGroups,
    ctx: click.Context,
    formatter: click.HelpFormatter,
) -> None:
    """Each group's options under its title, then the rest (``--help`` included) under
    "Other options" ("Options" when there are no groups)."""
    records = {}
    for param in command.get_params(ctx):
        if not isinstance(param, click.Option):
            continue  # arguments are in the usage line (click shows them in no section)
        record = param.get_help_record(ctx)
        if record is not None and param.name is not None:
            records[param.name] = record
    for title, names in groups:
        rows = [records.pop(name) for name in names if name in records]
        if rows:
            with formatter.section(title):
                formatter.write_dl(rows)
    if records:
        with formatter.section("Other options" if groups else "Options"):
            formatter.write_dl(list(records.values()))


def write_examples(examples: Examples, formatter: click.HelpFormatter) -> None:
    """``Examples:`` then ``1) what it does`` and the command line below it, unwrapped (a
    command is copied whole, so it is never folded)."""
    if not examples:
        return
    with formatter.section("Examples"):
        for number, (what, line) in enumerate(examples, 1):
            width = max(formatter.width - formatter.current_indent, 20)
            margin = " " * formatter.current_indent
            formatter.write(
                click.wrap_text(
                    f"{number}) {what}",
                    width,
                    initial_indent=margin,
                    subsequent_indent=margin + "   ",
                )
                + f"\n{margin}   $ {line}\n"
            )
