"""Requests to one repository of an OCI registry: its base URL, authorization, redirects.

The registry is spoken to over plain HTTP when it is on loopback or listed in
``PREFETCH_OCI_PLAIN_HTTP`` (:func:`registry_base`), else over HTTPS. Every request goes on the
transport seam; the registry's authorization (:mod:`prefetch.sources.oci.auth`) goes only to its
own origin, and a 401 there (an expired token) is answered once and the request sent again;
redirects (307 to object storage) are followed here with the headers sent again.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
from collections.abc import Mapping
from urllib.parse import urljoin, urlsplit

import urllib3

from prefetch import __version__
from prefetch.pipeline.spec import SourceURI
from prefetch.sources.http.transport import (
    HttpClient,
    Response,
    Sent,
    origin_of,
    redact_url,
    release_small_body,
    send,
    status_error,
    transport_error,
)
from prefetch.sources.oci.auth import RegistryAuth
from prefetch.support import settings
from prefetch.support.errors import SourceError

USER_AGENT = f"model-prefetch/{__version__}"
PLAIN_HTTP_ENV = "PREFETCH_OCI_PLAIN_HTTP"
#: Docker Hub's names: its API is at registry-1.docker.io, its official images under library/.
DOCKER_HUB = ("docker.io", "index.docker.io", "registry-1.docker.io")
#: The answers that redirect, and how many are followed in a row.
REDIRECTS = (301, 302, 303, 307, 308)
MAX_REDIRECTS = 5


def registry_base(registry: str, plain_http: tuple[str, ...] = ()) -> str:
    """``http://`` for a loopback host or one listed in ``plain_http`` (or the environment's
    ``PREFETCH_OCI_PLAIN_HTTP``), else ``https://``; then the host."""
    if registry in DOCKER_HUB:
        return "https://registry-1.docker.io"
    listed = set(settings.oci_plain_http()) | set(plain_http)
    host = urlsplit(f"//{registry}").hostname or ""
    loopback = host == "localhost"
    with contextlib.suppress(ValueError):
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    plain = loopback or registry in listed or host in listed
    return f"{'http' if plain else 'https'}://{registry}"


class RegistryRepository:
    """The repository ``uri`` names on its registry (Docker Hub's official images under
    ``library/``), as GETs of ``/v2/<repo>/...``; ``namespace``: a mirror's origin registry."""

    def __init__(
        self,
        uri: SourceURI,
        *,
        http: HttpClient,
        auth: RegistryAuth | None = None,
        timeout: urllib3.Timeout | None = None,
        plain_http: tuple[str, ...] = (),
        namespace: str | None = None,
    ) -> None:
        hub_official = uri.location in DOCKER_HUB and "/" not in uri.path
        self.repo = f"library/{uri.path}" if hub_official else uri.path
        #: a mirror's ``?ns=<origin registry>`` (what containerd sends a mirror: Spegel needs it)
        self._query = f"?ns={namespace}" if namespace else ""
        self.base = registry_base(uri.location, plain_http)
        self._origin = origin_of(self.base)
        self._http = http
        self._auth = auth or RegistryAuth(uri.location, http)
        self._timeout = timeout or urllib3.Timeout(connect=10.0, read=60.0)
        self._scope = f"repository:{self.repo}:pull"

    def send(self, url: str, headers: Mapping[str, str], what: str) -> Sent:
        """GET ``url`` on the seam (no redirects followed), the registry's authorization sent
        only to its own origin; a 401 there is answered (token or login) once and the request
        sent again (an expired token mid-pull)."""
        for attempt in (1, 2):
            auth = self._auth.header(self._scope)
            try:
                answer = send(
                    self._http, "GET", url, headers={**headers, "User-Agent": USER_AGENT},
                    timeout=self._timeout,
                    credentials={"Authorization": auth} if auth is not None else None,
                    credentials_origin=self.base,
                )  # fmt: skip
            except Exception as exc:
                raise transport_error(exc, what) from exc
            if answer.status == 401 and origin_of(url) == self._origin and attempt == 1:
                challenge = answer.headers.get("WWW-Authenticate")
                release_small_body(answer.raw)
                self._auth.forget(self._scope)
                self._auth.answer(challenge, self._scope, what)
                continue
            return answer
        raise AssertionError("unreachable")

    def get(self, path: str, headers: Mapping[str, str], what: str) -> tuple[Sent, str]:
        """GET ``/v2/<repo>/<path>``, following redirects (the headers sent again, the
        authorization only to the registry); the answer and the URL that gave it."""
        url = f"{self.base}/v2/{self.repo}/{path}{self._query}"
        for _ in range(MAX_REDIRECTS + 1):
            resp = self.send(url, headers, what)
            if resp.status not in REDIRECTS:
                return resp, url
            location = resp.headers.get("Location")
            release_small_body(resp.raw)
            if not location:
                raise SourceError(f"{what}: a redirect without a Location from {redact_url(url)}")
            target = urljoin(url, str(location))
            if urlsplit(target).scheme not in ("http", "https"):
                raise SourceError(f"{what}: a redirect to {redact_url(target)}")
            url = target
        raise SourceError(f"{what}: more than {MAX_REDIRECTS} redirects")

    def refusal(self, resp: Response, url: str, what: str) -> SourceError:
        status = resp.status
        detail = _error_detail(resp)
        resp.discard()
        return status_error(
            status, f"{what}: HTTP {status} from {redact_url(url)}{detail}",
            retry_after=resp.headers.get("Retry-After"),
        )  # fmt: skip


def _error_detail(resp: Response) -> str:
    """The registry's own error code (``{"errors":[{"code":"DENIED",...}]}``), if any."""
    try:
        body = resp.read(16 * 1024)
    except Exception:
        return ""
    try:
        errors = json.loads(body).get("errors")
        codes = [str(e.get("code")) for e in errors if isinstance(e, dict)][:3]
    except (ValueError, AttributeError, TypeError):
        return ""
    return f" ({', '.join(codes)})" if codes else ""
