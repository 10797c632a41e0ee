"""``prefetch status``: the command; the cluster read and the report are in :mod:`.status_report`,
imported when the command runs (it brings the kubernetes client, which ``prefetch --help`` need
not load)."""

from __future__ import annotations

import json
import time

import click

from prefetch.cli.help import HelpCommand


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
    from prefetch.cli.status_report import cluster_api, list_nodes, node_report, table

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
