"""The flags ``prefetch pull`` and ``prefetch mirror`` share are declared once
(prefetch/cli/__init__.py's option groups): the same help, default and environment twin in both
commands."""

from __future__ import annotations

import click

from prefetch.cli.mirror import mirror
from prefetch.cli.pull import pull

SHARED = (
    "revision", "token", "endpoint", "endpoint_url", "proxy",
    "attempts", "min_rate", "stall_timeout", "deadline",
)  # fmt: skip


def _options(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.params if isinstance(p, click.Option) and p.name}


def test_the_flags_pull_and_mirror_share_are_declared_once() -> None:
    pulls, mirrors = _options(pull), _options(mirror)
    for name in SHARED:
        a, b = pulls[name], mirrors[name]
        assert (a.opts, a.help, a.default, a.envvar, a.show_default) == (
            b.opts, b.help, b.default, b.envvar, b.show_default,
        ), name  # fmt: skip
    # --concurrency counts different things (ranged reads, parts): its own default and help,
    # one environment twin
    assert pulls["concurrency"].envvar == mirrors["concurrency"].envvar == "PREFETCH_CONCURRENCY"
    assert (pulls["concurrency"].default, mirrors["concurrency"].default) == (16, 8)
