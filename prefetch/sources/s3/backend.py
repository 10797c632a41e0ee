"""The S3 backend: ``s3://bucket/prefix``, read object by object and published plain, or in the
Hub's layout under ``hf_repo``. A prefix that is ``prefetch mirror``'s output (the S3 mirror) is
found when it is resolved and read as the mirror (see :mod:`prefetch.sources.s3.prefix`). The
sources themselves (:mod:`prefetch.sources.s3.source`, :mod:`prefetch.sources.s3_mirror.source`) are
imported when opened."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING
from urllib.parse import SplitResult

from prefetch.pipeline.backends import Backend, SourceURI, SpecFields
from prefetch.pipeline.spec_terms import check_no_revisions, hub_commit_split
from prefetch.support.errors import ConfigError

if TYPE_CHECKING:
    from prefetch.pipeline.spec import ModelSpec
    from prefetch.sources import SourceSettings
    from prefetch.sources.base import Source

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,254}$")


class S3Backend(Backend):
    scheme = "s3"
    usage = "s3://bucket/prefix"
    usage_rank = 0
    mirrored_from = True
    holds_mirrors = True
    has_revisions = False
    holds_compile_caches = True

    def parse(self, uri: str, text: str, parts: SplitResult) -> SourceURI:
        bucket = parts.netloc
        if not bucket:
            raise ConfigError(f"malformed S3 URI {uri!r}: no bucket (expected s3://bucket/prefix)")
        # The key prefix as written: "#" and "?" are characters of S3 keys, not a fragment and
        # a query (urlsplit's reading took s3://b/models#1/ for the prefix models/).
        two_slashes = text[:5].lower() == "s3://"
        after = text[len("s3://") + len(bucket) :] if two_slashes else parts.path
        if after and not after.startswith("/"):
            bucket += after.split("/", 1)[0]
        if not _BUCKET.match(bucket):
            raise ConfigError(f"malformed S3 URI {uri!r}: {bucket!r} is not a valid bucket name")
        prefix = after.lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return SourceURI(self.scheme, bucket, prefix)

    def render(self, uri: SourceURI) -> str:
        return f"s3://{uri.location}/{uri.path}"

    def check_spec(self, spec: SpecFields) -> None:
        """No revisions; a mirror published in the Hub layout may name the commit to publish
        under, with the repo id."""
        check_no_revisions(
            spec, "S3", aside="an S3 mirror takes the 40-hex commit to publish under as "
            "{hf_revision}, with {hf_repo}",
        )  # fmt: skip

    def publish_revision(
        self, hf_repo: str | None, revision: str | None
    ) -> tuple[str | None, str | None]:
        """On an S3 mirror (with ``hf_repo``) a 40-hex commit is the commit to publish under."""
        return hub_commit_split(hf_repo, revision)

    def open(self, spec: ModelSpec, settings: SourceSettings, *, probe: bool) -> Source:
        """The prefix, found to be a mirror or not when resolved (``probe``), else read object
        by object; one client for the probe and the reads (a no-op pull lists without botocore
        when it can: see prefetch.sources.s3.direct)."""
        from prefetch.sources.s3.factory import s3_client, shared_pace
        from prefetch.sources.s3.prefix import S3PrefixSource

        client = s3_client(spec, settings, lazy=True)
        return S3PrefixSource(
            client, spec.source, retry=settings.retry, pace=shared_pace(settings),
            ca_bundle=spec.ca_bundle, probe=probe,
        )  # fmt: skip


BACKEND = S3Backend()
