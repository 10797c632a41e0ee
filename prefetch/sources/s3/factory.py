"""Which S3 client a source uses, the seam's pool for it and the CA bundle both verify with.

* :func:`make_s3_client`: boto3's client, tuned for parallel ranged GETs, boto3's retries off
  (retrying lives in prefetch.pipeline.retry), TLS verified with the CA bundle
  :func:`prefetch.support.settings.ca_bundle` decides, proxies as every source decides them
  (:func:`s3_proxies`).
* :class:`LazyS3Client` (:func:`lazy_s3_client`): that client made when first needed, plus the
  botocore-free bucket of :mod:`prefetch.sources.s3.direct` when the settings allow it.
* :func:`seam_pool`: the seam's pool and timeouts for requests botocore's signer signs, with
  the client's own size, proxy and CA bundle.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, Unpack

import urllib3

from prefetch.pipeline.retry import AdaptiveRate
from prefetch.sources.http.transport import HttpClient, shared_http_pool
from prefetch.sources.s3.direct import S3Bucket, StaticCredentials, direct_settings
from prefetch.sources.s3.errors import answer_error
from prefetch.support import settings

if TYPE_CHECKING:  # imported where used: a pull with static keys never needs botocore's path
    from prefetch.pipeline.spec import ModelSpec
    from prefetch.sources.s3.sdk import S3Client


def make_s3_client(
    *,
    endpoint_url: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    region: str | None = None,
    max_pool_connections: int = 32,
    connect_timeout: float = 10,
    read_timeout: float = 60,
    profile: str | None = None,
    proxy: str | None = None,
    sign_payloads: bool | None = None,
    ca_bundle: str | None = None,
) -> Any:  # boto3's client: boto3 publishes no types (see S3Client for what the source calls)
    """A boto3 S3 client tuned for many parallel ranged GETs, with boto3's retries off.

    ``proxy`` is the source's own proxy setting (None: ``HTTP(S)_PROXY``; "": direct; see
    :func:`prefetch.support.settings.proxies`). ``sign_payloads=False`` sends request bodies as
    UNSIGNED-PAYLOAD instead of SHA256-hashing each one into the signature (botocore does hash
    them, even over HTTPS, when the caller supplies the body's checksum itself); only for
    callers whose every body carries a checksum S3 verifies. None: botocore's rule (and the
    AWS config file's ``payload_signing_enabled``). ``ca_bundle``: the CA bundle a flag or
    config key chose; TLS is verified with the one :func:`prefetch.support.settings.ca_bundle`
    decides from it and the environment (botocore alone ignores ``SSL_CERT_FILE`` and
    ``REQUESTS_CA_BUNDLE``, so it is always told)."""
    trust = settings.ca_bundle(ca_bundle, aws_profile=profile)
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(profile_name=profile)
    region_name = region or session.region_name or "us-east-1"
    config = Config(
        proxies=s3_proxies(endpoint_url, region_name, proxy),
        max_pool_connections=max_pool_connections,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"total_max_attempts": 1, "mode": "standard"},
        tcp_keepalive=True,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3=None if sign_payloads is None else {"payload_signing_enabled": sign_payloads},
    )
    kwargs: dict[str, object] = {"config": config}
    if trust.path is not None:
        kwargs["verify"] = trust.path
    if endpoint_url:
        kwargs["endpoint_url"] = endpoint_url
    if access_key and secret_key:
        kwargs["aws_access_key_id"] = access_key
        kwargs["aws_secret_access_key"] = secret_key
    if region or endpoint_url:
        kwargs["region_name"] = region_name
    return session.client("s3", **kwargs)


class S3ClientSettings(TypedDict, total=False):
    """:func:`make_s3_client`'s keyword arguments."""

    endpoint_url: str | None
    access_key: str | None
    secret_key: str | None
    region: str | None
    max_pool_connections: int
    connect_timeout: float
    read_timeout: float
    profile: str | None
    proxy: str | None
    sign_payloads: bool | None
    ca_bundle: str | None


class LazyS3Client:
    """A boto3 S3 client made by :func:`make_s3_client` when first used (any attribute is the
    client's), plus a listing without botocore when the settings allow it (see
    :mod:`prefetch.sources.s3.direct`): a no-op pull then neither imports botocore nor creates a
    client (~0.5 CPU-s of the ~0.9 such a pull cost, bench/README.md issue 15)."""

    def __init__(self, **settings: Unpack[S3ClientSettings]) -> None:
        self.settings = settings  #: make_s3_client's keyword arguments
        self._client: Any = None  # boto3's client (untyped: see make_s3_client)
        self._direct_buckets: dict[str, S3Bucket | None] = {}
        self._lock = threading.Lock()
        #: The request rate to this client's endpoint, shared by every source using the client
        #: (the agent shares a client per endpoint between models): a throttled node slows
        #: down as a whole.
        self.pace = AdaptiveRate()

    @property
    def created(self) -> bool:
        return self._client is not None

    def client(self) -> Any:  # boto3's client
        with self._lock:
            if self._client is None:
                self._client = make_s3_client(**self.settings)
            return self._client

    def __getattr__(self, name: str) -> Any:  # an attribute of boto3's client
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.client(), name)

    def direct_bucket(self, bucket: str) -> S3Bucket | None:
        """The botocore-free lister of ``bucket`` (one per bucket, so the region a redirect
        taught it is kept), or None when botocore must list."""
        with self._lock:
            if bucket not in self._direct_buckets:
                self._direct_buckets[bucket] = self._make_direct(bucket)
            return self._direct_buckets[bucket]

    def http(self) -> HttpClient:
        """The seam's pool for this client's settings (size, proxy, CA bundle)."""
        opts = self.settings
        return shared_http_pool(
            int(opts.get("max_pool_connections", 32)),
            settings.proxies(override=opts.get("proxy")),
            ca_certs=self.ca_certs(),
        )

    def ca_certs(self) -> str | None:
        """The CA bundle botocore's client verifies TLS with (None: the system's)."""
        opts = self.settings
        return settings.ca_bundle(opts.get("ca_bundle"), aws_profile=opts.get("profile")).path

    def timeout(self) -> urllib3.Timeout:
        opts = self.settings
        return urllib3.Timeout(
            connect=float(opts.get("connect_timeout", 10)), read=float(opts.get("read_timeout", 60))
        )

    def _make_direct(self, bucket: str) -> S3Bucket | None:
        opts = self.settings
        if opts.get("profile") is not None:
            return None  # a profile's own credentials or settings: botocore's to resolve
        keys = None
        access_key, secret_key = opts.get("access_key"), opts.get("secret_key")
        if access_key and secret_key:
            keys = StaticCredentials(access_key, secret_key)
        found = direct_settings(
            bucket, endpoint_url=opts.get("endpoint_url"), region=opts.get("region"),
            credentials=keys,
        )  # fmt: skip
        if found is None:
            return None
        return S3Bucket.static(
            bucket, endpoint_url=found.endpoint_url, region=found.region,
            credentials=found.credentials, http=self.http(), timeout=self.timeout(),
            on_error=lambda what, answer: answer_error(what, answer, has_body=True),
        )  # fmt: skip


def lazy_s3_client(**settings: Unpack[S3ClientSettings]) -> LazyS3Client:
    """:func:`make_s3_client`'s client, created when something first needs it."""
    return LazyS3Client(**settings)


def s3_proxies(endpoint_url: str | None, region: str, proxy: str | None) -> dict[str, str]:
    """botocore's ``proxies`` for a client of ``endpoint_url`` (None: AWS S3 in ``region``).

    Always explicit, even empty: left unset, botocore would read the environment itself with
    its own NO_PROXY reading, and a per-source setting could not say "direct". The decision is
    the one every source makes (settings.Proxies.proxy_for), taken for the endpoint's host,
    which is where botocore sends every request of the client (a bucket's virtual host is a
    subdomain of it, which NO_PROXY's suffix rule covers the same way)."""
    endpoint = endpoint_url or f"https://s3.{region}.amazonaws.com"
    chosen = settings.proxies(override=proxy).proxy_for(endpoint)
    if chosen is None:
        return {}
    return {"http": chosen, "https": chosen}


def seam_pool(
    client: S3Client | LazyS3Client, ca_choice: str | None
) -> tuple[HttpClient, urllib3.Timeout]:
    """The seam's pool and timeouts for requests botocore's signer signs: the lazy client's
    settings, or a client's own public configuration; TLS verified with the CA bundle the
    client's requests are (:func:`ca_bundle_of`)."""
    if isinstance(client, LazyS3Client):
        opts = client.settings
        proxy = opts.get("proxy")
        size = int(opts.get("max_pool_connections", 32))
        timeout = client.timeout()
    else:
        config = getattr(getattr(client, "meta", None), "config", None)
        # botocore's explicit proxies (make_s3_client always sets them; {} is "direct"),
        # or None: the environment's, as botocore would read them
        chosen = getattr(config, "proxies", None)
        proxy = (chosen.get("https") or chosen.get("http") or "") if chosen is not None else None
        size = int(getattr(config, "max_pool_connections", None) or 32)
        timeout = urllib3.Timeout(
            connect=float(getattr(config, "connect_timeout", None) or 10),
            read=float(getattr(config, "read_timeout", None) or 60),
        )
    ca_certs = ca_bundle_of(client, ca_choice)
    pool = shared_http_pool(size, settings.proxies(override=proxy), ca_certs=ca_certs)
    return pool, timeout


def ca_bundle_of(client: S3Client | LazyS3Client, ca_choice: str | None) -> str | None:
    """The CA bundle botocore's client verifies TLS with, so the seam verifies with the
    same (:func:`prefetch.support.settings.ca_bundle`): a lazy client's own choice, else
    ``ca_choice`` (the one a flag or config key chose for a client that is not lazy); None for the
    system's store."""
    if isinstance(client, LazyS3Client):
        return client.ca_certs()
    return settings.ca_bundle(ca_choice).path


class Reach(Protocol):
    """What :func:`s3_client` reads of the front door's settings
    (:class:`prefetch.sources.SourceSettings`, which imports this module's callers)."""

    @property
    def s3_client(self) -> Any: ...
    @property
    def clients(self) -> Any: ...
    @property
    def s3_endpoint(self) -> str | None: ...
    @property
    def pool(self) -> int: ...


def s3_client(spec: ModelSpec, reach: Reach, *, lazy: bool) -> Any:
    """The client reading ``spec``'s S3 source or mirrors: the one given, a shared one, or a new
    one (``lazy``: created when first needed)."""
    if reach.s3_client is not None:
        return reach.s3_client
    if reach.clients is not None:
        return reach.clients.get(reach.s3_endpoint, reach.pool, spec.proxy, spec.ca_bundle)
    make = lazy_s3_client if lazy else make_s3_client
    return make(
        endpoint_url=reach.s3_endpoint, max_pool_connections=reach.pool, proxy=spec.proxy,
        ca_bundle=spec.ca_bundle,
    )  # fmt: skip


def shared_pace(reach: Reach) -> AdaptiveRate | None:
    """The shared request rate to the S3 endpoint in a long-running process (None: the
    client's or the source's own, see S3Source)."""
    if reach.clients is None:
        return None
    pace: AdaptiveRate = reach.clients.pace(reach.s3_endpoint)
    return pace
