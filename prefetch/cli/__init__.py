"""The ``prefetch`` command line: the group, and every command added to it.

Results go to stdout (one JSON object with ``--json``); everything meant for a person (progress,
warnings, errors) goes to stderr. Every PrefetchError becomes one ``Error: ...`` line, an optional
``Hint: ...`` line and exit status 1; set PREFETCH_DEBUG=1 for a traceback.
"""

from __future__ import annotations

import atexit
import gc
import logging

import click

from prefetch import __version__
from prefetch.cli.common import LazyGroup
from prefetch.support.redact import install_filter


@click.group(
    cls=LazyGroup,
    # imported when they run (or --help lists them): the agent's bring kubernetes,
    # prometheus_client, psutil, which a `prefetch pull` does not need; `pull` and `mirror` the
    # engine and the HTTP stack, which `verify`, `ls` and `status` do not
    lazy_commands={
        "pull": ("prefetch.cli.pull", "pull"),
        "verify": ("prefetch.cli.verify", "verify_cmd"),
        "mirror": ("prefetch.cli.mirror", "mirror"),
        "demo": ("prefetch.cli.demo", "demo"),
        "agent": ("prefetch.cli.agent", "agent_cmd"),
        "ls": ("prefetch.cli.store", "ls_cmd"),
        "gc": ("prefetch.cli.store", "gc_cmd"),
        "status": ("prefetch.cli.status", "status_cmd"),
        "cache": ("prefetch.cli.compile_cache", "cache"),
    },
    context_settings={"help_option_names": ["-h", "--help"]},
    examples=[
        ("Try it on this machine: a local S3 server, a generated model, a pull",
         "prefetch demo"),
        ("Pull a model from the Hugging Face Hub into an HF_HOME",
         "prefetch pull hf://org/name /mnt/models/huggingface"),
        ("Pull a prefix of an S3 bucket into a folder",
         "prefetch pull s3://my-bucket/models/llama /mnt/models/llama"),
        ("The options and examples of one command", "prefetch pull --help"),
    ],
)  # fmt: skip
@click.version_option(__version__, prog_name="prefetch")
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-vv for debug).")
def main(verbose: int) -> None:
    """Pre-fetch model weights to local disk, verified, in the Hugging Face cache layout."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        install_filter(handler)  # -vv shows urllib3's requests: never their signatures
    if verbose < 2:
        for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "filelock"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    if verbose == 0:  # azure-identity warns of a failure the Error line already says
        logging.getLogger("azure.identity").setLevel(logging.ERROR)


# At exit, the interpreter's last collections walk every object the imports made (~100k) and
# free the cycles among them one by one: ~25 ms of a one-file pull's ~0.2 CPU-s (issue 33).
# Freezing them first (the collector then skips them) leaves that memory to the process's exit.
# It changes nothing before the exit: the command has finished, every other atexit hook still
# runs (logging's flush, registered earlier, runs after this one), and objects made after the
# freeze are collected as before.
atexit.register(gc.freeze)
