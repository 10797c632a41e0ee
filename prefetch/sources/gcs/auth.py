"""Credentials for Cloud Storage: the ``Authorization`` header each request carries.

In order: an access token given as it is (``GOOGLE_OAUTH_ACCESS_TOKEN``, see
:func:`prefetch.support.settings.gcs_access_token`); none for an emulator
(``STORAGE_EMULATOR_HOST``, as Google's libraries do) unless ``GOOGLE_APPLICATION_CREDENTIALS``
names credentials for it; else Application Default Credentials as
google-auth finds them (``GOOGLE_APPLICATION_CREDENTIALS``'s service-account or external-account
JSON, gcloud's user credentials, GKE Workload Identity through the metadata server), refreshed by
google-auth on the seam's pool. No credentials found at all: anonymous requests, which a public
bucket answers (a private one's 401/403 then says no credentials were found).

Token exchange is google-auth's, never written here. A token is never logged or put in a message;
the source sends it only to the Cloud Storage endpoint's origin (see
``prefetch.sources.http.transport.send``).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from prefetch.sources.http.transport import HttpClient
from prefetch.support import settings
from prefetch.support.errors import AccessDeniedError, ConfigError, TransientSourceError

#: Read-only access to objects is all a pull needs.
SCOPES = ("https://www.googleapis.com/auth/devstorage.read_only",)
#: What to check when Cloud Storage refuses the credentials.
CREDENTIALS_HINT = (
    "check the Google credentials: GOOGLE_APPLICATION_CREDENTIALS (a service-account JSON), "
    "`gcloud auth application-default login`, GKE Workload Identity, or GOOGLE_OAUTH_ACCESS_TOKEN; "
    "they need storage.objects.list and storage.objects.get on the bucket"
)
INSTALL_HINT = "pip install 'model-prefetch[gcs]' (google-auth)"


class GcsAuth(Protocol):
    """What the source asks of its credentials."""

    #: where the credentials came from, for messages ("GOOGLE_OAUTH_ACCESS_TOKEN", ...)
    origin: str

    def header(self) -> str | None:
        """The ``Authorization`` value (None: anonymous); may refresh a token first."""
        ...

    def expired(self, sent: str | None) -> bool:
        """A 401 answered the header ``sent``: forget it (unless another request has already
        replaced it). True when a new one may be fetched (a retry makes sense), False when the
        token can only be the same."""
        ...


class StaticToken:
    """A token given as it is: never refreshed."""

    def __init__(self, token: str, origin: str) -> None:
        self._value = f"Bearer {token}"
        self.origin = origin

    def header(self) -> str | None:
        return self._value

    def expired(self, sent: str | None) -> bool:
        return False

    def __repr__(self) -> str:  # never the token
        return f"StaticToken(origin={self.origin!r})"


class Anonymous:
    """No credentials: a public bucket's objects (or an emulator's)."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def header(self) -> str | None:
        return None

    def expired(self, sent: str | None) -> bool:
        return False


class ApplicationDefault:
    """Application Default Credentials through google-auth, found when first needed (opening
    a source makes no request) and refreshed by google-auth when they expire, one thread at a
    time. No credentials anywhere: anonymous."""

    origin = "Application Default Credentials"

    def __init__(self, http: HttpClient) -> None:
        self._http = http
        self._lock = threading.Lock()
        self._credentials: Any = None  # google.auth.credentials.Credentials (untyped library)
        self._found = False
        self._anonymous = False

    @property
    def anonymous(self) -> bool:
        return self._anonymous

    def header(self) -> str | None:
        with self._lock:
            if not self._found:
                self._find()
            if self._credentials is None:
                return None
            if not self._credentials.valid:
                self._refresh()
            return f"Bearer {self._credentials.token}"

    def expired(self, sent: str | None) -> bool:
        with self._lock:
            if self._credentials is None:
                return False
            # parallel reads meet the same expiry: only the first to report it drops the token,
            # the others retry with the one it fetched (one refresh, not one per read)
            if sent == f"Bearer {self._credentials.token}":
                self._credentials.token = None  # the next header() refreshes
            return True

    def _find(self) -> None:
        try:
            import google.auth
            import google.auth.exceptions
        except ImportError:
            raise ConfigError(
                "reading gs:// with Application Default Credentials needs google-auth",
                hint=INSTALL_HINT,
            ) from None
        try:
            credentials, _project = google.auth.default(scopes=list(SCOPES))
        except google.auth.exceptions.DefaultCredentialsError as exc:
            named = settings.google_application_credentials()
            if named is not None:  # named explicitly: never silently anonymous instead
                reason = str(exc.args[0]) if exc.args else type(exc).__name__
                raise ConfigError(
                    f"GOOGLE_APPLICATION_CREDENTIALS={named}: {reason[:300]}",
                    hint=CREDENTIALS_HINT,
                ) from None
            credentials = None  # none anywhere: a public bucket still answers
            self._anonymous = True
            self.origin = "no credentials (none found: anonymous requests)"
        except (ValueError, OSError) as exc:  # a credentials file that is not one
            raise ConfigError(f"Google credentials: {exc}", hint=CREDENTIALS_HINT) from None
        self._credentials = credentials
        self._found = True

    def _refresh(self) -> None:
        import google.auth.exceptions
        import google.auth.transport.urllib3

        # google-auth's urllib3 transport, on the seam's pool (proxies, CA bundle); the
        # library ships no annotations for it
        request = google.auth.transport.urllib3.Request(self._http)  # type: ignore[no-untyped-call]
        try:
            self._credentials.refresh(request)
        except google.auth.exceptions.TransportError as exc:
            raise TransientSourceError(
                f"fetching a Google access token: {type(exc).__name__}"
            ) from None
        except google.auth.exceptions.RefreshError as exc:
            # the message is google-auth's reason (never the token or the key)
            reason = str(exc.args[0]) if exc.args else type(exc).__name__
            raise AccessDeniedError(
                f"fetching a Google access token: {reason[:300]}", hint=CREDENTIALS_HINT
            ) from None


def gcs_auth(endpoint: str | None, http: HttpClient) -> GcsAuth:
    """The credentials of a source reading ``endpoint`` (None: Google's), refreshed over
    ``http`` (the seam's pool, with its proxies and CA bundle)."""
    token = settings.gcs_access_token()
    if token is not None:
        return StaticToken(token, "the access token of GOOGLE_OAUTH_ACCESS_TOKEN")
    if endpoint is not None and settings.google_application_credentials() is None:
        return Anonymous("no credentials (an emulator: STORAGE_EMULATOR_HOST)")
    return ApplicationDefault(http)
