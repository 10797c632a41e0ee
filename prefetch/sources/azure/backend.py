"""The Azure Blob backend: ``az://account/container/prefix``, and the URL the portal shows for a
container or folder, ``https://<account>.blob.core.windows.net/<container>/<prefix>`` (only that
host shape: every other ``https://`` URI stays unsupported). A SAS written on the URI's query is
kept as the URI's secret, never rendered. Read blob by blob and published plain, or in the Hub's
layout under ``hf_repo``; the source is :mod:`prefetch.sources.azure.source` (imported when
opened)."""

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

#: A storage account name: 3-24 lowercase letters and digits.
_ACCOUNT = re.compile(r"^[a-z0-9]{3,24}$")
#: A container name: 3-63 lowercase letters, digits and single hyphens, starting and ending with
#: a letter or digit (or the root container, ``$root``).
_CONTAINER = re.compile(r"^(?:[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}|\$root)$")
#: The portal's URL of a blob endpoint in Azure's public cloud.
_PORTAL_HOST = re.compile(r"^([a-z0-9]{3,24})\.blob\.core\.windows\.net$")


def _masked(text: str) -> str:
    """A URI fit for a message: its query (a SAS) left out."""
    return text.split("?", 1)[0] + ("?***" if "?" in text else "")


class AzureBackend(Backend):
    scheme = "az"
    usage = "az://account/container/prefix"
    usage_rank = 4
    has_revisions = False

    def claims(self, parts: SplitResult) -> bool:
        if parts.scheme == self.scheme:
            return True
        return parts.scheme == "https" and bool(_PORTAL_HOST.match(parts.hostname or ""))

    def parse(self, uri: str, text: str, parts: SplitResult) -> SourceURI:
        shown = _masked(uri)
        if parts.scheme == self.scheme:
            account, path = parts.netloc, parts.path
            if text[:5].lower() != "az://":
                raise ConfigError(f"malformed Azure URI {shown!r}: expected {self.usage}")
        else:
            found = _PORTAL_HOST.match(parts.hostname or "")
            if parts.port not in (None, 443) or parts.username or found is None:
                raise ConfigError(f"malformed Azure Blob URL {shown!r}: expected {self.usage}")
            account, path = found.group(1), parts.path
        if parts.fragment:
            raise ConfigError(f"malformed Azure URI {shown!r}: '#' is in no blob prefix here")
        if not _ACCOUNT.match(account):
            raise ConfigError(
                f"malformed Azure URI {shown!r}: {account!r} is not a storage account name "
                "(3-24 lowercase letters and digits)"
            )
        container, _, prefix = path.lstrip("/").partition("/")
        if not _CONTAINER.match(container):
            raise ConfigError(
                f"malformed Azure URI {shown!r}: "
                + (f"{container!r} is not a container name" if container else "no container")
                + f" (expected {self.usage})"
            )
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return SourceURI(self.scheme, account, f"{container}/{prefix}", secret=parts.query)

    def render(self, uri: SourceURI) -> str:
        return f"az://{uri.location}/{uri.path}"

    def check_spec(self, spec: SpecFields) -> None:
        check_no_revisions(
            spec, "Azure Blob", aside="the commit to publish under is {hf_revision}, with {hf_repo}"
        )

    def publish_revision(
        self, hf_repo: str | None, revision: str | None
    ) -> tuple[str | None, str | None]:
        """With ``hf_repo``, a 40-hex commit is the commit to publish under (the agent's one
        ``revision`` field, as for S3 and file://)."""
        return hub_commit_split(hf_repo, revision)

    def open(self, spec: ModelSpec, settings: SourceSettings, *, probe: bool) -> Source:
        from prefetch.sources.azure.source import open_azure_source

        return open_azure_source(spec, settings)


BACKEND = AzureBackend()
