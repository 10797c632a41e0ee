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
  (:meth:`OciSource.remember_archives`): at the next resolve an unchanged layer whose members
  are all published is neither fetched nor unpacked (its members come from the record); it is
  fetched again only when one of them must be (then at resolve, or on the engine's first read
  of a member). Bytes fetched at resolve count in the sync's ``bytes_downloaded``.
* Time: each attempt at a manifest (its redirects and token answer included) must end within
  ``metadata_timeout`` (:data:`METADATA_TIMEOUT`; a mirror's :data:`MIRROR_METADATA_TIMEOUT`,
  so a mirror that trickles falls back to the next source as one that fails does), and an
  archive layer unpacked at resolve within that plus its size at :data:`ARCHIVE_FLOOR_RATE`:
  the one deadline mechanism (:func:`prefetch.pipeline.deadline.call_with_deadline`) aborts the
  request in flight, whose socket timeout a byte every few seconds would reset for ever.
* Authentication: :mod:`prefetch.sources.oci.auth` (docker config, helpers, the token flow); a
  401 mid-pull (an expired token) fetches a new token once and sends the request again.

Loopback registries (and hosts in ``PREFETCH_OCI_PLAIN_HTTP``, comma-separated ``host[:port]``:
a Spegel or pull-through mirror on the node) are spoken to over plain HTTP, as docker does for
``localhost``; every other registry over HTTPS.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import shutil
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TypeVar
from urllib.parse import urljoin, urlsplit

import urllib3

from prefetch import __version__
from prefetch.pipeline.deadline import Alarms, call_with_deadline, current_watch
from prefetch.pipeline.retry import RetryPolicy, call_with_retries
from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, SourceURI
from prefetch.sources.base import RangeReader, Source
from prefetch.sources.http.transport import (
    HttpClient,
    Response,
    Sent,
    check_range_answer,
    origin_of,
    range_body_reader,
    redact_url,
    release_small_body,
    send,
    shared_http_pool,
    status_error,
    transport_error,
)
from prefetch.sources.oci import archive as oci_tar
from prefetch.sources.oci import manifest as om
from prefetch.sources.oci.auth import RegistryAuth
from prefetch.support import settings
from prefetch.support.errors import (
    InsufficientSpaceError,
    InvalidListingError,
    NoMatchingFilesError,
    RangeIgnoredError,
    RevisionNotFoundError,
    SourceChangedError,
    SourceError,
)
from prefetch.support.paths import check_listing
from prefetch.support.redact import redact
from prefetch.support.safejson import load_json
from prefetch.support.units import format_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")

USER_AGENT = f"model-prefetch/{__version__}"
PLAIN_HTTP_ENV = "PREFETCH_OCI_PLAIN_HTTP"
#: Docker Hub's names: its API is at registry-1.docker.io, its official images under library/.
DOCKER_HUB = ("docker.io", "index.docker.io", "registry-1.docker.io")
#: Where archive layers are unpacked before they are published (default: the temp folder).
STAGING_ENV = "PREFETCH_OCI_STAGING"
_REDIRECTS = (301, 302, 303, 307, 308)
#: Seconds one attempt at a manifest may take in all (as the Hub's and S3's metadata calls).
METADATA_TIMEOUT = 120.0
#: The same for a registry mirror (on the node or near it: it answers in well under a second,
#: or the next source is asked).
MIRROR_METADATA_TIMEOUT = 20.0
#: An archive layer may unpack to this many times its size (at least UNPACK_FLOOR bytes): more
#: is a decompression bomb, refused. Real archives (tokenizers, configs, code) compress 3-10x.
UNPACK_RATIO = 64
UNPACK_FLOOR = 1 << 20
#: Free space the staging folder keeps: the archives of one sync, staged together, may fill
#: its file system up to this much (the published copies need room too).
STAGING_RESERVE = 256 << 20
#: An archive layer unpacked at resolve may take ``metadata_timeout`` plus its size at this
#: rate (bytes/s): a quarter of the agent's syncDeadline floor, far below any healthy link.
ARCHIVE_FLOOR_RATE = 1 << 20
_MAX_REDIRECTS = 5


def registry_base(registry: str, plain_http: tuple[str, ...] = ()) -> str:
    """``http://`` for a loopback host or one listed in ``plain_http`` (or the environment's
    ``PREFETCH_OCI_PLAIN_HTTP``), else ``https://``; then the host."""
    if registry in DOCKER_HUB:
        return "https://registry-1.docker.io"
    listed = set(settings.oci_plain_http()) | set(plain_http)
    host = urlsplit(f"//{registry}").hostname or ""
    loopback = host == "localhost"
    with contextlib.suppress(ValueError):
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    plain = loopback or registry in listed or host in listed
    return f"{'http' if plain else 'https'}://{registry}"


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
        hub_official = uri.location in DOCKER_HUB and "/" not in uri.path
        self._repo = f"library/{uri.path}" if hub_official else uri.path
        #: a mirror's ``?ns=<origin registry>`` (what containerd sends a mirror: Spegel needs it)
        self._query = f"?ns={namespace}" if namespace else ""
        self._base = registry_base(uri.location, plain_http)
        self._origin = origin_of(self._base)
        self._http = http
        self._auth = auth or RegistryAuth(uri.location, http)
        self._retry = retry or RetryPolicy()
        self._timeout = timeout or urllib3.Timeout(connect=10.0, read=60.0)
        self._scope = f"repository:{self._repo}:pull"
        self._lock = threading.Lock()
        self._staging: Path | None = None
        self._staged: dict[str, list[oci_tar.StagedMember]] = {}
        self._local: dict[str, Path] = {}
        self._layers: dict[str, om.Layer] = {}  # archive layers by hex digest
        self._records: Path | None = None
        self._is_current: Callable[[RemoteFile], bool] | None = None
        self._pending: list[tuple[om.Layer, list[oci_tar.StagedMember]]] = []
        self._staged_read = 0
        #: Seconds one attempt at a manifest may take in all (see the module's notes).
        self.metadata_timeout = metadata_timeout
        self._alarms = Alarms(name="oci-alarms")

    @property
    def uri(self) -> SourceURI:
        return self._uri

    def remember_archives(self, records: Path, is_current: Callable[[RemoteFile], bool]) -> None:
        """Record what archive layers unpack to under ``records`` (``<hex digest>.json``), and
        skip an unchanged layer whose members ``is_current`` says are all published."""
        self._records = records
        self._is_current = is_current

    def staged_bytes_read(self) -> int:
        with self._lock:
            return self._staged_read

    def _count_staged(self, n: int) -> None:
        with self._lock:
            self._staged_read += n

    def write_archive_records(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for layer, staged in pending:
            self._write_record(layer, staged)

    def pin(self, digest: str) -> None:
        """Read the manifest ``digest`` (a mirror: the digest the origin resolved)."""
        self._uri = replace(self._uri, revision=digest)

    # -- requests --------------------------------------------------------------------------------

    def _send(self, url: str, headers: Mapping[str, str], what: str) -> Sent:
        """GET ``url`` on the seam (no redirects followed), the registry's authorization sent
        only to its own origin; a 401 there is answered (token or login) once and the request
        sent again (an expired token mid-pull)."""
        for attempt in (1, 2):
            auth = self._auth.header(self._scope)
            try:
                answer = send(
                    self._http, "GET", url, headers={**headers, "User-Agent": USER_AGENT},
                    timeout=self._timeout,
                    credentials={"Authorization": auth} if auth is not None else None,
                    credentials_origin=self._base,
                )  # fmt: skip
            except Exception as exc:
                raise transport_error(exc, what) from exc
            if answer.status == 401 and origin_of(url) == self._origin and attempt == 1:
                challenge = answer.headers.get("WWW-Authenticate")
                release_small_body(answer.raw)
                self._auth.forget(self._scope)
                self._auth.answer(challenge, self._scope, what)
                continue
            return answer
        raise AssertionError("unreachable")

    def _get(self, path: str, headers: Mapping[str, str], what: str) -> tuple[Sent, str]:
        """GET ``/v2/<repo>/<path>``, following redirects (the headers sent again, the
        authorization only to the registry); the answer and the URL that gave it."""
        url = f"{self._base}/v2/{self._repo}/{path}{self._query}"
        for _ in range(_MAX_REDIRECTS + 1):
            resp = self._send(url, headers, what)
            if resp.status not in _REDIRECTS:
                return resp, url
            location = resp.headers.get("Location")
            release_small_body(resp.raw)
            if not location:
                raise SourceError(f"{what}: a redirect without a Location from {redact_url(url)}")
            target = urljoin(url, str(location))
            if urlsplit(target).scheme not in ("http", "https"):
                raise SourceError(f"{what}: a redirect to {redact_url(target)}")
            url = target
        raise SourceError(f"{what}: more than {_MAX_REDIRECTS} redirects")

    def _refusal(self, resp: Response, url: str, what: str) -> SourceError:
        status = resp.status
        detail = _error_detail(resp)
        resp.discard()
        return status_error(
            status, f"{what}: HTTP {status} from {redact_url(url)}{detail}",
            retry_after=resp.headers.get("Retry-After"),
        )  # fmt: skip

    # -- resolve ---------------------------------------------------------------------------------

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
        resp, url = self._get(f"manifests/{reference}", {"Accept": om.ACCEPT}, what)
        if resp.status == 404:
            resp.discard()
            raise RevisionNotFoundError(f"{what}: not found in {redact_url(url)}")
        if resp.status != 200:
            raise self._refusal(resp, url, what)
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
                members, unpacked = self._archive_members(layer, spec)
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

    # -- archive layers --------------------------------------------------------------------------

    def _archive_members(self, layer: om.Layer, spec: ModelSpec) -> tuple[list[RemoteFile], bool]:
        """The members of an archive layer that ``spec`` wants, and whether the layer was
        fetched for them now: from its record when they are all published already."""
        with self._lock:
            self._layers[layer.hex] = layer
        recorded = self._recorded(layer)
        if recorded is not None and self._is_current is not None:
            files = [self._member_file(layer, *m) for m in recorded if spec.wants(m[0])]
            if all(self._is_current(f) for f in files):
                return files, False
        staged, unpacked = self._stage(layer)
        wanted = [m for m in staged if spec.wants(m.path)]
        return [self._member_file(layer, m.path, m.size, m.sha256) for m in wanted], unpacked

    def _recorded(self, layer: om.Layer) -> list[tuple[str, int, str]] | None:
        """The members the layer's record lists, or None (no record, or one not to trust)."""
        if self._records is None:
            return None
        path = self._records / f"{layer.hex}.json"
        try:
            data = path.read_bytes()
            doc = load_json(data, where=str(path), max_bytes=_MAX_RECORD_BYTES)
            return _record_members(doc, layer, str(path))
        except (OSError, SourceError, ValueError):
            return None  # unpacked again, and recorded anew

    def _write_record(self, layer: om.Layer, staged: list[oci_tar.StagedMember]) -> None:
        if self._records is None:
            return
        doc = {
            "digest": layer.digest,
            "members": [{"path": m.path, "size": m.size, "sha256": m.sha256} for m in staged],
        }
        target = self._records / f"{layer.hex}.json"
        try:
            self._records.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}")
            partial.write_text(json.dumps(doc))
            os.replace(partial, target)
        except OSError as exc:  # the next resolve unpacks it again: slower, never wrong
            log.debug("cannot record %s: %s", target, exc)

    def _stage(self, layer: om.Layer) -> tuple[list[oci_tar.StagedMember], bool]:
        """An archive layer's members, unpacked under the staging folder (once per source:
        a later resolve of the same layer reuses them), and whether it was unpacked now."""
        with self._lock:
            staged = self._staged.get(layer.digest)
            if staged is not None:
                return staged, False
            root = self._staging_root() / layer.hex
            oci_tar.remove_staging(root)
            what = f"{self._uri.location}/{self._repo}: layer {layer.path}"
            limit = _unpack_limit(layer, root.parent, what)  # before any byte is fetched
            root.mkdir(parents=True)
            try:
                staged = call_with_retries(
                    lambda: self._bounded(
                        lambda: self._unpack(layer, root, what, limit), what,
                        extra=layer.size / ARCHIVE_FLOOR_RATE,
                    ),
                    self._retry,
                    what=what,
                )  # fmt: skip
            except BaseException:
                oci_tar.remove_staging(root)
                raise
            self._staged[layer.digest] = staged
            for member in staged:
                self._local[f"tar:{layer.hex}/{member.path}"] = member.staged
            self._pending.append((layer, staged))  # written by write_archive_records()
            return staged, True

    def _unpack(
        self, layer: om.Layer, root: Path, what: str, limit: tuple[int, str]
    ) -> list[oci_tar.StagedMember]:
        for child in list(root.iterdir()):  # what a failed attempt left
            if child.is_dir():
                oci_tar.remove_staging(child)
            else:
                child.unlink()
        resp, url = self._get(f"blobs/{layer.digest}", {"Accept-Encoding": "identity"}, what)
        if resp.status != 200:
            raise self._refusal(resp, url, what)
        stated = (resp.headers.get("Docker-Content-Digest") or "").strip()
        if stated and stated != layer.digest:
            resp.discard()
            raise SourceChangedError(f"{what}: the registry served blob {stated}")
        try:
            return oci_tar.unpack_layer(
                _Counted(resp.raw), kind=layer.archive or "tar", size=layer.size,
                digest_hex=layer.hex, staging=root, what=what,
                max_unpacked=limit[0], limit_reason=limit[1],
            )  # fmt: skip
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise transport_error(exc, what) from exc
        finally:
            resp.discard()

    def _staging_root(self) -> Path:
        if self._staging is None:
            self._staging, owner = oci_tar.new_staging(settings.oci_staging())
            weakref.finalize(self, oci_tar.release_staging, self._staging, owner)
        return self._staging

    @staticmethod
    def _member_file(layer: om.Layer, path: str, size: int, sha256: str) -> RemoteFile:
        return RemoteFile(
            path=path,
            size=size,
            version=sha256,
            checksums=(Checksum("sha256", sha256, origin="oci-archive"),),
            locator=f"tar:{layer.hex}/{path}",
            described=True,
        )

    def _staged_member(self, file: RemoteFile) -> Path:
        """Where the member ``file`` is staged: its layer unpacked now when the resolve took
        it from the record (a member published before is missing or changed on disk)."""
        layer = self._layers.get(file.locator[4:].split("/", 1)[0])
        if layer is None:
            raise SourceError(f"{file.path}: not a member of any layer of this manifest")
        self._stage(layer)
        self.write_archive_records()  # after the resolve: the state folder is there
        staged = self._local.get(file.locator)
        if staged is None:
            raise SourceChangedError(f"{file.path}: layer {layer.digest} does not hold it")
        return staged

    # -- read ------------------------------------------------------------------------------------

    def open_range(self, file: RemoteFile, start: int, end: int) -> RangeReader:
        end = min(end, file.size)  # never past the descriptor's size (a 416 otherwise)
        staged = self._local.get(file.locator)
        if staged is None and file.locator.startswith("tar:"):
            staged = self._staged_member(file)
        if staged is not None:
            return oci_tar.StagedReader(staged, start, end, self._count_staged)
        what = f"{self._uri.location}/{self._repo}/{file.path} bytes {start}-{end - 1}"
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        resp, url = self._get(f"blobs/{file.locator}", headers, what)
        if resp.status not in (200, 206):
            raise self._refusal(resp, url, what)
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


def _unpack_limit(layer: om.Layer, staging: Path, what: str) -> tuple[int, str]:
    """The bytes ``layer`` may unpack to under ``staging`` and why that many: its size times
    :data:`UNPACK_RATIO` (a decompression bomb beyond), or the staging folder's free space
    less :data:`STAGING_RESERVE` when smaller (measured now, so the layers staged before count:
    staging is bounded in total). InsufficientSpaceError when not even the layer's own size
    fits."""
    allowed = max(UNPACK_RATIO * layer.size, UNPACK_FLOOR)
    free = shutil.disk_usage(staging).free - STAGING_RESERVE
    if free < layer.size:
        raise InsufficientSpaceError(
            f"{what}: the staging folder {staging} has {format_bytes(max(free, 0))} free "
            f"(keeping {format_bytes(STAGING_RESERVE)}), less than the layer's "
            f"{format_bytes(layer.size)}",
            hint=f"free space there, or set {STAGING_ENV} to a larger file system",
        )
    if free < allowed:
        return free, f"the free space of the staging folder {staging}"
    return allowed, f"{UNPACK_RATIO}x the layer's size of {layer.size} bytes"


#: A layer's record lists its members (path, size, sha256): ~150 bytes each.
_MAX_RECORD_BYTES = 64 << 20
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _record_members(doc: object, layer: om.Layer, where: str) -> list[tuple[str, int, str]]:
    """The members a layer's record lists; ValueError for a record not of that layer."""
    if not isinstance(doc, dict) or doc.get("digest") != layer.digest:
        raise ValueError(f"{where}: not the record of {layer.digest}")
    members = doc.get("members")
    if not isinstance(members, list):
        raise ValueError(f"{where}: no members")
    out = []
    for m in members:
        path, size, sha = (
            (m.get(k) for k in ("path", "size", "sha256"))
            if isinstance(m, dict)
            else (None, None, None)
        )
        if not (isinstance(path, str) and isinstance(size, int) and size >= 0):
            raise ValueError(f"{where}: a member without a path and size")
        if not (isinstance(sha, str) and _SHA256_HEX.fullmatch(sha)):
            raise ValueError(f"{where}: a member without a sha256")
        out.append((oci_tar.member_path(path, where), size, sha))
    return out


class _Counted:
    """A blob's body whose bytes count as received by the operation watching this thread (the
    engine's stall rule sees an archive unpacked for a read make progress)."""

    def __init__(self, body: oci_tar.Readable) -> None:
        self._body = body
        self._watch = current_watch()

    def read(self, n: int = -1, /) -> bytes:
        data = self._body.read(n)
        if self._watch is not None:
            self._watch.received += len(data)
        return data


def _whole_blob(status: int, start: int, end: int, size: int, length: str | None) -> bool:
    """A 200 answer is the range asked for when that range is the whole blob."""
    return status == 200 and start == 0 and end == size and (length is None or length == str(size))


def _error_detail(resp: Response) -> str:
    """The registry's own error code (``{"errors":[{"code":"DENIED",...}]}``), if any."""
    try:
        body = resp.read(16 * 1024)
    except Exception:
        return ""
    try:
        errors = json.loads(body).get("errors")
        codes = [str(e.get("code")) for e in errors if isinstance(e, dict)][:3]
    except (ValueError, AttributeError, TypeError):
        return ""
    return f" ({', '.join(codes)})" if codes else ""


class OciMirrors:
    """An ``oci://`` model with registry mirrors: the manifest digest comes from the origin
    (the URI's own digest, or its tag resolved there, once), then each mirror is asked for that
    digest in order and the origin last (:class:`~prefetch.sources.ordered.OrderedSource`'s
    fallback rule). A mirror serves only bytes that hash to the origin's digests, so it cannot
    change what is published; with a tag and the origin down nothing can be pulled (pin the
    digest to pull through a mirror alone).

    Blobs are content-addressed, so each may come from any of them: a blob the source that
    served the manifest lacks (a Spegel peer set, a cache filled partly) or cannot serve now is
    read from the next one in order, and that answer is remembered for the rest of the sync.

    A mirror that answers a range of a blob with ``200`` and the whole blob (a pull-through
    cache that does not hold it yet: distribution with ``proxy: remoteurl``) lacks it for this
    sync: the blob is read from the next source. Taking the whole body instead would move the
    whole blob once per chunk (quadratic in the chunks of a large layer) or serialise the
    layer into one stream without resume; the cache fills itself from that request anyway,
    so the next pull reads the blob from it."""

    def __init__(
        self, origin: OciSource, mirrors: list[OciSource], *, origin_fallback: bool = True
    ) -> None:
        from prefetch.sources.ordered import OrderedSource

        self._origin = origin
        candidates: list[tuple[str, Source]] = [(str(m.uri), m) for m in mirrors]
        if origin_fallback:
            candidates.append((str(origin.uri), origin))
        self._ordered = OrderedSource(candidates)
        self._sources = [*mirrors, *([origin] if origin_fallback else [])]
        self._first = 0  # the source that served the manifest
        self._lacking: set[tuple[int, str]] = set()  # (source, blob) that failed
        self._lock = threading.Lock()

    def remember_archives(self, records: Path, is_current: Callable[[RemoteFile], bool]) -> None:
        for source in self._sources:
            source.remember_archives(records, is_current)

    def write_archive_records(self) -> None:
        for source in self._sources:
            source.write_archive_records()

    def staged_bytes_read(self) -> int:
        return sum(source.staged_bytes_read() for source in self._sources)

    def resolve(self, spec: ModelSpec) -> Snapshot:
        reference = self._origin.uri.revision or "latest"
        if not reference.startswith("sha256:"):
            _, reference, _ = self._origin.fetch_manifest(reference)
        for source in self._sources:
            source.pin(reference)
        snapshot = self._ordered.resolve(spec)
        for i, source in enumerate(self._sources):
            if snapshot.source.startswith(f"oci://{source.uri.location}/{source.uri.path}@"):
                self._first = i
        return snapshot

    def describe(self, file: RemoteFile) -> RemoteFile:
        return file

    def open_range(self, file: RemoteFile, start: int, end: int) -> RangeReader:
        if not file.locator.startswith("sha256:"):  # an archive member, staged by its reader
            return self._ordered.open_range(file, start, end)
        from prefetch.sources.ordered import FALLBACK_ERRORS

        failure: SourceError | None = None
        for i in range(self._first, len(self._sources)):
            with self._lock:
                if (i, file.locator) in self._lacking:
                    continue
            try:
                return self._sources[i].open_range(file, start, end)
            except SourceError as exc:
                if not isinstance(exc, (*FALLBACK_ERRORS, RangeIgnoredError)):
                    raise
                failure = exc
                with self._lock:
                    self._lacking.add((i, file.locator))
                if i + 1 < len(self._sources):
                    log.warning(
                        "%s: %s cannot serve it (%s); reading it from %s", file.path,
                        self._sources[i].uri, redact(str(exc)), self._sources[i + 1].uri,
                    )  # fmt: skip
        if failure is None:  # every source failed this blob earlier in the sync
            with self._lock:
                self._lacking.clear()
            return self._sources[self._first].open_range(file, start, end)
        raise failure


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
