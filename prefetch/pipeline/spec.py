"""ModelSpec: what the user asked to have on the node, parsed from a URI, flags or a config file."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from prefetch.pipeline.backends import SourceURI, backend, parse_uri
from prefetch.pipeline.spec_terms import (
    COMMIT_SHA,
    HF_REPO,
    SPEC_FIELDS,
    SpecError,
    escape,
    literal,
    validate_revision,
)
from prefetch.support.errors import ConfigError
from prefetch.support.settings import parse_proxy

__all__ = [
    "COMMIT_SHA",
    "HF_REPO",
    "LAYOUT_NAMES",
    "SIDECAR_MANIFEST",
    "SPEC_FIELDS",
    "ModelSpec",
    "SourceURI",
    "SpecError",
    "default_model_name",
    "escape",
    "layout_kind",
    "literal",
    "parse_source_uri",
    "publish_revision",
    "validate_name",
    "validate_patterns",
    "validate_revision",
]

_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
#: The sidecar checksum file an S3 prefix may carry (sha256sum format), see docs/pulling.md.
SIDECAR_MANIFEST = "SHA256SUMS"
#: The layouts a model can be published in (see :func:`layout_kind`).
LAYOUT_NAMES = ("hf", "plain")


def parse_source_uri(uri: str) -> SourceURI:
    """Parse ``s3://bucket/prefix`` or ``hf://org/name[@revision]``; errors name what is wrong."""
    text = uri.strip()
    try:
        parts = urlsplit(text)
    except ValueError as exc:  # a bracketed host that is no IP address: oci://[0]/m, s3://[b/
        raise ConfigError(f"malformed URI {uri!r}: {exc}") from exc
    return parse_uri(uri, parts, text)


def default_model_name(uri: SourceURI) -> str:
    """A DNS label derived from the URI, for node labels when the user gave no name."""
    base = backend(uri.scheme).name_base(uri).rsplit("/", 1)[-1].lower()
    name = re.sub(r"[^a-z0-9-]+", "-", base).strip("-")[:63].strip("-")
    return name or "model"


def validate_name(name: str, *, field_name: str = "name") -> str:
    if not _DNS_LABEL.fullmatch(name):
        raise SpecError(
            field_name,
            f"{literal(name)} is not a DNS label "
            "(lowercase letters, digits and '-', at most 63, starting and ending alphanumeric)",
        )
    return name


def validate_patterns(patterns: tuple[str, ...], *, field_name: str) -> tuple[str, ...]:
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise SpecError(field_name, f"patterns must be non-empty strings, got {literal(p)}")
    return patterns


@dataclass(frozen=True)
class ModelSpec:
    """One model to have on the node."""

    source: SourceURI
    name: str = ""
    revision: str | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    required: bool = True
    pin: bool = False
    #: S3 sources: publish in the Hugging Face layout under this repo id.
    hf_repo: str | None = None
    #: S3 sources with hf_repo: the commit sha to publish under (default: derived from the listing).
    hf_revision: str | None = None
    #: How to reach the source, not what the model is (so not in the agent's spec digest): an
    #: http(s) proxy URL for every request to it, "" for direct (the config's "none"), None for
    #: the environment's HTTP(S)_PROXY. NO_PROXY applies either way (settings.proxies).
    proxy: str | None = None
    #: How to reach the source too: the CA bundle chosen for it (``--ca-bundle``, a config's
    #: ``caBundle``), first in :func:`prefetch.support.settings.ca_bundle`'s order; None: the rest
    #: of it.
    ca_bundle: str | None = None
    #: hf:// sources: S3 mirrors (see prefetch.sources.s3_mirror.format) tried in order before the
    #: Hub; the model's identity (repo id, revision, layout) stays the hf:// source.
    mirrors: tuple[SourceURI, ...] = ()
    #: hf:// sources with mirrors: go to the Hub when no mirror has the commit (or none answers).
    hub_fallback: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", default_model_name(self.source))
        validate_name(self.name)
        validate_patterns(self.include, field_name="include")
        validate_patterns(self.exclude, field_name="exclude")
        backend(self.source.scheme).check_spec(self)
        if self.hf_repo is not None and (
            not HF_REPO.match(self.hf_repo) or "/" not in self.hf_repo
        ):
            raise SpecError(
                "hf_repo", f"{literal(self.hf_repo)} is not a Hub repo id like org/name"
            )
        if self.hf_revision is not None and not COMMIT_SHA.match(self.hf_revision):
            raise SpecError(
                "hf_revision", f"{literal(self.hf_revision)} is not a 40-hex commit sha"
            )
        if self.proxy is not None:
            self._normalize_proxy(self.proxy)
        self._check_mirrors()

    def _normalize_proxy(self, proxy: str) -> None:
        """``proxy`` as settings.parse_proxy reads it ("none" and "direct" become "")."""
        try:
            value = parse_proxy(proxy, field="proxy")
        except ConfigError as exc:
            raise SpecError("proxy", escape(str(exc).removeprefix("proxy: "))) from exc
        object.__setattr__(self, "proxy", value)

    def _check_mirrors(self) -> None:
        """Mirrors are S3 prefixes in front of a Hub model, each listed once; without the Hub
        to fall back to, at least one mirror must be given."""
        kind = backend(self.source.scheme).mirror_scheme
        if self.mirrors and kind is None:
            raise SpecError(
                "mirrors",
                "only for hf:// models and oci:// models (a mirror holds a Hub repo's commits, "
                "or a registry's blobs); an S3 mirror prefix can be the {source} itself",
                cross_field=True,
            )
        seen: set[str] = set()
        # an hf:// model's mirrors are S3 prefixes, an oci:// model's are registries (a
        # pull-through cache, Spegel, Harbor): each checked by its own backend
        for mirror in self.mirrors:
            if not isinstance(mirror, SourceURI) or mirror.scheme != kind:
                raise SpecError("mirrors", f"{literal(str(mirror))} is not an {kind}:// URI")
            backend(kind).check_mirror(mirror)
            if str(mirror) in seen:
                raise SpecError("mirrors", f"{literal(str(mirror))} is listed twice")
            seen.add(str(mirror))
        if not self.hub_fallback and not self.mirrors:
            raise SpecError(
                "hub_fallback",
                "turning the Hub fallback off needs {mirrors} (else there is no source left)",
                cross_field=True,
            )

    @property
    def fetch_route(self) -> tuple[object, ...]:
        """Where the bytes come from, as opposed to what they are: the mirrors in order, the
        Hub fallback, the proxy and the CA bundle. Changing it changes no content, so a cached
        copy stays valid; the agent confirms it with the new route at once."""
        return (tuple(str(m) for m in self.mirrors), self.hub_fallback, self.proxy, self.ca_bundle)

    @property
    def repo_id(self) -> str | None:
        """The Hub repo id the model is published under (None: plain layout only)."""
        return backend(self.source.scheme).repo_id(self)

    def source_kind(self, served_by: str) -> str:
        """What kind of source served a sync of this model, from the URI it names
        (``SyncResult.served_by``): "mirror" (one of ``mirrors``), "hub", "oci" or "s3". A bounded
        set, for metric labels."""
        if served_by.startswith("hf://"):
            return "hub"
        if served_by.startswith("oci://"):
            # a mirror serves the origin's repo under its own host (and prefix)
            mirror = any(served_by.startswith((f"{m}/", f"{m}@")) for m in self.mirrors)
            return "mirror" if mirror else "oci"
        if any(served_by == str(m) for m in self.mirrors):
            return "mirror"
        return "s3"

    def wants(self, path: str) -> bool:
        """Does the include/exclude filter keep this relative path?"""
        if self.include and not any(_match(path, p) for p in self.include):
            return False
        return not any(_match(path, p) for p in self.exclude)


def layout_kind(spec: ModelSpec, requested: str | None = None) -> str:
    """The layout ``spec`` is published in: ``requested`` when given (``--layout``), else
    ``hf`` for a model with a Hub repo id (an ``hf://`` source, an S3 mirror with ``hf_repo``)
    and ``plain`` for every other. SpecError (field ``layout``) for an unknown name, or ``hf``
    without a repo id (the Hugging Face cache has no place for it)."""
    name = requested or ("hf" if spec.repo_id is not None else "plain")
    if name not in LAYOUT_NAMES:
        raise SpecError(
            "layout", f"unknown layout {literal(name)}: choose one of {', '.join(LAYOUT_NAMES)}"
        )
    if name == "hf" and spec.repo_id is None:
        raise SpecError(
            "layout",
            "{layout} hf needs {hf_repo} org/name for an S3 or OCI source: the Hugging Face "
            "layout needs a Hub repo id to publish under",
            cross_field=True,
            leads=False,
        )
    return name


def publish_revision(
    source: SourceURI, hf_repo: str | None, revision: str | None
) -> tuple[str | None, str | None]:
    """``(revision, hf_revision)`` from one ``revision`` field (the agent's config has one):
    on an S3 mirror (an ``s3://`` source with ``hf_repo``) a 40-hex commit is the commit to
    publish under; anything else stays the revision (and ModelSpec's rules judge it)."""
    return backend(source.scheme).publish_revision(hf_repo, revision)


def _match(path: str, pattern: str) -> bool:
    """Glob match on the relative path; a pattern without '/' also matches the base name."""
    if fnmatch.fnmatchcase(path, pattern):
        return True
    return "/" not in pattern and fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)
