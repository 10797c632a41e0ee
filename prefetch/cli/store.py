"""``prefetch ls`` and ``prefetch gc``: the models in a cache, and evicting them (added to the
group in prefetch.cli)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from prefetch.agent.config_values import DEFAULT_CACHE_DIR, DEFAULT_CONFIG_PATH, AgentConfig
from prefetch.cli.help import HelpCommand
from prefetch.support.errors import ConfigError, LockTimeoutError
from prefetch.support.units import format_bytes

if TYPE_CHECKING:
    from prefetch.pipeline.store import CachedModel
from prefetch.cli.agent import _cache_dir_option, _config_option

log = logging.getLogger(__name__)


def _load_for_listing(
    config_path: str | None, cache_dir: str | None, *, need_config: bool
) -> tuple[AgentConfig | None, Path]:
    from prefetch.agent.config import load_config

    config: AgentConfig | None = None
    path = Path(config_path) if config_path else None
    if path is not None and (path.exists() or need_config or config_path != DEFAULT_CONFIG_PATH):
        config = load_config(path)
    if config is None and need_config:
        raise ConfigError(
            "gc needs the agent's config to know which models are wanted",
            hint="pass --config (or PREFETCH_CONFIG)",
        )
    root = Path(cache_dir) if cache_dir else config.cache_dir if config else Path(DEFAULT_CACHE_DIR)
    return config, root


@click.command(
    "ls",
    cls=HelpCommand,
    short_help="List the models in a cache: size, revision, verified, wanted.",
    examples=[
        ("What a node's cache holds, and what its config wants",
         "prefetch ls --config /etc/model-prefetch/models.yaml"),
        ("A cache folder alone, as JSON", "prefetch ls --cache-dir /mnt/models --json"),
    ],
)  # fmt: skip
@_cache_dir_option
@_config_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list on stdout.")
def ls_cmd(cache_dir: str | None, config_path: str | None, as_json: bool) -> None:
    """List the models in the cache: size, revision, verified, last used, wanted by the config."""
    from prefetch.pipeline.store import Store

    config, root = _load_for_listing(config_path, cache_dir, need_config=False)
    entries = Store(root).list(config.models if config else None)
    if as_json:
        click.echo(json.dumps([e.to_json() for e in entries], sort_keys=True))
        return
    if not entries:
        click.echo(f"no models cached in {root}", err=True)
        return
    rows = [("NAME", "KIND", "SIZE", "REVISION", "VERIFIED", "LAST USED", "WANTED", "PINNED")]
    for e in entries:
        rows.append(
            (
                e.name,
                e.kind,
                format_bytes(e.size),
                (e.revision or UNKNOWN)[:24],
                {True: "yes", False: "NO", None: UNKNOWN}[e.complete],
                _ago(e.last_used),
                {True: "yes", False: "no", None: UNKNOWN}[e.wanted],
                "yes" if e.pinned else "no",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    for line in _ls_legend(entries):
        click.echo(line, err=True)


#: What ``prefetch ls`` shows where the cache holds no record of a column's value.
UNKNOWN = "unknown"


def _ls_legend(entries: list[CachedModel]) -> list[str]:
    """The notes under ``prefetch ls``'s table that say what an ``unknown`` means (on stderr:
    stdout is the table)."""
    notes = []
    if any(e.complete is None or e.last_used is None for e in entries):
        notes.append(
            f"VERIFIED, LAST USED {UNKNOWN}: no agent sync recorded in this cache (a model "
            "`prefetch pull` wrote: `prefetch verify DIR` re-checks it)"
        )
    if any(e.wanted is None for e in entries):
        notes.append(
            f"WANTED {UNKNOWN}: no agent config to compare with (pass --config or set "
            "PREFETCH_CONFIG)"
        )
    return notes


def _ago(ts: float | None) -> str:
    if ts is None:
        return UNKNOWN
    s = max(0, int(time.time() - ts))
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s // n}{unit} ago"
    return f"{s}s ago"


@click.command(
    "gc",
    cls=HelpCommand,
    short_help="Evict cached models the agent's config no longer wants.",
    examples=[
        ("See what would go, delete nothing",
         "prefetch gc --config /etc/model-prefetch/models.yaml --dry-run"),
        ("Evict them, pinned ones too",
         "prefetch gc --config /etc/model-prefetch/models.yaml --include-pinned"),
    ],
)  # fmt: skip
@_cache_dir_option
@_config_option
@click.option("--dry-run", is_flag=True, help="Say what would be evicted; delete nothing.")
@click.option(
    "--include-pinned", is_flag=True, help="Also evict pinned models that left the config."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
def gc_cmd(
    cache_dir: str | None,
    config_path: str | None,
    dry_run: bool,
    include_pinned: bool,
    as_json: bool,
) -> None:
    """Evict cached models the config no longer wants (least recently used first)."""
    from prefetch.pipeline.store import CachedModelJson, Store

    config, root = _load_for_listing(config_path, cache_dir, need_config=True)
    assert config is not None
    store = Store(root)
    candidates = store.eviction_candidates(config.models, include_pinned=include_pinned)
    kept_pinned = [e for e in store.list(config.models) if not e.wanted and e.pinned]
    evicted: list[CachedModelJson] = []
    skipped: list[dict[str, object]] = []
    for entry in candidates:
        if dry_run:
            evicted.append(entry.to_json())
            click.echo(f"would evict {entry.key} ({format_bytes(entry.size)})", err=True)
            continue
        try:
            store.evict(entry, lock_timeout=10.0)
        except LockTimeoutError as exc:
            skipped.append({**entry.to_json(), "reason": str(exc)})
            click.echo(f"skipped {entry.key}: {exc}", err=True)
            continue
        evicted.append(entry.to_json())
        click.echo(f"evicted {entry.key} ({format_bytes(entry.size)})", err=True)
    if not dry_run:
        store.empty_trash()
    if not include_pinned:
        for entry in kept_pinned:
            click.echo(f"kept {entry.key}: pinned (use --include-pinned)", err=True)
    freed = sum(e["size"] for e in evicted)
    if as_json:
        click.echo(
            json.dumps(
                {"dry_run": dry_run, "evicted": evicted, "skipped": skipped, "freed_bytes": freed},
                sort_keys=True,
            )
        )
    else:
        verb = "would free" if dry_run else "freed"
        click.echo(f"{len(evicted)} model(s), {verb} {format_bytes(freed)}")
