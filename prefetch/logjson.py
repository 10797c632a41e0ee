"""Log lines for the agent: one JSON object per line on stderr (or plain text for people).

Fields: ``ts`` (UTC, RFC 3339 with milliseconds), ``level``, ``logger``, ``msg``, and when the
call passed them through ``extra=``: ``model``, ``phase``, ``bytes``, ``rate``, ``error``. An
exception adds ``error`` (type and message) and ``traceback``. Every record passes
:class:`prefetch.redact.RedactingFilter` and the formatters scrub again: nothing that looks like a
credential (presigned URL signatures, bearer tokens, Hub tokens, AWS secret keys) is written, and a
message is one line, control characters escaped. The code never logs secrets on purpose; this is
the last line of defence against a library's debug log.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any, TextIO

from prefetch.redact import install_filter, redact

#: ``extra=`` keys copied into the JSON object, in this order.
EXTRA_FIELDS = ("model", "phase", "bytes", "rate", "error")
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

#: Kept under its old name for callers: see :func:`prefetch.redact.redact`.
scrub = redact


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": scrub(record.getMessage()),
        }
        for key in EXTRA_FIELDS:
            value = record.__dict__.get(key)
            if value is not None:
                out[key] = scrub(value) if isinstance(value, str) else value
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
            f"{k}={record.__dict__[k]}"
            for k in EXTRA_FIELDS
            if record.__dict__.get(k) is not None and k != "error"
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
