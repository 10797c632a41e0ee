"""OCI registry source: model artifacts (ModelPack, KitOps, Docker models) by manifest digest.

* ``resolve``: ``GET /v2/<repo>/manifests/<tag or digest>``; the bytes must hash to the digest
  asked for (a tag: to the ``Docker-Content-Digest`` the registry states, when it states one),
  and the tag is resolved here once: the snapshot's revision is the manifest digest. An index
  is followed to its one model manifest (:func:`prefetch.sources.oci.manifest.pick_model`).
  Each layer is a file at its ``org.cncf.model.filepath``; its sha256 digest is its checksum
  and its version, so the engine verifies every byte and the Hugging Face layout names its blob
  by it (as the Hub names LFS blobs).
* ``open_range``: ``GET /v2/<repo>/blobs/<digest>`` with ``Range``, clamped to the descriptor's
  size (a registry answers a range past the end with 416 yet states the whole length);
  redirects (307 to object storage) are followed here with the Range sent again and the
  ``Authorization`` only on the registry's own origin; a ``Docker-Content-Digest`` other than
  the layer's is refused; the range rule of :mod:`prefetch.sources.base` applies.
* Archive layers (``tar``, ``tar+gzip``, ``tar+zstd``): streamed once at resolve, checked
  against their digest and unpacked safely (:mod:`prefetch.sources.oci.archive`) into a staging
  folder (``PREFETCH_OCI_STAGING``, else the temp folder); their members are then files of the
  snapshot, each with the sha256 taken as it was unpacked, copied into place by the engine.
  What a layer unpacked to is recorded by its digest in the destination's state
  (:meth:`OciSource.remember_archives`, :mod:`prefetch.sources.oci.layer_staging`): at the next
  resolve an unchanged layer whose members are all published is neither fetched nor unpacked
  (its members come from the record); it is fetched again only when one of them must be (then
  at resolve, or on the engine's first read of a member). Bytes fetched at resolve count in the
  sync's ``bytes_downloaded``.
* Time: each attempt at a manifest (its redirects and token answer included) must end within
  ``metadata_timeout`` (:data:`METADATA_TIMEOUT`; a mirror's :data:`MIRROR_METADATA_TIMEOUT`,
  so a mirror that trickles falls back to the next source as one that fails does), and an
  archive layer unpacked at resolve within that plus its size at
  :data:`~prefetch.sources.oci.layer_staging.ARCHIVE_FLOOR_RATE`:
  the one deadline mechanism (:func:`prefetch.pipeline.deadline.call_with_deadline`) aborts the
  request in flight, whose socket timeout a byte every few seconds would reset for ever.
* Authentication: :mod:`prefetch.sources.oci.auth` (docker config, helpers, the token flow); a
  401 mid-pull (an expired token) fetches a new token once and sends the request again.

Loopback registries (and hosts in ``PREFETCH_OCI_PLAIN_HTTP``, comma-separated ``host[:port]``:
a Spegel or pull-through mirror on the node) are spoken to over plain HTTP, as docker does for
``localhost``; every other registry over HTTPS.

The pieces: requests to the repository (:mod:`~prefetch.sources.oci.registry`), archive layers
(:mod:`~prefetch.sources.oci.layer_staging`), registry mirrors
(:mod:`~prefetch.sources.oci.mirrors`); manifest resolution and the blob reads are here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import urllib3

from prefetch.pipeline.deadline import Alarms, call_with_deadline
from prefetch.pipeline.retry import RetryPolicy, call_with_retries
from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, SourceURI
from prefetch.sources.base import RangeReader
from prefetch.sources.http.transport import (
    HttpClient,
    check_range_answer,
    range_body_reader,
    redact_url,
    shared_http_pool,
    transport_error,
)
from prefetch.sources.oci import archive as oci_tar
from prefetch.sources.oci import manifest as om
from prefetch.sources.oci.auth import RegistryAuth
from prefetch.sources.oci.layer_staging import ArchiveLayers
from prefetch.sources.oci.mirrors import OciMirrors
from prefetch.sources.oci.registry import RegistryRepository
from prefetch.support import settings
from prefetch.support.errors import (
    InvalidListingError,
    NoMatchingFilesError,
    RangeIgnoredError,
    RevisionNotFoundError,
    SourceChangedError,
)
from prefetch.support.paths import check_listing

T = TypeVar("T")

#: Seconds one attempt at a manifest may take in all (as the Hub's and S3's metadata calls).
METADATA_TIMEOUT = 120.0
#: The same for a registry mirror (on the node or near it: it answers in well under a second,
#: or the next source is asked).
MIRROR_METADATA_TIMEOUT = 20.0


class OciSource:
    """One repository of one registry (``uri``: ``oci://registry/repo[:tag|@digest]``)."""

    def __init__(
        self,
        uri: SourceURI,
        *,
        http: HttpClient,
        auth: RegistryAuth | None = None,
        retry: RetryPolicy | None = None,
        timeout: urllib3.Timeout | None = None,
        plain_http: tuple[str, ...] = (),
        namespace: str | None = None,
        metadata_timeout: float = METADATA_TIMEOUT,
    ) -> None:
        self._uri = uri
        self._registry = RegistryRepository(
            uri, http=http, auth=auth, timeout=timeout, plain_http=plain_http, namespace=namespace
        )
        self._repo = self._registry.repo
        self._retry = retry or RetryPolicy()
        #: Seconds one attempt at a manifest may take in all (see the module's notes).
        self.metadata_timeout = metadata_timeout
        self._alarms = Alarms(name="oci-alarms")
        self._archives = ArchiveLayers(
            self._registry, f"{uri.location}/{self._repo}", retry=self._retry,
            bounded=self._bounded,
        )  # fmt: skip

    @property
    def uri(self) -> SourceURI:
        return self._uri

    def remember_archives(self, records: Path, is_current: Callable[[RemoteFile], bool]) -> None:
        """Record what archive layers unpack to under ``records`` (``<hex digest>.json``), and
        skip an unchanged layer whose members ``is_current`` says are all published."""
        self._archives.remember(records, is_current)

    def staged_bytes_read(self) -> int:
        return self._archives.bytes_read()

    def write_archive_records(self) -> None:
        self._archives.write_records()

    def pin(self, digest: str) -> None:
        """Read the manifest ``digest`` (a mirror: the digest the origin resolved)."""
        self._uri = replace(self._uri, revision=digest)

    # -- resolve --------------------------------------------------------------------------------

    def fetch_manifest(self, reference: str) -> tuple[bytes, str, str | None]:
        """The bytes of the manifest ``reference`` names, checked against its digest; its digest
        and its Content-Type. Retried per the policy."""
        what = f"{self._uri.location}/{self._repo}: manifest {reference}"
        return call_with_retries(
            lambda: self._bounded(lambda: self._fetch_manifest(reference, what), what),
            self._retry,
            what=what,
        )

    def _bounded(self, fn: Callable[[], T], what: str, extra: float = 0.0) -> T:
        """``fn()`` aborted (TransientSourceError) when ``metadata_timeout + extra`` seconds
        pass, whatever request it waits for then."""
        seconds = self.metadata_timeout + extra
        return call_with_deadline(fn, seconds, what=what, alarms=self._alarms)

    def _fetch_manifest(self, reference: str, what: str) -> tuple[bytes, str, str | None]:
        resp, url = self._registry.get(f"manifests/{reference}", {"Accept": om.ACCEPT}, what)
        if resp.status == 404:
            resp.discard()
            raise RevisionNotFoundError(f"{what}: not found in {redact_url(url)}")
        if resp.status != 200:
            raise self._registry.refusal(resp, url, what)
        try:
            data = resp.read(om.MAX_MANIFEST_BYTES + 1)
        except Exception as exc:
            raise transport_error(exc, what) from exc
        finally:
            resp.discard()
        if len(data) > om.MAX_MANIFEST_BYTES:
            raise InvalidListingError(f"{what}: larger than {om.MAX_MANIFEST_BYTES} bytes")
        stated = (resp.headers.get("Docker-Content-Digest") or "").strip() or None
        if reference.startswith("sha256:"):
            om.check_digest(data, reference, what)
            digest = reference
        else:
            digest = om.digest_of(data)
            if stated is not None and stated != digest:
                raise SourceChangedError(
                    f"{what}: the registry states digest {stated} for a manifest whose bytes "
                    f"hash to {digest} (refused)"
                )
        return data, digest, resp.headers.get("Content-Type")

    def model_manifest(self, reference: str) -> om.ModelManifest:
        """The model manifest ``reference`` names (an index: its one model manifest)."""
        data, digest, content_type = self.fetch_manifest(reference)
        what = f"{self._uri.location}/{self._repo}@{digest}"
        doc = om.parse_document(data, what)
        media = om.document_type(doc, content_type)
        if not om.is_index(media):
            return om.parse_model_manifest(doc, digest, what)
        return self._pick_model(om.index_entries(doc, what), what)

    def _pick_model(self, entries: list[om.IndexEntry], what: str) -> om.ModelManifest:
        """The one model manifest of an index: by ``artifactType`` when entries state one,
        else each image manifest is read and the model ones kept; none or several: an error
        naming what the index holds."""
        typed = [e for e in entries if om.is_model_type(e.artifact_type)]
        candidates = typed or [e for e in entries if not om.is_index(e.media_type)]
        models: list[om.ModelManifest] = []
        for entry in candidates:
            data, digest, _ = self.fetch_manifest(entry.digest)
            doc = om.parse_document(data, f"{what} -> {digest}")
            try:
                models.append(om.parse_model_manifest(doc, digest, f"{what} -> {digest}"))
            except InvalidListingError:
                if typed:
                    raise
        if len(models) == 1:
            return models[0]
        found = ", ".join(e.describe() for e in entries) or "no manifests"
        if not models:
            raise InvalidListingError(f"{what}: an index with no model manifest (it holds {found})")
        raise InvalidListingError(
            f"{what}: an index with {len(models)} model manifests (it holds {found}); "
            "name one by its digest"
        )

    def resolve(self, spec: ModelSpec) -> Snapshot:
        # what pulls killed while staging left (a no-op pull stages nothing, so not only when
        # this one stages)
        oci_tar.reclaim_stale_staging(oci_tar.staging_parent(settings.oci_staging()))
        reference = self._uri.revision or "latest"
        manifest = self.model_manifest(reference)
        return self.snapshot_of(spec, manifest, requested=None)

    def snapshot_of(
        self, spec: ModelSpec, manifest: om.ModelManifest, *, requested: str | None
    ) -> Snapshot:
        # the raw layers' paths first: a bad one refuses the manifest before any archive layer
        # is fetched and unpacked (their members' paths are checked as they are unpacked)
        check_listing(
            [self.remote_file(layer) for layer in manifest.layers if layer.archive is None]
        )
        files = []
        fetched = 0
        for layer in manifest.layers:
            if layer.archive is not None:
                members, unpacked = self._archives.members(layer, spec)
                files += members
                fetched += layer.size if unpacked else 0
            elif spec.wants(layer.path):
                files.append(self.remote_file(layer))
        if not files:
            raise NoMatchingFilesError(
                f"{self._uri}: no layer matches the include/exclude patterns"
                if manifest.layers
                else f"{self._uri}: the manifest has no layers"
            )
        files.sort(key=lambda f: f.path)
        revision = spec.hf_revision or manifest.digest.split(":", 1)[1]
        return Snapshot(
            source=f"oci://{self._uri.location}/{self._repo}@{manifest.digest}",
            revision_id=revision,
            files=tuple(files),
            requested_revision=requested,
            repo_id=spec.repo_id,
            fetched_bytes=fetched,
        )

    @staticmethod
    def remote_file(layer: om.Layer) -> RemoteFile:
        return RemoteFile(
            path=layer.path,
            size=layer.size,
            version=layer.hex,
            checksums=(Checksum("sha256", layer.hex, origin="oci-digest"),),
            locator=layer.digest,
            described=True,
        )

    def describe(self, file: RemoteFile) -> RemoteFile:
        return file  # the manifest has it all: size and digest

    # -- read --------------------------------------------------------------------------------

    def open_range(self, file: RemoteFile, start: int, end: int) -> RangeReader:
        end = min(end, file.size)  # never past the descriptor's size (a 416 otherwise)
        member = self._archives.open_member(file, start, end)
        if member is not None:
            return member
        what = f"{self._uri.location}/{self._repo}/{file.path} bytes {start}-{end - 1}"
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        resp, url = self._registry.get(f"blobs/{file.locator}", headers, what)
        if resp.status not in (200, 206):
            raise self._registry.refusal(resp, url, what)
        h = resp.headers
        stated = (h.get("Docker-Content-Digest") or "").strip()
        if stated and stated != file.locator:
            resp.discard()
            raise SourceChangedError(f"{what}: the registry served blob {stated}")
        length = h.get("Content-Length")
        if resp.status == 200 and not (start == 0 and end == file.size):
            resp.discard()
            raise RangeIgnoredError(
                f"{what}: the server answered 200, not 206 (it ignored the Range header, as "
                "a cold pull-through cache does)"
            )
        if not _whole_blob(resp.status, start, end, file.size, length):
            # the range asked for was not the whole blob: the answer must be exactly it
            try:
                check_range_answer(
                    what, start, end, file.size, resp.status, h.get("Content-Range"), length
                )
            except SourceChangedError:
                resp.discard()
                raise
        return range_body_reader(resp, what, end - start)


def _whole_blob(status: int, start: int, end: int, size: int, length: str | None) -> bool:
    """A 200 answer is the range asked for when that range is the whole blob."""
    return status == 200 and start == 0 and end == size and (length is None or length == str(size))


def open_oci_source(
    spec: ModelSpec,
    *,
    http: HttpClient | None = None,
    pool_size: int = 32,
    retry: RetryPolicy | None = None,
    token_timeout: float = 10.0,
) -> OciSource | OciMirrors:
    """The OciSource for ``spec`` (an ``oci://`` URI), on the shared pool unless given one."""
    from prefetch.support import settings

    client = http or shared_http_pool(
        pool_size,
        settings.proxies(override=spec.proxy),
        ca_certs=settings.ca_bundle(spec.ca_bundle).path,
    )

    def source(uri: SourceURI, namespace: str | None = None) -> OciSource:
        auth = RegistryAuth(uri.location, client, timeout=token_timeout)
        bound = METADATA_TIMEOUT if namespace is None else MIRROR_METADATA_TIMEOUT
        return OciSource(
            uri, http=client, auth=auth, retry=retry, namespace=namespace, metadata_timeout=bound
        )

    origin = source(spec.source)
    if not spec.mirrors:
        return origin
    mirrors = [
        # a mirror's path is a prefix (Harbor's proxy project); its repo is the origin's
        source(replace(m, path="/".join(p for p in (m.path, spec.source.path) if p)),
               namespace=spec.source.location)
        for m in spec.mirrors
    ]  # fmt: skip
    return OciMirrors(origin, mirrors, origin_fallback=spec.hub_fallback)
