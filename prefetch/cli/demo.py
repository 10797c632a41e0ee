"""``prefetch demo``: a local S3 server, a generated model, a verified pull."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from prefetch.cli.help import HelpCommand

if TYPE_CHECKING:
    pass
from prefetch.cli.common import (
    on_interrupt,
    size_option,
    writable_destination,
)


@click.command(
    cls=HelpCommand,
    short_help="Try it here: a local S3 server, a generated model, a verified pull.",
    examples=[
        ("The whole path on a 96 MiB model; its data is removed at the end", "prefetch demo"),
        ("A bigger model, kept afterwards", "prefetch demo --size 1GiB --keep"),
        ("Pull into a folder of your own (kept)", "prefetch demo --dest /tmp/demo-model"),
    ],
)  # fmt: skip
@click.option("--size", default="96MiB", show_default=True, help="Total size of the model.")
@click.option(
    "--dest",
    default=None,
    help="Where to pull to, kept after the demo [default: a folder the demo removes].",
)
@click.option(
    "--keep",
    is_flag=True,
    help="Keep the demo's folder (the generated model, the server's data, the pull).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the pull's JSON summary on stdout.")
def demo(size: str, dest: str | None, keep: bool, as_json: bool) -> None:
    """Start a local S3 server, upload a generated model, pull and verify it, stop the server.

    It prints the `prefetch pull` command that does the same by hand and where its data is, and
    removes that data at the end unless --keep (on an error or Ctrl-C too)."""
    from prefetch.demo.run import run_demo

    total = size_option(size, "--size")
    assert total is not None
    if dest:  # checked before a model is generated and a server started, as `pull` checks it
        dest = str(writable_destination(dest))
    on_interrupt("Interrupted; the demo's server is stopped.")
    run_demo(total, dest, as_json=as_json, keep=keep)
