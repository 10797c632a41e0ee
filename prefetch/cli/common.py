"""What the commands share: one error line per failure, the options several commands take.

Results go to stdout (one JSON object with ``--json``); everything meant for a person (progress,
warnings, errors) goes to stderr. Every PrefetchError becomes one ``Error: ...`` line, an optional
``Hint: ...`` line and exit status 1; set PREFETCH_DEBUG=1 for a traceback.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import signal
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from prefetch.cli.help import HelpGroup
from prefetch.support import errors, settings
from prefetch.support.errors import (
    ConfigError,
    LayoutError,
    PrefetchError,
    TlsError,
)
from prefetch.support.redact import printable, redact
from prefetch.support.units import parse_duration, parse_size

if TYPE_CHECKING:
    # the engine (and the HTTP stack below it) is imported by the commands that transfer: the
    # group, `--help`, `verify`, `ls` and `status` start without it
    from prefetch.pipeline.engine.transfer import TransferConfig
    from prefetch.pipeline.progress import ProgressSink
F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("prefetch")


def fail(exc: PrefetchError) -> None:
    click.echo(f"Error: {printable(redact(str(exc)))}", err=True)
    if exc.hint:
        click.echo(f"Hint: {printable(redact(exc.hint))}", err=True)


#: ``error_reason`` in a failed command's ``--json`` object: a stable name per kind of failure,
#: for scripts (the ``error`` line is for people and may change): the package's one vocabulary
#: (:data:`prefetch.support.errors.ERROR_REASONS`, which the agent's failure labels use too), plus
#: the command line's own usage errors.
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


class LazyGroup(_Group):
    """A group some of whose commands are imported only when they run (or ``--help`` lists
    them): the agent's commands bring kubernetes, prometheus_client and psutil, which a
    ``prefetch pull`` does not need (start-up: see bench/README.md)."""

    def __init__(
        self, *args: Any, lazy_commands: Mapping[str, tuple[str, str]] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        #: command name -> (module, attribute)
        self.lazy_commands = dict(lazy_commands or {})

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

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        """click's, with a mistyped name's "Did you mean" looked for among the lazy commands
        too (click looks only among those the group holds, imported)."""
        try:
            return super().resolve_command(ctx, args)
        except click.NoSuchCommand:
            raise click.NoSuchCommand(
                str(args[0]), possibilities=self.list_commands(ctx), ctx=ctx
            ) from None


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
    from prefetch.pipeline.engine.transfer import TransferConfig
    from prefetch.pipeline.retry import RetryPolicy

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
                     help="s3, oci, gs, az and file sources: publish in the Hugging Face layout "
                     "under this repo id (org/name), so vLLM finds it offline."),
        click.option("--hf-revision", default=None,
                     help="With --hf-repo: the 40-hex commit id to publish under "
                     "[default: a digest of the listing]."),
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
    :func:`prefetch.support.settings.ca_bundle`'s order (then REQUESTS_CA_BUNDLE, SSL_CERT_FILE,
    AWS_CA_BUNDLE, the AWS profile's ca_bundle, the system's store)."""
    return click.option(
        "--ca-bundle", default=None, metavar="FILE", callback=_checked_ca_bundle,
        help="PEM file of CA certificates to verify TLS with (a private CA) [default: "
        "REQUESTS_CA_BUNDLE, SSL_CERT_FILE, AWS_CA_BUNDLE, the AWS profile's ca_bundle, then "
        "the system's store]. Hostnames are always verified.",
    )(fn)  # fmt: skip
