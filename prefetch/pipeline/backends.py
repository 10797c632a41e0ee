"""The backend registry: every source scheme, and the one :class:`Backend` that knows it.

A backend declares its scheme, parses and prints its URIs (:class:`SourceURI`), checks the spec
fields that are its own, says how its models are published by default (the repo id, the ref a
snapshot is recorded under) and opens a :class:`~prefetch.sources.base.Source` for a spec.
Nothing outside a backend compares a scheme: :mod:`prefetch.pipeline.spec`, the front door
(:func:`prefetch.sources.open_source`), the CLI and the agent ask :func:`backend`.

The declarations are modules of :mod:`prefetch.sources` named in :data:`DECLARATIONS`, each
defining ``BACKEND``; they are loaded by name when the registry is first asked, as plugins are:
this module sits below everything that checks a spec and knows no backend's code. A declaration
imports only the vocabulary (this module, :mod:`prefetch.pipeline.spec_terms`), so loading the
registry stays cheap; what reads the network (botocore, urllib3 pools, the OCI client) is imported
when a backend opens a source. Adding a backend: a declaration module named here, and a case of the
conformance suite (tests/test_source_conformance.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import SplitResult

from prefetch.support.errors import ConfigError

__all__ = [
    "DECLARATIONS",
    "Backend",
    "SourceURI",
    "SpecFields",
    "backend",
    "backends",
    "mirror_schemes",
    "mirrors_by_source",
    "parse_uri",
    "source_schemes",
]

#: The declaration modules, in the order their schemes are listed (the chart's schema and the
#: config reference are generated in it).
DECLARATIONS = (
    "prefetch.sources.hf.backend",
    "prefetch.sources.s3.backend",
    "prefetch.sources.oci.backend",
    "prefetch.sources.gcs.backend",
    "prefetch.sources.azure.backend",
    "prefetch.sources.file.backend",
)


@dataclass(frozen=True)
class SourceURI:
    scheme: str  # a backend's (see :func:`backend`)
    location: str  # bucket, Hub repo id, or registry host[:port]
    path: str  # S3 key prefix (no leading slash, "" or ending in "/"); "" for hf; oci: the repo
    revision: str | None = None  # hf://org/name@rev; oci: the tag or "sha256:<hex>"
    #: a credential written in the URI (an Azure SAS on its query): never rendered or printed
    secret: str = field(default="", repr=False, compare=False)

    def __str__(self) -> str:
        return backend(self.scheme).render(self)


class SpecFields(Protocol):
    """What a backend reads of a :class:`~prefetch.pipeline.spec.ModelSpec` (its shape, named here
    as the spec is above the registry)."""

    @property
    def source(self) -> SourceURI: ...
    @property
    def revision(self) -> str | None: ...
    @property
    def hf_repo(self) -> str | None: ...
    @property
    def hf_revision(self) -> str | None: ...


class Backend:
    """One scheme's knowledge. A declaration subclasses it, sets the attributes and overrides
    what differs."""

    #: the URI scheme (``s3``)
    scheme: str = ""
    #: the shape of its URIs, in the message for an unsupported URI
    usage: str = ""
    #: where :attr:`usage` comes in that message (lowest first)
    usage_rank: int = 0
    #: the scheme of a model's ``mirrors`` (None: the model takes none)
    mirror_scheme: str | None = None
    #: a mirror can live here (a model's ``mirrors``, ``prefetch mirror``'s destinations)
    holds_mirrors: bool = False
    #: the source has revisions (``prefetch mirror --revision`` is for it)
    has_revisions: bool = True
    #: the ref a snapshot resolved without one is recorded under in the Hugging Face layout
    #: (None: none, a pinned commit stays unnamed)
    offline_ref: str | None = "main"
    #: ``prefetch mirror`` copies its commits with the Hub's ids (else it copies a prefix)
    mirrors_commits: bool = False
    #: the URI names an OCI registry (``prefetch mirror``'s registry destinations)
    registry: bool = False
    #: how ``prefetch mirror`` puts it into a registry: ``"modelpack"`` (a resolved snapshot
    #: pushed as a ModelPack artifact), ``"copy"`` (the artifact copied by digest); None: not
    to_registry: str | None = None
    #: ``prefetch mirror`` reads it (a Hub commit, an S3 prefix, a registry's artifact)
    mirrored_from: bool = False
    #: compile caches are published here (``compileCaches[].source``)
    holds_compile_caches: bool = False

    def claims(self, parts: SplitResult) -> bool:
        """Is a URI of this shape this backend's? (Its scheme; a backend may also claim some
        hosts of a shared scheme, as Azure claims ``https://<account>.blob.core.windows.net``.)"""
        return parts.scheme == self.scheme

    def parse(self, uri: str, text: str, parts: SplitResult) -> SourceURI:
        """``uri`` (stripped: ``text``, split: ``parts``) as a SourceURI; ConfigError naming
        what is wrong."""
        raise NotImplementedError

    def render(self, uri: SourceURI) -> str:
        """The URI's text (``parse(render(u)) == u``)."""
        raise NotImplementedError

    def name_base(self, uri: SourceURI) -> str:
        """What a default model name is derived from."""
        return uri.path.rstrip("/") or uri.location

    def check_spec(self, spec: SpecFields) -> None:
        """The spec fields' rules that are this scheme's (SpecError); may normalize fields
        of the spec being built (``object.__setattr__``, as its own ``__post_init__`` does)."""

    def refuse_destination(self, uri: SourceURI, folders: tuple[Path, ...]) -> None:
        """Before a pull makes ``folders`` (a destination's missing folders, the first one
        first): refuse them if they would be inside the source (a directory of this machine,
        which is never written to). Nothing to refuse for a remote source."""

    def check_mirror(self, mirror: SourceURI) -> None:
        """A mirror of this scheme, as a model's ``mirrors`` names it (SpecError)."""

    def repo_id(self, spec: SpecFields) -> str | None:
        """The Hub repo id the model is published under (None: plain layout only)."""
        return spec.hf_repo

    def publish_revision(
        self, hf_repo: str | None, revision: str | None
    ) -> tuple[str | None, str | None]:
        """``(revision, hf_revision)`` from one ``revision`` field (the agent's config)."""
        return revision, None

    # the spec, the settings and the source are higher layers' types (a ModelSpec, a
    # prefetch.sources.SourceSettings, a prefetch.sources.base.Source): open_source names them
    def open(self, spec: Any, settings: Any, *, probe: bool) -> Any:
        """A source reading ``spec`` (no request yet: resolving makes the first). ``probe``:
        an S3 prefix may be read as a mirror when it is one."""
        raise NotImplementedError


@cache
def backends() -> tuple[Backend, ...]:
    """Every backend, in :data:`DECLARATIONS` order (loaded once, then a constant)."""
    found: list[Backend] = []
    for name in DECLARATIONS:
        declared = importlib.import_module(name).BACKEND
        if not isinstance(declared, Backend):
            raise TypeError(f"{name}.BACKEND is not a Backend")
        found.append(declared)
    return tuple(found)


def backend(scheme: str) -> Backend:
    """The backend of ``scheme``; ValueError for a scheme no backend declares."""
    for b in backends():
        if b.scheme == scheme:
            return b
    raise ValueError(f"no backend for scheme {scheme!r}")


def parse_uri(uri: str, parts: SplitResult, text: str) -> SourceURI:
    """``uri`` parsed by its scheme's backend; ConfigError for a scheme none declares."""
    for b in backends():
        if b.claims(parts):
            return b.parse(uri, text, parts)
    usages = [b.usage for b in sorted(backends(), key=lambda b: b.usage_rank)]
    raise ConfigError(
        f"unsupported source URI {uri!r}: expected {', '.join(usages[:-1])} or {usages[-1]}"
    )


def source_schemes() -> tuple[str, ...]:
    """The schemes of a model's ``source``; the chart's schema and the config reference are
    generated from them."""
    return tuple(b.scheme for b in backends())


def mirror_schemes() -> tuple[str, ...]:
    """Where a mirror lives: a model's ``mirrors`` and ``prefetch mirror``'s destinations."""
    ranked = sorted(backends(), key=lambda b: b.usage_rank)
    return tuple(b.scheme for b in ranked if b.holds_mirrors)


def mirrors_by_source() -> Mapping[str, str]:
    """The scheme of a model's ``mirrors``, by its source's scheme (none: it takes none)."""
    return {b.scheme: b.mirror_scheme for b in backends() if b.mirror_scheme is not None}
