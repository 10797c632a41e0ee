"""The Cloud Storage backend: ``gs://bucket/prefix``, read object by object and published plain,
or in the Hub's layout under ``hf_repo`` (as an S3 prefix is). The source itself
(:mod:`prefetch.sources.gcs.source`) is imported when opened."""

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

#: Cloud Storage's bucket names: 3 to 63 characters (222 with dots), lower-case letters,
#: digits, "-", "_" and ".", beginning and ending with a letter or digit.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._\-]{1,220}[a-z0-9]$")


class GcsBackend(Backend):
    scheme = "gs"
    usage = "gs://bucket/prefix"
    usage_rank = 3
    has_revisions = False

    def parse(self, uri: str, text: str, parts: SplitResult) -> SourceURI:
        bucket = parts.netloc
        if text[:5].lower() != "gs://" or not bucket:
            raise ConfigError(f"malformed GCS URI {uri!r}: expected gs://bucket/prefix")
        # the object prefix as written: "#" and "?" are characters of object names
        after = text[len("gs://") + len(bucket) :]
        if after and not after.startswith("/"):
            bucket += after.split("/", 1)[0]
            after = after[len(after.split("/", 1)[0]) :]
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise ConfigError(f"malformed GCS URI {uri!r}: {bucket!r} is not a valid bucket name")
        prefix = after.lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return SourceURI(self.scheme, bucket, prefix)

    def render(self, uri: SourceURI) -> str:
        return f"gs://{uri.location}/{uri.path}"

    def check_spec(self, spec: SpecFields) -> None:
        """No revisions (a prefix is read as it is now); the Hub layout takes a repo id."""
        check_no_revisions(
            spec, "gs://", aside="the commit to publish under is {hf_revision}, with {hf_repo}"
        )

    def publish_revision(
        self, hf_repo: str | None, revision: str | None
    ) -> tuple[str | None, str | None]:
        """With ``hf_repo``, a 40-hex commit is the commit to publish under (the agent's one
        ``revision`` field, as for S3 and file://)."""
        return hub_commit_split(hf_repo, revision)

    def open(self, spec: ModelSpec, settings: SourceSettings, *, probe: bool) -> Source:
        """The prefix, read on the seam; no request until it is resolved."""
        from prefetch.sources.gcs.source import open_gcs_source

        return open_gcs_source(spec, settings)


BACKEND = GcsBackend()
