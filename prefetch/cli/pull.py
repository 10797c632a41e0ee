"""``prefetch pull``: download a model, verified and resumable."""

from __future__ import annotations

import functools
import json
import sys
import time
from typing import TYPE_CHECKING, Any

import click

from prefetch.cli.help import HelpCommand
from prefetch.pipeline.engine.transfer import Transfer, TransferConfig
from prefetch.pipeline.progress import NullProgress, ProgressSink, TerminalProgress
from prefetch.pipeline.spec import ModelSpec, SpecError, layout_kind, parse_source_uri
from prefetch.pipeline.sync import SyncResult
from prefetch.support.errors import (
    ConfigError,
)
from prefetch.support.redact import redact
from prefetch.support.units import format_bytes

if TYPE_CHECKING:
    from prefetch.pipeline.sync import EngineFactory
    from prefetch.pipeline.warmup import WarmReport
    from prefetch.sources import Source, SourceSettings
from prefetch.cli.common import (
    NoteWhenStarted,
    ca_bundle_option,
    hub_options,
    json_even_on_failure,
    make_config,
    missing_folders,
    proxy_option,
    removed_if_empty_on_failure,
    s3_endpoint_option,
    stop_on_sigterm,
    transfer_options,
    writable_destination,
)

#: The pull flags that set ModelSpec fields, named in messages about combinations of them.
_FLAG_NAMES = {
    "revision": "--revision", "hf_repo": "--hf-repo", "hf_revision": "--hf-revision",
    "proxy": "--proxy", "mirrors": "--mirror", "hub_fallback": "--no-hub-fallback",
    "layout": "--layout",
}  # fmt: skip


def pull_spec(
    uri: str,
    *,
    name: str,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    revision: str | None,
    hf_repo: str | None,
    hf_revision: str | None,
    layout_name: str | None,
    proxy: str | None = None,
    mirrors: tuple[str, ...] = (),
    hub_fallback: bool = True,
    ca_bundle: str | None = None,
) -> tuple[ModelSpec, str]:
    """The spec and layout name (hf or plain) the pull options describe; ConfigError on a
    combination that makes no sense."""
    source = parse_source_uri(uri)
    try:
        spec = ModelSpec(
            source=source,
            name=name,
            include=include,
            exclude=exclude,
            revision=revision or None,
            hf_repo=hf_repo or None,
            hf_revision=hf_revision or None,
            proxy=proxy,
            mirrors=tuple(parse_source_uri(m) for m in mirrors),
            hub_fallback=hub_fallback,
            ca_bundle=ca_bundle,
        )
        return spec, layout_kind(spec, layout_name)
    except SpecError as exc:
        if not names_flags(exc):
            raise
        raise ConfigError(exc.render(_FLAG_NAMES), hint=exc.hint) from exc


def names_flags(exc: SpecError) -> bool:
    """Is ``exc`` worded with the command line's flag names: a rule about a combination of
    flags, or about --proxy/--mirror/--no-hub-fallback (any other keeps its own words)."""
    return exc.cross_field or exc.field in ("proxy", "mirrors", "hub_fallback")


def open_pull_source(
    spec: ModelSpec,
    layout_name: str | None,
    config: TransferConfig,
    *,
    s3_endpoint: str | None,
    hub_endpoint: str | None,
    token: str | None,
) -> Source:
    """``prefetch pull``'s source, opened by the one front door with the command's flags."""
    from prefetch.sources import open_source

    reach = pull_settings(config, s3_endpoint=s3_endpoint, hub_endpoint=hub_endpoint, token=token)
    return open_source(spec, reach, layout=layout_name)  # pull_spec checked the layout


def pull_settings(
    config: TransferConfig, *, s3_endpoint: str | None, hub_endpoint: str | None, token: str | None
) -> SourceSettings:
    """How ``prefetch pull`` reaches its source (also each ``--processes`` worker's)."""
    from prefetch.sources import SourceSettings

    return SourceSettings(
        s3_endpoint=s3_endpoint or None,
        hub_endpoint=hub_endpoint or None,
        token=token or None,
        concurrency=config.concurrency,
        retry=config.retry,
    )


def pull_engine(
    processes: str, spec: ModelSpec, layout_name: str | None, settings: SourceSettings
) -> EngineFactory:
    """The engine ``--processes`` asks for: this process's Transfer (1), or worker processes
    (the module only imported then)."""
    if processes.strip() == "1":
        return Transfer
    from prefetch.pipeline.engine.processes import ProcessEngine, SourceRecipe, parse_processes

    count = parse_processes(processes)
    if count == 1:
        return Transfer
    recipe = SourceRecipe(spec, settings, layout_name)
    return functools.partial(ProcessEngine, recipe=recipe, processes=count)


@click.command(
    cls=HelpCommand,
    short_help="Download a model (s3, hf, oci, gs, az, file), verified, resumable.",
    option_groups=[
        ("Source", ["include", "exclude", "revision", "token", "endpoint", "endpoint_url",
                    "proxy", "mirrors", "hub_fallback"]),
        ("Destination", ["layout_name", "hf_repo", "hf_revision", "name", "delete"]),
        ("Performance", ["concurrency", "processes", "chunk_size", "attempts", "min_rate",
                         "stall_timeout", "deadline", "warm", "warm_memory_share"]),
        ("Verification", ["require_checksum", "no_verify"]),
        ("Output", ["as_json", "progress"]),
    ],
    examples=[
        ("A Hub model into an HF_HOME, which vLLM reads offline (HF_HUB_OFFLINE=1)",
         "prefetch pull hf://org/name /mnt/models/huggingface --revision main"),
        ("An S3 prefix, weights and JSON only (credentials: the usual AWS ways)",
         "prefetch pull s3://my-bucket/models/llama /mnt/models/llama "
         "--include '*.safetensors' --include '*.json'"),
        ("Another S3 server, one JSON summary on stdout",
         "prefetch pull s3://my-bucket/llama /models/llama --endpoint-url http://127.0.0.1:9000 "
         "--json"),
        ("An OCI model artifact (ModelPack, KitOps), by tag",
         "prefetch pull oci://ghcr.io/org/llama:v1 /models/llama"),
        ("An Azure Blob container's folder (AZURE_STORAGE_KEY, a SAS, or Microsoft Entra)",
         "prefetch pull az://myaccount/models/llama /models/llama"),
        ("A Cloud Storage prefix (Application Default Credentials), in the Hub layout",
         "prefetch pull gs://my-bucket/models/llama /mnt/models/huggingface "
         "--hf-repo org/llama"),
        ("A directory on NFS, Lustre or a mounted PVC (never modified; SHA256SUMS checked)",
         "prefetch pull file:///mnt/models/llama/ /models/llama"),
        ("A Hub model through an S3 mirror first",
         "prefetch pull hf://org/name /mnt/models/huggingface "
         "--mirror s3://my-mirror/hf/org/name/"),
    ],
)  # fmt: skip
@click.argument("uri")
@click.argument("dest")
@click.option("--include", multiple=True, help="Only files matching this glob (repeatable).")
@click.option("--exclude", multiple=True, help="Skip files matching this glob (repeatable).")
@click.option("--name", default="", help="Model name (a DNS label); default from the URI.")
@s3_endpoint_option
@hub_options
@proxy_option
@ca_bundle_option
@click.option(
    "--mirror",
    "mirrors",
    multiple=True,
    metavar="URI",
    help="hf:// sources: an S3 mirror of the repo (written by `prefetch mirror`) to "
    "pull from before the Hub; oci:// sources: a registry mirror (oci://host[:port][/prefix], "
    "e.g. Spegel on the node) asked for the origin's digest; repeatable, tried in order.",
)
@click.option(
    "--no-hub-fallback",
    "hub_fallback",
    is_flag=True,
    default=True,
    flag_value=False,
    help="With --mirror: fail when no mirror has the revision instead of pulling from the Hub.",
)
@click.option(
    "--delete",
    is_flag=True,
    help="Remove local files that are gone from the source (hf layout: links of this "
    "revision's snapshot, the snapshots this ref moved away from, and blobs no snapshot links "
    "any more).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar (default: when stderr is a terminal).")  # fmt: skip
@click.option(
    "--warm-page-cache",
    "warm",
    is_flag=True,
    help="After the pull, read the model's files into the page cache (skipped with "
    "a warning when they do not fit in --warm-memory-share of the available memory, or of "
    "what this process's memory cgroup limit leaves; a warning too when not all stayed).",
)
@click.option("--warm-memory-share", default=0.5, show_default=True, metavar="SHARE",
              type=click.FloatRange(0.0, 1.0, min_open=True),
              help="The share of available memory a warm-up may fill.")  # fmt: skip
@click.option("--processes", default="1", envvar="PREFETCH_PROCESSES", show_default=True,
              metavar="N|auto",
              help="Worker processes sharing the files (auto: one per core; --concurrency is "
              "their total). One process holds Python's GIL ~0.4 s per GB; see "
              "docs/performance.md.")  # fmt: skip
@transfer_options
# the URI as given, a signed query (an Azure SAS) masked: the summary is printed
@json_even_on_failure(lambda p: SyncResult(model=p["name"], source=redact(p["uri"])))
def pull(
    uri: str,
    dest: str,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    name: str,
    endpoint_url: str | None,
    revision: str | None,
    token: str | None,
    endpoint: str | None,
    layout_name: str | None,
    hf_repo: str | None,
    hf_revision: str | None,
    proxy: str | None,
    ca_bundle: str | None,
    mirrors: tuple[str, ...],
    hub_fallback: bool,
    delete: bool,
    as_json: bool,
    progress: bool | None,
    warm: bool,
    warm_memory_share: float,
    processes: str,
    record: SyncResult,
    **transfer: Any,
) -> None:
    """Download a model from URI (s3://bucket/prefix, hf://org/name, oci://registry/repo:tag or
    @sha256:digest, gs://bucket/prefix, az://account/container/prefix, file:///dir) into DEST,
    verified and resumable. With the hf
    layout DEST is an HF_HOME: vLLM with HF_HOME=DEST and HF_HUB_OFFLINE=1 loads the model from
    it."""
    from prefetch.pipeline.backends import backend
    from prefetch.pipeline.compose import Pipeline
    from prefetch.pipeline.compose import warm as warm_up
    from prefetch.pipeline.layout import layout_for
    from prefetch.sources import open_source

    config = make_config(**transfer)
    spec, _ = pull_spec(
        uri, name=name, include=include, exclude=exclude, revision=revision, hf_repo=hf_repo,
        hf_revision=hf_revision, layout_name=layout_name, proxy=proxy, mirrors=mirrors,
        hub_fallback=hub_fallback, ca_bundle=ca_bundle,
    )  # fmt: skip
    record.model = spec.name
    made = missing_folders(dest)
    if made:  # no folder is made inside a source that is a directory of this machine
        backend(spec.source.scheme).refuse_destination(spec.source, (made[0],))
    root = writable_destination(dest)
    record.path = str(root)
    with removed_if_empty_on_failure(made):
        reach = pull_settings(config, s3_endpoint=endpoint_url, hub_endpoint=endpoint, token=token)
        engine = pull_engine(processes, spec, layout_name, reach)
        source = open_source(spec, reach, layout=layout_name)  # pull_spec checked the layout
        pipeline = Pipeline(
            spec, source, lambda s, kind: layout_for(s, root, layout_name=kind),
            layout_name=layout_name, engine=engine,
        )  # fmt: skip
        show = sys.stderr.isatty() if progress is None else progress
        bar: ProgressSink = TerminalProgress(sys.stderr) if show else NullProgress()
        sink = NoteWhenStarted(bar, "Interrupted; partial downloads are kept and resume next time.")
        t0 = time.monotonic()
        try:
            resolved, result = pipeline.run(config, progress=sink, delete=delete,
                                            stop=stop_on_sigterm(), so_far=record)  # fmt: skip
        finally:
            record.seconds = round(time.monotonic() - t0, 3)
    warmed = None
    if warm:
        from prefetch.pipeline.warmup import WarmLimits

        limits = WarmLimits(memory_share=warm_memory_share)
        warmed = warm_up(resolved.layout, result, limits, model=resolved.spec.name)
    report_pull(resolved.spec.name, dest, result, warmed, as_json=as_json)


def report_pull(
    name: str, dest: str, result: SyncResult, warmed: WarmReport | None, *, as_json: bool
) -> None:
    """What a finished pull prints: warnings on stderr, then the JSON summary or one line."""
    if result.files_unverified:
        click.echo(
            f"Warning: {len(result.files_unverified)} file(s) had no checksum at the source "
            f"and were checked by size only (e.g. {result.files_unverified[0]}); "
            "use --require-checksum to refuse them",
            err=True,
        )
    warm_warning = None
    if warmed is not None and warmed.state != "warm":
        warm_warning = f"page-cache warm-up {warmed.state}: {warmed.reason}"
        click.echo(f"Warning: {warm_warning}", err=True)
    if as_json:
        out = result.to_json()
        if warmed is not None:
            out["warm"] = warmed.to_json()
            out["timings"]["warm"] = round(warmed.seconds, 3)
            # the warning stderr gives, for a script that reads only the JSON
            out["warnings"] = [warm_warning] if warm_warning else []
        click.echo(json.dumps(out, sort_keys=True))
        return
    if result.up_to_date:
        click.echo(f"{name}: up to date, 0 bytes downloaded ({result.files} files) in {dest}")
    else:
        rate = result.bytes_downloaded / result.seconds if result.seconds else 0
        click.echo(
            f"{name}: {result.files_downloaded} files, "
            f"{format_bytes(result.bytes_downloaded)} downloaded in {result.seconds:.1f}s "
            f"({format_bytes(rate)}/s), {result.files_verified} verified -> {result.path}"
        )
