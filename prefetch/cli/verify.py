"""``prefetch verify``: re-check a pulled model against its recorded checksums."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from prefetch.cli.help import HelpCommand
from prefetch.pipeline.verify_at_rest import VerifyReport
from prefetch.support.errors import (
    LayoutError,
    VerifyError,
)
from prefetch.support.redact import printable

if TYPE_CHECKING:
    pass
from prefetch.cli.common import (
    json_even_on_failure,
)


@click.command(
    "verify",
    cls=HelpCommand,
    short_help="Re-check a pulled model against the checksums recorded at download.",
    examples=[
        ("Re-hash every file pulled into a folder", "prefetch verify /mnt/models/llama"),
        ("The same for an HF_HOME, one JSON report on stdout",
         "prefetch verify /mnt/models/huggingface --json"),
    ],
)  # fmt: skip
@click.argument("dest")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report on stdout.")
@json_even_on_failure(lambda params: VerifyReport())
def verify_cmd(dest: str, as_json: bool, record: VerifyReport) -> None:
    """Re-check the files under DEST against the checksums recorded when they were pulled."""
    from prefetch.pipeline.layout import layouts_under
    from prefetch.pipeline.verify_at_rest import verify_layouts

    root = Path(dest).expanduser().resolve()
    if not root.is_dir():
        raise LayoutError(f"{root} does not exist or is not a directory")
    layouts = layouts_under(root)  # none: an HF_HOME where we recorded no repo
    if not layouts:
        raise VerifyError(f"nothing recorded under {root / 'hub'}: no model was pulled there")
    report = verify_layouts(layouts, into=record)
    if as_json:
        click.echo(json.dumps(report.to_json(), sort_keys=True))
    for failure in report.failures:
        click.echo(f"Error: {printable(str(failure))}", err=True)
    if not as_json and report.ok:
        click.echo(f"{len(report.checked)} files verified under {root}")
    if report.unverifiable:
        click.echo(
            f"Warning: {len(report.unverifiable)} file(s) have no recorded checksum", err=True
        )
    if not report.ok:
        sys.exit(1)
