"""S3 without botocore: the listing and the object requests a pull sends, and nothing more.

Importing botocore (it loads awscrt's native library) and creating a client (it reads the
1.25 MB ``endpoints.json`` and the S3 service model) cost ~0.5 CPU-s, most of a no-op pull
and a fifth of a cold 1 GB pull (bench/README.md, issue 15). So when the credentials are the
plain static keys of the environment or of the client's settings (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` [/ ``AWS_SESSION_TOKEN``]: botocore's first provider, which wins over
every other), ListObjectsV2 and the object GETs and HEADs are signed here (SigV4,
``hashlib``/``hmac``), sent on the shared urllib3 pool (with the source's proxy), and the
listing's XML parsed by ``listing`` (TLS verified with the bundle
:func:`prefetch.support.settings.ca_bundle` decides, as botocore's client is). Anything else (a
profile, IRSA, IMDS, FIPS or dual-stack endpoints, an access point ARN...) leaves
:func:`direct_settings` returning None, and botocore lists (and signs the object requests:
:mod:`prefetch.sources.s3.sdk`). The botocore client is only created when something needs
it, see ``LazyS3Client`` in source.py.

Addressing is the one botocore uses for the same settings where it matters: a custom endpoint
(``AWS_ENDPOINT_URL``, ``--endpoint-url``) path-style (``endpoint/bucket``), AWS itself
virtual-hosted (``bucket.s3.<region>.amazonaws.com``; path-style for a bucket name with dots,
as TLS needs). A bucket in another region answers 301/307/400 with ``x-amz-bucket-region``:
the request is signed again for that region and sent once more.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol
from urllib.parse import SplitResult, quote, urlsplit

from prefetch import __version__
from prefetch.sources.http.transport import HttpClient, Response, Route
from prefetch.sources.s3.listing import ListPage, parse_list_page
from prefetch.support import settings

if TYPE_CHECKING:
    import urllib3

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_USER_AGENT = f"model-prefetch/{__version__}"
_AMZ_DATE = "%Y%m%dT%H%M%SZ"
#: A plain bucket name that can be a DNS label (no dots: a dotted name breaks TLS).
_VIRTUAL_HOSTABLE = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
_REGION = re.compile(r"^[a-z0-9-]{1,40}$")
#: Settings under which botocore would address or sign differently: then botocore lists.
_BOTOCORE_ONLY_ENV = (
    "AWS_USE_FIPS_ENDPOINT", "AWS_USE_DUALSTACK_ENDPOINT",
    "AWS_S3_US_EAST_1_REGIONAL_ENDPOINT", "AWS_ENDPOINT_URL_S3",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
)  # fmt: skip
#: Keys of a config-file profile under which botocore would address or sign differently.
_BOTOCORE_ONLY_PROFILE_KEYS = (
    "s3", "use_fips_endpoint", "use_dualstack_endpoint", "endpoint_url", "services",
    "s3_use_arn_region", "s3_disable_multiregion_access_points",
)  # fmt: skip
#: A listing page's XML is read up to this size (1000 keys of 1 KiB each fit in ~1.5 MB).
MAX_PAGE_BYTES = 16 * 1024 * 1024
_REDIRECT_STATUSES = (301, 307, 400)


@dataclass(frozen=True)
class StaticCredentials:
    access_key: str
    secret_key: str
    token: str | None = None


def env_credentials(environ: Mapping[str, str]) -> StaticCredentials | None:
    """The environment's static keys, as botocore's environment provider reads them."""
    access_key = environ.get("AWS_ACCESS_KEY_ID", "")
    secret_key = environ.get("AWS_SECRET_ACCESS_KEY", "")
    if not access_key or not secret_key:
        return None
    token = environ.get("AWS_SESSION_TOKEN") or environ.get("AWS_SECURITY_TOKEN") or None
    return StaticCredentials(access_key, secret_key, token)


def _uri_encode(text: str, *, keep_slash: bool = False) -> str:
    """SigV4's URI encoding: everything but the unreserved characters (and '/' in a path)."""
    return quote(text, safe="-_.~/" if keep_slash else "-_.~")


def canonical_query(params: Mapping[str, str]) -> str:
    """The query string, encoded and sorted as SigV4 signs it (and as it is sent)."""
    pairs = sorted((_uri_encode(k), _uri_encode(v)) for k, v in params.items())
    return "&".join(f"{k}={v}" for k, v in pairs)


def sign_v4(
    method: str,
    url: str,
    credentials: StaticCredentials,
    region: str,
    *,
    now: datetime.datetime | None = None,
    headers: Mapping[str, str] | None = None,
    keys: dict[tuple[str, str, str], bytes] | None = None,
) -> dict[str, str]:
    """The headers to send with a bodyless S3 request for ``url`` (path and query already
    encoded as sent: see :func:`canonical_query`): ``headers`` (names lowercased; all of them
    signed, as botocore signs a GET's Range and If-Match and must sign every ``x-amz-*``), plus
    X-Amz-Date, X-Amz-Content-SHA256, [X-Amz-Security-Token] and Authorization. The Host header
    signed is the one ``http.client`` sends (the port only when it is not the scheme's
    default); it is not returned: set twice, a proxy refuses the request. ``keys``: a cache of
    signing keys by (secret, day, region) the caller keeps (the key changes once a day; deriving
    it is four HMACs per request otherwise)."""
    now = now or datetime.datetime.now(datetime.UTC)
    parts = urlsplit(url)
    return signed_headers(
        method, _host_header(parts), parts.path or "/", parts.query, credentials, region,
        now.strftime(_AMZ_DATE), headers or {}, keys,
    )  # fmt: skip


def signed_headers(
    method: str,
    host: str,
    path: str,
    query: str,
    credentials: StaticCredentials,
    region: str,
    amz_date: str,
    headers: Mapping[str, str],
    keys: dict[tuple[str, str, str], bytes] | None = None,
) -> dict[str, str]:
    """:func:`sign_v4` of a request already taken apart: ``host`` the Host header sent,
    ``path`` and ``query`` as sent, ``amz_date`` its X-Amz-Date (``YYYYMMDDTHHMMSSZ``). One
    dict is built: the canonical request is made from it and it is what goes on the wire (in
    this order: ``headers``, the x-amz-* ones, Authorization; not Host)."""
    day = amz_date[:8]
    signed = {name.lower(): " ".join(value.split()) for name, value in headers.items()}
    signed["host"] = host
    signed["x-amz-content-sha256"] = _EMPTY_SHA256
    signed["x-amz-date"] = amz_date
    if credentials.token:
        signed["x-amz-security-token"] = credentials.token
    names = sorted(signed)
    listed = ";".join(names)
    canonical = "\n".join(
        [
            method,
            path,
            query,
            "".join([f"{n}:{signed[n]}\n" for n in names]),
            listed,
            _EMPTY_SHA256,
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = (
        f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    )
    cached = (credentials.secret_key, day, region)
    key = keys.get(cached) if keys is not None else None
    if key is None:
        key = signing_key(credentials.secret_key, day, region)
        if keys is not None:
            keys.clear()  # only today's (a day change drops yesterday's)
            keys[cached] = key
    signature = hmac.digest(key, to_sign.encode(), "sha256").hex()
    signed["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope}, "
        f"SignedHeaders={listed}, Signature={signature}"
    )
    del signed["host"]
    return signed


def signing_key(secret_key: str, day: str, region: str) -> bytes:
    """SigV4's signing key for S3 on ``day`` (YYYYMMDD) in ``region``."""
    key = f"AWS4{secret_key}".encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def _host_header(parts: SplitResult) -> str:
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal
    default = 443 if parts.scheme == "https" else 80
    return host if parts.port in (None, default) else f"{host}:{parts.port}"


class Signer(Protocol):
    """Signs one bodyless S3 request: the headers to send with it (``headers`` included)."""

    def sign(
        self, method: str, url: str, region: str, headers: Mapping[str, str]
    ) -> dict[str, str]: ...


class StaticKeySigner:
    """Static keys, signed here (:func:`sign_v4`): no botocore import. What repeats between
    requests is kept: the signing key (per day and region) and the X-Amz-Date (per second)."""

    def __init__(
        self,
        credentials: StaticCredentials,
        *,
        clock: Callable[[], datetime.datetime] | None = None,
    ) -> None:
        self.credentials = credentials
        self._clock = clock  # tests: a fixed time (None: now)
        self.keys: dict[tuple[str, str, str], bytes] = {}  # today's signing key (sign_v4)
        #: the second of the latest signature and its X-Amz-Date (strftime costs ~4 µs)
        self._date: tuple[int, str] = (-1, "")

    def sign(
        self, method: str, url: str, region: str, headers: Mapping[str, str]
    ) -> dict[str, str]:
        parts = urlsplit(url)
        return self.sign_parts(
            method, _host_header(parts), parts.path or "/", parts.query, region, headers
        )

    def sign_parts(
        self, method: str, host: str, path: str, query: str, region: str,
        headers: Mapping[str, str],
    ) -> dict[str, str]:  # fmt: skip
        """:meth:`sign` of a request already taken apart (see :func:`signed_headers`)."""
        return signed_headers(
            method, host, path, query, self.credentials, region, self._amz_date(), headers,
            self.keys,
        )  # fmt: skip

    def _amz_date(self) -> str:
        now = self._clock() if self._clock is not None else None
        second = int(now.timestamp()) if now is not None else int(time.time())
        date = self._date
        if date[0] != second:
            text = time.strftime(_AMZ_DATE, time.gmtime(second))
            self._date = date = (second, text)  # one tuple: a reader sees a pair, never half
        return date[1]


def bucket_base_url(bucket: str, endpoint_url: str | None, region: str) -> str:
    """Where the bucket's keys are (ends with '/'): see the module docstring."""
    if endpoint_url:
        return f"{endpoint_url.rstrip('/')}/{bucket}/"
    if _VIRTUAL_HOSTABLE.match(bucket):
        return f"https://{bucket}.s3.{region}.amazonaws.com/"
    return f"https://s3.{region}.amazonaws.com/{bucket}/"


class S3Bucket:
    """One bucket's ``list_objects_v2`` and object requests (GET, HEAD): S3 as addressing (where
    a key is: ``base_url(region)``) plus a :class:`Signer`, sent on the transport seam. The
    signer is static keys (:class:`StaticKeySigner`) or botocore's credential chain
    (``sdk.BotocoreSigner``): the same requests, the same answers."""

    def __init__(
        self,
        bucket: str,
        *,
        base_url: Callable[[str], str],
        region: str,
        signer: Signer,
        http: HttpClient,
        timeout: urllib3.Timeout | float | None = None,
        on_error: Callable[[str, Response], Exception],
    ) -> None:
        self.bucket = bucket
        self.region = region
        self._base_url = base_url
        self._signer = signer
        self._http = http
        self._timeout = timeout
        self._on_error = on_error
        self._at: _Where | None = None  # where base_url is (made again when it changes)

    @classmethod
    def static(
        cls,
        bucket: str,
        *,
        endpoint_url: str | None,
        region: str,
        credentials: StaticCredentials,
        http: HttpClient,
        timeout: urllib3.Timeout | float | None = None,
        on_error: Callable[[str, Response], Exception],
    ) -> S3Bucket:
        """The bucket addressed as botocore would for these settings, signed with static keys."""
        return cls(
            bucket, base_url=lambda region: bucket_base_url(bucket, endpoint_url, region),
            region=region, signer=StaticKeySigner(credentials), http=http, timeout=timeout,
            on_error=on_error,
        )  # fmt: skip

    @property
    def base_url(self) -> str:
        return self._base_url(self.region)

    def list_objects_v2(
        self,
        *,
        # botocore's parameter names, so callers call either alike
        Bucket: str,
        Prefix: str = "",
        MaxKeys: int = 1000,
        ContinuationToken: str | None = None,
        Delimiter: str | None = None,
        what: str | None = None,
    ) -> ListPage:
        """One page, in botocore's answer shape (error answers raise ``on_error``'s error, named
        by ``what``: the caller's words for what it lists, e.g. the prefix the user asked for
        rather than the ``snapshots/`` probe under it)."""
        if Bucket != self.bucket:
            raise ValueError(f"this lister lists {self.bucket}, not {Bucket}")
        params = {"list-type": "2", "prefix": Prefix, "max-keys": str(MaxKeys)}
        params["encoding-type"] = "url"
        if ContinuationToken:
            params["continuation-token"] = ContinuationToken
        if Delimiter:
            params["delimiter"] = Delimiter
        query = canonical_query(params)
        answer = self._send(query)
        if answer.status in _REDIRECT_STATUSES:
            moved = answer.headers.get("x-amz-bucket-region")
            if moved and moved != self.region and _REGION.match(moved):
                _drain(answer)
                self.region = moved  # the bucket's region, for every later request too
                answer = self._send(query)
        if answer.status != 200:
            raise self._on_error(what or f"listing s3://{self.bucket}/{Prefix}", answer)
        try:
            body = answer.read(MAX_PAGE_BYTES + 1)
        finally:
            answer.release()
        if len(body) > MAX_PAGE_BYTES:
            raise ValueError(f"a listing page larger than {MAX_PAGE_BYTES} bytes")
        return parse_list_page(body)

    def _send(self, query: str) -> Response:
        region = self.region
        at = self._where(region)
        path = at.prefix[:-1] if at.prefix != "/" else at.prefix
        return self._request(at, region, "GET", path, query, {})

    def send(
        self, method: str, key: str, *, headers: Mapping[str, str], query: str = ""
    ) -> Response:
        """One signed request for the object ``key`` (``query``: already encoded, e.g.
        ``partNumber=1``). Transport failures raise urllib3's errors. A key with a "." or ".."
        segment is refused (ValueError): urllib3 would normalize its path and send another
        request than the one signed (see :func:`sends_as_signed`)."""
        if not sends_as_signed(key):
            raise ValueError(f"the key {key!r} has a segment a URL would normalize away")
        region = self.region
        at = self._where(region)
        path = at.prefix + _uri_encode(key, keep_slash=True)
        return self._request(at, region, method, path, query, headers)

    def _where(self, region: str) -> _Where:
        """Where the bucket's keys are in ``region`` (kept while the base URL stays)."""
        base = self._base_url(region)
        at = self._at
        if at is None or at.base != base:
            self._at = at = _Where.of(base, self._http)
        return at

    def _request(
        self, at: _Where, region: str, method: str, path: str, query: str,
        headers: Mapping[str, str],
    ) -> Response:  # fmt: skip
        """Sign for ``region`` and send ``method path?query`` (``path`` and ``query`` encoded
        as sent) to ``at``."""
        signer = self._signer
        if isinstance(signer, StaticKeySigner):
            signed = signer.sign_parts(method, at.host, path, query, region, headers)
        else:
            url = f"{at.origin}{path}?{query}" if query else at.origin + path
            signed = signer.sign(method, url, region, headers)
        signed["user-agent"] = _USER_AGENT
        target = f"{path}?{query}" if query else path
        return at.route.send(method, target, headers=signed, timeout=self._timeout)


class _Where(NamedTuple):
    """A bucket's base URL taken apart once: what each of its requests needs."""

    base: str  #: the base URL (``scheme://netloc/path/``)
    origin: str  #: ``scheme://netloc``, as written
    host: str  #: the Host header ``http.client`` sends there (signed)
    prefix: str  #: the path of the base URL, ending with '/'
    route: Route  #: the origin's pool, held

    @classmethod
    def of(cls, base: str, http: HttpClient) -> _Where:
        parts = urlsplit(base)
        origin = f"{parts.scheme}://{parts.netloc}"
        return cls(base, origin, _host_header(parts), parts.path or "/", Route(http, origin))


def sends_as_signed(key: str) -> bool:
    """Can an object request for ``key`` go out with the path it was signed for? Not when a
    segment is "." or "..": URL parsing (urllib3's included) removes dot segments, so the
    server would see, and check the signature of, another path (botocore sends such keys)."""
    return not any(segment in (".", "..") for segment in key.split("/"))


def _drain(answer: Response) -> None:
    try:
        answer.read(64 * 1024)
    finally:
        answer.release()


@dataclass(frozen=True)
class DirectSettings:
    """What a direct listing needs to know, as botocore would have resolved it."""

    credentials: StaticCredentials
    region: str
    endpoint_url: str | None


def direct_settings(
    bucket: str,
    *,
    endpoint_url: str | None,
    region: str | None,
    credentials: StaticCredentials | None = None,
    environ: Mapping[str, str] | None = None,
) -> DirectSettings | None:
    """The credentials, region and endpoint to list ``bucket`` with, when this module can do it
    exactly as botocore would; None when botocore must (see the module docstring).
    ``credentials``: keys given to the client itself (they win over the environment's)."""
    env = settings.aws_environ(environ)
    if any(env.get(name) for name in _BOTOCORE_ONLY_ENV):
        return None
    if not re.fullmatch(r"[a-z0-9][a-z0-9.\-_]{1,254}", bucket):
        return None  # an access point ARN, or a name botocore would refuse or rewrite
    if bucket.endswith(("--x-s3", "--ol-s3")):
        return None  # S3 Express directory bucket / Object Lambda: their own auth
    credentials = credentials or env_credentials(env)
    if credentials is None:
        return None
    profile = settings.aws_profile_section(env)
    if profile is None:
        return None
    if any(key in profile for key in _BOTOCORE_ONLY_PROFILE_KEYS):
        return None
    chosen = region or env.get("AWS_DEFAULT_REGION") or profile.get("region") or "us-east-1"
    if not _REGION.match(chosen):
        return None
    endpoint = endpoint_url or env.get("AWS_ENDPOINT_URL") or None
    return DirectSettings(credentials, chosen, endpoint)
