"""ModelSpec: what the user asked to have on the node, parsed from a URI, flags or a config file."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from prefetch import settings
from prefetch.errors import ConfigError
from prefetch.paths import ref_name_problem
from prefetch.settings import parse_proxy

_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,254}$")
_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$|^[A-Za-z0-9][\w.\-]*$")
_COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
#: oci://registry[:port]/repo[:tag|@sha256:<hex>] (see prefetch.oci_manifest for the rest)
_OCI_HOST = re.compile(
    r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9]([A-Za-z0-9.\-]*[A-Za-z0-9])?)(:[0-9]{1,5})?$"
)
_OCI_REPO = re.compile(
    r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$"
)
_OCI_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
_OCI_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
#: The schemes of a model's ``source`` (each has its branch in :func:`parse_source_uri`); the
#: chart's schema and the config reference are generated from this.
SOURCE_SCHEMES = ("hf", "s3", "oci")
#: Where a mirror lives: a model's ``mirrors`` (S3 prefixes for hf://, registries for oci://)
#: and ``prefetch mirror``'s destinations.
MIRROR_SCHEMES = ("s3", "oci")
#: The scheme of a model's ``mirrors``, by its source's scheme (none: it takes no mirrors).
MIRRORS_BY_SOURCE = {"hf": "s3", "oci": "oci"}
#: The sidecar checksum file an S3 prefix may carry (sha256sum format), see docs/pulling.md.
SIDECAR_MANIFEST = "SHA256SUMS"
#: The ModelSpec fields, and the layout asked for, that a rule's message may name (as
#: ``{field}`` in its reason).
SPEC_FIELDS = (
    "name", "source", "revision", "include", "exclude", "hf_repo", "hf_revision", "proxy",
    "mirrors", "hub_fallback", "layout",
)  # fmt: skip
#: The layouts a model can be published in (see :func:`layout_kind`).
LAYOUT_NAMES = ("hf", "plain")


class SpecError(ConfigError):
    """A ModelSpec rule broken: ``field`` is the spec field at fault, ``reason`` says why and
    may name other fields as ``{hf_repo}``-style placeholders. ``cross_field`` is true for a
    rule about a combination of fields (its reason names the others). ``leads``: the message
    starts with the field's name (``hf_repo: ...``); off, the reason names the field itself
    where the sentence needs it (``{layout} hf needs {hf_repo} ...``).

    ``str()`` names fields by their ModelSpec names (``hf_repo: ...``); a front end whose users
    know the fields by other names (the CLI's flags, the config file's keys) calls
    :meth:`render` with its names and the location of the spec, and changes nothing else.
    """

    def __init__(
        self,
        field: str,
        reason: str,
        *,
        cross_field: bool = False,
        hint: str | None = None,
        leads: bool = True,
    ) -> None:
        self.field = field
        self.reason = reason
        self.cross_field = cross_field
        self.leads = leads
        super().__init__(self.render(), hint=hint)

    def render(self, names: Mapping[str, str] | None = None, *, prefix: str = "") -> str:
        """The message with each field called by ``names`` (default: its spec name), the
        faulty field's name preceded by ``prefix`` (e.g. ``models[0].``)."""
        called = {f: f for f in SPEC_FIELDS} | dict(names or {})
        if not self.leads:
            return f"{prefix}{self.reason.format_map(called)}"
        return f"{prefix}{called.get(self.field, self.field)}: {self.reason.format_map(called)}"


def _escape(text: str) -> str:
    """``text`` taken literally inside a SpecError reason (braces doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


def _literal(value: object) -> str:
    """``repr(value)`` taken literally inside a SpecError reason."""
    return _escape(repr(value))


@dataclass(frozen=True)
class SourceURI:
    scheme: str  # "s3", "hf" or "oci"
    location: str  # bucket, Hub repo id, or registry host[:port]
    path: str  # S3 key prefix (no leading slash, "" or ending in "/"); "" for hf; oci: the repo
    revision: str | None = None  # hf://org/name@rev; oci: the tag or "sha256:<hex>"

    def __str__(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.location}/{self.path}"
        if self.scheme == "oci":
            ref = "" if self.revision is None else self.revision
            sep = "@" if ref.startswith("sha256:") else ":"
            repo = f"/{self.path}" if self.path else ""
            return f"oci://{self.location}{repo}{sep + ref if ref else ''}"
        suffix = f"@{self.revision}" if self.revision else ""
        return f"hf://{self.location}{suffix}"


def parse_source_uri(uri: str) -> SourceURI:
    """Parse ``s3://bucket/prefix`` or ``hf://org/name[@revision]``; errors name what is wrong."""
    text = uri.strip()
    try:
        parts = urlsplit(text)
    except ValueError as exc:  # a bracketed host that is no IP address: oci://[0]/m, s3://[b/
        raise ConfigError(f"malformed URI {uri!r}: {exc}") from exc
    two_slashes = text[: len(parts.scheme) + 3].lower() == f"{parts.scheme}://"
    if (parts.scheme == "hf" and not (two_slashes and parts.netloc)) or (
        parts.scheme == "oci" and not two_slashes  # oci:///m: "no registry host", below
    ):
        example = "hf://org/name" if parts.scheme == "hf" else "oci://registry/repo:tag"
        kind = "Hub" if parts.scheme == "hf" else "OCI"
        raise ConfigError(f"malformed {kind} URI {uri!r}: expected {example} (the scheme, then //)")
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not bucket:
            raise ConfigError(f"malformed S3 URI {uri!r}: no bucket (expected s3://bucket/prefix)")
        # The key prefix as written: "#" and "?" are characters of S3 keys, not a fragment and
        # a query (urlsplit's reading took s3://b/models#1/ for the prefix models/).
        after = text[len("s3://") + len(bucket) :] if two_slashes else parts.path
        if after and not after.startswith("/"):
            bucket += after.split("/", 1)[0]
        if not _BUCKET.match(bucket):
            raise ConfigError(f"malformed S3 URI {uri!r}: {bucket!r} is not a valid bucket name")
        prefix = after.lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return SourceURI("s3", bucket, prefix)
    if parts.scheme == "hf":
        if "#" in text or "?" in text:  # urlsplit would drop what follows them
            raise ConfigError(
                f"malformed Hub URI {uri!r}: '#' and '?' are in no repo id or revision"
            )
        repo = (parts.netloc + parts.path).strip("/")
        revision: str | None = None
        if "@" in repo:
            repo, revision = repo.split("@", 1)
            if not revision:
                raise ConfigError(f"malformed Hub URI {uri!r}: empty revision after '@'")
        if repo.startswith("models/"):
            repo = repo[len("models/") :]
        if not repo or not _HF_REPO.match(repo) or "--" in repo or ".." in repo:
            raise ConfigError(
                f"malformed Hub URI {uri!r}: expected hf://org/name or hf://org/name@revision"
            )
        return SourceURI("hf", repo, "", revision)
    if parts.scheme == "oci":
        return _parse_oci_uri(uri, text[len("oci://") :])
    raise ConfigError(
        f"unsupported source URI {uri!r}: expected s3://bucket/prefix, hf://org/name or "
        "oci://registry/repo:tag"
    )


def _parse_oci_uri(uri: str, rest: str) -> SourceURI:
    """``registry[:port]/repo`` then ``@sha256:<hex>`` (a manifest digest) or ``:tag``; a
    mirror may name the registry alone (``oci://host:port``: the origin's repo is read there)."""
    expected = "expected oci://registry/repo:tag or oci://registry/repo@sha256:<digest>"
    host, _, name = rest.partition("/")
    host = _expand_host(uri, host)
    if not host or not _OCI_HOST.match(host):
        raise ConfigError(
            f"malformed OCI URI {uri!r}: {host!r} is not a registry host ({expected})"
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
            f"malformed OCI URI {uri!r}: {name!r} is not a repository name ({expected})"
        )
    if reference is not None and not name:
        raise ConfigError(f"malformed OCI URI {uri!r}: no repository ({expected})")
    return SourceURI("oci", host.lower(), name, reference)


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand_host(uri: str, host: str) -> str:
    """``${NAME}`` in a registry host taken from the environment: the node's own mirror
    (Spegel, Dragonfly) is at the node's IP, which a DaemonSet has as an env var (the downward
    API's ``status.hostIP``) and a config file cannot spell."""

    def value(m: re.Match[str]) -> str:
        found = settings.variable(m.group(1))
        if not found:
            raise ConfigError(f"malformed OCI URI {uri!r}: ${{{m.group(1)}}} is not set")
        return settings.registry_host(found)  # an IPv6 node IP in brackets

    return _ENV_REF.sub(value, host)


def default_model_name(uri: SourceURI) -> str:
    """A DNS label derived from the URI, for node labels when the user gave no name."""
    base = uri.location if uri.scheme == "hf" else (uri.path.rstrip("/") or uri.location)
    if uri.scheme == "oci":
        base = uri.path or uri.location.split(":", 1)[0]
    base = base.rsplit("/", 1)[-1].lower()
    name = re.sub(r"[^a-z0-9-]+", "-", base).strip("-")[:63].strip("-")
    return name or "model"


def validate_name(name: str, *, field_name: str = "name") -> str:
    if not _DNS_LABEL.fullmatch(name):
        raise SpecError(
            field_name,
            f"{_literal(name)} is not a DNS label "
            "(lowercase letters, digits and '-', at most 63, starting and ending alphanumeric)",
        )
    return name


def validate_patterns(patterns: tuple[str, ...], *, field_name: str) -> tuple[str, ...]:
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise SpecError(field_name, f"patterns must be non-empty strings, got {_literal(p)}")
    return patterns


def validate_revision(revision: str, *, field_name: str = "revision") -> str:
    """A revision must be a valid git ref name (or a commit sha, which is one): it names a file
    under the cache's ``refs/`` and is sent in URLs, so ``../../x`` is refused up front."""
    problem = ref_name_problem(revision)
    if problem is not None:
        raise SpecError(
            field_name,
            f"{_literal(revision)} is not a valid branch, tag or commit name ({_escape(problem)})",
        )
    return revision


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
    #: ``caBundle``), first in :func:`prefetch.settings.ca_bundle`'s order; None: the rest of it.
    ca_bundle: str | None = None
    #: hf:// sources: S3 mirrors (see prefetch.mirror_format) tried in order before the Hub; the
    #: model's identity (repo id, revision, layout) stays the hf:// source.
    mirrors: tuple[SourceURI, ...] = ()
    #: hf:// sources with mirrors: go to the Hub when no mirror has the commit (or none answers).
    hub_fallback: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", default_model_name(self.source))
        validate_name(self.name)
        validate_patterns(self.include, field_name="include")
        validate_patterns(self.exclude, field_name="exclude")
        if self.source.scheme == "hf":
            self._check_hub_fields()
        elif self.source.scheme == "oci":
            self._check_oci_fields()
        else:
            self._check_s3_fields()
        for revision in (
            () if self.source.scheme == "oci" else (self.source.revision, self.revision)
        ):
            if revision is not None:
                validate_revision(revision)
        if self.hf_repo is not None and (
            not _HF_REPO.match(self.hf_repo) or "/" not in self.hf_repo
        ):
            raise SpecError(
                "hf_repo", f"{_literal(self.hf_repo)} is not a Hub repo id like org/name"
            )
        if self.hf_revision is not None and not _COMMIT_SHA.match(self.hf_revision):
            raise SpecError(
                "hf_revision", f"{_literal(self.hf_revision)} is not a 40-hex commit sha"
            )
        if self.proxy is not None:
            self._normalize_proxy(self.proxy)
        self._check_mirrors()

    def _normalize_proxy(self, proxy: str) -> None:
        """``proxy`` as settings.parse_proxy reads it ("none" and "direct" become "")."""
        try:
            value = parse_proxy(proxy, field="proxy")
        except ConfigError as exc:
            raise SpecError("proxy", _escape(str(exc).removeprefix("proxy: "))) from exc
        object.__setattr__(self, "proxy", value)

    def _check_mirrors(self) -> None:
        """Mirrors are S3 prefixes in front of a Hub model, each listed once; without the Hub
        to fall back to, at least one mirror must be given."""
        if self.mirrors and self.source.scheme not in MIRRORS_BY_SOURCE:
            raise SpecError(
                "mirrors",
                "only for hf:// models and oci:// models (a mirror holds a Hub repo's commits, "
                "or a registry's blobs); an S3 mirror prefix can be the {source} itself",
                cross_field=True,
            )
        seen: set[str] = set()
        # an oci:// model's mirrors are registries (a pull-through cache, Spegel, Harbor)
        kind = MIRRORS_BY_SOURCE.get(self.source.scheme, "s3")
        for mirror in self.mirrors:
            if not isinstance(mirror, SourceURI) or mirror.scheme != kind:
                raise SpecError("mirrors", f"{_literal(str(mirror))} is not an {kind}:// URI")
            if kind == "oci" and mirror.revision is not None:
                raise SpecError(
                    "mirrors",
                    f"{_literal(str(mirror))}: a mirror names no tag or digest (the origin's "
                    "digest is read there)",
                )
            if str(mirror) in seen:
                raise SpecError("mirrors", f"{_literal(str(mirror))} is listed twice")
            seen.add(str(mirror))
        if not self.hub_fallback and not self.mirrors:
            raise SpecError(
                "hub_fallback",
                "turning the Hub fallback off needs {mirrors} (else there is no source left)",
                cross_field=True,
            )

    def _check_hub_fields(self) -> None:
        """An hf:// source: publishes under its own repo id, at one revision (the URI's
        ``@rev`` or ``revision``, not two different ones)."""
        if self.hf_repo is not None or self.hf_revision is not None:
            raise SpecError(
                "hf_repo" if self.hf_repo is not None else "hf_revision",
                "only for s3:// sources; an hf:// source is published under its own repo id "
                "(options like {hf_repo} are for S3 sources)",
                cross_field=True,
            )
        uri_revision = self.source.revision
        if self.revision is not None and uri_revision and self.revision != uri_revision:
            raise SpecError(
                "revision",
                f"{_literal(self.revision)} conflicts with @{_escape(uri_revision)} "
                "in the source (two revisions given)",
                cross_field=True,
            )
        if uri_revision and self.revision is None:
            object.__setattr__(self, "revision", uri_revision)

    def _check_oci_fields(self) -> None:
        """An oci:// source names a repository and one tag or manifest digest (in the URI, or
        as ``revision``, not two different ones); it publishes like an S3 prefix (``hf_repo``)."""
        if not self.source.path:
            raise SpecError("source", f"{_literal(str(self.source))} names no repository")
        uri_ref = self.source.revision
        if self.revision is not None:
            if uri_ref and self.revision != uri_ref:
                raise SpecError(
                    "revision",
                    f"{_literal(self.revision)} conflicts with {_escape(uri_ref)} in the source "
                    "(two references given)",
                    cross_field=True,
                )
            if not (_OCI_DIGEST.match(self.revision) or _OCI_TAG.match(self.revision)):
                raise SpecError(
                    "revision", f"{_literal(self.revision)} is not a tag or a sha256:<hex> digest"
                )
            object.__setattr__(self, "source", replace(self.source, revision=self.revision))
        elif uri_ref is None:
            object.__setattr__(self, "source", replace(self.source, revision="latest"))
        object.__setattr__(self, "revision", self.source.revision)
        if self.hf_revision is not None and self.hf_repo is None:
            raise SpecError(
                "hf_revision",
                "needs {hf_repo} org/name (the repo id to publish under)",
                cross_field=True,
            )

    def _check_s3_fields(self) -> None:
        """An s3:// source has no revisions; a mirror published in the Hub layout may name
        the commit to publish under, with the repo id."""
        if self.revision is not None:
            raise SpecError(
                "revision",
                "S3 sources have no revisions; {revision} is for hf:// sources (an S3 mirror "
                "takes the 40-hex commit to publish under as {hf_revision}, with {hf_repo})",
                cross_field=True,
            )
        if self.hf_revision is not None and self.hf_repo is None:
            raise SpecError(
                "hf_revision",
                "needs {hf_repo} org/name (the repo id to publish under)",
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
        if self.source.scheme == "hf":
            return self.source.location
        return self.hf_repo

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
            "layout", f"unknown layout {_literal(name)}: choose one of {', '.join(LAYOUT_NAMES)}"
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
    if source.scheme == "s3" and hf_repo is not None and _COMMIT_SHA.match(revision or ""):
        return None, revision
    return revision, None


def _match(path: str, pattern: str) -> bool:
    """Glob match on the relative path; a pattern without '/' also matches the base name."""
    if fnmatch.fnmatchcase(path, pattern):
        return True
    return "/" not in pattern and fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)
