"""Archive layers (``tar``, ``tar+gzip``, ``tar+zstd``) of an OCI model: staged, recorded, read.

An archive layer is streamed once at resolve, checked against its digest and unpacked safely
(:mod:`prefetch.sources.oci.archive`) into a staging folder (``PREFETCH_OCI_STAGING``, else the temp
folder); its members are then files of the snapshot, each with the sha256 taken as it was
unpacked, copied into place by the engine. What a layer unpacked to is recorded by its digest in
the destination's state (:meth:`ArchiveLayers.remember`): at the next resolve an unchanged layer
whose members are all published is neither fetched nor unpacked (its members come from the
record); it is fetched again only when one of them must be (then at resolve, or on the engine's
first read of a member). Unpacking is bounded: :data:`UNPACK_RATIO` times the layer's size (a
decompression bomb beyond) and the staging folder's free space less :data:`STAGING_RESERVE`;
in time, ``metadata_timeout`` plus its size at :data:`ARCHIVE_FLOOR_RATE`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import urllib3

from prefetch.pipeline.deadline import current_watch
from prefetch.pipeline.retry import RetryPolicy, call_with_retries
from prefetch.pipeline.snapshot import Checksum, RemoteFile
from prefetch.pipeline.spec import ModelSpec
from prefetch.sources.http.transport import transport_error
from prefetch.sources.oci import archive as oci_tar
from prefetch.sources.oci import manifest as om
from prefetch.sources.oci.registry import RegistryRepository
from prefetch.support import settings
from prefetch.support.errors import InsufficientSpaceError, SourceChangedError, SourceError
from prefetch.support.safejson import load_json
from prefetch.support.units import format_bytes

log = logging.getLogger("prefetch.sources.oci")  # the OCI source's log, as before the split
T = TypeVar("T")

#: Where archive layers are unpacked before they are published (default: the temp folder).
STAGING_ENV = "PREFETCH_OCI_STAGING"
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


class Bounded(Protocol):
    """``fn()`` aborted when ``metadata_timeout + extra`` seconds pass (the source's deadline)."""

    def __call__(self, fn: Callable[[], T], what: str, extra: float = 0.0) -> T: ...


class ArchiveLayers:
    """The archive layers of one source's manifests: ``registry`` serves their blobs, ``where``
    names the repository in messages, ``bounded`` bounds each attempt at one in time."""

    def __init__(
        self, registry: RegistryRepository, where: str, *, retry: RetryPolicy, bounded: Bounded
    ) -> None:
        self._registry = registry
        self._where = where
        self._retry = retry
        self._bounded = bounded
        self._lock = threading.Lock()
        self._staging: Path | None = None
        self._staged: dict[str, list[oci_tar.StagedMember]] = {}
        self._local: dict[str, Path] = {}
        self._layers: dict[str, om.Layer] = {}  # archive layers by hex digest
        self._records: Path | None = None
        self._is_current: Callable[[RemoteFile], bool] | None = None
        self._pending: list[tuple[om.Layer, list[oci_tar.StagedMember]]] = []
        self._staged_read = 0

    def open_member(self, file: RemoteFile, start: int, end: int) -> oci_tar.StagedReader | None:
        """A reader of ``file`` when it is a staged member (its layer unpacked now when the
        resolve took it from the record); None for a blob the registry serves."""
        staged = self._local.get(file.locator)
        if staged is None and file.locator.startswith("tar:"):
            staged = self._staged_member(file)
        if staged is None:
            return None
        return oci_tar.StagedReader(staged, start, end, self._count)

    def remember(self, records: Path, is_current: Callable[[RemoteFile], bool]) -> None:
        """Record what archive layers unpack to under ``records`` (``<hex digest>.json``), and
        skip an unchanged layer whose members ``is_current`` says are all published."""
        self._records = records
        self._is_current = is_current

    def bytes_read(self) -> int:
        with self._lock:
            return self._staged_read

    def _count(self, n: int) -> None:
        with self._lock:
            self._staged_read += n

    def write_records(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for layer, staged in pending:
            self._write_record(layer, staged)

    def members(self, layer: om.Layer, spec: ModelSpec) -> tuple[list[RemoteFile], bool]:
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
            what = f"{self._where}: layer {layer.path}"
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
        resp, url = self._registry.get(
            f"blobs/{layer.digest}", {"Accept-Encoding": "identity"}, what
        )
        if resp.status != 200:
            raise self._registry.refusal(resp, url, what)
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
        self.write_records()  # after the resolve: the state folder is there
        staged = self._local.get(file.locator)
        if staged is None:
            raise SourceChangedError(f"{file.path}: layer {layer.digest} does not hold it")
        return staged


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
