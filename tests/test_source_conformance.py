"""Every source behaves the same when its server misbehaves: one suite, run by every source.

A source joins by adding one :class:`SourceCase` subclass (how to serve a model, how to pull it,
how to make its server misbehave, the scheme of the backend it checks) to ``CASES``; every
behaviour below then runs against it, and every backend of the registry
(:mod:`prefetch.pipeline.backends`) must have one:

* resume: a body cut mid-way, and a pull stopped mid-way, resume without re-fetching finished bytes;
* throttling: 429 / 503 SlowDown with Retry-After is retried and the pull succeeds;
* changed object: a file replaced mid-download ends in SourceChangedError or a clean re-fetch,
  never a mixed file;
* ignored Range: a 200 answer to a ranged GET is refused and nothing is published;
* stall: a trickling body is abandoned by the stall rule and retried;
* bad checksum: a corrupted byte is re-fetched once; a byte corrupted every time ends in
  ChecksumMismatchError naming the file, nothing published.

The model comes from :mod:`prefetch.demo.modelgen` (one shard big enough for several chunks plus the
small JSON files). The S3 case serves it from the session's SeaweedFS through
:class:`tests.fakes.s3proxy.S3FaultProxy` (real S3 checksums and conditional reads, faults injected
on the wire); the GCS case from gcp-storage-emulator behind the same proxy (tests/fakes/gcs.py,
which adds the generation check the emulator lacks); the Hub case from
:class:`tests.fakes.hubserver.HubServer` and its faults.
on the wire); the Hub case from :class:`tests.fakes.hubserver.HubServer` and its faults; the
file case from a directory, its faults injected in its reads (see :class:`FileCase` for the
behaviours that do not fit a local directory).

Every case is served over HTTPS with the session's private CA (tests/tls.py), each server under
its own test host name, and the client trusts that CA explicitly (S3: ``AWS_CA_BUNDLE``, set
for the session; the Hub and OCI: the pool's ``ca_certs``): TLS is how sources meet servers in
production, so it is how every behaviour below is checked.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote, urlsplit

import pytest
import urllib3

from prefetch.demo.modelgen import GeneratedFile, make_model_dir, random_bytes, upload_model
from prefetch.pipeline.backends import source_schemes
from prefetch.pipeline.engine.transfer import Cancelled, TransferConfig
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.layout.hf import HfCacheLayout
from prefetch.pipeline.progress import NullProgress
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import SyncResult, sync
from prefetch.pipeline.verify import new_hasher
from prefetch.sources import SourceSettings, open_source
from prefetch.sources.gcs.auth import Anonymous
from prefetch.sources.gcs.source import GcsClient, GcsSource
from prefetch.sources.hf.source import HubOptions, open_hub_source
from prefetch.sources.http.transport import watched_pools
from prefetch.sources.oci.source import open_oci_source
from prefetch.sources.s3.factory import make_s3_client
from prefetch.sources.s3.source import S3Source
from prefetch.sources.s3_mirror.format import (
    MirrorCommit,
    MirrorFile,
    blob_key,
    ref_key,
    snapshot_key,
)
from prefetch.support.errors import ChecksumMismatchError, SourceChangedError, SourceError

from .fakes.azurite import Azurite
from .fakes.gcs import GcsEmulator, tls_front
from .fakes.hubserver import HubFile, HubServer
from .fakes.registry import Registry
from .fakes.s3proxy import S3FaultProxy
from .support import journaled_bytes, put
from .tls import TestCA

MiB = 1024 * 1024
SHARD = "model.safetensors"
SHARD_SIZE = 3 * MiB + 5  # four 1 MiB chunks, the last one 5 bytes
CONFIG = TransferConfig(
    concurrency=4,
    chunk_size=1 * MiB,
    buffer_size=64 * 1024,
    stall_window=1.0,  # one-second stall windows keep the stall tests short
    retry=RetryPolicy(attempts=4, base_delay=0.01, max_delay=1.0),
)
ONE_AT_A_TIME = TransferConfig(
    concurrency=1,
    chunk_size=1 * MiB,
    buffer_size=64 * 1024,
    retry=RetryPolicy(attempts=4, base_delay=0.01, max_delay=1.0),
)


class SourceCase(ABC):
    """One source under test: its server, a model on it, a pull from it, and its faults.

    Faults apply to GETs of one file's bytes (``path`` is the model-relative path) and are used
    up after ``times`` answers (``None``: for the rest of the test).
    """

    id: ClassVar[str]
    #: the scheme of the backend under test (see prefetch.pipeline.backends)
    scheme: ClassVar[str]
    #: behaviours that do not fit the service (its tests are not generated for it; the class's
    #: docstring says why): "https", "throttle", "range", "stall"
    does_not_fit: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, model: dict[str, Path]) -> None:
        self.model = model

    @property
    @abstractmethod
    def url(self) -> str:
        """The base URL the source is pointed at (the server the pull talks to first)."""

    tls: TestCA

    def tls_pool(self) -> urllib3.PoolManager:
        """The pools production builds (prefetch.sources.http.transport: the watched connections,
        over TLS too), trusting the session CA; the caller clears it after the pull."""
        return watched_pools(
            urllib3.PoolManager(maxsize=16, retries=False, ca_certs=str(self.tls.ca_file))
        )

    # -- the model
    @abstractmethod
    def replace(self, path: str, data: bytes) -> None:
        """Publish new content for ``path`` (what a re-upload or a new commit does)."""

    @abstractmethod
    def pull(
        self,
        dest: Path,
        config: TransferConfig = CONFIG,
        *,
        progress: NullProgress | None = None,
        stop: threading.Event | None = None,
    ) -> SyncResult:
        """Sync the model into ``dest`` in this source's usual layout."""

    @abstractmethod
    def published(self, dest: Path, path: str) -> bytes | None:
        """The published content of ``path`` under ``dest`` (None if none is)."""

    @abstractmethod
    def partial_dir(self, dest: Path) -> Path:
        """Where partial files and their resume journals live."""

    # -- misbehaviours
    @abstractmethod
    def cut(self, path: str, after_bytes: int, times: int) -> None:
        """Close the connection after ``after_bytes`` of a body that states a longer length."""

    @abstractmethod
    def refuse(self, path: str, status: int, retry_after: int, times: int) -> None:
        """Answer ``status`` with ``Retry-After: retry_after`` instead of the bytes."""

    @abstractmethod
    def ignore_range(self, path: str) -> None:
        """Answer every ranged GET with 200 and no Content-Range."""

    @abstractmethod
    def trickle(self, path: str, times: int) -> None:
        """Send the body far below the stall rule's minimum rate."""

    @abstractmethod
    def corrupt(self, path: str, offset: int, times: int | None) -> None:
        """Flip the byte at ``offset`` of ``path`` in every answer that carries it."""

    @abstractmethod
    def fetches_from_start(self, path: str) -> int:
        """How many GETs of ``path`` asked for its first byte (whole-file fetches included)."""


class S3Case(SourceCase):
    """SeaweedFS, reached through a fault-injecting proxy; files uploaded as real tools do."""

    id = "s3"
    scheme = "s3"

    def __init__(
        self, model: dict[str, Path], s3_server: Any, client: Any, bucket: str, tls: TestCA
    ) -> None:
        super().__init__(model)
        self.client, self.bucket = client, bucket
        files = [GeneratedFile(rel, p, p.stat().st_size) for rel, p in model.items()]
        upload_model(client, bucket, "m", files, create_bucket=False)
        self.proxy = S3FaultProxy(s3_server.endpoint, tls).__enter__()
        self.proxy_client = make_s3_client(
            endpoint_url=self.proxy.endpoint,
            access_key=s3_server.access_key,
            secret_key=s3_server.secret_key,
        )

    def close(self) -> None:
        self.proxy.__exit__(None, None, None)

    @property
    def url(self) -> str:
        return self.proxy.endpoint

    def key(self, path: str) -> str:
        return f"m/{path}"

    def replace(self, path: str, data: bytes) -> None:
        self.client.put_object(
            Bucket=self.bucket, Key=self.key(path), Body=data, ChecksumAlgorithm="SHA256"
        )

    def pull(self, dest, config=CONFIG, *, progress=None, stop=None):  # type: ignore[no-untyped-def]
        spec = ModelSpec(source=parse_source_uri(f"s3://{self.bucket}/m/"))
        source = S3Source(self.proxy_client, spec.source)
        return sync(spec, source, PlainLayout(dest), config, progress=progress, stop=stop)

    def published(self, dest: Path, path: str) -> bytes | None:
        target = dest / path
        return target.read_bytes() if target.exists() else None

    def partial_dir(self, dest: Path) -> Path:
        return PlainLayout(dest).staging_dir()

    def cut(self, path: str, after_bytes: int, times: int) -> None:
        f = self.proxy.faults
        f.cut_key, f.cut_after, f.cut_times = self.key(path), after_bytes, times

    def refuse(self, path: str, status: int, retry_after: int, times: int) -> None:
        f = self.proxy.faults
        f.refuse_key, f.refuse_status, f.refuse_times = self.key(path), status, times
        f.refuse_retry_after = str(retry_after)

    def ignore_range(self, path: str) -> None:
        f = self.proxy.faults
        f.ignore_range_key, f.ignore_range_times = self.key(path), 1 << 30

    def trickle(self, path: str, times: int) -> None:
        f = self.proxy.faults
        f.trickle_key, f.trickle, f.trickle_times = self.key(path), (4096, 0.1), times

    def corrupt(self, path: str, offset: int, times: int | None) -> None:
        f = self.proxy.faults
        f.flip_key, f.flip_offset = self.key(path), offset
        f.flip_times = 1 << 30 if times is None else times

    def fetches_from_start(self, path: str) -> int:
        return sum(
            1
            for key, rng in self.proxy.get_ranges
            if key == self.key(path) and (rng is None or rng.startswith("bytes=0-"))
        )


class HubCase(SourceCase):
    """The fake Hub (hub port and CDN port), the model committed on ``main``."""

    id = "hub"
    scheme = "hf"
    repo = "acme/conform"

    def __init__(self, model: dict[str, Path], tls: TestCA) -> None:
        super().__init__(model)
        self.tls = tls
        self.hub = HubServer(tls).__enter__()
        self.hub.add_commit(self.repo, model)

    def close(self) -> None:
        self.hub.__exit__(None, None, None)

    @property
    def url(self) -> str:
        return self.hub.endpoint

    def replace(self, path: str, data: bytes) -> None:
        self.hub.add_commit(self.repo, {path: data}, inherit=True)

    def pull(self, dest, config=CONFIG, *, progress=None, stop=None):  # type: ignore[no-untyped-def]
        spec = ModelSpec(source=parse_source_uri(f"hf://{self.repo}"))
        pool = self.tls_pool()
        options = HubOptions(endpoint=self.hub.endpoint, token=False, http=pool, retry=config.retry)
        try:
            layout = HfCacheLayout(dest, self.repo)
            source = open_hub_source(spec, options)
            return sync(spec, source, layout, config, progress=progress, stop=stop)
        finally:
            pool.clear()

    def published(self, dest: Path, path: str) -> bytes | None:
        """What huggingface_hub would load: the file in the snapshot ``refs/main`` names."""
        root = HfCacheLayout(dest, self.repo).root
        ref = root / "refs" / "main"
        if not ref.exists():
            return None
        target = root / "snapshots" / ref.read_text().strip() / path
        return target.read_bytes() if target.exists() else None

    def partial_dir(self, dest: Path) -> Path:
        return HfCacheLayout(dest, self.repo).staging_dir()

    def _file(self, path: str) -> Any:
        return self.hub.file(self.repo, path)

    def cut(self, path: str, after_bytes: int, times: int) -> None:
        self.hub.faults.cut(after_bytes, count=times, file=self._file(path))

    def refuse(self, path: str, status: int, retry_after: int, times: int) -> None:
        self.hub.faults.fail(status, count=times, retry_after=retry_after, port="cdn")

    def ignore_range(self, path: str) -> None:
        self.hub.faults.ignore_range(count=None, file=self._file(path))

    def trickle(self, path: str, times: int) -> None:
        self.hub.faults.throttle(40_000, count=times, port="cdn", file=self._file(path))

    def corrupt(self, path: str, offset: int, times: int | None) -> None:
        self.hub.faults.corrupt(self._file(path), offset=offset, count=times)

    def fetches_from_start(self, path: str) -> int:
        sha256 = self._file(path).sha256
        return sum(
            1
            for r in self.hub.requests
            if r.port == "cdn"
            and r.method == "GET"
            and sha256 in r.url_path
            and r.headers.get("range", "bytes=0-").startswith("bytes=0-")
        )


class MirrorCase(S3Case):
    """A Hub repo's S3 mirror (prefetch/sources/s3_mirror/format.py) in SeaweedFS, through the same
    fault proxy, pulled as ``hf://`` with the mirror and no Hub fallback. A replaced file is a new
    commit on ``main``: a new blob, its metadata, the ref moved (the old blob stays)."""

    id = "mirror"
    repo = "acme/conform"
    prefix = "mirror/"

    def __init__(
        self, model: dict[str, Path], s3_server: Any, client: Any, bucket: str, tls: TestCA
    ) -> None:
        SourceCase.__init__(self, model)
        self.client, self.bucket = client, bucket
        self.files = {rel: HubFile.from_path(rel, p) for rel, p in model.items()}
        self.commit(self.files)
        self.proxy = S3FaultProxy(s3_server.endpoint, tls).__enter__()
        self.proxy_client = make_s3_client(
            endpoint_url=self.proxy.endpoint,
            access_key=s3_server.access_key,
            secret_key=s3_server.secret_key,
        )

    def commit(self, files: dict[str, HubFile]) -> None:
        """Mirror ``files`` as one new commit of ``main``, in the order ``prefetch mirror``
        writes: blobs, the commit's metadata, the ref."""
        entries = []
        for rel, f in sorted(files.items()):
            data = f.read()
            crc = new_hasher("crc64nvme")
            crc.update(data)
            kind = "sha256" if f.sha256 is not None else "git-sha1"
            crc64 = base64.b64encode(crc.digest()).decode()
            entries.append(MirrorFile(rel, f.size, f.etag, kind, crc64))
            put(self.client, self.bucket, blob_key(self.prefix, f.etag), data)
        sha = hashlib.sha1(repr(entries).encode()).hexdigest()
        meta = MirrorCommit(self.repo, sha, "main", f"hf://{self.repo}", "2026-01-01T00:00:00Z",
                            tuple(entries))  # fmt: skip
        put(self.client, self.bucket, snapshot_key(self.prefix, sha), meta.to_json())
        put(self.client, self.bucket, ref_key(self.prefix, "main"), sha.encode())

    def key(self, path: str) -> str:
        return blob_key(self.prefix, self.files[path].etag)

    def replace(self, path: str, data: bytes) -> None:
        self.files = {**self.files, path: HubFile.from_bytes(path, data)}
        self.commit(self.files)

    def pull(self, dest, config=CONFIG, *, progress=None, stop=None):  # type: ignore[no-untyped-def]
        spec = ModelSpec(
            source=parse_source_uri(f"hf://{self.repo}"),
            mirrors=(parse_source_uri(f"s3://{self.bucket}/{self.prefix}"),),
            hub_fallback=False,
        )
        source = open_source(spec, SourceSettings(s3_client=self.proxy_client))
        layout = HfCacheLayout(dest, self.repo)
        return sync(spec, source, layout, config, progress=progress, stop=stop)

    published = HubCase.published
    partial_dir = HubCase.partial_dir


class OciCase(SourceCase):
    """A real registry (docker-registry) through the same fault proxy, the model pushed as a
    ModelSpec artifact by hand-built manifests and pulled by tag. A replaced file is a new
    manifest for the tag (a new blob; the old one stays, content-addressed)."""

    id = "oci"
    scheme = "oci"
    repo = "conform/model"

    def __init__(self, model: dict[str, Path], registry: Registry, tls: TestCA) -> None:
        super().__init__(model)
        self.registry, self.tls = registry, tls
        self.files = {rel: p.read_bytes() for rel, p in model.items()}
        self.pushed = registry.pusher().modelpack(self.repo, "v1", self.files)
        self.proxy = S3FaultProxy(registry.url, tls, role="registry").__enter__()

    def close(self) -> None:
        self.proxy.__exit__(None, None, None)

    @property
    def url(self) -> str:
        return self.proxy.endpoint

    def key(self, path: str) -> str:
        return f"{self.repo}/blobs/{self.pushed.layers[path]}"

    def replace(self, path: str, data: bytes) -> None:
        self.files = {**self.files, path: data}
        self.pushed = self.registry.pusher().modelpack(self.repo, "v1", self.files)

    def pull(self, dest, config=CONFIG, *, progress=None, stop=None):  # type: ignore[no-untyped-def]
        host = self.proxy.endpoint.split("://", 1)[1]
        spec = ModelSpec(source=parse_source_uri(f"oci://{host}/{self.repo}:v1"))
        pool = self.tls_pool()
        try:
            source = open_oci_source(spec, http=pool, retry=config.retry)
            return sync(spec, source, PlainLayout(dest), config, progress=progress, stop=stop)
        finally:
            pool.clear()

    published = S3Case.published
    partial_dir = S3Case.partial_dir
    cut = S3Case.cut
    refuse = S3Case.refuse
    ignore_range = S3Case.ignore_range
    trickle = S3Case.trickle
    corrupt = S3Case.corrupt
    fetches_from_start = S3Case.fetches_from_start


class GcsCase(SourceCase):
    """gcp-storage-emulator through the same fault proxy (the TLS front of tests/fakes/gcs.py,
    which answers a media GET of a generation that is gone with 404, as Cloud Storage does and
    the emulator does not); read anonymously, as an emulator is."""

    id = "gcs"
    scheme = "gs"

    def __init__(self, model: dict[str, Path], emulator: GcsEmulator, tls: TestCA) -> None:
        super().__init__(model)
        self.emulator, self.tls = emulator, tls
        self.bucket = f"conform-{next(_gcs_buckets)}"
        emulator.create_bucket(self.bucket)
        emulator.upload_dir(self.bucket, "m/", model)
        self.proxy = tls_front(emulator, tls).__enter__()

    def close(self) -> None:
        self.proxy.__exit__(None, None, None)

    @property
    def url(self) -> str:
        return self.proxy.endpoint

    def key(self, path: str) -> str:
        return f"v1/b/{self.bucket}/o/{quote('m/' + path, safe='')}"

    def replace(self, path: str, data: bytes) -> None:
        self.emulator.upload(self.bucket, f"m/{path}", data)

    def pull(self, dest, config=CONFIG, *, progress=None, stop=None):  # type: ignore[no-untyped-def]
        spec = ModelSpec(source=parse_source_uri(f"gs://{self.bucket}/m/"))
        pool = self.tls_pool()
        try:
            client = GcsClient(self.proxy.endpoint, pool, Anonymous("the emulator"),
                               urllib3.Timeout(connect=10, read=60))  # fmt: skip
            source = GcsSource(client, spec.source, retry=config.retry)
            return sync(spec, source, PlainLayout(dest), config, progress=progress, stop=stop)
        finally:
            pool.clear()

    published = S3Case.published
    partial_dir = S3Case.partial_dir
    cut = S3Case.cut
    refuse = S3Case.refuse
    ignore_range = S3Case.ignore_range
    trickle = S3Case.trickle
    corrupt = S3Case.corrupt
    fetches_from_start = S3Case.fetches_from_start


class _FileFaults:
    """Faults of a local read, armed per model path: the wire of a directory is ``pread``."""

    def __init__(self) -> None:
        self.cut: dict[str, list[int]] = {}  # path -> [after_bytes, times left]
        self.flip: dict[str, list[int]] = {}  # path -> [offset, times left]
        self.from_start: dict[str, int] = {}

    def armed(self, path: str) -> bool:
        return any(f.get(path, [0, 0])[1] > 0 for f in (self.cut, self.flip))


class _FaultyReader:
    """A FileSource reader whose bytes the armed faults cut short or corrupt; it copies in
    the kernel (``copy_to``) only while no fault is armed for its file, as the engine would."""

    def __init__(self, inner: Any, path: str, start: int, faults: _FileFaults) -> None:
        self.inner, self.path, self.pos, self.faults = inner, path, start, faults
        self.body = 0  # bytes this "request" delivered
        self.flipped = False

    def readinto(self, buf: memoryview, /) -> int:
        cut = self.faults.cut.get(self.path)
        if cut is not None and cut[1] > 0:
            if self.body >= cut[0]:
                cut[1] -= 1
                return 0  # the engine's "connection closed": retried from this byte
            buf = buf[: cut[0] - self.body]
        n = int(self.inner.readinto(buf))
        flip = self.faults.flip.get(self.path)
        if flip is not None and flip[1] > 0 and self.pos <= flip[0] < self.pos + n:
            buf[flip[0] - self.pos] ^= 0xFF
            if not self.flipped:
                flip[1] -= 1
                self.flipped = True
        self.pos += n
        self.body += n
        return n

    def copy_to(self, fd: int, offset: int, length: int) -> int | None:
        if self.faults.armed(self.path):
            return None
        n = self.inner.copy_to(fd, offset, length)
        if n:
            self.pos += n
        return n  # type: ignore[no-any-return]  # (the inner reader's, typed there)

    def close(self) -> None:
        self.inner.close()


class _FaultyFileSource:
    """A FileSource whose ranged reads go through :class:`_FaultyReader`."""

    def __init__(self, inner: Any, faults: _FileFaults) -> None:
        self.inner, self.faults = inner, faults

    def refuse_destination(self, folders: tuple[Path, ...]) -> None:
        self.inner.refuse_destination(folders)

    def resolve(self, spec: ModelSpec) -> Any:
        return self.inner.resolve(spec)

    def describe(self, file: Any) -> Any:
        return self.inner.describe(file)

    def open_range(self, file: Any, start: int, end: int) -> _FaultyReader:
        reader = self.inner.open_range(file, start, end)
        if start == 0:
            self.faults.from_start[file.path] = self.faults.from_start.get(file.path, 0) + 1
        return _FaultyReader(reader, file.path, start, self.faults)


class FileCase(SourceCase):
    """A directory (``file://``) with a ``SHA256SUMS`` sidecar, read through a fault-injecting
    wrapper of its reads (a cut short read, a flipped byte). A replaced file is written whole
    and renamed over the old one, its sum updated (what a publisher of the directory does).

    What does not fit a local directory, and is skipped: TLS (there is no server); throttling
    (a read answers no status; a soft NFS mount's EIO/ETIMEDOUT is retried as transient
    instead); an ignored or wrong Range (``pread`` reads exactly the offsets asked for); a
    stall (a read does not trickle, and a read blocked on a hung hard-mounted NFS server
    sleeps in the kernel, where the watchdog cannot interrupt it)."""

    id = "file"
    scheme = "file"

    def __init__(self, model: dict[str, Path], root: Path) -> None:
        super().__init__(model)
        self.root = root
        for rel, path in model.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(path.read_bytes())
        self.write_sums()
        self.faults = _FileFaults()

    def write_sums(self) -> None:
        lines = [
            f"{hashlib.sha256((self.root / rel).read_bytes()).hexdigest()}  {rel}\n"
            for rel in sorted(self.model)
        ]
        (self.root / "SHA256SUMS").write_text("".join(lines))

    def close(self) -> None:
        pass

    does_not_fit = frozenset({"https", "throttle", "range", "stall"})

    @property
    def url(self) -> str:
        raise AssertionError("a local directory has no server: there is no TLS to check")

    def replace(self, path: str, data: bytes) -> None:
        staged = self.root / (path + ".new")
        staged.write_bytes(data)
        staged.replace(self.root / path)
        self.write_sums()

    def pull(self, dest, config=CONFIG, *, progress=None, stop=None):  # type: ignore[no-untyped-def]
        spec = ModelSpec(source=parse_source_uri(f"file://{self.root}"))
        source = _FaultyFileSource(open_source(spec), self.faults)
        return sync(spec, source, PlainLayout(dest), config, progress=progress, stop=stop)

    published = S3Case.published
    partial_dir = S3Case.partial_dir

    def cut(self, path: str, after_bytes: int, times: int) -> None:
        self.faults.cut[path] = [after_bytes, times]

    def refuse(self, path: str, status: int, retry_after: int, times: int) -> None:
        raise AssertionError("a local read answers no status: nothing throttles it")

    def ignore_range(self, path: str) -> None:
        raise AssertionError("pread reads exactly the offsets asked for: no Range to ignore")

    def trickle(self, path: str, times: int) -> None:
        raise AssertionError("a local read does not trickle (a hung NFS read blocks in the kernel)")

    def corrupt(self, path: str, offset: int, times: int | None) -> None:
        self.faults.flip[path] = [offset, 1 << 30 if times is None else times]

    def fetches_from_start(self, path: str) -> int:
        return self.faults.from_start.get(path, 0)


class AzureCase(SourceCase):
    """Azurite (Microsoft's emulator, checking SharedKey signatures) through the same fault
    proxy, the model uploaded with the SDK (single puts: each blob has its Content-MD5), read
    with the account key. Every fault fits: Azure answers a replaced blob's If-Match with 412,
    throttles with 503 ServerBusy (the proxy's 429 and 503 stand in), and a body cut, ignored
    range, trickle or flipped byte are the wire's, whatever the server."""

    id = "az"
    scheme = "az"
    container = "conform"

    def __init__(self, model: dict[str, Path], azurite: Azurite, tls: TestCA) -> None:
        super().__init__(model)
        self.azurite, self.tls = azurite, tls
        self.prefix = f"m{next(_AZURE_PREFIXES)}/"
        azurite.upload(self.container, self.prefix, {r: p.read_bytes() for r, p in model.items()})
        self.proxy = S3FaultProxy(azurite.base, tls, role="mirror").__enter__()

    def close(self) -> None:
        self.proxy.__exit__(None, None, None)

    @property
    def url(self) -> str:
        return self.proxy.endpoint

    def key(self, path: str) -> str:
        return f"{self.container}/{self.prefix}{path}"

    def replace(self, path: str, data: bytes) -> None:
        self.azurite.upload(self.container, self.prefix, {path: data})

    def pull(self, dest, config=CONFIG, *, progress=None, stop=None):  # type: ignore[no-untyped-def]
        from prefetch.sources.azure.auth import Account, SharedKey
        from prefetch.sources.azure.source import AzureBlobSource

        from .fakes.azurite import ACCOUNT, KEY

        spec = ModelSpec(source=parse_source_uri(f"az://{ACCOUNT}/{self.container}/{self.prefix}"))
        pool = self.tls_pool()
        key = SharedKey(ACCOUNT, KEY, "test")
        account = Account(ACCOUNT, f"{self.proxy.endpoint}/{ACCOUNT}", key)
        try:
            source = AzureBlobSource(spec.source, account, pool, retry=config.retry)
            return sync(spec, source, PlainLayout(dest), config, progress=progress, stop=stop)
        finally:
            pool.clear()

    published = S3Case.published
    partial_dir = S3Case.partial_dir
    cut = S3Case.cut
    refuse = S3Case.refuse
    ignore_range = S3Case.ignore_range
    trickle = S3Case.trickle
    corrupt = S3Case.corrupt
    fetches_from_start = S3Case.fetches_from_start


_gcs_buckets = itertools.count()
_AZURE_PREFIXES = itertools.count()

CASES = ["s3", "hub", "mirror", "oci", "gcs", "az", "file"]
CASE_CLASSES: tuple[type[SourceCase], ...] = (
    S3Case, HubCase, MirrorCase, OciCase, GcsCase, AzureCase, FileCase,
)  # fmt: skip


def fitting(behaviour: str) -> pytest.MarkDecorator:
    """Runs a test for the cases whose service has ``behaviour`` (not generated for the others,
    rather than skipped: CI runs with no skip)."""
    ids = [c.id for c in CASE_CLASSES if behaviour not in c.does_not_fit]
    return pytest.mark.parametrize("case", ids, indirect=True)


def test_every_backend_of_the_registry_has_a_case_here() -> None:
    """A backend joins the registry and this suite together (see docs/architecture.md)."""
    assert [c.id for c in CASE_CLASSES] == CASES
    assert {c.scheme for c in CASE_CLASSES} == set(source_schemes())


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_model_dir(tmp_path_factory.mktemp("conform"), seed=11, shard_sizes=(SHARD_SIZE,))


@pytest.fixture(params=CASES)
def case(
    request: pytest.FixtureRequest, model: dict[str, Path], test_ca: TestCA
) -> Iterator[SourceCase]:
    made: SourceCase
    if request.param == "file":
        root = request.getfixturevalue("tmp_path") / "file-source"
        made = FileCase(model, root)
    elif request.param == "oci":
        made = OciCase(model, request.getfixturevalue("registry"), test_ca)
    elif request.param == "gcs":
        made = GcsCase(model, request.getfixturevalue("gcs_emulator"), test_ca)
    elif request.param == "az":
        made = AzureCase(model, request.getfixturevalue("azurite"), test_ca)
    elif request.param in ("s3", "mirror"):
        server = request.getfixturevalue("s3_server")
        client = request.getfixturevalue("s3_client")
        kind = S3Case if request.param == "s3" else MirrorCase
        made = kind(model, server, client, request.getfixturevalue("bucket"), test_ca)
    else:
        made = HubCase(model, test_ca)
    try:
        yield made
    finally:
        made.close()


def shard_bytes(model: dict[str, Path]) -> bytes:
    return model[SHARD].read_bytes()


class StopAfter(NullProgress):
    """Sets ``stop`` once ``limit`` bytes have arrived: a pull interrupted mid-way."""

    def __init__(self, limit: int) -> None:
        self.limit, self.seen, self.stop = limit, 0, threading.Event()

    def advance(self, nbytes: int) -> None:
        self.seen += nbytes
        if self.seen >= self.limit:
            self.stop.set()


class ReplaceOnce(NullProgress):
    """Replaces ``path`` on the server as soon as the first bytes arrive."""

    def __init__(self, case: SourceCase, path: str, data: bytes) -> None:
        self.case, self.path, self.data = case, path, data
        self.done = threading.Event()

    def advance(self, nbytes: int) -> None:
        if not self.done.is_set():
            self.done.set()
            self.case.replace(self.path, self.data)


# -- the transport ------------------------------------------------------------------------------


@fitting("https")
def test_every_source_is_served_over_https_under_a_test_host_name(
    case: SourceCase, model: dict[str, Path], tmp_path: Path, test_ca: TestCA
) -> None:
    """What every test below runs on: TLS with the session CA and a certificate for a name, not
    plain HTTP to 127.0.0.1 (which hid a TypeError on every HTTPS request once)."""
    url = urlsplit(case.url)
    assert url.scheme == "https"
    assert url.hostname is not None and url.hostname.endswith(test_ca.host)
    case.pull(tmp_path / "dest")
    assert case.published(tmp_path / "dest", SHARD) == shard_bytes(model)


# -- resume -------------------------------------------------------------------------------------


def test_a_cut_body_resumes_from_the_last_byte_and_fetches_nothing_twice(
    case: SourceCase, model: dict[str, Path], tmp_path: Path
) -> None:
    case.cut(SHARD, after_bytes=100_000, times=2)
    result = case.pull(tmp_path / "dest", ONE_AT_A_TIME)
    assert case.published(tmp_path / "dest", SHARD) == shard_bytes(model)
    assert result.retries >= 2
    assert result.bytes_downloaded == result.bytes_total


def test_a_stopped_pull_resumes_without_refetching_finished_pieces(
    case: SourceCase, model: dict[str, Path], tmp_path: Path
) -> None:
    dest = tmp_path / "dest"
    progress = StopAfter(int(1.5 * MiB))
    with pytest.raises(Cancelled):
        case.pull(dest, ONE_AT_A_TIME, progress=progress, stop=progress.stop)
    assert case.published(dest, SHARD) is None
    kept = journaled_bytes(case.partial_dir(dest))
    assert kept >= 1 * MiB  # at least the first chunk was journaled
    result = case.pull(dest, ONE_AT_A_TIME)
    assert case.published(dest, SHARD) == shard_bytes(model)
    assert result.resumed_bytes >= kept
    assert result.bytes_downloaded <= result.bytes_total - kept


# -- throttling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 503])
@fitting("throttle")
def test_throttling_with_retry_after_is_retried_and_succeeds(
    case: SourceCase, model: dict[str, Path], tmp_path: Path, status: int
) -> None:
    case.refuse(SHARD, status, retry_after=1, times=1)
    result = case.pull(tmp_path / "dest", ONE_AT_A_TIME)
    assert case.published(tmp_path / "dest", SHARD) == shard_bytes(model)
    assert result.retries == 1 and not result.files_unverified


# -- a changed object ---------------------------------------------------------------------------


def test_an_object_replaced_mid_download_is_never_published_mixed(
    case: SourceCase, model: dict[str, Path], tmp_path: Path
) -> None:
    dest = tmp_path / "dest"
    old = shard_bytes(model)
    new = random_bytes(SHARD_SIZE, "conformance: the new version")
    try:
        case.pull(dest, ONE_AT_A_TIME, progress=ReplaceOnce(case, SHARD, new))
    except SourceChangedError:
        assert case.published(dest, SHARD) is None
    else:
        assert case.published(dest, SHARD) in (old, new)  # one version whole, never a mix
    case.pull(dest, ONE_AT_A_TIME)
    assert case.published(dest, SHARD) == new


# -- a wrong answer to a ranged GET -------------------------------------------------------------


@fitting("range")
def test_an_ignored_range_is_refused_and_nothing_is_published(
    case: SourceCase, tmp_path: Path
) -> None:
    case.ignore_range(SHARD)
    with pytest.raises(SourceError, match=r"200.*206|206.*200") as err:
        case.pull(tmp_path / "dest")
    assert SHARD in str(err.value) or case.id == "hub"  # the Hub names the CDN URL instead
    assert case.published(tmp_path / "dest", SHARD) is None


@fitting("range")
def test_a_wrong_range_answer_is_the_same_error_from_every_source(
    case: SourceCase, tmp_path: Path
) -> None:
    """One range rule (prefetch.sources.http.transport.check_range_answer), one error type: S3
    raised SourceError and the Hub its own wording for the same defect."""
    case.ignore_range(SHARD)
    with pytest.raises(SourceChangedError, match=r"the server answered 200, not 206"):
        case.pull(tmp_path / "dest", ONE_AT_A_TIME)
    assert case.published(tmp_path / "dest", SHARD) is None


# -- a stall ------------------------------------------------------------------------------------


@pytest.mark.slow
@fitting("stall")
def test_a_trickle_is_abandoned_by_the_stall_rule_and_retried(
    case: SourceCase, model: dict[str, Path], tmp_path: Path
) -> None:
    case.trickle(SHARD, times=1)
    result = case.pull(tmp_path / "dest")
    assert case.published(tmp_path / "dest", SHARD) == shard_bytes(model)
    assert result.retries >= 1 and not result.files_unverified


# -- a bad checksum -----------------------------------------------------------------------------


def test_a_corrupted_byte_is_fetched_again_once_and_the_file_verifies(
    case: SourceCase, model: dict[str, Path], tmp_path: Path
) -> None:
    case.corrupt(SHARD, offset=2 * MiB + 3, times=1)
    result = case.pull(tmp_path / "dest")
    assert case.published(tmp_path / "dest", SHARD) == shard_bytes(model)
    assert result.checksum_failures == 1
    assert case.fetches_from_start(SHARD) == 2


def test_a_byte_corrupted_every_time_fails_naming_the_file_and_publishes_nothing(
    case: SourceCase, tmp_path: Path
) -> None:
    case.corrupt(SHARD, offset=2 * MiB + 3, times=None)
    with pytest.raises(ChecksumMismatchError) as err:
        case.pull(tmp_path / "dest")
    assert err.value.path == SHARD
    assert case.published(tmp_path / "dest", SHARD) is None
    assert case.fetches_from_start(SHARD) == 2  # fetched again once, then given up
