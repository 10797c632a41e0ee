"""Sources: one module per backend behind the protocol in :mod:`prefetch.sources.base`, and the
one front door that opens them, :func:`open_source`.

Every entry point (``prefetch pull``, ``prefetch mirror``, the agent) opens a model's source
here, so a URI behaves the same from each: an ``s3://`` prefix that is ``prefetch mirror``'s
output is read as the mirror and published in the Hub's layout, a Hub model with ``mirrors``
reads them in order before the Hub, and every client is sized by :func:`pool_size`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from prefetch.retry import AdaptiveRate, RetryPolicy
from prefetch.snapshot import Snapshot
from prefetch.sources.base import RangeReader, Source
from prefetch.spec import ModelSpec, SpecError, layout_kind

if TYPE_CHECKING:
    from prefetch.sources.hf import HubOptions

__all__ = [
    "OpenedSource",
    "RangeReader",
    "S3Clients",
    "Source",
    "SourceSettings",
    "open_source",
    "pool_size",
]

#: Connections beyond the ranged reads: the metadata calls (listings, HEADs, ref lookups) that
#: run beside them, so they never wait for a free connection behind a stalled read.
_SPARE_CONNECTIONS = 8


def pool_size(concurrency: int, streams: int = 1) -> int:
    """Connections a client needs for ``streams`` syncs of ``concurrency`` ranged reads each
    (the agent runs ``parallelModels`` syncs over one client; a command runs one)."""
    return concurrency * streams + _SPARE_CONNECTIONS


class S3Clients:
    """S3 clients shared between the models of a long-running process (the agent): one per
    (endpoint, pool size, proxy, CA bundle), so parallel syncs reuse connections instead of
    each building its own, and a model with its own proxy never shares a client with one going
    direct.
    ``make`` is :func:`prefetch.sources.s3.make_s3_client` unless a test passes another."""

    def __init__(self, make: Callable[..., Any] | None = None) -> None:
        self._make = make
        self._clients: dict[tuple[str | None, int, str | None, str | None], Any] = {}
        self._paces: dict[str | None, AdaptiveRate] = {}
        self._lock = threading.Lock()

    def pace(self, endpoint: str | None) -> AdaptiveRate:
        """The request rate to ``endpoint`` (None: AWS), shared by every model the process
        reads from it: a throttled node slows down as a whole (see AdaptiveRate)."""
        with self._lock:
            return self._paces.setdefault(endpoint, AdaptiveRate())

    def get(
        self, endpoint: str | None, pool: int, proxy: str | None, ca_bundle: str | None = None
    ) -> Any:
        key = (endpoint, pool, proxy, ca_bundle)
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = self._new(
                    endpoint_url=endpoint, max_pool_connections=pool, proxy=proxy,
                    **({"ca_bundle": ca_bundle} if ca_bundle else {}),
                )  # fmt: skip
                self._clients[key] = client
            return client

    def _new(self, **settings: Any) -> Any:
        if self._make is not None:
            return self._make(**settings)
        from prefetch.sources.s3 import make_s3_client

        return make_s3_client(**settings)


@dataclass(frozen=True)
class SourceSettings:
    """How to reach a model's source; the model's own ``proxy`` is in its spec.

    ``s3_endpoint``: the S3 endpoint (None: ``AWS_ENDPOINT_URL``, else AWS). ``hub_endpoint``
    and ``token``: the Hub's (see :class:`~prefetch.sources.hf.HubOptions`). ``concurrency``
    and ``streams``: the ranged reads of one sync and the syncs sharing a client, which size
    every pool (:func:`pool_size`). ``retry``: the metadata calls' policy (None: the default).
    ``repo_from_mirror``: an ``s3://`` mirror prefix without ``hf_repo`` is published under
    the repo id its metadata records; off, that is a :class:`~prefetch.spec.SpecError` on
    ``hf_repo`` (the agent, whose cache index is read offline, needs the id in its config).

    Clients given here are used as they are: ``s3_client`` for every S3 read (tests pass
    local ones), ``hub`` instead of the Hub options above, ``clients`` to share S3 clients
    between calls (the agent). Otherwise each call builds its own: a lazy client for an
    ``s3://`` source (with static keys a no-op pull never imports botocore), a client for a
    Hub model's mirrors.
    """

    s3_endpoint: str | None = None
    hub_endpoint: str | None = None
    token: str | bool | None = None
    concurrency: int = 16
    streams: int = 1
    retry: RetryPolicy | None = None
    repo_from_mirror: bool = True
    s3_client: Any = None
    hub: HubOptions | None = None
    clients: S3Clients | None = None

    @property
    def pool(self) -> int:
        return pool_size(self.concurrency, self.streams)


@dataclass(frozen=True)
class OpenedSource:
    """What :func:`open_source` opened: the ``source``; the ``spec`` to sync (the one given,
    with ``hf_repo`` from the metadata for a mirror prefix that named none); the ``layout`` to
    publish in (``"hf"`` or ``"plain"``); the ``snapshot`` when probing already resolved it
    (sync it instead of resolving again); and ``s3_client``, the S3 client the source reads
    with (None for the Hub alone)."""

    source: Source
    spec: ModelSpec
    layout: str
    snapshot: Snapshot | None = None
    s3_client: Any = None


def open_source(
    spec: ModelSpec, settings: SourceSettings | None = None, *, layout: str | None = None
) -> OpenedSource:
    """Open ``spec``'s source: the one way anything opens one.

    ``layout`` is the layout asked for (``--layout``; None: the spec decides, see
    :func:`prefetch.spec.layout_kind`). An ``s3://`` source is probed for a mirror prefix
    unless the plain layout was asked for: a prefix holding ``snapshots/<commit>.json`` is read
    as the mirror (:class:`~prefetch.sources.mirror.MirrorSource`, one listing of
    ``snapshots/`` more than a plain prefix costs) and published in the Hub's layout. A Hub
    model with ``mirrors`` reads each in order, then the Hub unless ``hub_fallback`` is off."""
    settings = settings or SourceSettings()
    kind = layout_kind(spec, layout)
    if spec.source.scheme == "s3":
        return _open_s3(spec, settings, probe=layout != "plain", kind=kind)
    if spec.source.scheme == "hf":
        if not spec.mirrors:
            return OpenedSource(_hub(spec, settings), spec, kind)
        client = _s3_client(spec, settings, lazy=False)
        return OpenedSource(_ordered(spec, settings, client), spec, kind, s3_client=client)
    if spec.source.scheme == "oci":
        from prefetch.sources.oci import open_oci_source

        oci = open_oci_source(spec, pool_size=settings.pool, retry=settings.retry)
        return OpenedSource(oci, spec, kind)
    raise ValueError(f"no source for scheme {spec.source.scheme!r}")


def _s3_client(spec: ModelSpec, settings: SourceSettings, *, lazy: bool) -> Any:
    """The client reading ``spec``'s S3 source or mirrors: the one given, a shared one, or a new
    one (``lazy``: created when first needed)."""
    if settings.s3_client is not None:
        return settings.s3_client
    if settings.clients is not None:
        return settings.clients.get(settings.s3_endpoint, settings.pool, spec.proxy, spec.ca_bundle)
    from prefetch.sources.s3 import lazy_s3_client, make_s3_client

    make = lazy_s3_client if lazy else make_s3_client
    return make(
        endpoint_url=settings.s3_endpoint, max_pool_connections=settings.pool, proxy=spec.proxy,
        ca_bundle=spec.ca_bundle,
    )  # fmt: skip


def _pace(settings: SourceSettings) -> AdaptiveRate | None:
    """The shared request rate to the S3 endpoint in a long-running process (None: the
    client's or the source's own, see S3Source)."""
    return settings.clients.pace(settings.s3_endpoint) if settings.clients is not None else None


def _open_s3(spec: ModelSpec, settings: SourceSettings, *, probe: bool, kind: str) -> OpenedSource:
    """An S3 prefix: read as a mirror when it is one (``probe``), else object by object."""
    from prefetch.sources.s3 import S3Source

    # one client for the probe and the source (a no-op pull lists without botocore when it
    # can: see prefetch.sources.s3_direct)
    client = _s3_client(spec, settings, lazy=True)
    if probe:
        from prefetch.sources.mirror import MirrorSource

        mirror = MirrorSource(
            client,
            spec.source,
            retry=settings.retry,
            pace=_pace(settings),
            ca_bundle=spec.ca_bundle,
        )
        if mirror.is_mirror():
            snapshot = mirror.resolve(spec)
            if spec.hf_repo is None:
                if not settings.repo_from_mirror:
                    raise SpecError(
                        "hf_repo",
                        f"{_literal(spec.source)} is a mirror of {_literal(snapshot.repo_id)} "
                        "(prefetch mirror's output): name its repo id as {hf_repo} to publish "
                        "it in the Hugging Face layout",
                        cross_field=True,
                    )
                spec = replace(spec, hf_repo=snapshot.repo_id)
            return OpenedSource(mirror, spec, "hf", snapshot, s3_client=client)
    source = S3Source(
        client, spec.source, retry=settings.retry, pace=_pace(settings), ca_bundle=spec.ca_bundle
    )
    return OpenedSource(source, spec, kind, s3_client=client)


def _literal(value: object) -> str:
    """``value`` taken literally inside a SpecError reason (braces doubled)."""
    return str(value).replace("{", "{{").replace("}", "}}")


def _hub_options(settings: SourceSettings) -> HubOptions:
    from prefetch.sources.hf import HubOptions

    if settings.hub is not None:
        return settings.hub
    return HubOptions(
        endpoint=settings.hub_endpoint,
        token=settings.token,
        pool_size=settings.pool,
        retry=settings.retry or RetryPolicy(),
    )


def _hub(spec: ModelSpec, settings: SourceSettings) -> Source:
    from prefetch.sources import hf

    return hf.open_hub_source(spec, _hub_options(settings))


def _ordered(spec: ModelSpec, settings: SourceSettings, client: Any) -> Source:
    """A Hub model with mirrors: each mirror in order, then the Hub unless ``hub_fallback`` is
    off (see prefetch.sources.ordered for the fallback rule)."""
    from prefetch.sources.mirror import MirrorSource
    from prefetch.sources.ordered import OrderedSource

    retry = settings.retry if settings.hub is None else settings.hub.retry
    candidates: list[tuple[str, Source]] = [
        (
            str(m),
            MirrorSource(client, m, retry=retry, pace=_pace(settings), ca_bundle=spec.ca_bundle),
        )
        for m in spec.mirrors
    ]
    if spec.hub_fallback:
        candidates.append((f"hf://{spec.source.location}", _hub(spec, settings)))
    return OrderedSource(candidates)
