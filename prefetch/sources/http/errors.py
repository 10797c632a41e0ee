"""How an HTTP answer or a transport failure becomes the package's error: one table for all sources.

* :func:`error_class` / :func:`status_error`: THE status table: an HTTP status (and the Hub's
  ``X-Error-Code``) to the package's exception class. Every source asks it; only the wording
  of messages is theirs.
* :func:`transport_error`: an exception from sending a request or reading a body, as ours
  (:func:`tls_error` for a refused certificate, :func:`connection_failure` for no connection).
* :func:`parse_retry_after`: a ``Retry-After`` header in seconds.

Imported through :mod:`prefetch.sources.http.transport`, the seam's public face.
"""

from __future__ import annotations

import email.utils
import http.client
import ssl
import time
from collections.abc import Mapping

import urllib3

from prefetch.support.errors import (
    AccessDeniedError,
    NotFoundError,
    RepoNotFoundError,
    RevisionNotFoundError,
    SourceChangedError,
    SourceError,
    TlsError,
    TransientSourceError,
)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delay-seconds or an HTTP date); None if absent or
    unreadable. Never negative: a date in the past means now."""
    if not value:
        return None
    try:
        return max(0.0, float(value.strip()))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


# ---- the status table --------------------------------------------------------------------------

#: The Hub's ``X-Error-Code`` values that name what went wrong better than the status does.
_ERROR_CODES: Mapping[str, type[SourceError]] = {
    "GatedRepo": AccessDeniedError,
    "RepoNotFound": RepoNotFoundError,
    "RevisionNotFound": RevisionNotFoundError,
    "EntryNotFound": NotFoundError,
}
_STATUSES: Mapping[int, type[SourceError]] = {
    401: AccessDeniedError,
    403: AccessDeniedError,
    404: NotFoundError,
    408: TransientSourceError,
    410: NotFoundError,
    412: SourceChangedError,  # a pinned (If-Match) request: the object changed
    416: SourceChangedError,  # the range is past the end: the file is not the listed size
    429: TransientSourceError,
}


def error_class(
    status: int, error_code: str | None = None, *, credentials: bool = True
) -> type[SourceError]:
    """The package's exception class for an HTTP error answer.

    In order: a status worth retrying (408, 429, 5xx) is transient whatever else it says; a 401
    to a request without credentials is access denied (a private repo hides behind it); a known
    Hub ``X-Error-Code`` comes next; then the status; anything else is a plain SourceError.
    """
    if status >= 500 or _STATUSES.get(status) is TransientSourceError:
        return TransientSourceError
    if status == 401 and not credentials:
        return AccessDeniedError
    by_code = _ERROR_CODES.get((error_code or "").strip())
    if by_code is not None:
        return by_code
    return _STATUSES.get(status, SourceError)


def status_error(
    status: int,
    message: str,
    *,
    error_code: str | None = None,
    credentials: bool = True,
    retry_after: str | None = None,
    hint: str | None = None,
) -> SourceError:
    """The exception for an HTTP error answer, of the class :func:`error_class` picks, with the
    caller's ``message`` (a transient one carries the server's ``Retry-After``)."""
    cls = error_class(status, error_code, credentials=credentials)
    if cls is TransientSourceError:
        return TransientSourceError(message, retry_after=parse_retry_after(retry_after))
    return cls(message, hint=hint)


#: What to check when no connection could be made at all (no DNS answer, refused, timed out).
NETWORK_HINT = (
    "check the network and DNS; behind a proxy set HTTPS_PROXY (or --proxy); "
    "a Hub mirror: HF_ENDPOINT (or --endpoint); another S3 server: --endpoint-url"
)


#: Said with every failure of the proxy itself (not reachable, refusing, wanting credentials).
PROXY_HINT = (
    "check HTTPS_PROXY / HTTP_PROXY (or --proxy URL; --proxy none goes direct) and NO_PROXY"
)


def connection_failure(exc: BaseException) -> str | None:
    """``cannot reach HOST:PORT: why`` when ``exc`` is urllib3's failure to open a connection
    (no DNS answer, refused, timed out), else None. urllib3 words these with the connection
    object's repr (a private class name): the host, port and reason are taken apart instead."""
    if not isinstance(exc, urllib3.exceptions.ConnectTimeoutError):
        return None
    if isinstance(exc, urllib3.exceptions.NewConnectionError):
        conn, detail = exc.conn, str(exc).removeprefix(f"{exc.conn}: ")
    elif len(exc.args) == 2 and isinstance(exc.args[1], str):  # (conn, "Connection to ...")
        conn, detail = exc.args[0], exc.args[1]
    else:
        return None
    host, port = getattr(conn, "host", None), getattr(conn, "port", None)
    where = f"{host}:{port}" if host and port else host or "the server"
    return f"cannot reach {where}: {detail}"


#: Said with every TLS refusal: how to trust a private CA (verification cannot be turned off).
TLS_HINT = (
    "if the server's certificate is signed by a private CA, trust it with --ca-bundle FILE "
    "(agent: caBundle), or REQUESTS_CA_BUNDLE / SSL_CERT_FILE / AWS_CA_BUNDLE"
)
#: OpenSSL's reasons for a handshake with a peer that does not speak TLS (a plain-HTTP port).
_NOT_TLS = frozenset(
    {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST",
     "UNKNOWN_PROTOCOL"}
)  # fmt: skip


def _ssl_error_in(exc: BaseException) -> ssl.SSLError | None:
    """The ``ssl`` error under a library's wrapping (urllib3 and botocore keep it as an argument,
    a cause or a context), or None."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        item = todo.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, ssl.SSLError):
            return item
        todo.extend([item.__cause__, item.__context__, *item.args])
    return None


def tls_error(exc: BaseException, where: str) -> TlsError | None:
    """``exc`` as a :class:`TlsError` when it is a refused certificate or a handshake with a
    peer that does not speak TLS (``where``: the message's start, naming the host); None for
    any other failure (a reset in the middle of a TLS stream stays transient)."""
    if isinstance(exc, TlsError):
        return TlsError(f"{where}: {exc}", hint=exc.hint)
    err = _ssl_error_in(exc)
    if isinstance(err, ssl.SSLCertVerificationError):
        reason = f"certificate verify failed: {err.verify_message or err.reason}"
    elif err is not None and err.reason in _NOT_TLS:
        words = str(err.reason).lower().replace("_", " ")
        reason = f"TLS handshake failed: {words} (does the port speak plain HTTP?)"
    else:
        return None
    return TlsError(f"{where}: {reason}", hint=TLS_HINT)


def transport_error(exc: BaseException, what: str) -> SourceError:
    """An exception from sending a request or reading a body, as the package's error: network
    and protocol failures are transient, a refused certificate (:func:`tls_error`) is not."""
    refused = tls_error(exc, what)
    if refused is not None:
        return refused
    unreachable = connection_failure(exc)
    if unreachable is not None:
        return TransientSourceError(f"{what}: {unreachable}", hint=NETWORK_HINT)
    if isinstance(exc, urllib3.exceptions.ProxyError):
        from prefetch.sources.http.proxy_auth import proxy_failure  # a proxy's refusal: rare

        reason, transient = proxy_failure(exc)
        cls = TransientSourceError if transient else SourceError
        return cls(f"{what}: {reason}", hint=PROXY_HINT)
    if isinstance(exc, urllib3.exceptions.HTTPError | http.client.HTTPException | OSError):
        return TransientSourceError(f"{what}: {type(exc).__name__}: {exc}")
    return SourceError(f"{what}: {type(exc).__name__}: {exc}")
