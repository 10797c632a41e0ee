"""Registry credentials and the distribution spec's token flow.

* :func:`docker_credentials`: what ``docker login`` left for a registry, found as docker finds it:
  ``$DOCKER_CONFIG/config.json`` (else ``~/.docker/config.json``), a ``credHelpers`` entry for
  the host, then ``auths`` (base64 ``auth`` = ``user:password``, or an ``identitytoken``), then
  the ``credsStore`` helper. A helper is the binary ``docker-credential-<name>`` (``get``, the
  host on stdin, JSON on stdout), run only when present and bounded in time.
* :func:`ecr_credentials`: for an ECR host with nothing in the docker config, a login from the
  AWS credential chain (``ecr:GetAuthorizationToken``), as the ECR credential helper does.
* :class:`RegistryAuth`: the ``Authorization`` header for a repository, and what to do about a
  401's ``WWW-Authenticate``: ``Basic`` (send the credentials) or ``Bearer realm=,service=,
  scope=`` (GET a token from the realm, anonymously or with the credentials, bounded in time;
  kept until it expires, fetched again once on a 401 mid-pull).

The credentials and tokens never appear in a message or a log line.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import re
import selectors
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3

from prefetch.sources.http.transport import (
    HttpClient,
    discard,
    redact_url,
    status_error,
    transport_error,
)
from prefetch.support import settings
from prefetch.support.errors import AccessDeniedError, ConfigError, SourceError
from prefetch.support.safejson import load_json

#: Helpers are asked at most this long (a helper that prompts or hangs must not stop a pull).
HELPER_TIMEOUT = 20.0
#: A helper's answer is one small JSON object; more than this is refused as it is read.
MAX_HELPER_ANSWER = 1 << 20
_MAX_TOKEN_BODY = 1024 * 1024
#: A 401's ``WWW-Authenticate`` longer than this is refused unread (real ones are ~200 bytes;
#: urllib3 joins repeated headers, up to 100 of 64 KiB each).
MAX_CHALLENGE = 16 * 1024
#: One token of a challenge, read left to right: a parameter (``key=value`` or ``key="..."``),
#: else one other character or a run of word characters. Possessive loops and a quoted string
#: that may end at the end of the text: no alternative re-reads what it gave up, so the scan
#: is linear (a pattern searched from every offset was quadratic: ``Bearer `` + 60,000 ``a``
#: took 30 s).
_CHALLENGE_TOKEN = re.compile(
    r'(\w++)\s*+=\s*+(?:"((?:[^"\\]|\\.)*+)(?:"|\\?\Z)|([^\s,"]++))|\w++|.', re.DOTALL
)
#: A token without ``expires_in`` lives 60 s (the distribution spec's default).
_DEFAULT_TOKEN_LIFE = 60.0


@dataclass(frozen=True)
class Credentials:
    username: str
    secret: str
    #: an identity (refresh) token: sent to the token realm as an OAuth2 refresh_token
    identity_token: bool = False

    def __repr__(self) -> str:  # never the secret
        return f"Credentials(username={self.username!r})"


def docker_config_path() -> Path:
    return settings.docker_config_dir() / "config.json"


def docker_credentials(registry: str, config_path: Path | None = None) -> Credentials | None:
    """The credentials docker would send to ``registry`` (``host[:port]``); None: anonymous."""
    path = config_path or docker_config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"the docker config {path} cannot be read: {exc.strerror}") from exc
    config = load_json(
        text, where=f"the docker config {path}", max_bytes=16 << 20, error=ConfigError
    )
    if not isinstance(config, dict):
        raise ConfigError(f"the docker config {path} is not a JSON object")
    helpers = config.get("credHelpers")
    helper = helpers.get(registry) if isinstance(helpers, dict) else None
    if isinstance(helper, str) and helper:
        return helper_credentials(helper, registry)
    auths = config.get("auths")
    if isinstance(auths, dict):
        for key in _config_keys(registry):
            entry = auths.get(key)
            if isinstance(entry, dict):
                found = _auth_entry(entry, path, key)
                if found is not None:
                    return found
    store = config.get("credsStore")
    if isinstance(store, str) and store:
        return helper_credentials(store, registry)
    return None


def _config_keys(registry: str) -> tuple[str, ...]:
    """The keys ``docker login`` may have written for ``registry``."""
    keys: tuple[str, ...] = (
        registry, f"https://{registry}", f"http://{registry}", f"https://{registry}/v1/",
    )  # fmt: skip
    if registry in ("docker.io", "registry-1.docker.io", "index.docker.io"):
        keys += ("https://index.docker.io/v1/",)
    return keys


def _auth_entry(entry: dict[str, object], path: Path, key: str) -> Credentials | None:
    identity = entry.get("identitytoken")
    if isinstance(identity, str) and identity:
        return Credentials("<token>", identity, identity_token=True)
    auth = entry.get("auth")
    if isinstance(auth, str) and auth:
        try:
            user, sep, secret = base64.b64decode(auth, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"{path}: auths[{key!r}].auth is not base64 of user:password"
            ) from exc
        if not sep:
            raise ConfigError(f"{path}: auths[{key!r}].auth is not base64 of user:password")
        return Credentials(user, secret)
    name, password = entry.get("username"), entry.get("password")
    if isinstance(name, str) and isinstance(password, str) and name:
        return Credentials(name, password)
    return None


def helper_credentials(helper: str, registry: str) -> Credentials | None:
    """Ask ``docker-credential-<helper>`` for ``registry``'s credentials; None when the binary
    is not installed or has none for it."""
    binary = shutil.which(f"docker-credential-{helper}")
    if binary is None:
        return None
    returncode, output = _run_helper(binary, registry, helper)
    if returncode != 0:
        return None  # "credentials not found in native keychain": anonymous, as docker does
    what = f"credential helper {helper}: its answer"
    data = load_json(output, where=what, max_bytes=MAX_HELPER_ANSWER)
    if not isinstance(data, dict) or "Username" not in data or "Secret" not in data:
        raise SourceError(f"credential helper {helper}: an answer that is not its JSON")
    user, secret = str(data["Username"]), str(data["Secret"])
    if user == "<token>":
        return Credentials(user, secret, identity_token=True)
    return Credentials(user, secret)


def _run_helper(binary: str, registry: str, helper: str) -> tuple[int, bytes]:
    """``binary get`` with the registry on stdin: its exit status and what it printed, read as
    it comes and never more than :data:`MAX_HELPER_ANSWER` (one byte more ends the helper: a
    helper printing 200 MiB once cost 429 MB of memory), all within :data:`HELPER_TIMEOUT`.
    Hand-written: ``subprocess.run`` reads the whole output before anything can bound it."""
    deadline = time.monotonic() + HELPER_TIMEOUT
    out = bytearray()
    with subprocess.Popen(
        [binary, "get"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    ) as proc:  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None  # both are pipes
        try:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(registry.encode())
                proc.stdin.close()
            with selectors.DefaultSelector() as selector:
                selector.register(proc.stdout, selectors.EVENT_READ)
                while piece := _read_before(selector, proc.stdout.fileno(), deadline, helper):
                    out += piece
                    if len(out) > MAX_HELPER_ANSWER:
                        raise SourceError(
                            f"credential helper {helper}: an answer of more than "
                            f"{MAX_HELPER_ANSWER} bytes (refused)"
                        )
            return proc.wait(max(deadline - time.monotonic(), 0.01)), bytes(out)
        except subprocess.TimeoutExpired as exc:
            raise SourceError(
                f"credential helper {helper}: no answer within {HELPER_TIMEOUT:g} s"
            ) from exc
        finally:
            if proc.poll() is None:
                proc.kill()


def _read_before(selector: selectors.BaseSelector, fd: int, deadline: float, helper: str) -> bytes:
    """The next bytes on ``fd`` (empty at its end), or SourceError once ``deadline`` passes."""
    while not selector.select(max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
            raise SourceError(f"credential helper {helper}: no answer within {HELPER_TIMEOUT:g} s")
    return os.read(fd, 64 * 1024)


_ECR_HOST = re.compile(r"^(\d{12})\.dkr\.ecr(?:-fips)?\.([a-z0-9-]+)\.amazonaws\.com(?:\.cn)?$")


def ecr_region(registry: str) -> str | None:
    """The AWS region of an ECR registry host (``<account>.dkr.ecr.<region>.amazonaws.com``)."""
    m = _ECR_HOST.match(registry.split(":", 1)[0].lower())
    return m.group(2) if m else None


def ecr_credentials(registry: str, client: Any = None) -> Credentials | None:
    """ECR's credentials from the AWS credential chain (``GetAuthorizationToken``: base64 of
    ``AWS:<password>``, valid 12 hours); None for a host that is not ECR. ``client``: an ECR
    client (tests pass a stubbed one), else one made with botocore's default chain."""
    region = ecr_region(registry)
    if region is None:
        return None
    if client is None:
        import boto3

        client = boto3.client("ecr", region_name=region)
    try:
        answer = client.get_authorization_token()
        token = answer["authorizationData"][0]["authorizationToken"]
        user, _, secret = base64.b64decode(token).decode().partition(":")
    except Exception as exc:
        raise AccessDeniedError(
            f"{registry}: ECR GetAuthorizationToken failed: {type(exc).__name__}: {exc}",
            hint="AWS credentials with ecr:GetAuthorizationToken (the node role, or AWS_PROFILE)",
        ) from exc
    return Credentials(user, secret)


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="...",service="..."`` as ("bearer", {realm:..., service:...}), in time
    linear in the header (bound its size before: :data:`MAX_CHALLENGE`)."""
    scheme, _, rest = header.strip().partition(" ")
    params = {m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3)
              for m in _CHALLENGE_TOKEN.finditer(rest) if m.group(1)}  # fmt: skip
    return scheme.lower(), params


class RegistryAuth:
    """The ``Authorization`` to send to one registry, per repository scope; thread-safe.

    ``credentials``: None looks them up in the docker config on first need (a public registry
    never reads it). ``timeout``: bounds one token request (connect and each read)."""

    def __init__(
        self,
        registry: str,
        http: HttpClient,
        *,
        credentials: Credentials | bool | None = None,
        timeout: float = 10.0,
    ) -> None:
        self._registry = registry
        self._http = http
        self._credentials = credentials
        self._timeout = urllib3.Timeout(connect=min(timeout, 10.0), read=timeout)
        self._lock = threading.Lock()
        #: scope -> (header value, expiry on the monotonic clock)
        self._tokens: dict[str, tuple[str, float]] = {}
        self._basic = False

    def _creds(self) -> Credentials | None:
        if self._credentials is None:
            found = docker_credentials(self._registry) or ecr_credentials(self._registry)
            self._credentials = found or False
        return self._credentials if isinstance(self._credentials, Credentials) else None

    def header(self, scope: str) -> str | None:
        """What to send now (None: nothing yet, the registry has not asked)."""
        with self._lock:
            token = self._tokens.get(scope)
            if token is not None and token[1] > time.monotonic():
                return token[0]
            basic = self._basic
        creds = self._creds() if basic else None
        if creds is not None:
            raw = f"{creds.username}:{creds.secret}".encode()
            return "Basic " + base64.b64encode(raw).decode()
        return None

    def answer(self, challenge: str | None, scope: str, what: str) -> None:
        """A 401 came with ``challenge``: get what it asks for (raises when nothing can)."""
        if not challenge:
            raise AccessDeniedError(f"{what}: the registry refused access (401, no challenge)")
        if len(challenge) > MAX_CHALLENGE:
            raise SourceError(
                f"{what}: the registry's authentication challenge is {len(challenge)} bytes, "
                f"more than the {MAX_CHALLENGE} allowed (refused unread)"
            )
        kind, params = parse_challenge(challenge)
        if kind == "basic":
            if self._creds() is None:
                raise AccessDeniedError(
                    f"{what}: the registry asks for a login",
                    hint=f"docker login {self._registry} (or set DOCKER_CONFIG)",
                )
            with self._lock:
                if self._basic:
                    raise AccessDeniedError(f"{what}: the registry refused the docker login")
                self._basic = True
            return
        if kind != "bearer" or not params.get("realm"):
            raise AccessDeniedError(f"{what}: unsupported authentication challenge {kind!r}")
        token, life = self._fetch_token(params, scope, what)
        with self._lock:
            self._tokens[scope] = (f"Bearer {token}", time.monotonic() + max(life - 5.0, 1.0))

    def forget(self, scope: str) -> None:
        with self._lock:
            self._tokens.pop(scope, None)

    def _fetch_token(self, params: dict[str, str], scope: str, what: str) -> tuple[str, float]:
        realm = params["realm"]
        parts = urlsplit(realm)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SourceError(f"{what}: the token realm {realm!r} is not an HTTP(S) URL")
        query = {k: v for k, v in (("service", params.get("service")), ("scope", scope)) if v}
        url = f"{realm}{'&' if parts.query else '?'}{urlencode(query)}"
        headers = {"Accept": "application/json"}
        creds = self._creds()
        if creds is not None and not creds.identity_token:
            raw = f"{creds.username}:{creds.secret}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(raw).decode()
        method, body = "GET", None
        if creds is not None and creds.identity_token:
            # an identity token is a refresh token: exchanged by POST (the OAuth2 flow)
            method = "POST"
            body = urlencode(
                {"grant_type": "refresh_token", "refresh_token": creds.secret,
                 "service": params.get("service", ""), "scope": scope, "client_id": "prefetch"}
            ).encode()  # fmt: skip
            headers["Content-Type"] = "application/x-www-form-urlencoded"
            url = realm
        where = f"{what}: the token service ({redact_url(realm)})"
        try:
            resp = self._http.request(
                method, url, headers=headers, body=body, redirect=False, retries=False,
                preload_content=False, timeout=self._timeout,
            )  # fmt: skip
        except Exception as exc:
            raise transport_error(exc, where) from exc
        try:
            if resp.status != 200:
                raise status_error(
                    resp.status, f"{where}: HTTP {resp.status}",
                    retry_after=resp.headers.get("Retry-After"),
                    hint=f"docker login {self._registry}" if resp.status in (401, 403) else None,
                )  # fmt: skip
            try:
                data = resp.read(_MAX_TOKEN_BODY + 1)
            except Exception as exc:
                raise transport_error(exc, where) from exc
        finally:
            discard(resp)
        doc = load_json(data, where=f"{where}: the answer", max_bytes=_MAX_TOKEN_BODY)
        if not isinstance(doc, dict):
            raise SourceError(f"{where}: no token in the answer")
        token = doc.get("token") or doc.get("access_token")
        if not isinstance(token, str) or not token:
            raise SourceError(f"{where}: no token in the answer")
        life = doc.get("expires_in")
        seconds = float(life) if isinstance(life, int | float) and life > 0 else _DEFAULT_TOKEN_LIFE
        return token, seconds


__all__ = [
    "Credentials",
    "RegistryAuth",
    "docker_config_path",
    "docker_credentials",
    "ecr_credentials",
    "ecr_region",
    "helper_credentials",
    "parse_challenge",
]
