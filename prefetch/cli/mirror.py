"""``prefetch mirror``: copy a model into an S3 mirror prefix or an OCI registry."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import TYPE_CHECKING, Any

import click

from prefetch.cli.help import HelpCommand
from prefetch.pipeline.progress import NullProgress, ProgressSink, TerminalProgress
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.support.errors import (
    ConfigError,
)
from prefetch.support.redact import printable
from prefetch.support.units import format_bytes

if TYPE_CHECKING:
    from prefetch.pipeline.backends import Backend
    from prefetch.publish.s3_mirror import MirrorConfig, MirrorResult, S3Prefix
    from prefetch.sources import SourceSettings

    pass
from prefetch.cli.common import (
    MIRROR_INTERRUPTED,
    NoteWhenStarted,
    ca_bundle_option,
    concurrency_option,
    hub_source_options,
    json_even_on_failure,
    make_config,
    pace_options,
    proxy_option,
    s3_endpoint_option,
    size_option,
    stop_on_sigterm,
)


def _mirror_record(params: dict[str, Any]) -> Any:
    from prefetch.publish.s3_mirror import MirrorResult

    return MirrorResult(source=params["src"], destination=params["dst"])


@click.command(
    cls=HelpCommand,
    short_help="Copy a Hub model (or a mirror) into S3 or an OCI registry, verified.",
    option_groups=[
        ("Source", ["revision", "token", "endpoint", "proxy"]),
        ("Destination", ["endpoint_url"]),
        ("Performance", ["concurrency", "part_size", "attempts", "min_rate", "stall_timeout",
                         "deadline"]),
        ("Output", ["as_json", "progress"]),
    ],
    examples=[
        ("One commit of a Hub repo into an S3 mirror prefix",
         "prefetch mirror hf://org/name@main s3://my-mirror/hf/org/name/"),
        ("A mirror prefix into another bucket or region",
         "prefetch mirror s3://my-mirror/hf/org/name/ s3://my-mirror-eu/hf/org/name/"),
        ("A Hub commit into a registry, as a ModelPack artifact",
         "prefetch mirror hf://org/name@main oci://registry.internal/models/name:main"),
    ],
)  # fmt: skip
@click.argument("src")
@click.argument("dst")
@hub_source_options
@s3_endpoint_option
@proxy_option
@ca_bundle_option
@concurrency_option(8, "Parts in flight; peak memory is about concurrency x part size.")
@click.option(
    "--part-size",
    default="16MiB",
    show_default=True,
    help="Multipart part size, 5MiB-5GiB (grown for files over 10,000 parts).",
)
@pace_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Progress bar (default: when stderr is a terminal).",
)
@json_even_on_failure(_mirror_record)
def mirror(
    src: str,
    dst: str,
    revision: str | None,
    token: str | None,
    endpoint: str | None,
    endpoint_url: str | None,
    proxy: str | None,
    ca_bundle: str | None,
    concurrency: int,
    part_size: str,
    attempts: int,
    min_rate: str,
    stall_timeout: str,
    deadline: str,
    as_json: bool,
    progress: bool | None,
    record: Any,
) -> None:
    """Mirror SRC (hf://org/name[@rev], or an s3:// mirror prefix) into DST (s3://bucket/prefix):
    verified against the Hub's ids, resumable, and uploading nothing already there. DST may be
    oci://registry/repo:tag: a Hub commit is pushed as a ModelPack artifact, an oci:// SRC is
    copied by digest."""
    from prefetch.publish.s3_mirror import MirrorConfig, S3Prefix, mirror_hub
    from prefetch.publish.s3_mirror.upload import make_writer_client
    from prefetch.sources import SourceSettings, open_source, pool_size
    from prefetch.sources.s3.factory import make_s3_client

    if not dst.strip().startswith(("s3://", "oci://")):
        raise ConfigError(
            f"the mirror destination must be s3://bucket/prefix or oci://registry/repo:tag, "
            f"not {dst!r}"
        )
    reads = _mirrored_backend(src)
    if dst.strip().startswith("oci://"):  # a registry: a ModelPack artifact, or a copy
        _mirror_to_registry(src, dst, revision, token, endpoint, proxy, ca_bundle, concurrency,
                            attempts, progress, as_json, record)  # fmt: skip
        return
    source_uri, dest_uri = parse_source_uri(src), parse_source_uri(dst)
    if not reads.has_revisions and revision:
        raise ConfigError("--revision is for hf:// sources")
    size = size_option(part_size, "--part-size")
    assert size is not None
    transfer = make_config(
        concurrency, "64MiB", False, False, attempts, min_rate, stall_timeout, deadline
    )
    config = MirrorConfig(transfer=transfer, part_size=size)
    client = make_writer_client(
        make_s3_client, endpoint_url, max_pool_connections=pool_size(concurrency), proxy=proxy,
        ca_bundle=ca_bundle,
    )  # fmt: skip
    dest = S3Prefix(client, dest_uri.location, dest_uri.path, retry=transfer.retry)
    record.destination = dest.url(dest.prefix)
    reach = SourceSettings(
        s3_endpoint=endpoint_url or None,
        hub_endpoint=endpoint or None,
        token=token or None,
        concurrency=concurrency,
        retry=transfer.retry,
        # --proxy is for the source only: without it, the source shares the writer's client
        s3_client=client if proxy is None else None,
    )
    show = sys.stderr.isatty() if progress is None else progress
    bar: ProgressSink = TerminalProgress(sys.stderr) if show else NullProgress()
    sink = NoteWhenStarted(bar, MIRROR_INTERRUPTED)
    t0 = time.monotonic()
    try:
        if reads.mirrors_commits:
            spec = ModelSpec(
                source=source_uri, revision=revision or None, proxy=proxy, ca_bundle=ca_bundle
            )
            source = open_source(spec, reach)
            result = mirror_hub(
                spec, source, dest, config, progress=sink, stop=stop_on_sigterm(), so_far=record
            )
        else:
            spec = ModelSpec(source=source_uri, proxy=proxy, ca_bundle=ca_bundle)
            result = _copy_prefix(spec, dest, reach, config, sink, record)
    finally:
        record.seconds = round(time.monotonic() - t0, 3)
    _print_mirror(result, src, as_json)


def _mirrored_backend(src: str) -> Backend:
    """SRC's backend, if ``prefetch mirror`` reads it (else one line naming what it reads)."""
    from prefetch.pipeline.backends import backend, backends

    reads = backend(parse_source_uri(src).scheme)
    if not reads.mirrored_from:
        raise ConfigError(
            f"prefetch mirror does not read {src!r}: its sources are "
            + ", ".join(f"{b.scheme}://" for b in backends() if b.mirrored_from),
            hint="copy it with its own tools (gcloud storage, azcopy, aws s3 sync, oras push)",
        )
    return reads


def _copy_prefix(
    spec: ModelSpec,
    dest: S3Prefix,
    reach: SourceSettings,
    config: MirrorConfig,
    sink: ProgressSink,
    record: Any,
) -> MirrorResult:
    """An S3 prefix copied object by object into ``dest`` (a mirror's metadata is copied as it
    is); one client lists the prefix and reads its objects."""
    from prefetch.publish.s3_mirror import S3Prefix, mirror_s3
    from prefetch.sources import open_source
    from prefetch.sources.s3.factory import s3_client

    uri = spec.source
    if (uri.location, uri.path) == (dest.bucket, dest.prefix):
        raise ConfigError("the mirror source and destination are the same prefix")
    reader = s3_client(spec, reach, lazy=True)
    reach = dataclasses.replace(reach, s3_client=reader)
    src_prefix = S3Prefix(reader, uri.location, uri.path, retry=config.transfer.retry)
    return mirror_s3(
        open_source(spec, reach, layout="plain"), src_prefix, dest, config, progress=sink,
        stop=stop_on_sigterm(), so_far=record,
    )  # fmt: skip


def _mirror_to_registry(
    src: str, dst: str, revision: str | None, token: str | None, endpoint: str | None,
    proxy: str | None, ca_bundle: str | None, concurrency: int, attempts: int,
    progress: bool | None, as_json: bool, record: Any,
) -> None:  # fmt: skip
    """``prefetch mirror SRC oci://...`` (see :mod:`prefetch.publish.oci_push`)."""
    from prefetch.publish.oci_push import mirror_command

    show = sys.stderr.isatty() if progress is None else progress
    bar: ProgressSink = TerminalProgress(sys.stderr) if show else NullProgress()
    sink = NoteWhenStarted(bar, MIRROR_INTERRUPTED)
    retry = make_config(concurrency, "64MiB", False, False, attempts, "64KiB", "30s", "off").retry
    t0 = time.monotonic()
    try:
        result = mirror_command(
            src, dst, revision=revision, hub_endpoint=endpoint or None, token=token or None,
            proxy=proxy, ca_bundle=ca_bundle, concurrency=concurrency, retry=retry,
            progress=sink, so_far=record,
        )  # fmt: skip
    finally:
        record.seconds = round(time.monotonic() - t0, 3)
    _print_mirror(result, src, as_json)


def _print_mirror(result: Any, src: str, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result.to_json(), sort_keys=True))
        return
    what = f"{result.repo_id}@{result.ref}" if result.repo_id else src
    commit = f" ({result.commit[:12]})" if result.commit else ""
    click.echo(
        f"{printable(what)}{commit}: {result.files} files, "
        f"{format_bytes(result.bytes_uploaded)} uploaded, "
        f"{format_bytes(result.bytes_skipped)} already there, in {result.seconds:.1f}s "
        f"-> {printable(result.destination)}"
    )
