"""Text fit to print: credentials redacted, control characters escaped.

Two hazards reach our output from outside. Signed URLs and headers: a CDN redirect carries
``Signature=...``, a presigned S3 URL ``X-Amz-Signature``/``X-Amz-Credential``, a request an
``Authorization`` header, and with ``-vv`` urllib3 and botocore log them all; :func:`redact`
replaces their values with ``***``. Names from the source: an S3 key or a file path may hold a
newline or a terminal escape, so printing it raw could forge a line (``evil\\nError: forged``) or
drive the terminal; :func:`printable` escapes such characters. :class:`RedactingFilter` applies
both to every log record a handler emits; the CLI's ``Error:`` line and progress lines call them
directly.
"""

from __future__ import annotations

import logging
import re
import unicodedata

#: Header, field and parameter names whose value is a secret wherever it is printed (OAuth2's
#: tokens, a docker config's ``auth`` and ``identitytoken``, as well as the headers').
_SECRET_NAME = (
    r"(?:proxy-)?authorization|x-amz-security-token|x-amz-signature|x-amz-credential"
    r"|(?:aws_)?(?:secret(?:_access)?_key|session_token)|password|(?:access_|refresh_|id_)?token"
    r"|identitytoken|registrytoken|client_secret|auth|cookie"
)
#: Query parameters whose values are never secrets (listing and paging, API versions, what a
#: registry is asked for). The value of every other parameter of a URL is masked: a signed URL's
#: signature may have any name (Azure's ``sig``, Cloudflare's ``verify``, CloudFront's
#: ``Signature``, a token in ``access_token``), so the policy lists what may be shown, not
#: vendors' secrets.
PUBLIC_QUERY_PARAMETERS = frozenset(
    {
        "ns", "recursive", "expand", "revision", "cursor", "limit", "n", "last",
        "list-type", "prefix", "delimiter", "max-keys", "start-after", "encoding-type",
        "fetch-owner", "continuation-token", "versionid", "partnumber", "uploads", "x-id",
        "x-amz-algorithm", "x-amz-date", "x-amz-expires", "x-amz-signedheaders",
        "service", "scope", "digest", "mount", "from", "sv", "sr", "sp", "spr",
    }
)  # fmt: skip
#: One ``name=value`` of a query string (after ``?`` or ``&``).
_QUERY_PARAMETER = re.compile(r"([?&])([A-Za-z0-9_.~%+-]+)=([^&\s\"'#<>]+)")
_SECRETS = (
    # botocore's SigV4 debug lines: the canonical request carries the session token and the
    # string to sign plus the signature are as good as one; nothing after the label is kept
    (
        re.compile(r"(?is)\b(CanonicalRequest|StringToSign|String to sign|Signature):\s.*"),
        r"\1: ***",
    ),
    # presigned URLs: signature, credential and session token query parameters
    (re.compile(r"(?i)\b(X-Amz-(?:Signature|Credential|Security-Token)=)[^&\s\"']+"), r"\1***"),
    (re.compile(r"(?i)\b(Signature=|Expires=|Policy=|Key-Pair-Id=)[^&\s\"']+"), r"\1***"),
    # a quoted value of a secret header or field, as Python logs a dict of str or of bytes
    # ('X-Amz-Security-Token': b'...', "authorization": "Bearer ..."): the whole quoted value
    (
        re.compile(rf"(?i)\b({_SECRET_NAME})([\"']?\s*[:=]\s*b?)([\"'])(?:(?!\3).)*\3"),
        r"\1\2\3***\3",
    ),
    # an unquoted one (an HTTP header line, a canonical request's name:value, key=value pairs)
    (
        re.compile(
            rf"(?i)\b({_SECRET_NAME})([\"']?\s*[:=]\s*)(?!b?[\"'])"
            r"(?:bearer\s+|basic\s+|aws4-hmac-sha256\s+)?[^\s\"',}&]+"
        ),
        r"\1\2***",
    ),
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"), r"\1***"),
    # Hugging Face user/org tokens
    (re.compile(r"\bhf_[A-Za-z0-9]{16,}\b"), "hf_***"),
    # a password in a URL's user info (a proxy's http://user:password@host:3128)
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@\"']*:)[^/\s@\"']+@"), r"\1***@"),
)


def redact(text: str) -> str:
    """``text`` with signatures, credentials and tokens (in URLs, headers, pairs) as ``***``:
    every query parameter's value but those of :data:`PUBLIC_QUERY_PARAMETERS`, and the values
    of secret headers and fields wherever they appear."""
    text = _QUERY_PARAMETER.sub(_query_value, text)
    for pattern, repl in _SECRETS:
        text = pattern.sub(repl, text)
    return text


def _query_value(match: re.Match[str]) -> str:
    if match.group(2).lower() in PUBLIC_QUERY_PARAMETERS:
        return match.group(0)
    return f"{match.group(1)}{match.group(2)}=***"


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``, ``\\u2028``): one line,
    nothing a terminal acts on. Everything else, including non-ASCII names, is kept."""
    if text.isprintable():
        return text
    return "".join(_escape(c) for c in text)


def _escape(char: str) -> str:
    """Controls, format characters (bidi overrides, zero-width), line and paragraph separators,
    lone surrogates (undecodable bytes) and unassigned code points, escaped; the rest kept."""
    category = unicodedata.category(char)
    if category[0] == "C" or category in ("Zl", "Zp"):
        return char.encode("unicode_escape").decode("ascii")
    return char


class RedactingFilter(logging.Filter):
    """Makes each record's message (with its args) and traceback safe to print: redacted, and
    on one line. Install it on a handler, so records from every logger (urllib3's too) pass it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed call: logging reports it when formatting
            return True
        record.msg, record.args = printable(redact(message)), None
        if record.name.startswith("urllib3.") and record.levelno < logging.ERROR:
            # urllib3 attaches a traceback to its warnings (a header it could not parse): the
            # caller reports the failure in one line, so the warning stays one line too
            record.exc_info, record.exc_text = None, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


def install_filter(handler: logging.Handler) -> None:
    """Add one RedactingFilter to ``handler`` (idempotent)."""
    if not any(isinstance(f, RedactingFilter) for f in handler.filters):
        handler.addFilter(RedactingFilter())
