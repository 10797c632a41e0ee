"""Log lines for the agent: one JSON object per line on stderr (or plain text for people).

Fields: ``ts`` (UTC, RFC 3339 with milliseconds), ``level``, ``logger``, ``msg``, and when the
call passed them through ``extra=``: ``model``, ``phase``, ``bytes``, ``rate``, ``error``. An
exception adds ``error`` (type and message) and ``traceback``. Messages are scrubbed of anything
that looks like a credential (presigned URL signatures, bearer tokens, Hub tokens, AWS secret
keys) as a last line of defence; the code never logs them on purpose.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any, TextIO

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

_SECRETS = (
    # presigned URLs: signature, credential and session token query parameters
    (re.compile(r"(?i)\b(X-Amz-(?:Signature|Credential|Security-Token)=)[^&\s\"']+"), r"\1***"),
    (re.compile(r"(?i)\b(Signature=|Expires=|Policy=|Key-Pair-Id=)[^&\s\"']+"), r"\1***"),
    # Authorization headers and bearer tokens
    (
        re.compile(
            r"(?i)\b(authorization[\"']?\s*[:=]\s*[\"']?)(?:bearer\s+|aws4-hmac-sha256\s+)?"
            r"[^\s\"',}]+"
        ),
        r"\1***",
    ),
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"), r"\1***"),
    # Hugging Face user/org tokens
    (re.compile(r"\bhf_[A-Za-z0-9]{16,}\b"), "hf_***"),
    # key=value / "key": "value" pairs whose key names a secret
    (
        re.compile(
            r"(?i)\b((?:aws_)?(?:secret(?:_access)?_key|session_token|password|token)"
            r"[\"']?\s*[:=]\s*[\"']?)[^\s\"',}&]+"
        ),
        r"\1***",
    ),
)


def scrub(text: str) -> str:
    """``text`` with credential-looking substrings replaced by ``***``."""
    for pattern, repl in _SECRETS:
        text = pattern.sub(repl, text)
    return text


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
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
    return handler
