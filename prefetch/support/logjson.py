"""Log lines for the agent: one JSON object per line on stderr (or plain text for people).

Fields: ``ts`` (UTC, RFC 3339 with milliseconds), ``level``, ``logger``, ``msg``, and when the
call passed them through ``extra=``: ``model``, ``phase``, ``bytes``, ``rate``, ``error``, and for
the node's story (:mod:`prefetch.agent.events`) ``event``, ``seconds``, ``source``, ``node``. An
exception adds ``error`` (type and message) and ``traceback``. A line written while a sync runs
carries that sync's ``sync_id`` (:func:`sync_context`), also from the engine's worker threads
(their pools start with :func:`inherit_context`). Every record passes
:class:`prefetch.support.redact.RedactingFilter` and the formatters scrub again: nothing that looks
like a credential (presigned URL signatures, bearer tokens, Hub tokens, AWS secret keys) is written,
and a message is one line, control characters escaped. The code never logs secrets on purpose; this
is the last line of defence against a library's debug log.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from prefetch.support.redact import install_filter, redact

#: ``extra=`` keys copied into the JSON object, in this order.
EXTRA_FIELDS = (
    "model",
    "phase",
    "bytes",
    "rate",
    "error",
    "event",
    "seconds",
    "source",
    "node",
    "sync_id",
)
NOISY_LOGGERS = (
    "botocore",
    "boto3",
    "urllib3",
    "s3transfer",
    "filelock",
    "kubernetes",
    "watchdog",
    "asyncio",
)

#: Kept under its old name for callers: see :func:`prefetch.support.redact.redact`.
scrub = redact

#: The sync a line is written for (None outside one): set by :func:`sync_context`.
_SYNC_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("sync_id", default=None)


def new_sync_id() -> str:
    """A short random id for one sync attempt (8 hex digits: unique enough among one node's
    syncs, short enough to read and to grep)."""
    return secrets.token_hex(4)


def current_sync_id() -> str | None:
    return _SYNC_ID.get()


@contextlib.contextmanager
def sync_context(sync_id: str | None = None) -> Iterator[str]:
    """Every line written in this context (and in threads started with :func:`inherit_context`
    or ``asyncio.to_thread`` from it) carries ``sync_id``; yields the id."""
    value = sync_id or new_sync_id()
    token = _SYNC_ID.set(value)
    try:
        yield value
    finally:
        _SYNC_ID.reset(token)


def inherit_context() -> Callable[[], None]:
    """An initializer for a thread pool created here: its threads take this thread's sync id.
    (A new thread starts with an empty context; ``asyncio.to_thread`` copies it, a
    ``ThreadPoolExecutor`` does not.)"""
    value = _SYNC_ID.get()

    def initializer() -> None:
        _SYNC_ID.set(value)

    return initializer


def _field(record: logging.LogRecord, key: str) -> object:
    """An extra field of ``record``; the sync id falls back to the writing thread's context
    (the handlers here format on the thread that logs)."""
    value = record.__dict__.get(key)
    if value is None and key == "sync_id":
        return _SYNC_ID.get()
    return value


def _safe(value: object) -> object:
    """An extra field's value fit for the log: numbers as they are; anything else (a string,
    an exception, a dict holding a URL) redacted, structured values kept structured."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return scrub(value)
    text = json.dumps(value, default=str, ensure_ascii=False)
    try:
        return json.loads(scrub(text))
    except ValueError:  # the redaction cut through the JSON's quoting: keep it as text
        return scrub(text)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, object] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": scrub(record.getMessage()),
        }
        for key in EXTRA_FIELDS:
            value = _field(record, key)
            if value is not None:
                out[key] = _safe(value)
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            out.setdefault("error", scrub(f"{type(exc).__name__}: {exc}"))
            out["traceback"] = scrub(self.formatException(record.exc_info))
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``<ts> <level> <logger>: <msg> [model=.. phase=..]`` for people at a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = scrub(super().format(record))
        extras = [
            f"{k}={_field(record, k)}"
            for k in EXTRA_FIELDS
            if _field(record, k) is not None and k != "error"
        ]
        if record.__dict__.get("error") is not None and not record.exc_info:
            extras.append(f"error={scrub(str(record.__dict__['error']))!r}")
        return f"{line} [{' '.join(extras)}]" if extras else line


def setup_logging(
    fmt: str = "json", *, level: int = logging.INFO, stream: TextIO | None = None
) -> logging.Handler:
    """Route every log record to ``stream`` (stderr) in ``fmt`` (json|text), replacing handlers."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    install_filter(handler)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
    # what Python would print on stderr by itself goes through the handler too: one format
    # (off first: captureWarnings(True) does nothing when it believes it is on already, even if
    # something has put warnings.showwarning back since, as a second setup in one process finds)
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    threading.excepthook = _log_thread_exception
    return handler


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    """An exception that ended a thread: one log record, not a raw traceback on stderr."""
    if args.exc_type is SystemExit:
        return
    thread = args.thread.name if args.thread is not None else "?"
    logging.getLogger("prefetch.thread").error(
        "uncaught exception in thread %s",
        thread,
        exc_info=(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback),
    )
