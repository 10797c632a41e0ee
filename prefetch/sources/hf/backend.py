"""The Hugging Face Hub backend: ``hf://org/name[@revision]``, published in the Hub's layout
under its own repo id; a model may name S3 mirrors (``prefetch mirror``'s output) read in order
before the Hub. The source itself is :mod:`prefetch.sources.hf.source` (imported when opened)."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import SplitResult

from prefetch.pipeline.backends import Backend, SourceURI, SpecFields
from prefetch.pipeline.spec_terms import HF_REPO, SpecError, escape, literal, validate_revision
from prefetch.support.errors import ConfigError

if TYPE_CHECKING:
    from prefetch.pipeline.spec import ModelSpec
    from prefetch.sources import SourceSettings
    from prefetch.sources.base import Source


class HubBackend(Backend):
    scheme = "hf"
    usage = "hf://org/name"
    usage_rank = 1
    mirrored_from = True
    mirror_scheme = "s3"
    offline_ref = None
    mirrors_commits = True
    to_registry = "modelpack"

    def parse(self, uri: str, text: str, parts: SplitResult) -> SourceURI:
        if not (text[:5].lower() == "hf://" and parts.netloc):
            raise ConfigError(
                f"malformed Hub URI {uri!r}: expected hf://org/name (the scheme, then //)"
            )
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
        if not repo or not HF_REPO.match(repo) or "--" in repo or ".." in repo:
            raise ConfigError(
                f"malformed Hub URI {uri!r}: expected hf://org/name or hf://org/name@revision"
            )
        return SourceURI(self.scheme, repo, "", revision)

    def render(self, uri: SourceURI) -> str:
        suffix = f"@{uri.revision}" if uri.revision else ""
        return f"hf://{uri.location}{suffix}"

    def name_base(self, uri: SourceURI) -> str:
        return uri.location

    def repo_id(self, spec: SpecFields) -> str | None:
        return spec.source.location

    def check_spec(self, spec: SpecFields) -> None:
        """Publishes under its own repo id, at one revision (the URI's ``@rev`` or
        ``revision``, not two different ones), a valid ref name."""
        if spec.hf_repo is not None or spec.hf_revision is not None:
            raise SpecError(
                "hf_repo" if spec.hf_repo is not None else "hf_revision",
                "only for s3:// sources; an hf:// source is published under its own repo id "
                "(options like {hf_repo} are for S3 sources)",
                cross_field=True,
            )
        uri_revision = spec.source.revision
        if spec.revision is not None and uri_revision and spec.revision != uri_revision:
            raise SpecError(
                "revision",
                f"{literal(spec.revision)} conflicts with @{escape(uri_revision)} "
                "in the source (two revisions given)",
                cross_field=True,
            )
        if uri_revision and spec.revision is None:
            object.__setattr__(spec, "revision", uri_revision)
        for revision in (spec.source.revision, spec.revision):
            if revision is not None:
                validate_revision(revision)

    def open(self, spec: ModelSpec, settings: SourceSettings, *, probe: bool) -> Source:
        """The Hub; with ``mirrors``, each in order, then the Hub unless ``hub_fallback`` is
        off (see prefetch.sources.ordered for the fallback rule)."""
        from prefetch.sources.hf.source import hub_source
        from prefetch.sources.ordered import OrderedSource
        from prefetch.sources.s3.factory import s3_client, shared_pace
        from prefetch.sources.s3_mirror.source import MirrorSource

        if not spec.mirrors:
            return hub_source(spec, settings)
        client = s3_client(spec, settings, lazy=False)
        retry = settings.retry if settings.hub is None else settings.hub.retry
        pace = shared_pace(settings)
        candidates: list[tuple[str, Source]] = [
            (str(m), MirrorSource(client, m, retry=retry, pace=pace, ca_bundle=spec.ca_bundle))
            for m in spec.mirrors
        ]
        if spec.hub_fallback:
            candidates.append((f"hf://{spec.source.location}", hub_source(spec, settings)))
        return OrderedSource(candidates)


BACKEND = HubBackend()
