"""How the agent opens each model's source: through :func:`prefetch.sources.open_source`, the
front door the CLI uses too, with S3 clients shared between models (:class:`S3Clients`) so that
parallel syncs reuse connections instead of each building its own."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from prefetch.agent.config_models import render_spec_error
from prefetch.agent.config_values import AgentConfig
from prefetch.pipeline.spec import ModelSpec, SpecError
from prefetch.sources import S3Clients, SourceSettings, open_source
from prefetch.sources.base import Source
from prefetch.support import settings

if TYPE_CHECKING:
    from prefetch.sources.hf.source import HubOptions

__all__ = ["SourceOpener"]


class SourceOpener:
    """Opens each model's Source under the agent's config. S3 models (and Hub models' S3
    mirrors) share one client per (endpoint, pool size, proxy setting), sized for
    ``concurrency`` streams of each of ``parallelModels`` syncs; ``s3_client`` and ``hub``,
    when given (tests), are used for every model."""

    def __init__(self, s3_client: object | None, hub: HubOptions | None) -> None:
        self._s3_client = s3_client
        self._clients = S3Clients()
        self._hub = hub

    def __call__(self, spec: ModelSpec, config: AgentConfig) -> Source:
        return self.open(spec, config)

    def open(self, spec: ModelSpec, config: AgentConfig) -> Source:
        """What :func:`~prefetch.sources.open_source` opens for ``spec`` (resolving is the
        sync's: an S3 mirror prefix is published in the Hub's layout only under the repo id the
        config names, see SyncJob). A model without its own ``caBundle`` gets the config's
        top-level one."""
        if spec.ca_bundle is None and config.ca_bundle is not None:
            spec = replace(spec, ca_bundle=config.ca_bundle)
        reach = SourceSettings(
            s3_endpoint=config.s3_endpoint_url or settings.aws_endpoint_url(),
            concurrency=config.concurrency,
            streams=config.parallel_models,
            s3_client=self._s3_client,
            hub=self._hub,
            clients=self._clients,
        )
        try:
            return open_source(spec, reach)
        except SpecError as exc:
            raise render_spec_error(exc, f"{spec.name}: ") from exc
