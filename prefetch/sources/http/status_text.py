"""Words for an HTTP error answer that carries no S3 error document.

An S3 error answer names its code (``AccessDenied``, ``SlowDown``); one from something else in
the path (a proxy's 407, a load balancer's 502, a redirect S3 does not explain) has only a
status, and printing it as the code and the message both read ``407: 407``. :func:`bare_status`
says what the status means, where a redirect points (scheme and host only: its query may be a
signature), and what to check. :func:`header_problem` says when an answer's header block did
not parse: ``http.client`` stops at the first malformed line and takes the rest (the
Content-Length too) for the body, which then ends only when the server closes the connection.
"""

from __future__ import annotations

import http
from collections.abc import Mapping
from urllib.parse import urlsplit

import urllib3

__all__ = ["bare_status", "header_problem"]


def bare_status(status: int, headers: Mapping[str, str]) -> str:
    """``Proxy Authentication Required (...)``, ``Temporary Redirect to https://host (...)``."""
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "an unknown status"
    if status == 407:
        return (
            f"{phrase} (a proxy in the way wants credentials: give them in the proxy's URL, "
            "as user:password@ before its host)"
        )
    if 300 <= status < 400:
        target = urlsplit(headers.get("Location") or "")
        where = f" to {target.scheme}://{target.netloc.rpartition('@')[2]}" if target.netloc else ""
        return (
            f"{phrase}{where} (not followed: check the endpoint URL and the bucket's region, "
            "AWS_DEFAULT_REGION)"
        )
    return f"{phrase} (no S3 error document: from a proxy or load balancer in the way?)"


def header_problem(resp: object) -> str | None:
    """Why the header block of ``resp`` (a urllib3 response) is unusable, or None."""
    message = getattr(getattr(resp, "_original_response", None), "msg", None)
    if message is None:
        return None
    try:
        urllib3.util.response.assert_header_parsing(message)
    except urllib3.exceptions.HeaderParsingError:
        defects = getattr(message, "defects", None) or []
        kinds = ", ".join(sorted({type(d).__name__ for d in defects})) or "unparsed data"
        payload = message.get_payload() if hasattr(message, "get_payload") else None
        unparsed = repr(payload)[:80] if isinstance(payload, str | bytes) and payload else "-"
        return f"has a malformed header line ({kinds}; unparsed: {unparsed})"
    return None
