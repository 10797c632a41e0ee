"""How the agent opens each model's :class:`~prefetch.sources.base.Source`: S3 models share a
client per endpoint and pool size, so that parallel syncs reuse connections instead of each
building its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefetch import settings
from prefetch.agent.config import AgentConfig
from prefetch.sources import open_source
from prefetch.sources.base import Source
from prefetch.spec import ModelSpec

if TYPE_CHECKING:
    from prefetch.sources.hf import HubOptions

__all__ = ["SourceOpener"]


class SourceOpener:
    """Opens each model's Source; S3 models (and Hub models' S3 mirrors) share one client per
    (endpoint, pool size, proxy setting), sized for ``concurrency`` streams of each of
    ``parallelModels`` syncs."""

    def __init__(self, s3_client: object | None, hub: HubOptions | None) -> None:
        self._s3_client = s3_client
        self._s3_clients: dict[tuple[str | None, int, str | None], object] = {}
        self._hub = hub

    def __call__(self, spec: ModelSpec, config: AgentConfig) -> Source:
        if spec.source.scheme != "s3" and not spec.mirrors:
            return open_source(spec, hub=self._hub, concurrency=config.concurrency)
        client = self._s3_client
        if client is None:
            endpoint = config.s3_endpoint_url or settings.aws_endpoint_url()
            pool = config.concurrency * config.parallel_models + 8
            key = (endpoint, pool, spec.proxy)  # a model's own proxy gets its own client
            client = self._s3_clients.get(key)
            if client is None:
                from prefetch.sources.s3 import make_s3_client

                client = make_s3_client(
                    endpoint_url=endpoint, max_pool_connections=pool, proxy=spec.proxy
                )
                self._s3_clients[key] = client
        # a Hub model with mirrors reads them with the S3 client, then the Hub with ``hub``
        return open_source(spec, s3_client=client, hub=self._hub, concurrency=config.concurrency)
