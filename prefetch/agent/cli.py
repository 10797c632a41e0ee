"""``prefetch agent``, ``prefetch ls`` and ``prefetch gc`` (added to the group in prefetch.cli).

Every agent flag has one environment twin, declared here and nowhere else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from prefetch.agent.config_values import DEFAULT_CACHE_DIR, DEFAULT_CONFIG_PATH, AgentConfig
from prefetch.agent.gate_driver import GateFactory, NodeGateLike
from prefetch.clihelp import HelpCommand
from prefetch.compile_cache import GPU_PRODUCT_LABEL
from prefetch.constants import DEFAULT_LISTEN
from prefetch.errors import ConfigError, LockTimeoutError, PrefetchError
from prefetch.units import format_bytes

if TYPE_CHECKING:
    from prefetch.store import CachedModel

log = logging.getLogger(__name__)

_config_option = click.option(
    "--config",
    "config_path",
    envvar="PREFETCH_CONFIG",
    default=DEFAULT_CONFIG_PATH,
    show_default=True,
    show_envvar=True,
    help="The agent's config file (models.yaml).",
)
_cache_dir_option = click.option(
    "--cache-dir",
    envvar="PREFETCH_CACHE_DIR",
    default=None,
    show_envvar=True,
    help=f"The cache directory (= HF_HOME) [default: the config's cacheDir, else "
    f"{DEFAULT_CACHE_DIR}].",
)


@click.command(
    "agent",
    cls=HelpCommand,
    short_help="Keep this node's models synced and verified (the DaemonSet).",
    examples=[
        ("Run it with a model list (the DaemonSet passes its ConfigMap's file)",
         "prefetch agent --config /etc/model-prefetch/models.yaml"),
        ("Outside a cluster: no node labels or taint, a local port, text logs",
         "prefetch agent --config models.yaml --listen 127.0.0.1:8090 --log-format text"),
    ],
)  # fmt: skip
@_config_option
@click.option(
    "--listen",
    envvar="PREFETCH_LISTEN",
    default=None,
    show_envvar=True,
    help=f"HOST:PORT for /healthz, /readyz and /metrics; overrides the config's listen "
    f"[default: {DEFAULT_LISTEN}].",
)
@click.option(
    "--node-name",
    envvar="NODE_NAME",
    default=None,
    show_envvar=True,
    help="This node's name (downward API spec.nodeName); without it, or outside a "
    "cluster, node labels and the startup taint are left alone and no Events are written.",
)
@_cache_dir_option
@click.option(
    "--gpu-product",
    envvar="PREFETCH_GPU_PRODUCT",
    default=None,
    show_envvar=True,
    help="The GPU product that keys compileCaches entries without a gpuProduct "
    "[default: the node label nvidia.com/gpu.product].",
)
@click.option(
    "--log-format",
    type=click.Choice(["json", "text"]),
    default="json",
    envvar="PREFETCH_LOG_FORMAT",
    show_default=True,
    show_envvar=True,
    help="JSON lines or plain text, on stderr.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    envvar="PREFETCH_LOG_LEVEL",
    show_default=True,
    show_envvar=True,
    help="Least severe level logged.",
)
def agent_cmd(
    config_path: str,
    listen: str | None,
    node_name: str | None,
    cache_dir: str | None,
    gpu_product: str | None,
    log_format: str,
    log_level: str,
) -> None:
    """Keep the configured models synced and verified on this node; gate scheduling on them.

    Serves /healthz, /readyz and /metrics; reloads the config file when it changes; on SIGTERM
    stops downloads resumably and exits 0.
    """
    from prefetch.agent.kube_events import in_cluster_events
    from prefetch.agent.reconcile import Agent
    from prefetch.logjson import setup_logging

    setup_logging(log_format, level=getattr(logging, log_level.upper()))
    from prometheus_client import disable_created_metrics

    # prometheus_client leaves this one function unannotated
    disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series: only clutter for counters this process owns
    agent = Agent(
        Path(config_path),
        cache_dir=Path(cache_dir) if cache_dir else None,
        listen=listen,
        gate_factory=_cluster_gate_factory(node_name),
        event_sink=in_cluster_events(node_name),
        handle_signals=True,
        exit_on_stuck=True,
        gpu_product=gpu_product or _node_gpu_product(node_name),
    )
    asyncio.run(agent.run())


def _node_gpu_product(node_name: str | None) -> str | None:
    """The node label nvidia.com/gpu.product (GPU feature discovery sets it), read once at
    start; None outside a cluster or when it cannot be read (logged)."""
    from prefetch.agent.node import in_cluster_gate

    try:
        gate = in_cluster_gate(node_name)
        return gate.label(GPU_PRODUCT_LABEL) if gate is not None else None
    except PrefetchError as exc:
        logging.getLogger("prefetch.agent").warning("cannot read the node's GPU product: %s", exc)
        return None


def _cluster_gate_factory(node_name: str | None) -> GateFactory:
    def make(config: AgentConfig) -> NodeGateLike | None:
        from prefetch.agent.node import in_cluster_gate

        return in_cluster_gate(
            node_name,
            label_prefix=config.label_prefix,
            startup_taint_key=config.startup_taint,
        )

    return make


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
    from prefetch.store import Store

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
    from prefetch.store import CachedModelJson, Store

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


@click.command(
    "status",
    cls=HelpCommand,
    short_help="Show each node's model warm-up: phase, progress, rate, ETA.",
    examples=[
        ("Every node of the current kubeconfig context", "prefetch status"),
        ("The nodes of one NodePool, as JSON",
         "prefetch status -l karpenter.sh/nodepool=gpu -o json"),
    ],
)  # fmt: skip
@click.option(
    "--kubeconfig",
    default=None,
    help="The kubeconfig file [default: KUBECONFIG, else ~/.kube/config].",
)
@click.option("--context", default=None, help="The kubeconfig context [default: its current].")
@click.option(
    "-o",
    "--output",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="A table for people, or one JSON document on stdout.",
)
@click.option(
    "-l",
    "--selector",
    default=None,
    help="Only nodes with these labels, e.g. karpenter.sh/nodepool=gpu (as kubectl -l).",
)
def status_cmd(
    kubeconfig: str | None, context: str | None, output: str, selector: str | None
) -> None:
    """Show each node's model warm-up: phase, progress, rate, ETA, ready labels, startup taint.

    Reads the Nodes with your kubeconfig (the agent's progress annotation and the node's labels
    and taint); needs only 'list nodes'. Nodes without an agent report are listed as such.
    """
    from prefetch.agent.node_report import cluster_api, list_nodes, node_report, table

    api = cluster_api(kubeconfig, context)
    try:
        nodes = list_nodes(api, selector)
    finally:
        api.api_client.close()
    now = time.time()
    reports = [node_report(n, now) for n in nodes]
    if output == "json":
        without = sum(1 for r in reports if r.problem is not None)
        document = {"nodes": [r.to_json() for r in reports], "nodes_without_report": without}
        click.echo(json.dumps(document, sort_keys=True))
        return
    if not reports:
        click.echo("no nodes" + (f" match {selector!r}" if selector else ""), err=True)
        return
    for line in table(reports):
        click.echo(line)
