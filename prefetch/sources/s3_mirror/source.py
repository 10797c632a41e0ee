"""Mirror source: a Hub repo's commits as ``prefetch mirror`` laid them out under an S3 prefix.

Resolving reads ``refs/<rev>`` (unless the revision is a commit sha) and that commit's
``snapshots/<commit>.json`` (see :mod:`prefetch.sources.s3_mirror.format`), and returns the snapshot
a Hub pull of the same revision would: the Hub's commit, repo id and ref, each file named by its Hub
id, so the Hugging Face layout publishes exactly what it publishes from the Hub. The bytes are
read through :class:`~prefetch.sources.s3.source.S3Source` (ranged GETs pinned to the ETag, the
retries, the stall and range rules); each file carries the two checks its metadata recorded, the Hub
id and the object's CRC64NVME, so an object altered after mirroring is a checksum failure.

A mirror that lacks the ref or the commit raises a
:class:`~prefetch.support.errors.NotFoundError` (the caller may try the next source); a mirror of
another repo raises :class:`~prefetch.support.errors.ConfigError` (a configuration mistake to fix,
not a reason to fall back).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from prefetch.pipeline.retry import AdaptiveRate, RetryPolicy
from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, SourceURI
from prefetch.sources.base import RangeReader
from prefetch.sources.s3.factory import LazyS3Client
from prefetch.sources.s3.listing import listed_objects
from prefetch.sources.s3.source import S3Source
from prefetch.sources.s3_mirror.format import (
    MirrorCommit,
    MirrorFile,
    blob_key,
    is_commit,
    parse_mirror_commit,
    parse_ref_body,
    ref_key,
    refs_prefix,
    snapshot_key,
    snapshots_prefix,
)
from prefetch.support.errors import (
    AccessDeniedError,
    ChecksumMismatchError,
    ConfigError,
    NoMatchingFilesError,
    RevisionNotFoundError,
    SourceError,
    TransientSourceError,
)

if TYPE_CHECKING:
    from prefetch.sources.s3.sdk import S3Client

log = logging.getLogger(__name__)

#: The largest metadata object read (a repo of ~100k files); a bigger one is refused.
MAX_METADATA_BYTES = 64 * 1024 * 1024
#: The checks a mirrored file's metadata records; their origin makes Verify compute both.
ORIGIN = "mirror"


class MirrorSource:
    """The commits mirrored under ``s3://bucket/prefix`` (one Hub repo per prefix)."""

    def __init__(
        self,
        client: S3Client | LazyS3Client,
        uri: SourceURI,
        *,
        retry: RetryPolicy | None = None,
        pace: AdaptiveRate | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        if uri.scheme != "s3":
            raise ValueError(f"not an S3 URI: {uri}")
        self._client = client
        self._uri = uri
        self._retry = retry or RetryPolicy()
        self._objects = S3Source(client, uri, retry=self._retry, pace=pace, ca_bundle=ca_bundle)
        #: blob key -> the ETag describe saw, so reads stay pinned to that object (the file's
        #: ``version`` is its Hub id, which is what the layout names its blob by)
        self._etags: dict[str, str] = {}
        self._lock = threading.Lock()
        self._signed_ready = False  # see _prepare_signed_path
        self._signed_lock = threading.Lock()

    @property
    def uri(self) -> str:
        return str(self._uri)

    # -- resolve -------------------------------------------------------------------------------

    def resolve(self, spec: ModelSpec) -> Snapshot:
        commit, requested = self._commit_for(spec)
        meta = self.read_commit(commit)
        repo_id = self._check_repo(spec, meta)
        if not meta.files:
            raise NoMatchingFilesError(f"{self.uri}: {repo_id}@{commit[:12]} has no files")
        files = [_remote_file(self._uri.path, f) for f in meta.files if spec.wants(f.path)]
        if not files:
            raise NoMatchingFilesError(
                f"no file of {repo_id}@{commit[:12]} in {self.uri} matches the include/exclude "
                "patterns",
                hint=f"include={list(spec.include)} exclude={list(spec.exclude)}",
            )
        return Snapshot(
            source=self.uri,
            revision_id=meta.commit,
            files=tuple(files),
            requested_revision=requested,
            repo_id=repo_id,
        )

    def _commit_for(self, spec: ModelSpec) -> tuple[str, str | None]:
        """The commit to read and the ref it was asked by (None for a commit sha, as the Hub
        source says): the Hub model's revision, or for the mirror prefix pulled as a source of
        its own, ``hf_revision``, else ``main``, else its only ref."""
        if spec.source.scheme == "hf":
            revision = spec.revision or "main"
        elif spec.hf_revision is not None:
            revision = spec.hf_revision
        else:
            revision = self._default_ref()
        if is_commit(revision):
            return revision, None
        return self.read_ref(revision), revision

    def _default_ref(self) -> str:
        refs = self.list_refs()
        if "main" in refs or not refs:
            return "main"
        if len(refs) == 1:
            return refs[0]
        raise ConfigError(
            f"{self.uri} mirrors several refs and none is 'main': {', '.join(refs[:10])}",
            hint="pull it as hf://org/name@REF --mirror with the ref you want, "
            "or pass --hf-revision COMMIT",
        )

    def _check_repo(self, spec: ModelSpec, meta: MirrorCommit) -> str:
        """The repo id to publish under; a mirror of another repo is refused (case aside, as
        the Hub compares ids)."""
        wanted = spec.repo_id
        if wanted is None:
            return meta.repo_id
        if wanted.casefold() != meta.repo_id.casefold():
            raise ConfigError(
                f"{self.uri} is a mirror of {meta.repo_id}, not of {wanted}",
                hint="one prefix mirrors one repo: point the model at its own mirror prefix",
            )
        return wanted

    # -- metadata ------------------------------------------------------------------------------

    def read_ref(self, ref: str) -> str:
        """The commit ``refs/<ref>`` names; RevisionNotFoundError when the mirror lacks it."""
        key = ref_key(self._uri.path, ref)
        body = self._get(key, missing=f"{self.uri} has no ref {ref!r} (not mirrored yet?)")
        return parse_ref_body(body, where=self._where(key))

    def read_commit(self, commit: str) -> MirrorCommit:
        """The metadata of ``commit``; RevisionNotFoundError when the mirror lacks it (its
        metadata is written last, so a commit without it is not complete)."""
        key = snapshot_key(self._uri.path, commit)
        body = self._get(key, missing=f"{self.uri} has no commit {commit} (not mirrored yet?)")
        meta = parse_mirror_commit(body, where=self._where(key))
        if meta.commit != commit:
            raise SourceError(f"{self._where(key)} describes commit {meta.commit}, not {commit}")
        return meta

    def list_refs(self) -> list[str]:
        """Every ref the mirror holds, sorted (at most the first 1000)."""
        start = refs_prefix(self._uri.path)
        page = self._objects.list_page(f"listing {self._where(start)}", Prefix=start, MaxKeys=1000)
        return sorted(str(o["Key"])[len(start) :] for o in listed_objects(page, self.uri))

    def is_mirror(self) -> bool:
        """Does the prefix hold a mirrored commit (a ``snapshots/<40 hex>.json`` object)? A
        copy of a Hugging Face cache folder has ``snapshots/<commit>/...`` instead: not one."""
        start = snapshots_prefix(self._uri.path)
        page = self._objects.list_page(
            f"listing {self.uri}", Prefix=start, Delimiter="/", MaxKeys=100
        )
        names = (str(o["Key"])[len(start) :] for o in listed_objects(page, self.uri))
        return any(n.endswith(".json") and is_commit(n.removesuffix(".json")) for n in names)

    def _where(self, key: str) -> str:
        return f"s3://{self._uri.location}/{key}"

    def _get(self, key: str, *, missing: str) -> bytes:
        """One small object's body, retried like every S3 call; ``missing`` is the message of
        the RevisionNotFoundError raised when it does not exist."""
        what = f"reading {self._where(key)}"
        self._prepare_signed_path()  # static keys: read without creating a botocore client
        data = self._objects.read_object(key, what, limit=MAX_METADATA_BYTES)
        if data is None:
            raise RevisionNotFoundError(missing)
        return data

    # -- describe and read ---------------------------------------------------------------------

    def describe(self, file: RemoteFile) -> RemoteFile:
        """HEAD the blob (or fetch a small one whole) through the S3 source; an object whose
        full-object CRC64NVME (as S3 states it) is not the recorded one fails here, before a
        byte is downloaded."""
        if file.described:
            return file
        self._prepare_signed_path()
        return self._accept(file, self._objects.describe(file.with_(version="", checksums=())))

    def describe_whole(
        self, file: RemoteFile, *, within: float | None = None
    ) -> tuple[RemoteFile, bytes | None]:
        """:meth:`describe`, a small blob fetched whole with it (as the S3 source does, see
        :class:`~prefetch.sources.base.DescribesWhole`)."""
        if file.described:
            return file, None
        self._prepare_signed_path()
        seen, body = self._objects.describe_whole(
            file.with_(version="", checksums=()), within=within
        )
        return self._accept(file, seen), body

    def _accept(self, file: RemoteFile, seen: RemoteFile) -> RemoteFile:
        """``file`` described, once what S3 states of its blob (``seen``) agrees with what the
        mirror recorded (ChecksumMismatchError otherwise); the blob's ETag noted for its reads."""
        recorded = next((c for c in file.checksums if c.algorithm == "crc64nvme"), None)
        stated = next(
            (c for c in seen.checksums if c.algorithm == "crc64nvme" and not c.composite), None
        )
        if recorded is not None and stated is not None and stated.value != recorded.value:
            raise ChecksumMismatchError(
                f"{file.path} ({self._where(file.locator)})",
                "crc64nvme",
                recorded.value,
                stated.value,
            )
        with self._lock:
            self._etags[file.locator] = seen.version
        return file.with_(described=True)

    def _prepare_signed_path(self) -> None:
        """Metadata and blob requests on the S3 source's transport seam (~1.5 ms of CPU less each
        than botocore's; with static keys, no botocore client at all), set up once, before the
        first read. A listing the credentials may not make leaves the reads on botocore; any
        other failure (no such bucket, an unreachable endpoint) is the mirror's answer, and
        trying botocore after it would only make the caller wait twice before a fallback."""
        with self._signed_lock:  # the other describing threads wait: they would use botocore
            if self._signed_ready:
                return
            try:
                self._objects.ensure_signed_path()
            except AccessDeniedError as exc:
                log.debug("reads of %s stay on botocore: %s", self.uri, exc)
            self._signed_ready = True

    def open_range(self, file: RemoteFile, start: int, end: int) -> RangeReader:
        with self._lock:
            etag = self._etags.get(file.locator, "")
        try:
            return self._objects.open_range(file.with_(version=etag), start, end)
        except TransientSourceError:
            raise  # retried as it is
        except SourceError as exc:
            # the blob's key names no file: say which file it is
            named = type(exc)(f"{file.path}: {exc}")
            named.hint = exc.hint
            raise named from exc


def _remote_file(prefix: str, f: MirrorFile) -> RemoteFile:
    """A mirrored file as the Hub source lists it (version and blob id: the Hub id), read from
    its blob, checked by both recorded checksums."""
    return RemoteFile(
        path=f.path,
        size=f.size,
        version=f.id,
        checksums=(
            Checksum(f.id_kind, f.id, origin=ORIGIN),
            Checksum("crc64nvme", f.crc64nvme, encoding="base64", origin=ORIGIN),
        ),
        blob_id=f.id,
        locator=blob_key(prefix, f.id),
    )
