"""ModelSpec: what the user asked to have on the node, parsed from a URI, flags or a config file."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prefetch.errors import ConfigError
from prefetch.paths import ref_name_problem

_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,254}$")
_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$|^[A-Za-z0-9][\w.\-]*$")
#: The sidecar checksum file an S3 prefix may carry (sha256sum format), see README.
SIDECAR_MANIFEST = "SHA256SUMS"


@dataclass(frozen=True)
class SourceURI:
    scheme: str  # "s3" or "hf"
    location: str  # bucket, or Hub repo id
    path: str  # S3 key prefix (no leading slash, "" or ending in "/"); "" for hf
    revision: str | None = None  # hf://org/name@rev

    def __str__(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.location}/{self.path}"
        suffix = f"@{self.revision}" if self.revision else ""
        return f"hf://{self.location}{suffix}"


def parse_source_uri(uri: str) -> SourceURI:
    """Parse ``s3://bucket/prefix`` or ``hf://org/name[@revision]``; errors name what is wrong."""
    text = uri.strip()
    parts = urlsplit(text)
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not bucket:
            raise ConfigError(f"malformed S3 URI {uri!r}: no bucket (expected s3://bucket/prefix)")
        if not _BUCKET.match(bucket):
            raise ConfigError(f"malformed S3 URI {uri!r}: {bucket!r} is not a valid bucket name")
        prefix = parts.path.lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return SourceURI("s3", bucket, prefix)
    if parts.scheme == "hf":
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
    raise ConfigError(
        f"unsupported source URI {uri!r}: expected s3://bucket/prefix or hf://org/name"
    )


def default_model_name(uri: SourceURI) -> str:
    """A DNS label derived from the URI, for node labels when the user gave no name."""
    base = uri.location if uri.scheme == "hf" else (uri.path.rstrip("/") or uri.location)
    base = base.rsplit("/", 1)[-1].lower()
    name = re.sub(r"[^a-z0-9-]+", "-", base).strip("-")[:63].strip("-")
    return name or "model"


def validate_name(name: str, *, field_name: str = "name") -> str:
    if not _DNS_LABEL.match(name):
        raise ConfigError(
            f"{field_name}: {name!r} is not a DNS label "
            "(lowercase letters, digits and '-', at most 63, starting and ending alphanumeric)"
        )
    return name


def validate_patterns(patterns: tuple[str, ...], *, field_name: str) -> tuple[str, ...]:
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ConfigError(f"{field_name}: patterns must be non-empty strings, got {p!r}")
    return patterns


def validate_revision(revision: str, *, field_name: str = "revision") -> str:
    """A revision must be a valid git ref name (or a commit sha, which is one): it names a file
    under the cache's ``refs/`` and is sent in URLs, so ``../../x`` is refused up front."""
    problem = ref_name_problem(revision)
    if problem is not None:
        raise ConfigError(
            f"{field_name}: {revision!r} is not a valid branch, tag or commit name ({problem})"
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
    extra: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", default_model_name(self.source))
        validate_name(self.name)
        validate_patterns(self.include, field_name="include")
        validate_patterns(self.exclude, field_name="exclude")
        if self.source.scheme == "hf" and self.source.revision and self.revision is None:
            object.__setattr__(self, "revision", self.source.revision)
        for revision in {self.source.revision, self.revision} - {None}:
            validate_revision(revision)
        if self.hf_repo is not None and (
            not _HF_REPO.match(self.hf_repo) or "/" not in self.hf_repo
        ):
            raise ConfigError(f"hf_repo: {self.hf_repo!r} is not a Hub repo id like org/name")
        if self.hf_revision is not None and not re.fullmatch(r"[0-9a-f]{40}", self.hf_revision):
            raise ConfigError(f"hf_revision: {self.hf_revision!r} is not a 40-hex commit sha")

    @property
    def repo_id(self) -> str | None:
        """The Hub repo id the model is published under (None: plain layout only)."""
        if self.source.scheme == "hf":
            return self.source.location
        return self.hf_repo

    def wants(self, path: str) -> bool:
        """Does the include/exclude filter keep this relative path?"""
        if self.include and not any(_match(path, p) for p in self.include):
            return False
        return not any(_match(path, p) for p in self.exclude)


def _match(path: str, pattern: str) -> bool:
    """Glob match on the relative path; a pattern without '/' also matches the base name."""
    if fnmatch.fnmatchcase(path, pattern):
        return True
    return "/" not in pattern and fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)
