"""``prefetch agent`` (added to the group in prefetch.cli).

Every agent flag has one environment twin, declared here and nowhere else.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import click

from prefetch.agent.config_values import DEFAULT_CACHE_DIR, DEFAULT_CONFIG_PATH, AgentConfig
from prefetch.agent.gate_driver import GateFactory, NodeGateLike
from prefetch.cli.help import HelpCommand
from prefetch.publish.compile_cache import GPU_PRODUCT_LABEL
from prefetch.support.constants import DEFAULT_LISTEN
from prefetch.support.errors import PrefetchError

if TYPE_CHECKING:
    pass

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
    from prefetch.agent.loop import Agent
    from prefetch.support.logjson import setup_logging

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
