"""S3's failures as the package's errors: botocore's exceptions, the seam's transport failures
and S3 error answers (their XML code and message), all through one table.

:func:`translate` takes an exception (botocore's, urllib3's, http.client's), :func:`answer_error`
an error answer on the seam; both end in the same S3 code table (throttling, access denied,
a changed or missing object) and fall back to the one status table of
:mod:`prefetch.sources.http.transport`.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import sys
from collections.abc import Mapping

import urllib3.exceptions

from prefetch.sources.http.transport import (
    NETWORK_HINT,
    Response,
    connection_failure,
    error_class,
    origin_of,
    parse_retry_after,
    tls_error,
    transport_error,
)
from prefetch.support.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    SourceChangedError,
    SourceError,
    ThrottledError,
    TransientSourceError,
)

_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "503", "500", "502", "504", "RequestLimitExceeded",
}  # fmt: skip

#: The codes (and statuses) of an answer asking the client to slow down (see AdaptiveRate).
_THROTTLE_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "503", "429",
}  # fmt: skip

_DENIED_CODES = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "401",
    "ExpiredToken", "InvalidToken", "AllAccessDisabled", "AccountProblem",
}  # fmt: skip

_ERROR_CODE = re.compile(rb"<Code>([^<]{1,200})</Code>")

_ERROR_MESSAGE = re.compile(rb"<Message>([^<]{0,500})</Message>")

#: At most this much of an error answer's body is read for its code and message.
_ERROR_BODY_LIMIT = 64 * 1024


def translate(exc: Exception, what: str) -> Exception:
    """A boto3/botocore exception as the package's error (raise it ``from exc``)."""
    if "botocore" not in sys.modules:
        # nothing has loaded botocore, so this is no botocore exception: a direct request's
        # (s3_direct) failure, translated without importing botocore (~0.2 s)
        return _transport_or_other(exc, what)
    import botocore.exceptions as bce

    if isinstance(exc, bce.SSLError):
        url = str(exc.kwargs.get("endpoint_url") or "")
        scheme, host, port = origin_of(url)
        refused = tls_error(exc, f"{what}: {scheme}://{host}:{port}" if host else what)
        if refused is not None:
            return refused
    if isinstance(exc, bce.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        meta = exc.response.get("ResponseMetadata", {})
        status = meta.get("HTTPStatusCode", 0)
        msg = err.get("Message") or code
        if code == "NoSuchBucket":
            return BucketNotFoundError(f"{what}: bucket does not exist")
        error = _client_error(what, code, int(status or 0), msg)
        # the server's Retry-After (S3 throttling may send it), as answer_error keeps it
        return _with_retry_after(error, dict(meta.get("HTTPHeaders") or {}))
    if isinstance(exc, bce.ProxyConnectionError):
        # botocore's "Failed to connect to proxy URL": the proxy's own answer, in one sentence
        # as the seam's requests say it (its cause is urllib3's ProxyError)
        cause = exc.kwargs.get("error")
        if isinstance(cause, urllib3.exceptions.ProxyError):
            return transport_error(cause, what)
        return TransientSourceError(f"{what}: cannot connect through the proxy")
    if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
        return AccessDeniedError(
            f"{what}: no AWS credentials found",
            hint="set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or use IRSA",
        )
    if isinstance(exc, bce.EndpointConnectionError | bce.ConnectTimeoutError):
        return TransientSourceError(
            f"{what}: cannot connect to the S3 endpoint: {exc}", hint=NETWORK_HINT
        )
    if isinstance(
        exc,
        bce.ReadTimeoutError
        | bce.ResponseStreamingError
        | bce.ConnectionClosedError
        | bce.IncompleteReadError
        | bce.HTTPClientError
        | ConnectionError
        | TimeoutError,
    ):
        return TransientSourceError(f"{what}: {type(exc).__name__}: {exc}")
    if isinstance(exc, bce.ParamValidationError):
        return SourceError(f"{what}: invalid request: {exc}")
    return _transport_or_other(exc, what)


def _transport_or_other(exc: Exception, what: str) -> SourceError:
    """A failure that is not botocore's: urllib3's and http.client's (and socket errors) are
    transient, anything else a SourceError naming it."""
    refused = tls_error(exc, what)
    if refused is not None:
        return refused
    if isinstance(exc, urllib3.exceptions.ProxyError) or connection_failure(exc) is not None:
        return transport_error(exc, what)
    if isinstance(
        exc,
        urllib3.exceptions.HTTPError | http.client.HTTPException | ConnectionError | TimeoutError,
    ):
        return TransientSourceError(f"{what}: {type(exc).__name__}: {exc}")
    return SourceError(f"{what}: {type(exc).__name__}: {exc}")


def read_failure(exc: Exception, what: str) -> Exception:
    """A failed body read: a socket or protocol failure is transient (as for every source),
    anything else is translated as botocore's."""
    if isinstance(exc, OSError | http.client.HTTPException):
        return transport_error(exc, what)
    return translate(exc, what)


def _client_error(what: str, code: str, status: int, msg: str) -> SourceError:
    """An S3 error answer: its code when S3 names one we know, else the status through the one
    status table; a 404 while reading a pinned object means it went away (it was listed)."""
    if code in ("PreconditionFailed", "412"):
        cls: type[SourceError] = SourceChangedError
    elif code in ("NoSuchKey", "404") or status == 404:
        return SourceChangedError(f"{what}: the object disappeared during the download")
    elif code in _DENIED_CODES:
        cls = AccessDeniedError
    elif code in _TRANSIENT_CODES:
        cls = TransientSourceError
    else:
        cls = error_class(status) if status else SourceError
    if cls is SourceChangedError:
        return SourceChangedError(f"{what}: the object changed during the download")
    if cls is AccessDeniedError:
        return AccessDeniedError(
            f"{what}: access denied ({code}: {msg})",
            hint="check the AWS credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID, IRSA role) "
            "and that they may s3:ListBucket and s3:GetObject here",
        )
    if cls is TransientSourceError:
        throttled = code in _THROTTLE_CODES or status in (429, 503)
        kind = ThrottledError if throttled else TransientSourceError
        return kind(f"{what}: {code or status}: {msg}")
    return cls(f"{what}: {code or status}: {msg}")


def error_code_and_message(answer: Response, *, has_body: bool) -> tuple[str, str]:
    """The S3 error code and message of an error answer (read from at most 64 KiB of its XML
    body; a HEAD has none: then the status); the connection is not reused."""
    if answer.error is not None:
        answer.discard()
        return answer.error
    body = b""
    if has_body:
        with contextlib.suppress(Exception):
            body = answer.read(_ERROR_BODY_LIMIT)
    answer.discard()
    code = _ERROR_CODE.search(body)
    message = _ERROR_MESSAGE.search(body)
    code_text = code.group(1).decode("utf-8", "replace").strip() if code else str(answer.status)
    return code_text, (message.group(1).decode("utf-8", "replace") if message else code_text)


def answer_error(what: str, answer: Response, *, has_body: bool) -> SourceError:
    """The error of an S3 error answer, as :func:`translate` makes it of botocore's (plus the
    server's Retry-After on a transient one: S3 throttling may send it)."""
    code, msg = error_code_and_message(answer, has_body=has_body)
    if code == msg == str(answer.status):  # no S3 error document: say what the status means
        from prefetch.sources.http.status_text import bare_status  # an error's words: rare

        msg = bare_status(answer.status, answer.headers)
    if code == "NoSuchBucket":
        return BucketNotFoundError(f"{what}: bucket does not exist")
    error = _client_error(what, code, answer.status, msg)
    return _with_retry_after(error, answer.headers)


def _with_retry_after(error: SourceError, headers: Mapping[str, str]) -> SourceError:
    """``error`` carrying the answer's ``Retry-After`` when it is transient and one was sent
    (``headers``: urllib3's, or botocore's lowercased ``HTTPHeaders``)."""
    value = headers.get("Retry-After") or headers.get("retry-after")
    retry_after = parse_retry_after(value)
    if isinstance(error, TransientSourceError) and retry_after is not None:
        return type(error)(str(error), retry_after=retry_after)
    return error
