"""``prefetch mirror SRC oci://registry/repo:tag``: a model into an OCI registry.

* From the Hub (``hf://org/name[@rev]``): a ModelPack artifact, one raw layer per file (its path
  in ``org.cncf.model.filepath``, its media type by what the file is: weights, their config,
  docs, code), a ModelPack config whose ``modelfs.diffIds`` are the layers' digests, and the
  Hub commit in the manifest's annotations. Each file is read from the Hub by ranges, checked
  against the Hub's id (sha256 or git blob sha1) as it streams, and uploaded in chunks (POST,
  PATCH, PUT with the digest): a file whose bytes do not match is never committed. A blob the
  registry already has (HEAD by the Hub's sha256) is not sent again; a small file the Hub
  knows only by its git blob id (not in LFS) is read and hashed first for that HEAD (up to
  :data:`HASH_FIRST` bytes: the Hub keeps larger files in LFS), so a second run uploads nothing
  already there.
* From a registry (``oci://...``): a copy by digest: the model manifest's bytes as they are (its
  digest stays), its config and layers copied blob by blob, each checked against its digest.

Blobs are pushed in parallel (``concurrency``), the manifest last, so a tag never names a
manifest whose blobs are missing.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin

import urllib3

from prefetch.pipeline.progress import NullProgress, ProgressSink
from prefetch.pipeline.retry import RetryPolicy, call_with_retries
from prefetch.pipeline.snapshot import RemoteFile, Snapshot
from prefetch.pipeline.spec import SourceURI
from prefetch.pipeline.verify import encode, new_hasher, normalize
from prefetch.publish.s3_mirror.run import MirrorResult
from prefetch.sources.base import Source
from prefetch.sources.http.transport import (
    HttpClient,
    discard,
    origin_of,
    redact_url,
    release_small_body,
    status_error,
    transport_error,
)
from prefetch.sources.oci.auth import RegistryAuth
from prefetch.sources.oci.manifest import OCI_MANIFEST
from prefetch.sources.oci.source import USER_AGENT, OciSource, registry_base
from prefetch.support.errors import ChecksumMismatchError, ConfigError, SourceError

ARTIFACT_TYPE = "application/vnd.cncf.model.manifest.v1+json"
CONFIG_TYPE = "application/vnd.cncf.model.config.v1+json"
WEIGHT = "application/vnd.cncf.model.weight.v1.raw"
WEIGHT_CONFIG = "application/vnd.cncf.model.weight.config.v1.raw"
DOC = "application/vnd.cncf.model.doc.v1.raw"
CODE = "application/vnd.cncf.model.code.v1.raw"
FILEPATH = "org.cncf.model.filepath"
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".h5", ".msgpack", ".ckpt")
_DOCS = (".md", ".txt", ".rst", ".pdf")
_CODE = (".py", ".sh", ".ipynb", ".jinja")
_DOC_NAMES = ("license", "notice", "readme", "copying")
#: Bytes per PATCH of an upload (and per ranged read of the source).
PIECE = 16 * 1024 * 1024
#: A file without a sha256 (git-tracked, not LFS) up to this size is read and hashed before it
#: is uploaded, to ask the registry for it by digest first; held in memory meanwhile.
HASH_FIRST = 16 * 1024 * 1024


def layer_media_type(path: str) -> str:
    """The ModelPack media type of a file, by its name."""
    name = posixpath.basename(path).lower()
    if name.endswith(_WEIGHTS):
        return WEIGHT
    if name.startswith(_DOC_NAMES) or name.endswith(_DOCS):
        return DOC
    if name.endswith(_CODE):
        return CODE
    return WEIGHT_CONFIG  # config.json, tokenizer files, generation_config.json, ...


class RegistryWriter:
    """Pushes blobs and manifests to one repository (``repository:<repo>:pull,push``)."""

    def __init__(
        self, uri: SourceURI, http: HttpClient, *, retry: RetryPolicy, auth: RegistryAuth | None
    ) -> None:
        self.uri = uri
        self._repo = uri.path
        self._base = registry_base(uri.location)
        self._http = http
        self._retry = retry
        self._auth = auth or RegistryAuth(uri.location, http)
        self._scope = f"repository:{self._repo}:pull,push"
        self._timeout = urllib3.Timeout(connect=10.0, read=120.0)

    def _request(
        self, method: str, url: str, what: str, *, headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
    ) -> Any:  # fmt: skip
        for attempt in (1, 2):
            sent = {"User-Agent": USER_AGENT, **(headers or {})}
            own = origin_of(url) == origin_of(self._base)
            auth = self._auth.header(self._scope) if own else None
            if auth is not None:  # never to another host (an upload Location may be one)
                sent["Authorization"] = auth
            try:
                resp = self._http.request(
                    method, url, headers=sent, body=body, redirect=False, retries=False,
                    preload_content=False, timeout=self._timeout,
                )  # fmt: skip
            except Exception as exc:
                raise transport_error(exc, what) from exc
            if resp.status == 401 and own and attempt == 1:
                challenge = resp.headers.get("WWW-Authenticate")
                release_small_body(resp)
                self._auth.forget(self._scope)
                self._auth.answer(challenge, self._scope, what)
                continue
            return resp
        raise AssertionError("unreachable")

    def _expect(self, resp: Any, statuses: tuple[int, ...], url: str, what: str) -> Any:
        if resp.status in statuses:
            return resp
        detail = resp.read(2048).decode("utf-8", "replace").strip()[:300]
        discard(resp)
        raise status_error(
            resp.status, f"{what}: HTTP {resp.status} from {redact_url(url)}: {detail}",
            retry_after=resp.headers.get("Retry-After"),
        )  # fmt: skip

    def has_blob(self, digest: str, size: int) -> bool:
        url = f"{self._base}/v2/{self._repo}/blobs/{digest}"
        what = f"{self.uri.location}/{self._repo}: blob {digest[:19]}"
        resp = self._request("HEAD", url, what)
        discard(resp)
        if resp.status == 404:
            return False
        self._expect(resp, (200,), url, what)
        return str(resp.headers.get("Content-Length", "")) == str(size)

    def upload(self, pieces: Iterator[bytes], finish: Callable[[], str], what: str) -> int:
        """One blob upload: POST, a PATCH per piece, PUT with the digest ``finish`` gives once
        every piece was sent (it raises when the bytes were not what the source promised:
        the upload is then never committed). Returns the bytes sent."""
        url = f"{self._base}/v2/{self._repo}/blobs/uploads/"
        resp = self._expect(self._request("POST", url, what), (202,), url, what)
        discard(resp)
        location = self._location(resp, url, what)
        offset = 0
        for piece in pieces:
            headers = {
                "Content-Type": "application/octet-stream",
                "Content-Range": f"{offset}-{offset + len(piece) - 1}",
                "Content-Length": str(len(piece)),
            }
            resp = self._request("PATCH", location, what, headers=headers, body=piece)
            self._expect(resp, (202,), location, what)
            discard(resp)
            location = self._location(resp, location, what)
            offset += len(piece)
        digest = finish()
        sep = "&" if "?" in location else "?"
        target = f"{location}{sep}digest={digest}"
        resp = self._request("PUT", target, what, headers={"Content-Length": "0"}, body=b"")
        self._expect(resp, (201,), location, what)
        discard(resp)
        return offset

    def _location(self, resp: Any, url: str, what: str) -> str:
        location = resp.headers.get("Location")
        if not location:
            raise SourceError(f"{what}: an upload answer without a Location")
        return urljoin(url, str(location))

    def put_manifest(self, reference: str, body: bytes, media_type: str) -> str:
        url = f"{self._base}/v2/{self._repo}/manifests/{reference}"
        what = f"{self.uri.location}/{self._repo}: manifest {reference}"
        resp = self._request("PUT", url, what, headers={"Content-Type": media_type}, body=body)
        self._expect(resp, (201,), url, what)
        discard(resp)
        return "sha256:" + hashlib.sha256(body).hexdigest()


@dataclass
class _Blob:
    """One blob to push: read from ``source`` as ``file`` (its bytes checked against the file's
    checksum as they stream); ``digest`` when known up front (a Hub LFS sha256, a layer)."""

    file: RemoteFile
    digest: str | None


def _pieces(source: Source, file: RemoteFile, sink: Callable[[bytes], None]) -> Iterator[bytes]:
    """``file``'s bytes from ``source`` in pieces, each passed to ``sink`` before it is sent."""
    for start in range(0, file.size, PIECE):
        end = min(start + PIECE, file.size)
        buf = bytearray(end - start)
        view = memoryview(buf)
        reader = source.open_range(file, start, end)
        try:
            got = 0
            while got < len(buf):
                n = reader.readinto(view[got:])
                if n <= 0:
                    raise SourceError(f"{file.path}: the source ended early")
                got += n
        finally:
            reader.close()
        sink(bytes(buf))
        yield bytes(buf)


class Pusher:
    def __init__(
        self, writer: RegistryWriter, *, retry: RetryPolicy, concurrency: int,
        progress: ProgressSink, result: MirrorResult,
    ) -> None:  # fmt: skip
        self.writer = writer
        self.retry = retry
        self.concurrency = concurrency
        self.progress = progress
        self.result = result
        self._lock = threading.Lock()

    def push_all(self, source: Source, blobs: list[_Blob]) -> list[str]:
        """Every blob pushed (or found there); their digests, in order."""
        with ThreadPoolExecutor(max(1, self.concurrency), thread_name_prefix="oci-push") as pool:
            return list(pool.map(lambda b: self._push(source, b), blobs))

    def _push(self, source: Source, blob: _Blob) -> str:
        file = blob.file
        what = f"{self.writer.uri.location}/{self.writer.uri.path}: {file.path}"
        if blob.digest is None and file.size <= HASH_FIRST:
            data = call_with_retries(lambda: _read_checked(source, file), self.retry, what=what)
            blob = _Blob(file, "sha256:" + hashlib.sha256(data).hexdigest())
            source = _BytesFile(data)
        if blob.digest is not None and self.writer.has_blob(blob.digest, file.size):
            with self._lock:
                self.result.blobs_skipped += 1
                self.result.bytes_skipped += file.size
            self.progress.advance(file.size)
            return blob.digest

        def attempt() -> str:
            sha = hashlib.sha256()
            check = file.checksum
            algorithm = check.algorithm if check is not None else "sha256"
            promised = new_hasher(algorithm, size=file.size)

            def sink(piece: bytes) -> None:
                sha.update(piece)
                promised.update(piece)
                self.progress.advance(len(piece))

            def finish() -> str:
                digest = "sha256:" + sha.hexdigest()
                encoding = check.encoding if check is not None else "hex"
                actual = encode(promised.digest(), encoding)
                if check is not None and actual != normalize(check.value, encoding):
                    raise ChecksumMismatchError(file.path, algorithm, check.value, actual)
                if blob.digest is not None and digest != blob.digest:
                    raise ChecksumMismatchError(file.path, "sha256", blob.digest, digest)
                return digest

            self.writer.upload(_pieces(source, file, sink), finish, what)
            return finish()

        digest = call_with_retries(attempt, self.retry, what=what)
        with self._lock:
            self.result.blobs_uploaded += 1
            self.result.bytes_uploaded += file.size
        return digest


def _read_checked(source: Source, file: RemoteFile) -> bytes:
    """``file``'s bytes, checked against the checksum the source gives (ChecksumMismatchError)."""
    check = file.checksum
    hasher = new_hasher(check.algorithm, size=file.size) if check is not None else None
    data = b"".join(_pieces(source, file, hasher.update if hasher else lambda piece: None))
    if check is not None and hasher is not None:
        actual = encode(hasher.digest(), check.encoding)
        if actual != normalize(check.value, check.encoding):
            raise ChecksumMismatchError(file.path, check.algorithm, check.value, actual)
    return data


def modelpack_manifest(
    snapshot: Snapshot, digests: list[str], config_digest: str, config: bytes
) -> bytes:
    layers = [
        {"mediaType": layer_media_type(f.path), "digest": d, "size": f.size,
         "annotations": {FILEPATH: f.path}}
        for f, d in zip(snapshot.files, digests, strict=True)
    ]  # fmt: skip
    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": len(config)},
        "layers": layers,
        "annotations": {
            "org.opencontainers.image.source": snapshot.source,
            "org.opencontainers.image.revision": snapshot.revision_id,
        },
    }
    return json.dumps(doc, indent=2, sort_keys=True).encode()


def modelpack_config(snapshot: Snapshot, digests: list[str]) -> bytes:
    """The ModelPack config of a Hub commit: no timestamp, so the same commit pushed twice is
    the same manifest digest."""
    doc = {
        "descriptor": {
            "name": snapshot.repo_id or snapshot.source,
            "sourceURL": snapshot.source,
            "revision": snapshot.revision_id,
        },
        "config": {},
        "modelfs": {"type": "layers", "diffIds": digests},
    }
    return json.dumps(doc, sort_keys=True).encode()


class _BytesFile:
    """A small blob held in memory, read like a source (the config)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def resolve(self, spec: Any) -> Snapshot:
        raise NotImplementedError

    def describe(self, file: RemoteFile) -> RemoteFile:
        return file

    def open_range(self, file: RemoteFile, start: int, end: int) -> Any:
        import io

        return io.BytesIO(self.data[start:end])


def push_snapshot(source: Source, snapshot: Snapshot, pusher: Pusher, tag: str) -> str:
    """A Hub snapshot as a ModelPack artifact under ``tag``; the manifest digest."""
    blobs = []
    for f in snapshot.files:
        sha = f.checksum.value.lower() if f.checksum and f.checksum.algorithm == "sha256" else None
        blobs.append(_Blob(f, f"sha256:{sha}" if sha else None))
    pusher.result.files = len(blobs)
    pusher.result.bytes_total = sum(f.size for f in snapshot.files)
    digests = pusher.push_all(source, blobs)
    config = modelpack_config(snapshot, digests)
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    config_file = RemoteFile("<modelpack config>", len(config))
    pusher.push_all(_BytesFile(config), [_Blob(config_file, config_digest)])
    body = modelpack_manifest(snapshot, digests, config_digest, config)
    pusher.result.blobs = len(blobs) + 1
    return pusher.writer.put_manifest(tag, body, OCI_MANIFEST)


def copy_artifact(source: OciSource, pusher: Pusher, tag: str | None) -> str:
    """The model manifest ``source`` names, copied by digest: its blobs, then its own bytes."""
    reference = source.uri.revision or "latest"
    manifest = source.model_manifest(reference)
    body, digest, _ = source.fetch_manifest(manifest.digest)
    blobs = [_Blob(RemoteFile("<config>", manifest.config_size, locator=manifest.config_digest),
                   manifest.config_digest)]  # fmt: skip
    blobs += [
        _Blob(RemoteFile(layer.path, layer.size, locator=layer.digest), layer.digest)
        for layer in manifest.layers
    ]
    pusher.result.files = len(manifest.layers)
    pusher.result.blobs = len(blobs)
    pusher.result.bytes_total = sum(b.file.size for b in blobs)
    pusher.push_all(source, blobs)
    pushed = pusher.writer.put_manifest(tag or digest, body, manifest.media_type)
    if pushed != digest:  # the bytes were sent as they are: this cannot differ
        raise SourceError(f"the copied manifest's digest {pushed} is not {digest}")
    return digest


def parse_destination(dst: str) -> tuple[SourceURI, str]:
    """``oci://registry/repo[:tag]`` as a destination: the repo and the tag (default latest);
    a digest cannot be a destination (it is what the push produces)."""
    from prefetch.pipeline.backends import backend
    from prefetch.pipeline.spec import parse_source_uri

    uri = parse_source_uri(dst)
    if not backend(uri.scheme).registry or not uri.path:
        raise ConfigError(f"the destination must be oci://registry/repo:tag, not {dst!r}")
    if uri.revision is not None and uri.revision.startswith("sha256:"):
        raise ConfigError(f"the destination {dst!r} names a digest: name a tag (or none)")
    return uri, uri.revision or "latest"


def mirror_to_oci(
    source: Source,
    snapshot: Snapshot | None,
    dst: str,
    *,
    http: HttpClient,
    retry: RetryPolicy,
    concurrency: int,
    progress: ProgressSink | None = None,
    so_far: MirrorResult | None = None,
) -> MirrorResult:
    """Push ``snapshot`` (a Hub source's) as a ModelPack artifact, or copy the artifact an
    :class:`OciSource` names (``snapshot`` None), to ``dst``."""
    uri, tag = parse_destination(dst)
    result = so_far or MirrorResult(source="", destination=dst)
    result.destination = str(uri)
    writer = RegistryWriter(uri, http, retry=retry, auth=None)
    pusher = Pusher(
        writer, retry=retry, concurrency=concurrency, progress=progress or NullProgress(),
        result=result,
    )  # fmt: skip
    if snapshot is None:
        if not isinstance(source, OciSource):
            raise ConfigError("only an oci:// source is copied without a snapshot")
        if (source.uri.location, source.uri.path) == (uri.location, uri.path):
            raise ConfigError("the copy's source and destination are the same repository")
        digest = copy_artifact(source, pusher, tag)
    else:
        digest = push_snapshot(source, snapshot, pusher, tag)
        result.repo_id = snapshot.repo_id
        result.commit = snapshot.revision_id
    result.ref = f"{tag}@{digest}"
    return result


def mirror_command(
    src: str,
    dst: str,
    *,
    revision: str | None,
    hub_endpoint: str | None,
    token: str | None,
    proxy: str | None,
    concurrency: int,
    retry: RetryPolicy,
    progress: ProgressSink,
    so_far: MirrorResult,
    ca_bundle: str | None = None,
) -> MirrorResult:
    """``prefetch mirror SRC oci://...``: SRC is ``hf://org/name[@rev]`` (pushed as ModelPack)
    or ``oci://...`` (copied by digest); ``proxy`` is for the source only, ``ca_bundle``
    (``--ca-bundle``) for both ends (:func:`prefetch.support.settings.ca_bundle`)."""
    from prefetch.pipeline.backends import backend
    from prefetch.pipeline.spec import ModelSpec, parse_source_uri
    from prefetch.sources import SourceSettings, open_source, pool_size
    from prefetch.sources.http.transport import shared_http_pool
    from prefetch.support import settings

    parse_destination(dst)
    source_uri = parse_source_uri(src)
    how = backend(source_uri.scheme).to_registry
    if how is None:
        raise ConfigError(f"a registry is mirrored from hf:// or oci://, not {src!r}")
    if how == "copy" and revision:
        raise ConfigError("--revision is for hf:// sources (name the tag or digest in the URI)")
    reach = SourceSettings(
        hub_endpoint=hub_endpoint, token=token, concurrency=concurrency, retry=retry
    )
    spec = ModelSpec(source=source_uri, revision=revision or None, proxy=proxy, ca_bundle=ca_bundle)
    source = open_source(spec, reach)
    snapshot = source.resolve(spec) if how == "modelpack" else None
    http = shared_http_pool(
        pool_size(concurrency), settings.proxies(), ca_certs=settings.ca_bundle(ca_bundle).path
    )
    return mirror_to_oci(
        source, snapshot, dst, http=http, retry=retry, concurrency=concurrency,
        progress=progress, so_far=so_far,
    )  # fmt: skip
