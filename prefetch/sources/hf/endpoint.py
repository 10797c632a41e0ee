"""The Hub's endpoint (the Hub or a mirror) as one repository's requests see it: GETs on the
transport seam with the token added only on the endpoint's own origin (scheme, host, port: a
redirect or a next page elsewhere, a CDN, never receives it), the targets of redirects and links
checked, and the package's error for an answer that refuses (:mod:`prefetch.sources.hf.errors`).
"""

from __future__ import annotations

from urllib.parse import urljoin, urlsplit

import urllib3

from prefetch import __version__
from prefetch.pipeline.snapshot import RemoteFile
from prefetch.sources.hf.errors import HubRefusal, hub_error
from prefetch.sources.http.status_text import header_problem
from prefetch.sources.http.transport import (
    HttpClient,
    discard,
    origin_of,
    redact_url,
    release_small_body,
    send,
    transport_error,
    watched_pools,
)
from prefetch.support.errors import SourceError

USER_AGENT = f"model-prefetch/{__version__}"
#: The answers that redirect, and how many are followed in a row.
REDIRECTS = (301, 302, 303, 307, 308)
MAX_REDIRECTS = 5


class HubEndpoint:
    """``endpoint`` for the repository ``repo``: its requests, the token only on its origin."""

    def __init__(
        self,
        endpoint: str,
        *,
        repo: str,
        token: str | None,
        http: HttpClient,
        timeout: urllib3.Timeout,
    ) -> None:
        self.url = endpoint.rstrip("/")
        self.origin = origin_of(self.url)
        self._repo = repo
        self._token = token
        if isinstance(http, urllib3.PoolManager):
            watched_pools(http)  # a deadline or a stop interrupts its header waits too
        self._http = http
        self._timeout = timeout

    def get(
        self, url: str, headers: dict[str, str], what: str, *, decode: bool = False
    ) -> urllib3.BaseHTTPResponse:
        """GET ``url`` on the pool (no redirects, no urllib3 retries, the body left unread), the
        token added only on the endpoint's origin; ``decode``: undo a gzip Content-Encoding."""
        token = {"Authorization": f"Bearer {self._token}"} if self._token else None
        try:
            answer = send(
                self._http, "GET", url, headers=headers, timeout=self._timeout, decode=decode,
                credentials=token, credentials_origin=self.url,
            )  # fmt: skip
            resp = answer.raw
        except Exception as exc:
            raise transport_error(exc, what) from exc
        problem = header_problem(resp)
        if problem is not None:  # its body would be read until the server closes
            discard(resp)
            raise SourceError(f"{what}: the answer of {redact_url(url)} {problem}")
        return resp

    def redirect_target(self, url: str, resp: urllib3.BaseHTTPResponse, what: str) -> str:
        """Where a redirect from ``url`` points (its body released): an HTTP(S) URL only."""
        location = resp.headers.get("Location")
        release_small_body(resp)
        if not location:
            raise SourceError(f"{what}: redirect without a Location from {redact_url(url)}")
        return http_target(url, str(location), what, "a redirect")

    def refusal(
        self,
        resp: urllib3.BaseHTTPResponse,
        url: str,
        what: str,
        *,
        revision: str,
        file: RemoteFile | None = None,
    ) -> SourceError:
        """The error for an answer that is not what was asked: to a metadata call, or to a
        ranged read of ``file``."""
        h = resp.headers
        return hub_error(
            HubRefusal(
                what,
                resp.status,
                repo=self._repo,
                revision=revision,
                has_token=bool(self._token),
                where="the Hub" if origin_of(url) == self.origin else redact_url(url),
                error_code=(h.get("X-Error-Code") or "").strip(),
                server_message=(h.get("X-Error-Message") or "").strip()[:200],
                retry_after=h.get("Retry-After"),
                reading=file is not None,
                size=file.size if file is not None else None,
            )
        )


def http_target(base: str, reference: str, what: str, kind: str) -> str:
    """``reference`` (a Location or a Link, maybe relative) resolved against ``base``: an
    HTTP(S) URL we can connect to, or one clear SourceError (never a ValueError from parsing)."""
    try:
        target = urljoin(base, reference)
        parts = urlsplit(target)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as exc:
        raise SourceError(
            f"{what}: {kind} from {redact_url(base)} to a malformed URL: {exc}"
        ) from exc
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise SourceError(
            f"{what}: refusing {kind} to {redact_url(target)!r}: not an HTTP(S) location"
        )
    return target
