"""Sources: one module per backend behind the protocol in :mod:`prefetch.sources.base`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefetch.snapshot import Snapshot
from prefetch.sources.base import RangeReader, Source
from prefetch.spec import ModelSpec

__all__ = ["RangeReader", "Source", "open_mirror_prefix", "open_source"]


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
        from prefetch.sources.s3 import S3Source, lazy_s3_client

        client = s3_client or lazy_s3_client(
            endpoint_url=endpoint_url, max_pool_connections=concurrency + 8, proxy=spec.proxy
        )
        return S3Source(client, spec.source)
    if spec.source.scheme == "hf":
        from prefetch.sources import hf

        if not spec.mirrors:
            return hf.open_hub_source(spec, hub)
        return _ordered(spec, hub, s3_client, endpoint_url=endpoint_url, concurrency=concurrency)
    if spec.source.scheme == "oci":
        from prefetch.sources.oci import open_oci_source

        return open_oci_source(spec, pool_size=concurrency + 8)
    raise ValueError(f"no source for scheme {spec.source.scheme!r}")


def _ordered(
    spec: ModelSpec, hub: Any, s3_client: Any, *, endpoint_url: str | None, concurrency: int
) -> Source:
    """A Hub model with mirrors: each mirror in order, then the Hub unless ``hub_fallback`` is
    off (see prefetch.sources.ordered for the fallback rule)."""
    from prefetch.sources import hf
    from prefetch.sources.mirror import MirrorSource
    from prefetch.sources.ordered import OrderedSource
    from prefetch.sources.s3 import make_s3_client

    client = s3_client or make_s3_client(
        endpoint_url=endpoint_url, max_pool_connections=concurrency + 8, proxy=spec.proxy
    )
    retry = getattr(hub, "retry", None)
    candidates: list[tuple[str, Source]] = [
        (str(m), MirrorSource(client, m, retry=retry)) for m in spec.mirrors
    ]
    if spec.hub_fallback:
        candidates.append((f"hf://{spec.source.location}", hf.open_hub_source(spec, hub)))
    return OrderedSource(candidates)


def open_mirror_prefix(
    spec: ModelSpec,
    *,
    s3_client: Any = None,
    endpoint_url: str | None = None,
    concurrency: int = 16,
) -> tuple[ModelSpec, Source, Snapshot] | None:
    """For an ``s3://`` spec whose prefix is a mirror (it holds ``snapshots/*.json``): the spec
    published under the mirrored repo id (``hf_repo``, from the metadata), the mirror's source
    and the snapshot it resolved, which publishes the Hub's layout (ref ``main``, or the
    mirror's only ref). None for a plain prefix."""
    from prefetch.sources.mirror import MirrorSource
    from prefetch.sources.s3 import lazy_s3_client

    if spec.source.scheme != "s3":
        return None
    client = s3_client or lazy_s3_client(
        endpoint_url=endpoint_url, max_pool_connections=concurrency + 8, proxy=spec.proxy
    )
    mirror = MirrorSource(client, spec.source)
    if not mirror.is_mirror():
        return None
    snapshot = mirror.resolve(spec)
    if spec.hf_repo is None:
        spec = replace(spec, hf_repo=snapshot.repo_id)
    return spec, mirror, snapshot
