"""The OCI backend: ``oci://registry[:port]/repo[:tag|@sha256:<hex>]``, a model artifact
(ModelPack, KitOps) published plain, or in the Hub's layout under ``hf_repo``; a model may name
registry mirrors (a pull-through cache, Spegel on the node) asked for the origin's digest. The
source itself is :mod:`prefetch.sources.oci.source` (imported when opened)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING
from urllib.parse import SplitResult

from prefetch.pipeline.backends import Backend, SourceURI, SpecFields
from prefetch.pipeline.spec_terms import SpecError, escape, literal
from prefetch.support import settings as env
from prefetch.support.errors import ConfigError

if TYPE_CHECKING:
    from prefetch.pipeline.spec import ModelSpec
    from prefetch.sources import SourceSettings
    from prefetch.sources.base import Source

#: oci://registry[:port]/repo[:tag|@sha256:<hex>] (see prefetch.sources.oci.manifest for the rest)
_OCI_HOST = re.compile(
    r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9]([A-Za-z0-9.\-]*[A-Za-z0-9])?)(:[0-9]{1,5})?$"
)
_OCI_REPO = re.compile(
    r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$"
)
_OCI_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
_OCI_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_EXPECTED = "expected oci://registry/repo:tag or oci://registry/repo@sha256:<digest>"


class OciBackend(Backend):
    scheme = "oci"
    usage = "oci://registry/repo:tag"
    usage_rank = 2
    mirror_scheme = "oci"
    holds_mirrors = True
    registry = True
    to_registry = "copy"

    def parse(self, uri: str, text: str, parts: SplitResult) -> SourceURI:
        """``registry[:port]/repo`` then ``@sha256:<hex>`` (a manifest digest) or ``:tag``; a
        mirror may name the registry alone (``oci://host:port``: the origin's repo is read
        there)."""
        if text[:6].lower() != "oci://":  # oci:///m: "no registry host", below
            raise ConfigError(
                f"malformed OCI URI {uri!r}: expected oci://registry/repo:tag (the scheme, then //)"
            )
        host, _, name = text[len("oci://") :].partition("/")
        host = _expand_host(uri, host)
        if not host or not _OCI_HOST.match(host):
            raise ConfigError(
                f"malformed OCI URI {uri!r}: {host!r} is not a registry host ({_EXPECTED})"
            )
        reference: str | None = None
        if "@" in name:
            name, reference = name.split("@", 1)
            if not _OCI_DIGEST.match(reference):
                raise ConfigError(
                    f"malformed OCI URI {uri!r}: {reference!r} is not a sha256:<64 hex> digest"
                )
        elif ":" in name.rsplit("/", 1)[-1]:
            name, reference = name.rsplit(":", 1)
            if not _OCI_TAG.match(reference):
                raise ConfigError(f"malformed OCI URI {uri!r}: {reference!r} is not a valid tag")
        name = name.strip("/")
        if name and not _OCI_REPO.match(name):
            raise ConfigError(
                f"malformed OCI URI {uri!r}: {name!r} is not a repository name ({_EXPECTED})"
            )
        if reference is not None and not name:
            raise ConfigError(f"malformed OCI URI {uri!r}: no repository ({_EXPECTED})")
        return SourceURI(self.scheme, host.lower(), name, reference)

    def render(self, uri: SourceURI) -> str:
        ref = "" if uri.revision is None else uri.revision
        sep = "@" if ref.startswith("sha256:") else ":"
        repo = f"/{uri.path}" if uri.path else ""
        return f"oci://{uri.location}{repo}{sep + ref if ref else ''}"

    def name_base(self, uri: SourceURI) -> str:
        return uri.path or uri.location.split(":", 1)[0]

    def check_spec(self, spec: SpecFields) -> None:
        """A repository and one tag or manifest digest (in the URI, or as ``revision``, not
        two different ones); it publishes like an S3 prefix (``hf_repo``)."""
        if not spec.source.path:
            raise SpecError("source", f"{literal(str(spec.source))} names no repository")
        uri_ref = spec.source.revision
        if spec.revision is not None:
            if uri_ref and spec.revision != uri_ref:
                raise SpecError(
                    "revision",
                    f"{literal(spec.revision)} conflicts with {escape(uri_ref)} in the source "
                    "(two references given)",
                    cross_field=True,
                )
            if not (_OCI_DIGEST.match(spec.revision) or _OCI_TAG.match(spec.revision)):
                raise SpecError(
                    "revision", f"{literal(spec.revision)} is not a tag or a sha256:<hex> digest"
                )
            object.__setattr__(spec, "source", replace(spec.source, revision=spec.revision))
        elif uri_ref is None:
            object.__setattr__(spec, "source", replace(spec.source, revision="latest"))
        object.__setattr__(spec, "revision", spec.source.revision)
        if spec.hf_revision is not None and spec.hf_repo is None:
            raise SpecError(
                "hf_revision",
                "needs {hf_repo} org/name (the repo id to publish under)",
                cross_field=True,
            )

    def check_mirror(self, mirror: SourceURI) -> None:
        if mirror.revision is not None:
            raise SpecError(
                "mirrors",
                f"{literal(str(mirror))}: a mirror names no tag or digest (the origin's "
                "digest is read there)",
            )

    def open(self, spec: ModelSpec, settings: SourceSettings, *, probe: bool) -> Source:
        from prefetch.sources.oci.source import open_oci_source

        return open_oci_source(spec, pool_size=settings.pool, retry=settings.retry)


def _expand_host(uri: str, host: str) -> str:
    """``${NAME}`` in a registry host taken from the environment: the node's own mirror
    (Spegel, Dragonfly) is at the node's IP, which a DaemonSet has as an env var (the downward
    API's ``status.hostIP``) and a config file cannot spell."""

    def value(m: re.Match[str]) -> str:
        found = env.variable(m.group(1))
        if not found:
            raise ConfigError(f"malformed OCI URI {uri!r}: ${{{m.group(1)}}} is not set")
        return env.registry_host(found)  # an IPv6 node IP in brackets

    return _ENV_REF.sub(value, host)


BACKEND = OciBackend()
