"""Sources: one module per backend behind the protocol in :mod:`prefetch.sources.base`."""

from __future__ import annotations

from typing import Any

from prefetch.sources.base import RangeReader, Source
from prefetch.spec import ModelSpec

__all__ = ["RangeReader", "Source", "open_source"]


def open_source(
    spec: ModelSpec,
    *,
    s3_client: Any = None,
    endpoint_url: str | None = None,
    concurrency: int = 16,
    hub: Any = None,
) -> Source:
    """The Source for ``spec.source``; clients given here are used as they are (tests pass
    local ones), otherwise one is built from the environment."""
    if spec.source.scheme == "s3":
        from prefetch.sources.s3 import S3Source, make_s3_client

        client = s3_client or make_s3_client(
            endpoint_url=endpoint_url, max_pool_connections=concurrency + 8
        )
        return S3Source(client, spec.source)
    if spec.source.scheme == "hf":
        from prefetch.sources import hf

        return hf.open_hub_source(spec, hub)
    raise ValueError(f"no source for scheme {spec.source.scheme!r}")
