"""The tools prefetch is compared with, as a table of rows, and the one builder that runs them.

A row (``ToolRow``) is data: the tool's name, group and label, a command template, the executable
it needs and the reason shown when that executable is not found. ``build`` fills a row from one
run's ``ToolContext`` (the environment, the paths to warm, the server pids and the template's
values: endpoint, bucket, prefix, ...) and returns the ``Tool`` that ``Bench`` measures.

A command template is a tuple of words. ``{key}`` in a word is replaced by a value of the
context (``str.format``), and a word that is exactly ``{*key}`` by the words of a list value.
Besides the context's values a template can use ``{dest}`` (the run's destination directory),
``{exe}`` (the path of the executable the row needs, or its bare name when it is not found) and
``{*extra_args}`` (the row's own extra words). Labels are templates over the same values.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from datasets import BUCKET, HUB_REPO
from harness import GiB, MiB, count_bytes

from prefetch.support.executables import find_executable

CLIENTS = Path(__file__).resolve().with_name("clients.py")
#: How each external tool prints its version (warm-up runs and the report's tool versions).
VERSION_ARG = {
    "s5cmd": "version",
    "rclone": "version",
    "aws": "--version",
    "hf": "version",
    "weed": "version",
    "curl": "--version",
    "dd": "--version",
}


def find_bin(name: str) -> str | None:
    """A tool's real executable: next to this Python first (skips pyenv shims), then PATH."""
    return find_executable(name)


def prefetch_cmd() -> list[str]:
    exe = find_bin("prefetch")
    return [exe] if exe else [sys.executable, "-m", "prefetch.cli"]


def baseline_cmd(package_dir: str) -> list[str]:
    """``prefetch`` run with the package in ``package_dir`` (``python -m`` would put the current
    directory, the repository, first on sys.path)."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(package_dir).resolve())!r}); "
        "sys.argv[0] = 'prefetch'; from prefetch.cli import main; main()"
    )
    return [sys.executable, "-c", code]


def count_dest(dest: Path, outs: list[Path]) -> int:
    """The bytes a tool wrote: what landed under its destination."""
    return count_bytes(dest)


def curl_sum(dest: Path, outs: list[Path]) -> int:
    """The bytes curl fetched into /dev/null: the sum of the byte counts it printed."""
    total = 0
    for out in outs:
        for line in out.read_text().split():
            with contextlib.suppress(ValueError):
                total += int(float(line))
    return total


@dataclass
class Tool:
    name: str
    group: str  # s3 | hub | ceiling | scaling
    label: str  # what it runs, for the report
    cmds: Callable[[Path], list[list[str]]]
    env: dict[str, str]
    warm: list[Path]
    servers: list[int]
    count: Callable[[Path, list[Path]], int] = count_dest
    missing: str = ""  # why it is not available, when it is not
    json_out: bool = False


@dataclass(frozen=True)
class ToolRow:
    """One tool of the table (see the module docstring for the template's words)."""

    name: str
    group: str
    label: str
    argv: tuple[str, ...]
    needs: str = ""  # the executable the command runs as {exe}
    missing: str = ""  # the "not available" reason, when ``needs`` is not found
    missing_label: str = ""  # the label then, when it differs
    extra_args: tuple[str, ...] = ()
    one_per: str = ""  # a list value: one command per element, as {each}, run together
    count: Callable[[Path, list[Path]], int] = count_dest
    json_out: bool = False  # the last stdout line is prefetch's --json summary
    only_if: str = ""  # a value that must be set for the row to exist


@dataclass
class ToolContext:
    """What the rows need from one run: where the data is served and how to reach it."""

    env: dict[str, str]
    warm: list[Path]  # read back into the page cache before each run: the server's data
    servers: list[int]  # the server processes whose CPU time is reported
    values: dict[str, Any] = field(default_factory=dict)


PREFETCH_PULL = ("{*prefetch}", "pull", "{uri}", "{dest}", "--json", "{*extra_args}")
S5CMD_CP = "s3://{bucket}/{prefix}/*"
RCLONE_REMOTE = "benchs3:{bucket}/{prefix}"
DD = (
    "exec {exe} if=/dev/zero of={dest}/dd.bin bs=16M count={total} iflag=count_bytes {dd_flags} "
    "status=none"
)
#: A fresh HF_HOME per run, inside the destination (deleted with it).
PREFETCH_HF_HOME = ("env", "HF_HOME={dest}/.prefetch-hf-home")
FRESH_HF_HOME = ("env", "HF_HOME={dest}")

PREFETCH = ToolRow(
    "prefetch", "s3", "prefetch pull (verify on, defaults)", PREFETCH_PULL, json_out=True
)

#: the prefetch rows that come before ``--prefetch-variant``'s
PREFETCH_S3_ROWS = (
    PREFETCH,
    ToolRow("prefetch-noverify", "s3", "prefetch pull --no-verify", PREFETCH_PULL,
            extra_args=("--no-verify",), json_out=True),
    ToolRow("prefetch-baseline", "s3", "prefetch pull with the package from {baseline}",
            ("{*baseline_prefetch}", "pull", "{uri}", "{dest}", "--json"),
            json_out=True, only_if="baseline"),
)  # fmt: skip

S3_RIVAL_ROWS = (
    ToolRow("s5cmd", "s3", "s5cmd cp (defaults: 256 workers, -c 5, -p 50)",
            ("{exe}", "--endpoint-url", "{endpoint}", "cp", S5CMD_CP, "{dest}/"),
            needs="s5cmd", missing="not available: s5cmd not installed"),
    ToolRow("s5cmd-tuned", "s3", "s5cmd {s5cmd_tuned}",
            ("{exe}", "--endpoint-url", "{endpoint}", "{*s5cmd_tuned_global}", "cp",
             "{*s5cmd_tuned_cp}", S5CMD_CP, "{dest}/"),
            needs="s5cmd", missing="not available: s5cmd not installed"),
    ToolRow("rclone", "s3", "rclone copy (defaults)",
            ("{exe}", "copy", RCLONE_REMOTE, "{dest}"),
            needs="rclone", missing="not available: rclone not installed"),
    ToolRow("rclone-mts8", "s3", "rclone copy --multi-thread-streams 8",
            ("{exe}", "copy", "--multi-thread-streams", "8", RCLONE_REMOTE, "{dest}"),
            needs="rclone", missing="not available: rclone not installed"),
    ToolRow("aws", "s3", "aws s3 cp --recursive (awscli defaults)",
            ("{exe}", "--endpoint-url", "{endpoint}", "s3", "cp", "{uri}", "{dest}",
             "--recursive", "--only-show-errors"),
            needs="aws", missing="not available: aws (awscli) not installed"),
    ToolRow("boto3", "s3",
            "boto3 TransferManager (download_file's engine), "
            "max_concurrency={boto3_concurrency}, chunk {boto3_chunk_mib} MiB",
            ("{python}", "{clients}", "boto3", "--bucket", "{bucket}", "--prefix", "{prefix}",
             "--dest", "{dest}", "--concurrency", "{boto3_concurrency}",
             "--chunk-size", "{boto3_chunk_size}")),
)  # fmt: skip

CEILING_ROWS = (
    ToolRow("ceiling-get", "ceiling",
            "{ceiling_streams} curl processes, {ceiling_chunk_mib} MiB ranged GETs (presigned) "
            "of the same objects into /dev/null: the server's limit",
            ("{exe}", "-sS", "--fail", "-K", "{each}"), one_per="curl_configs", count=curl_sum,
            needs="curl", missing="not available: curl not installed",
            missing_label="curl ranged GETs"),
    ToolRow("ceiling-dd", "ceiling",
            "dd if=/dev/zero bs=16M oflag=direct conv=fsync of=DEST, same byte count: "
            "the disk's sequential write limit",
            ("sh", "-c", DD.replace("{dd_flags}", "oflag=direct conv=fsync")),
            needs="dd", missing="not available: dd not found"),
    ToolRow("dd-buffered", "ceiling",
            "dd if=/dev/zero bs=16M conv=fsync of=DEST, same byte count: "
            "through the page cache (for reference, not a ceiling)",
            ("sh", "-c", DD.replace("{dd_flags}", "conv=fsync")),
            needs="dd", missing="not available: dd not found"),
)  # fmt: skip

HUB_ROWS = (
    ToolRow("hf-prefetch", "hub", "prefetch pull hf://{hub_repo} (verify on, defaults)",
            (*PREFETCH_HF_HOME, "{*prefetch}", "pull", "hf://{hub_repo}", "{dest}", "--json"),
            json_out=True),
    ToolRow("hf-prefetch-baseline", "hub",
            "prefetch pull hf://{hub_repo} with the package from {baseline}",
            (*PREFETCH_HF_HOME, "{*baseline_prefetch}", "pull", "hf://{hub_repo}", "{dest}",
             "--json"),
            json_out=True, only_if="baseline"),
    ToolRow("hf-snapshot", "hub", "huggingface_hub.snapshot_download (defaults, fresh HF_HOME)",
            (*FRESH_HF_HOME, "{python}", "{clients}", "snapshot", "--repo", "{hub_repo}")),
    ToolRow("hf-cli", "hub", "hf download {hub_repo} (fresh HF_HOME)",
            (*FRESH_HF_HOME, "{exe}", "download", "{hub_repo}"),
            needs="hf", missing="not available: hf CLI not installed"),
)  # fmt: skip


def literal(text: str) -> str:
    """``text`` as a template that renders to itself (user input used as a label)."""
    return text.replace("{", "{{").replace("}", "}}")


def variant_rows(specs: Iterable[str]) -> list[ToolRow]:
    """The rows of ``--prefetch-variant NAME=ARGS``: prefetch pull with ARGS added."""
    rows = []
    for spec in specs:
        name, _, extra = spec.partition("=")
        rows.append(
            ToolRow(f"prefetch-{name}", "s3", literal(f"prefetch pull {extra}"), PREFETCH_PULL,
                    extra_args=tuple(extra.split()), json_out=True)
        )  # fmt: skip
    return rows


def scaling_row(size: int, names: list[str]) -> ToolRow:
    """prefetch pull of the first of the scaling objects, ``names``: ``size`` bytes."""
    includes = tuple(word for name in names for word in ("--include", name))
    return ToolRow(f"prefetch@{size / GiB:g}GiB", "scaling",
                   literal(f"prefetch pull {size / GiB:g} GiB"), PREFETCH_PULL,
                   extra_args=includes, json_out=True)  # fmt: skip


def run_values(args: argparse.Namespace) -> dict[str, Any]:
    """The template values that come from the command line, the same for every server."""
    return {
        "bucket": BUCKET,
        "hub_repo": HUB_REPO,
        "python": sys.executable,
        "clients": str(CLIENTS),
        "prefetch": prefetch_cmd(),
        "baseline": args.baseline or "",
        "baseline_prefetch": baseline_cmd(args.baseline) if args.baseline else [],
        "s5cmd_tuned": args.s5cmd_tuned,
        "s5cmd_tuned_global": args.s5cmd_tuned.split()[:2],
        "s5cmd_tuned_cp": args.s5cmd_tuned.split()[2:],
        "boto3_concurrency": args.boto3_concurrency,
        "boto3_chunk_size": args.boto3_chunk_size,
        "boto3_chunk_mib": args.boto3_chunk_size // MiB,
        "ceiling_streams": args.ceiling_streams,
        "ceiling_chunk_mib": args.ceiling_chunk_size // MiB,
    }


_SPLICE = re.compile(r"\{\*(\w+)\}")


def render(argv: Iterable[str], values: Mapping[str, Any]) -> list[str]:
    """One command from a template: ``{key}`` filled in, ``{*key}`` spliced in as words."""
    words: list[str] = []
    for word in argv:
        splice = _SPLICE.fullmatch(word)
        if splice:
            words += values[splice.group(1)]
        else:
            words.append(word.format_map(values))
    return words


def commands(row: ToolRow, values: Mapping[str, Any], dest: Path) -> list[list[str]]:
    """The commands of one run into ``dest``: one, or one per element of ``row.one_per``."""
    values = {**values, "dest": str(dest)}
    if not row.one_per:
        return [render(row.argv, values)]
    return [render(row.argv, {**values, "each": str(item)}) for item in values[row.one_per]]


def build(row: ToolRow, ctx: ToolContext) -> Tool:
    """The ``Tool`` that runs ``row`` in ``ctx``; not available when its executable is missing."""
    exe = find_bin(row.needs) if row.needs else None
    missing = row.missing if row.needs and not exe else ""
    values = {**ctx.values, "exe": exe or row.needs, "extra_args": list(row.extra_args)}
    label = row.missing_label if missing and row.missing_label else row.label.format_map(values)
    return Tool(
        row.name,
        row.group,
        label,
        partial(commands, row, values),
        ctx.env,
        ctx.warm,
        ctx.servers,
        count=row.count,
        missing=missing,
        json_out=row.json_out,
    )


def build_rows(rows: Iterable[ToolRow], ctx: ToolContext) -> list[Tool]:
    """The tools of ``rows`` in order, leaving out rows whose ``only_if`` value is not set."""
    return [build(row, ctx) for row in rows if not row.only_if or ctx.values.get(row.only_if)]


def build_s3_tools(ctx: ToolContext, variants: Iterable[str]) -> list[Tool]:
    """Every S3 row: prefetch's (with ``--prefetch-variant``'s), then the rivals'."""
    return build_rows([*PREFETCH_S3_ROWS, *variant_rows(variants), *S3_RIVAL_ROWS], ctx)
