"""The ``file://`` backend's declaration: ``file:///abs/dir/`` (``file://localhost/abs/dir/``
too), a directory read file by file and published plain, or in the Hub's layout under
``hf_repo``. A Kubernetes PVC is read by mounting it and naming the mount point (KServe's
``pvc://`` is not a scheme here). The source is imported when opened."""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import SplitResult

from prefetch.pipeline.backends import Backend, SourceURI, SpecFields
from prefetch.pipeline.spec_terms import check_no_revisions, hub_commit_split
from prefetch.support.errors import ConfigError

if TYPE_CHECKING:
    from prefetch.pipeline.spec import ModelSpec
    from prefetch.sources import SourceSettings
    from prefetch.sources.base import Source

_PREFIX = "file://"


class FileBackend(Backend):
    scheme = "file"
    usage = "file:///path/to/dir"
    usage_rank = 5
    has_revisions = False
    #: a directory is uploaded by the tools that write a bucket (``aws s3 sync``), not mirrored

    def parse(self, uri: str, text: str, parts: SplitResult) -> SourceURI:
        """The absolute path after ``file://`` (or ``file://localhost``), taken as written: no
        percent-decoding, ``#`` and ``?`` are characters of the path; normalized (``a/./b``,
        ``a//b``), ``..`` refused."""
        if text[: len(_PREFIX)].lower() != _PREFIX:
            raise ConfigError(
                f"malformed file URI {uri!r}: expected file:///absolute/path (three slashes)"
            )
        rest = text[len(_PREFIX) :]
        if rest[: len("localhost/")].lower() == "localhost/":
            rest = rest[len("localhost") :]
        if not rest.startswith("/"):
            host = rest.split("/", 1)[0]
            raise ConfigError(
                f"malformed file URI {uri!r}: {host!r} is a host; a file:// source is a "
                "directory on this machine: file:///absolute/path (three slashes)"
            )
        if ".." in rest.split("/"):
            raise ConfigError(f"malformed file URI {uri!r}: '..' is not allowed in the path")
        path = posixpath.normpath(rest).lstrip("/")
        if not path or path == ".":
            raise ConfigError(f"malformed file URI {uri!r}: the root directory is not a model")
        return SourceURI(self.scheme, "", path + "/")

    def render(self, uri: SourceURI) -> str:
        return f"file:///{uri.path}"

    def check_spec(self, spec: SpecFields) -> None:
        """No revisions (a directory has one state); the Hub layout may name the commit to
        publish under, with the repo id (as for S3)."""
        check_no_revisions(
            spec, "file://", aside="the commit to publish under is {hf_revision}, with {hf_repo}"
        )

    def publish_revision(
        self, hf_repo: str | None, revision: str | None
    ) -> tuple[str | None, str | None]:
        """With ``hf_repo``, a 40-hex commit is the commit to publish under."""
        return hub_commit_split(hf_repo, revision)

    def refuse_destination(self, uri: SourceURI, folders: tuple[Path, ...]) -> None:
        from prefetch.sources.file.source import FileSource

        FileSource(uri).refuse_destination(folders)

    def open(self, spec: ModelSpec, settings: SourceSettings, *, probe: bool) -> Source:
        from prefetch.sources.file.source import FileSource

        return FileSource(spec.source)


BACKEND = FileBackend()
