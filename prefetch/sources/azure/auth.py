"""How a request to Azure Blob Storage is authorized: SharedKey, a SAS, a Microsoft Entra token,
or nothing (a public container).

Chosen from the environment (:func:`prefetch.support.settings.azure_storage`), first found wins: a
SAS on the URI's query; ``AZURE_STORAGE_CONNECTION_STRING`` (its ``AccountKey`` or
``SharedAccessSignature``, and ``BlobEndpoint``) when its ``AccountName`` is the URI's account;
``AZURE_STORAGE_SAS_TOKEN``; ``AZURE_STORAGE_KEY`` (the account key); Microsoft Entra through
``azure-identity``'s ``DefaultAzureCredential`` when ``AZURE_STORAGE_AUTH_MODE=login`` or a
variable it reads is set (workload identity on AKS: ``AZURE_FEDERATED_TOKEN_FILE``,
``AZURE_CLIENT_ID``, ``AZURE_TENANT_ID``; a managed identity's ``IDENTITY_ENDPOINT``); else no
credentials.

SharedKey is signed here (HMAC-SHA256 over the canonical string, ~40 lines) rather than through
``azure-storage-blob``: the bytes go through the project's HTTP seam (watched connections,
proxies, stall detection, reading straight into the engine's buffer), and the SDK's pipeline
costs more CPU per GB and more start-up (measured: bench/README.md, "Issue 32"; verifying every
byte, the seam spends 3.35 CPU-s per GB, the SDK 3.99 verifying nothing, 11.45 with its MD5s).
Only the credential exchange of Entra, which is not small, comes from a library
(azure-identity).

Every credential goes only to the account's endpoint (the seam's ``credentials_origin``); the
key, the SAS and the token are never in a message (the SAS's ``sig`` is masked by
:func:`prefetch.support.redact.redact` in any URL logged, and the Authorization header's value too).
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import hmac
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlsplit

from prefetch.support.errors import ConfigError

#: The REST API version sent (a version Azurite and every public region serve).
API_VERSION = "2021-12-02"
#: The scope of a Microsoft Entra token for Azure Storage.
STORAGE_SCOPE = "https://storage.azure.com/.default"
#: A token is renewed this many seconds before it expires.
_TOKEN_MARGIN = 300

#: Where credentials may come from, for the hint of a refused request.
CREDENTIALS_HINT = (
    "set AZURE_STORAGE_KEY (the account key), AZURE_STORAGE_SAS_TOKEN or "
    "AZURE_STORAGE_CONNECTION_STRING, or use Microsoft Entra (workload identity: "
    "AZURE_FEDERATED_TOKEN_FILE, AZURE_CLIENT_ID, AZURE_TENANT_ID; AZURE_STORAGE_AUTH_MODE=login)"
)


class Credential(Protocol):
    """Authorizes one request: ``kind`` names it in messages (never its secret)."""

    kind: str

    def authorize(self, method: str, url: str, headers: dict[str, str]) -> str:
        """Add the Authorization header to ``headers`` if it has one; returns the URL to send
        (with a SAS appended when it is one)."""
        ...


class Anonymous:
    kind = "no credentials (a public container)"

    def authorize(self, method: str, url: str, headers: dict[str, str]) -> str:
        return url


class Sas:
    """A shared access signature: its query parameters are appended to every URL."""

    def __init__(self, token: str, origin: str) -> None:
        self.token = token.lstrip("?")
        self.kind = f"a SAS ({origin})"

    def authorize(self, method: str, url: str, headers: dict[str, str]) -> str:
        return f"{url}{'&' if '?' in url else '?'}{self.token}"


class SharedKey:
    """An account key: each request signed with HMAC-SHA256 (Shared Key authorization)."""

    def __init__(self, account: str, key: str, origin: str) -> None:
        try:
            self._key = base64.b64decode(key, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"{origin}: the account key is not base64") from None
        self._account = account
        self.kind = f"the account key ({origin})"

    def authorize(self, method: str, url: str, headers: dict[str, str]) -> str:
        headers["Authorization"] = self.signature(method, url, headers)
        return url

    def signature(self, method: str, url: str, headers: Mapping[str, str]) -> str:
        """The Authorization header for ``method url`` with ``headers`` (x-ms-date set)."""
        lower = {k.lower(): v for k, v in headers.items()}
        standard = (
            "content-encoding", "content-language", "content-length", "content-md5",
            "content-type", "date", "if-modified-since", "if-match", "if-none-match",
            "if-unmodified-since", "range",
        )  # fmt: skip
        lines = [method.upper(), *(lower.get(name, "") for name in standard)]
        ms = sorted((k, " ".join(v.split())) for k, v in lower.items() if k.startswith("x-ms-"))
        parts = urlsplit(url)
        resource = f"/{self._account}{parts.path or '/'}"
        params: dict[str, list[str]] = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            params.setdefault(name.lower(), []).append(value)
        resource += "".join(
            f"\n{name}:{','.join(sorted(values))}" for name, values in sorted(params.items())
        )
        text = "\n".join(lines) + "\n" + "".join(f"{k}:{v}\n" for k, v in ms) + resource
        mac = hmac.new(self._key, text.encode("utf-8"), hashlib.sha256).digest()
        return f"SharedKey {self._account}:{base64.b64encode(mac).decode()}"


class EntraToken:
    """A Microsoft Entra token from azure-identity (imported when first needed), renewed before
    it expires; ``credential`` is a test's stand-in for DefaultAzureCredential."""

    kind = "Microsoft Entra (azure-identity)"

    def __init__(self, credential: Any = None) -> None:
        self._credential = credential
        self._token: str | None = None
        self._expires = 0.0
        self._lock = threading.Lock()

    def _fetch(self) -> str:
        with self._lock:
            if self._token is not None and time.time() < self._expires - _TOKEN_MARGIN:
                return self._token
            if self._credential is None:
                self._credential = _default_credential()
            from prefetch.support.errors import AccessDeniedError

            try:
                got = self._credential.get_token(STORAGE_SCOPE)
            except Exception as exc:  # azure-identity's ClientAuthenticationError and others
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise AccessDeniedError(
                    f"Microsoft Entra: no token for Azure Storage: {first[:300]}",
                    hint=CREDENTIALS_HINT,
                ) from None
            self._token, self._expires = str(got.token), float(got.expires_on)
            return self._token

    def authorize(self, method: str, url: str, headers: dict[str, str]) -> str:
        headers["Authorization"] = f"Bearer {self._fetch()}"
        return url


def _default_credential() -> Any:
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        raise ConfigError(
            "Microsoft Entra credentials need azure-identity",
            hint="pip install 'model-prefetch[azure]'",
        ) from None
    return DefaultAzureCredential(exclude_interactive_browser_credential=True)


@dataclass(frozen=True)
class Account:
    """Where an account's blobs are and how requests to it are authorized."""

    name: str
    endpoint: str  # the blob service's URL, no trailing slash
    credential: Credential


def connection_string(text: str) -> dict[str, str]:
    """``Name=value;...`` as a dict (the values keep their own ``=``: keys are base64)."""
    fields: dict[str, str] = {}
    for item in text.split(";"):
        name, eq, value = item.strip().partition("=")
        if eq:
            fields[name.strip()] = value.strip()
    return fields


def account_for(account: str, uri_sas: str, env: Mapping[str, str]) -> Account:
    """The endpoint and credential of ``account`` (see the module docstring for the order);
    ``env``: :func:`prefetch.support.settings.azure_storage`'s."""
    endpoint = env.get("AZURE_STORAGE_BLOB_ENDPOINT", "")
    conn = connection_string(env.get("AZURE_STORAGE_CONNECTION_STRING", ""))
    if conn.get("AccountName") != account:
        conn = {}
    endpoint = endpoint or conn.get("BlobEndpoint", "")
    if not endpoint:
        suffix = conn.get("EndpointSuffix", "core.windows.net")
        scheme = conn.get("DefaultEndpointsProtocol", "https")
        endpoint = f"{scheme}://{account}.blob.{suffix}"
    endpoint = endpoint.replace("{account}", account).rstrip("/")
    return Account(account, endpoint, _credential(account, uri_sas, conn, env))


def _credential(
    account: str, uri_sas: str, conn: Mapping[str, str], env: Mapping[str, str]
) -> Credential:
    mode = env.get("AZURE_STORAGE_AUTH_MODE", "").lower()
    if mode not in ("", "key", "login"):
        raise ConfigError(f"AZURE_STORAGE_AUTH_MODE: {mode!r} is neither key nor login")
    if uri_sas:
        return Sas(uri_sas, "the URI's query")
    if mode != "login":
        if conn.get("SharedAccessSignature"):
            return Sas(conn["SharedAccessSignature"], "AZURE_STORAGE_CONNECTION_STRING")
        if conn.get("AccountKey"):
            return SharedKey(account, conn["AccountKey"], "AZURE_STORAGE_CONNECTION_STRING")
        if env.get("AZURE_STORAGE_SAS_TOKEN"):
            return Sas(env["AZURE_STORAGE_SAS_TOKEN"], "AZURE_STORAGE_SAS_TOKEN")
        if env.get("AZURE_STORAGE_KEY"):
            return SharedKey(account, env["AZURE_STORAGE_KEY"], "AZURE_STORAGE_KEY")
    if mode == "login" or env.get("entra"):
        return EntraToken()
    return Anonymous()


def request_headers(now: datetime.datetime | None = None) -> dict[str, str]:
    """The headers every request carries: the date and the API version."""
    now = now or datetime.datetime.now(datetime.UTC)
    return {
        "x-ms-date": now.strftime("%a, %d %b %Y %H:%M:%S GMT"),
        "x-ms-version": API_VERSION,
    }


def blob_path(name: str) -> str:
    """A blob name as a URL path segment: every byte but the unreserved ones and '/' escaped."""
    from urllib.parse import quote

    return quote(name, safe="/-_.~")


__all__ = [
    "API_VERSION",
    "CREDENTIALS_HINT",
    "Account",
    "Anonymous",
    "Credential",
    "EntraToken",
    "Sas",
    "SharedKey",
    "account_for",
    "blob_path",
    "connection_string",
    "request_headers",
]
