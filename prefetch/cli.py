"""The ``prefetch`` command line.

Results go to stdout (one JSON object with ``--json``); everything meant for a person (progress,
warnings, errors) goes to stderr. Every PrefetchError becomes one ``Error: ...`` line, an optional
``Hint: ...`` line and exit status 1; set PREFETCH_DEBUG=1 for a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from prefetch import __version__, errors, settings
from prefetch.clihelp import HelpGroup
from prefetch.errors import (
    ConfigError,
    LayoutError,
    PrefetchError,
    TlsError,
    VerifyError,
)
from prefetch.progress import NullProgress, ProgressSink, TerminalProgress
from prefetch.redact import install_filter, printable, redact
from prefetch.retry import RetryPolicy
from prefetch.spec import ModelSpec, SpecError, layout_kind, parse_source_uri
from prefetch.sync import SyncResult, VerifyReport
from prefetch.transfer import TransferConfig
from prefetch.units import format_bytes, parse_duration, parse_size

if TYPE_CHECKING:
    from prefetch.sources import Source

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("prefetch")


def fail(exc: PrefetchError) -> None:
    click.echo(f"Error: {printable(redact(str(exc)))}", err=True)
    if exc.hint:
        click.echo(f"Hint: {printable(redact(exc.hint))}", err=True)


#: ``error_reason`` in a failed command's ``--json`` object: a stable name per kind of failure,
#: for scripts (the ``error`` line is for people and may change): the package's one vocabulary
#: (:data:`prefetch.errors.ERROR_REASONS`, which the agent's failure labels use too), plus the
#: command line's own usage errors.
ERROR_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (click.ClickException, "config"),
    *errors.ERROR_REASONS,
)


def error_reason(exc: BaseException) -> str:
    """The ``error_reason`` of ``exc`` (see ERROR_REASONS); ``internal`` for a bug."""
    return next((reason for cls, reason in ERROR_REASONS if isinstance(exc, cls)), "internal")


def failure_json(exc: BaseException, done: dict[str, Any]) -> str:
    """A failed command's one JSON object: what it had done, the error and its reason."""
    if isinstance(exc, click.ClickException):
        message = exc.format_message()
    elif isinstance(exc, KeyboardInterrupt):
        message = "interrupted"
    else:
        message = str(exc) or type(exc).__name__
    message = printable(redact(message))  # as the Error: line shows it: no secrets
    out = {**done, "error": message.splitlines()[0] if message else message}
    out["error_reason"] = error_reason(exc)
    if "ok" in out:
        out["ok"] = False  # a report cut short by an error is not a clean one
    return json.dumps(out, sort_keys=True)


def json_even_on_failure(new_record: Callable[[dict[str, Any]], Any]) -> Callable[[F], F]:
    """With ``--json``, the command prints one JSON object on stdout whether it succeeds or not.

    ``new_record(params)`` makes the object (with a ``to_json()``) that the command, called with
    it as ``record``, fills in as it goes; when the command raises, its ``to_json()`` plus
    ``error`` and ``error_reason`` are printed before the group turns the error into the usual
    ``Error: ...`` line on stderr and exit status. Deliberate exits (``sys.exit``) print nothing
    more: the command has printed its own object by then."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(**params: Any) -> Any:
            record = new_record(params)
            try:
                return fn(record=record, **params)
            except (SystemExit, click.exceptions.Exit):
                raise
            except BaseException as exc:
                if params.get("as_json"):
                    click.echo(failure_json(exc, record.to_json()))
                raise

        return cast("F", wrapper)  # functools.wraps keeps fn's signature; mypy cannot see it

    return decorate


#: ``ctx.meta`` key: what a Ctrl-C leaves behind, said by the command once it is true (before
#: any download there is nothing partial to keep).
INTERRUPTED_NOTE = "prefetch.interrupted_note"


def on_interrupt(note: str) -> None:
    """From here on, a Ctrl-C of this command prints ``note`` (default: ``Interrupted.``)."""
    click.get_current_context().meta[INTERRUPTED_NOTE] = note


#: What a Ctrl-C of ``prefetch mirror`` says once uploads have started.
MIRROR_INTERRUPTED = "Interrupted; partial uploads are kept and the next mirror resumes them."


class NoteWhenStarted:
    """A progress sink that passes everything on and, when the transfer starts (after the
    resolve, the plan and the lock), makes ``note`` what a Ctrl-C prints from then on."""

    def __init__(self, inner: ProgressSink, note: str) -> None:
        self._inner = inner
        self._note = note
        self._meta = click.get_current_context().meta

    def start(self, model: str, total_bytes: int, total_files: int) -> None:
        self._meta[INTERRUPTED_NOTE] = self._note
        self._inner.start(model, total_bytes, total_files)

    def advance(self, nbytes: int) -> None:
        self._inner.advance(nbytes)

    def chunk_done(self) -> None:
        self._inner.chunk_done()

    def file_done(self, path: str, size: int) -> None:
        self._inner.file_done(path, size)

    def retry(self, reason: str) -> None:
        self._inner.retry(reason)

    def checksum_failure(self, path: str) -> None:
        self._inner.checksum_failure(path)

    def finish(self) -> None:
        self._inner.finish()


class _Group(HelpGroup):
    """Turns package errors into one clear line and exit 1, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            debug = settings.debug()
        except ConfigError as exc:
            fail(exc)
            ctx.exit(1)
        try:
            return super().invoke(ctx)
        except PrefetchError as exc:
            if debug:
                raise
            fail(with_trust_note(exc, ctx) if isinstance(exc, TlsError) else exc)
            ctx.exit(1)
        except KeyboardInterrupt:
            click.echo(ctx.meta.get(INTERRUPTED_NOTE, "Interrupted."), err=True)
            ctx.exit(130)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except OSError as exc:
            if debug:
                raise
            click.echo(f"Error: {printable(redact(str(exc)))}", err=True)
            ctx.exit(1)


class _LazyGroup(_Group):
    """A group some of whose commands are imported only when they run (or ``--help`` lists
    them): the agent's commands bring kubernetes, prometheus_client and psutil, which a
    ``prefetch pull`` does not need (start-up: see bench/README.md)."""

    #: command name -> (module, attribute)
    lazy_commands: dict[str, tuple[str, str]] = {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in self.lazy_commands:
            import importlib

            module, attribute = self.lazy_commands[cmd_name]
            command = getattr(importlib.import_module(module), attribute)
            self.add_command(command, cmd_name)
        return command


@click.group(
    cls=_LazyGroup,
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


_NUMBER = re.compile(r"\d+(\.\d+)?")


def size_option(value: str | None, name: str) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value, field=name)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc


def _with(fn: F, options: list[Callable[[F], F]]) -> F:
    for option in reversed(options):
        fn = option(fn)
    return fn


def concurrency_option(default: int, help: str) -> Callable[[F], F]:
    """``--concurrency``: what is in flight at once (each command says what that is)."""
    return click.option("--concurrency", type=click.IntRange(1, 512), default=default,
                        envvar="PREFETCH_CONCURRENCY", show_default=True, help=help)  # fmt: skip


def pace_options(fn: F) -> F:
    """How hard a command tries, and how long it waits: the flags ``pull`` and ``mirror``
    share (their defaults and environment twins once)."""
    return _with(fn, [
        click.option("--attempts", type=click.IntRange(1, 100), default=6, show_default=True,
                     help="Tries per request on timeouts, resets, 5xx and throttling."),
        click.option("--min-rate", default="64KiB", envvar="PREFETCH_MIN_RATE",
                     show_default=True,
                     help="Bytes/s a request must average over --stall-timeout, or it is "
                     "abandoned and retried from its last byte (0: off)."),
        click.option("--stall-timeout", default="30s", envvar="PREFETCH_STALL_TIMEOUT",
                     show_default=True, help="Window of the --min-rate rule (e.g. 30s, 2m)."),
        click.option("--deadline", default="off", envvar="PREFETCH_DEADLINE", show_default=True,
                     help="Give up (resumably) when the command takes longer (e.g. 2h)."),
    ])  # fmt: skip


def transfer_options(fn: F) -> F:
    return _with(fn, [
        concurrency_option(16, "Ranged requests in flight, across all files."),
        click.option("--chunk-size", default="64MiB", envvar="PREFETCH_CHUNK_SIZE",
                     show_default=True, help="Size of each ranged request (e.g. 16MiB)."),
        click.option("--require-checksum", is_flag=True,
                     help="Fail on files the source states no checksum for."),
        click.option("--no-verify", is_flag=True, help="Skip checksum verification (sizes only)."),
        pace_options,
    ])  # fmt: skip


def duration_option(value: str, name: str) -> float | None:
    """A duration flag ('30s', '2m', '90'; '0'/'off': None), as a click usage error if bad."""
    text = value.strip()
    try:
        return parse_duration(float(text) if _NUMBER.fullmatch(text) else text, field=name)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc


def make_config(
    concurrency: int,
    chunk_size: str,
    require_checksum: bool,
    no_verify: bool,
    attempts: int,
    min_rate: str = "64KiB",
    stall_timeout: str = "30s",
    deadline: str = "off",
) -> TransferConfig:
    size = size_option(chunk_size, "--chunk-size")
    assert size is not None
    rate = size_option(min_rate, "--min-rate")
    window = duration_option(stall_timeout, "--stall-timeout")
    if window is None:
        raise click.BadParameter("--stall-timeout: must be positive (use --min-rate 0 for off)")
    return TransferConfig(
        min_rate=rate or 0,
        stall_window=window,
        deadline=duration_option(deadline, "--deadline"),
        concurrency=concurrency,
        chunk_size=size,
        buffer_size=min(1024 * 1024, size),
        verify=not no_verify,
        require_checksum=require_checksum,
        retry=RetryPolicy(attempts=attempts),
    )


def stop_on_sigterm() -> threading.Event:
    """SIGTERM sets the returned event: no new chunks start, resumable state stays."""
    stop = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
    return stop


def missing_folders(dest: str) -> list[Path]:
    """The folders a pull into ``dest`` creates (``dest`` first, then its missing parents)."""
    path = Path(dest).expanduser().resolve()
    made: list[Path] = []
    while not path.exists() and path != path.parent:
        made.append(path)
        path = path.parent
    return made


@contextlib.contextmanager
def removed_if_empty_on_failure(made: list[Path]) -> Iterator[None]:
    """On a failure (a refused certificate, no network, a typo in the name, Ctrl-C), the
    folders the command created are removed again while they are empty: a pull that got
    nothing leaves nothing behind (a partial download is not empty: it stays, to resume)."""
    try:
        yield
    except BaseException:
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def writable_destination(dest: str) -> Path:
    path = Path(dest).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LayoutError(f"cannot create the destination {path}: {exc.strerror}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise LayoutError(f"the destination {path} is not writable: {unwritable_reason(path)}")
    return path


def unwritable_reason(path: Path) -> str:
    """Why this process cannot write in the directory ``path``: its file system is mounted
    read-only, or the permissions (owner, mode, who runs this) do not allow it."""
    if os.statvfs(path).f_flag & os.ST_RDONLY:
        return "read-only file system"
    st = path.stat()
    return (
        f"permission denied (owner uid {st.st_uid}, {stat.filemode(st.st_mode)}; "
        f"this process runs as uid {os.geteuid()})"
    )


def hub_source_options(fn: F) -> F:
    """Which Hub revision, and how to reach the Hub: ``pull`` and ``mirror``."""
    return _with(fn, [
        click.option("--revision", default=None,
                     help="hf:// sources: branch, tag or 40-hex commit (also hf://org/name@rev) "
                     "[default: main]."),
        click.option("--token", default=None,
                     help="Hub token [default: HF_TOKEN, then the token file in HF_HOME]."),
        click.option("--endpoint", envvar="HF_ENDPOINT", default=None, show_envvar=True,
                     help="Hub endpoint or mirror [default: https://huggingface.co]."),
    ])  # fmt: skip


def s3_endpoint_option(fn: F) -> F:
    return click.option(
        "--endpoint-url", envvar="AWS_ENDPOINT_URL", help="S3 endpoint (default: AWS)."
    )(fn)


def hub_options(fn: F) -> F:
    return _with(fn, [
        hub_source_options,
        click.option("--layout", "layout_name", type=click.Choice(["hf", "plain"]), default=None,
                     help="hf: the Hugging Face cache, DEST is HF_HOME and files go under "
                     "DEST/hub/; plain: files at DEST/<path>. [default: hf for hf:// sources and "
                     "--hf-repo, plain otherwise]"),
        click.option("--hf-repo", default=None,
                     help="S3 and OCI sources: publish in the Hugging Face layout under this "
                     "repo id (org/name), so vLLM finds it offline."),
        click.option("--hf-revision", default=None,
                     help="With --hf-repo: the 40-hex commit id to publish under "
                     "[default: a digest of the S3 listing]."),
    ])  # fmt: skip


def proxy_option(fn: F) -> F:
    """``--proxy URL``: this command's requests to the source go through URL ("none": direct),
    instead of HTTP(S)_PROXY; NO_PROXY still applies."""
    return click.option(
        "--proxy", default=None, metavar="URL",
        help="HTTP(S) proxy for the source (none: direct) [default: HTTPS_PROXY/HTTP_PROXY; "
        "hosts in NO_PROXY always go direct].",
    )(fn)  # fmt: skip


#: ``ctx.meta`` key (shared by a command and its group): the ``--ca-bundle`` the command got.
CA_BUNDLE_FLAG = "prefetch.ca_bundle"


def _checked_ca_bundle(ctx: click.Context, _param: click.Parameter, value: str | None) -> Any:
    """The flag's file, checked now (a one-line error naming --ca-bundle)."""
    checked = None if not value else settings.check_ca_bundle(value, "--ca-bundle")
    ctx.meta[CA_BUNDLE_FLAG] = checked
    return checked


def with_trust_note(exc: TlsError, ctx: click.Context) -> TlsError:
    """``exc`` with its hint saying which CA bundle this run trusted and where that choice came
    from: a variable set for other tools (a system-wide REQUESTS_CA_BUNDLE) comes before the
    SSL_CERT_FILE a user just set, and the refusal alone does not say so."""
    flag = ctx.meta.get(CA_BUNDLE_FLAG)
    try:
        trusted = settings.CaBundle(flag, "--ca-bundle") if flag else settings.ca_bundle()
    except ConfigError:
        return exc
    if trusted.path is None:
        return exc
    note = f"this run trusted {trusted.path}, from {trusted.origin}"
    hint = f"{exc.hint}; {note}" if exc.hint else note
    return TlsError(str(exc), hint=hint)


def ca_bundle_option(fn: F) -> F:
    """``--ca-bundle FILE``: the CA bundle (PEM) TLS to every remote is verified with, first in
    :func:`prefetch.settings.ca_bundle`'s order (then REQUESTS_CA_BUNDLE, SSL_CERT_FILE,
    AWS_CA_BUNDLE, the AWS profile's ca_bundle, the system's store)."""
    return click.option(
        "--ca-bundle", default=None, metavar="FILE", callback=_checked_ca_bundle,
        help="PEM file of CA certificates to verify TLS with (a private CA) [default: "
        "REQUESTS_CA_BUNDLE, SSL_CERT_FILE, AWS_CA_BUNDLE, the AWS profile's ca_bundle, then "
        "the system's store]. Hostnames are always verified.",
    )(fn)  # fmt: skip


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
    from prefetch.sources import SourceSettings, open_source

    reach = SourceSettings(
        s3_endpoint=s3_endpoint or None,
        hub_endpoint=hub_endpoint or None,
        token=token or None,
        concurrency=config.concurrency,
        retry=config.retry,
    )
    return open_source(spec, reach, layout=layout_name)  # pull_spec checked the layout


@main.command(
    short_help="Download a model (s3://, hf://, oci://), verified and resumable.",
    option_groups=[
        ("Source", ["include", "exclude", "revision", "token", "endpoint", "endpoint_url",
                    "proxy", "mirrors", "hub_fallback"]),
        ("Destination", ["layout_name", "hf_repo", "hf_revision", "name", "delete"]),
        ("Performance", ["concurrency", "chunk_size", "attempts", "min_rate", "stall_timeout",
                         "deadline", "warm", "warm_memory_share"]),
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
@transfer_options
@json_even_on_failure(lambda params: SyncResult(model=params["name"], source=params["uri"]))
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
    record: SyncResult,
    **transfer: Any,
) -> None:
    """Download a model from URI (s3://bucket/prefix, hf://org/name, or
    oci://registry/repo:tag or @sha256:digest) into DEST, verified and resumable. With the hf
    layout DEST is an HF_HOME: vLLM with HF_HOME=DEST and HF_HUB_OFFLINE=1 loads the model from
    it."""
    from prefetch.layout import layout_for
    from prefetch.pipeline import Pipeline
    from prefetch.pipeline import warm as warm_up

    config = make_config(**transfer)
    spec, _ = pull_spec(
        uri, name=name, include=include, exclude=exclude, revision=revision, hf_repo=hf_repo,
        hf_revision=hf_revision, layout_name=layout_name, proxy=proxy, mirrors=mirrors,
        hub_fallback=hub_fallback, ca_bundle=ca_bundle,
    )  # fmt: skip
    record.model = spec.name
    made = missing_folders(dest)
    root = writable_destination(dest)
    record.path = str(root)
    with removed_if_empty_on_failure(made):
        source = open_pull_source(
            spec, layout_name, config, s3_endpoint=endpoint_url, hub_endpoint=endpoint, token=token
        )
        pipeline = Pipeline(
            spec, source, lambda s, kind: layout_for(s, root, layout_name=kind),
            layout_name=layout_name,
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
    spec = resolved.spec
    warmed = None
    if warm:
        from prefetch.warm import WarmLimits

        limits = WarmLimits(memory_share=warm_memory_share)
        warmed = warm_up(resolved.layout, result, limits, model=spec.name)
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
        click.echo(f"{spec.name}: up to date, 0 bytes downloaded ({result.files} files) in {dest}")
    else:
        rate = result.bytes_downloaded / result.seconds if result.seconds else 0
        click.echo(
            f"{spec.name}: {result.files_downloaded} files, "
            f"{format_bytes(result.bytes_downloaded)} downloaded in {result.seconds:.1f}s "
            f"({format_bytes(rate)}/s), {result.files_verified} verified -> {result.path}"
        )


@main.command(
    "verify",
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
    from prefetch.layout import layouts_under
    from prefetch.sync import verify_layouts

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


def _mirror_record(params: dict[str, Any]) -> Any:
    from prefetch.mirror import MirrorResult

    return MirrorResult(source=params["src"], destination=params["dst"])


@main.command(
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
    from prefetch.backends import backend
    from prefetch.mirror import MirrorConfig, S3Prefix, mirror_hub, mirror_s3
    from prefetch.mirror.upload import make_writer_client
    from prefetch.sources import SourceSettings, open_source, pool_size, s3_client
    from prefetch.sources.s3_factory import make_s3_client

    if not dst.strip().startswith(("s3://", "oci://")):
        raise ConfigError(
            f"the mirror destination must be s3://bucket/prefix or oci://registry/repo:tag, "
            f"not {dst!r}"
        )
    if dst.strip().startswith("oci://"):  # a registry: a ModelPack artifact, or a copy
        _mirror_to_registry(src, dst, revision, token, endpoint, proxy, ca_bundle, concurrency,
                            attempts, progress, as_json, record)  # fmt: skip
        return
    source_uri, dest_uri = parse_source_uri(src), parse_source_uri(dst)
    reads = backend(source_uri.scheme)
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
            if (source_uri.location, source_uri.path) == (dest_uri.location, dest_uri.path):
                raise ConfigError("the mirror source and destination are the same prefix")
            spec = ModelSpec(source=source_uri, proxy=proxy, ca_bundle=ca_bundle)
            # the prefix read object by object (a mirror's metadata is copied as it is)
            # one client lists the prefix and reads its objects
            reader = s3_client(spec, reach, lazy=True)
            reach = dataclasses.replace(reach, s3_client=reader)
            src_prefix = S3Prefix(
                reader, source_uri.location, source_uri.path, retry=transfer.retry
            )
            result = mirror_s3(
                open_source(spec, reach, layout="plain"),
                src_prefix,
                dest,
                config,
                progress=sink,
                stop=stop_on_sigterm(),
                so_far=record,
            )
    finally:
        record.seconds = round(time.monotonic() - t0, 3)
    _print_mirror(result, src, as_json)


def _mirror_to_registry(
    src: str, dst: str, revision: str | None, token: str | None, endpoint: str | None,
    proxy: str | None, ca_bundle: str | None, concurrency: int, attempts: int,
    progress: bool | None, as_json: bool, record: Any,
) -> None:  # fmt: skip
    """``prefetch mirror SRC oci://...`` (see :mod:`prefetch.mirror.oci_push`)."""
    from prefetch.mirror.oci_push import mirror_command

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


@main.command(
    short_help="Try it here: a local S3 server, a generated model, a verified pull.",
    examples=[
        ("The whole path on a 96 MiB model; its data is removed at the end", "prefetch demo"),
        ("A bigger model, kept afterwards", "prefetch demo --size 1GiB --keep"),
        ("Pull into a folder of your own (kept)", "prefetch demo --dest /tmp/demo-model"),
    ],
)  # fmt: skip
@click.option("--size", default="96MiB", show_default=True, help="Total size of the model.")
@click.option(
    "--dest",
    default=None,
    help="Where to pull to, kept after the demo [default: a folder the demo removes].",
)
@click.option(
    "--keep",
    is_flag=True,
    help="Keep the demo's folder (the generated model, the server's data, the pull).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the pull's JSON summary on stdout.")
def demo(size: str, dest: str | None, keep: bool, as_json: bool) -> None:
    """Start a local S3 server, upload a generated model, pull and verify it, stop the server.

    It prints the `prefetch pull` command that does the same by hand and where its data is, and
    removes that data at the end unless --keep (on an error or Ctrl-C too)."""
    from prefetch.demo import run_demo

    total = size_option(size, "--size")
    assert total is not None
    if dest:  # checked before a model is generated and a server started, as `pull` checks it
        dest = str(writable_destination(dest))
    on_interrupt("Interrupted; the demo's server is stopped.")
    run_demo(total, dest, as_json=as_json, keep=keep)


_LazyGroup.lazy_commands.update(
    {
        name: ("prefetch.agent.cli", f"{name}_cmd")
        for name in ("agent", "ls", "gc", "status")  # each defined there as <name>_cmd
    }
)
_LazyGroup.lazy_commands["cache"] = ("prefetch.cache_cli", "cache")

if __name__ == "__main__":  # pragma: no cover
    main()
