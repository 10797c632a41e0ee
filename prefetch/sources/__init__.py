"""Sources: one backend per scheme, declared in :mod:`prefetch.pipeline.backends`, behind the
protocol in :mod:`prefetch.sources.base`, and the one front door that opens them,
:func:`open_source`.

Every entry point (``prefetch pull``, ``prefetch mirror``, the agent) opens a model's source
here, so a URI behaves the same from each: an ``s3://`` prefix that is ``prefetch mirror``'s
output is read as the mirror and published in the Hub's layout, a Hub model with ``mirrors``
reads them in order before the Hub, and every client is sized by :func:`pool_size`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefetch.pipeline.backends import backend
from prefetch.pipeline.retry import AdaptiveRate, RetryPolicy
from prefetch.pipeline.spec import ModelSpec
from prefetch.sources.base import RangeReader, Source

if TYPE_CHECKING:
    from prefetch.sources.hf.source import HubOptions

__all__ = [
    "RangeReader",
    "S3Clients",
    "Source",
    "SourceSettings",
    "hub_source",
    "open_source",
    "pool_size",
    "s3_client",
    "shared_pace",
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
    ``make`` is :func:`prefetch.sources.s3.factory.make_s3_client` unless a test passes another."""

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
        from prefetch.sources.s3.factory import make_s3_client

        return make_s3_client(**settings)


@dataclass(frozen=True)
class SourceSettings:
    """How to reach a model's source; the model's own ``proxy`` is in its spec.

    ``s3_endpoint``: the S3 endpoint (None: ``AWS_ENDPOINT_URL``, else AWS). ``hub_endpoint``
    and ``token``: the Hub's (see :class:`~prefetch.sources.hf.source.HubOptions`). ``concurrency``
    and ``streams``: the ranged reads of one sync and the syncs sharing a client, which size
    every pool (:func:`pool_size`). ``retry``: the metadata calls' policy (None: the default).

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
    s3_client: Any = None
    hub: HubOptions | None = None
    clients: S3Clients | None = None

    @property
    def pool(self) -> int:
        return pool_size(self.concurrency, self.streams)


def open_source(
    spec: ModelSpec, settings: SourceSettings | None = None, *, layout: str | None = None
) -> Source:
    """Open ``spec``'s source through its backend (:mod:`prefetch.pipeline.backends`): the one
    way anything opens one. Opening makes no request; resolving makes the snapshot (once per
    sync, see :class:`prefetch.pipeline.compose.Pipeline`).

    ``layout`` is the layout asked for (``--layout``; None: the spec decides). An ``s3://``
    source is probed for a mirror prefix when resolved unless the plain layout was asked for:
    a prefix holding ``snapshots/<commit>.json`` is read as the mirror (one listing of
    ``snapshots/`` more than a plain prefix costs) and published in the Hub's layout. A Hub
    model with ``mirrors`` reads each in order, then the Hub unless ``hub_fallback`` is off."""
    settings = settings or SourceSettings()
    source: Source = backend(spec.source.scheme).open(spec, settings, probe=layout != "plain")
    return source
