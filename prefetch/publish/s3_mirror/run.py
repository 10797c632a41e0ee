"""``prefetch mirror``: a Hub commit, or another mirror, into an S3 mirror prefix.

The order of writes is what makes a mirror safe to read while it is written and after a crash
(:mod:`prefetch.sources.s3_mirror.format`): blobs first, each checked before its object exists; a
commit's metadata only once every blob it names is there; the ref last. Keys are the Hub's ids, so a
blob already present with the right size and a CRC64NVME is not sent again: mirroring the same
commit twice uploads nothing, and a moved branch adds only its new blobs, a new
``snapshots/<commit>.json`` and the ref, leaving the old commit whole.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prefetch.pipeline.progress import NullProgress, ProgressSink
from prefetch.pipeline.snapshot import Checksum, RemoteFile
from prefetch.pipeline.spec import ModelSpec
from prefetch.publish.s3_mirror.stream import (
    BlobUpload,
    MirrorConfig,
    PartStreamer,
    streamable_checks,
)
from prefetch.publish.s3_mirror.upload import ListedObject, S3Prefix, StoredObject
from prefetch.sources.base import Source
from prefetch.sources.s3_mirror.format import (
    MirrorCommit,
    MirrorFile,
    blob_key,
    parse_mirror_commit,
    parse_ref_body,
    ref_key,
    refs_prefix,
    snapshot_key,
    snapshots_prefix,
)
from prefetch.support.errors import InvalidListingError, NoMatchingFilesError, SourceError
from prefetch.support.redact import redact

log = logging.getLogger(__name__)
#: The Hub's ids, as the Hub source states them (see prefetch.sources.hf.source).
HUB_ID_KINDS = ("sha256", "git-sha1")


@dataclass
class MirrorResult:
    """What one ``prefetch mirror`` did (its ``--json`` object)."""

    source: str
    destination: str
    repo_id: str | None = None
    commit: str | None = None
    ref: str | None = None
    commits: list[str] = field(default_factory=list)
    files: int = 0
    blobs: int = 0
    bytes_total: int = 0
    bytes_uploaded: int = 0
    bytes_skipped: int = 0
    bytes_reused: int = 0
    blobs_uploaded: int = 0
    blobs_skipped: int = 0
    uploads_aborted: int = 0
    retries: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "source": redact(self.source),
            "destination": self.destination,
            "repo_id": self.repo_id,
            "commit": self.commit,
            "ref": self.ref,
            "commits": list(self.commits),
            "files": self.files,
            "blobs": self.blobs,
            "bytes_total": self.bytes_total,
            "bytes_uploaded": self.bytes_uploaded,
            "bytes_skipped": self.bytes_skipped,
            "bytes_reused": self.bytes_reused,
            "blobs_uploaded": self.blobs_uploaded,
            "blobs_skipped": self.blobs_skipped,
            "uploads_aborted": self.uploads_aborted,
            "retries": self.retries,
            "seconds": self.seconds,
        }


@dataclass
class _Blob:
    """A blob the commit(s) need: the source file with its checks, and what the mirror holds."""

    id: str
    id_kind: str
    file: RemoteFile
    key: str  # where it goes in the destination
    expected_crc: str | None = None  # when the source recorded one (another mirror)
    #: the key names the content (blobs/<id>): an object there of the right size is this blob
    content_addressed: bool = True
    crc64nvme: str | None = None


def mirror_hub(
    spec: ModelSpec,
    source: Source,
    dest: S3Prefix,
    config: MirrorConfig,
    *,
    progress: ProgressSink | None = None,
    stop: threading.Event | None = None,
    so_far: MirrorResult | None = None,
) -> MirrorResult:
    """Mirror the Hub commit ``spec`` names (its branch, tag or sha) into ``dest``."""
    result = so_far or MirrorResult(source=str(spec.source), destination=dest.url(dest.prefix))
    dest.check_bucket()  # before the Hub: a typo in the bucket fails at once
    snapshot = source.resolve(spec)
    repo_id = snapshot.repo_id or spec.repo_id
    if repo_id is None:
        raise SourceError(f"{spec.source}: not a Hub repository")
    result.repo_id, result.commit = repo_id, snapshot.revision_id
    result.ref = spec.revision or "main"
    result.commits = [snapshot.revision_id]
    _refuse_another_repo(dest, repo_id)
    entries = _hub_blobs(snapshot.files, dest, str(spec.source))
    result.files = len(entries)
    blobs = list({b.id: b for _, b in entries}.values())
    _transfer(blobs, source, dest, config, progress, stop, spec.name, result)
    commit = MirrorCommit(
        repo_id=repo_id,
        commit=snapshot.revision_id,
        ref=result.ref,
        source=redact(str(spec.source)),
        mirrored_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        files=tuple(
            MirrorFile(f.path, f.size, b.id, b.id_kind, _stored_crc(b)) for f, b in entries
        ),
    )
    _write_commit(dest, commit, commit.to_json())
    if result.ref != commit.commit:
        _write_ref(dest, result.ref, commit.commit)
    return result


def _hub_blobs(
    files: tuple[RemoteFile, ...], dest: S3Prefix, where: str
) -> list[tuple[RemoteFile, _Blob]]:
    """Each file with its blob (files of the same content share one), named by its Hub id."""
    blobs: dict[str, _Blob] = {}
    entries: list[tuple[RemoteFile, _Blob]] = []
    for f in files:
        kind = next((c.algorithm for c in f.checksums if c.algorithm in HUB_ID_KINDS), None)
        if kind is None or not f.blob_id:
            raise InvalidListingError(f"{where}: {f.path} has no Hub id")
        key = blob_key(dest.prefix, f.blob_id)
        entries.append((f, blobs.setdefault(f.blob_id, _Blob(f.blob_id, kind, f, key))))
    return entries


def mirror_s3(
    source: Source,
    src: S3Prefix,
    dest: S3Prefix,
    config: MirrorConfig,
    *,
    progress: ProgressSink | None = None,
    stop: threading.Event | None = None,
    so_far: MirrorResult | None = None,
) -> MirrorResult:
    """Copy the S3 prefix ``src`` (read through ``source``) to ``dest``: a mirror (every
    commit's blobs, checked against the recorded ids and CRC64NVME, then its metadata, then its
    refs), or any other prefix object by object, checked against what S3 states about each."""
    result = so_far or MirrorResult(source=src.url(src.prefix), destination=dest.url(dest.prefix))
    dest.check_bucket()
    listing = {o.path: o for o in src.list_objects()}
    if not listing:
        raise NoMatchingFilesError(f"no objects under {src.url(src.prefix)}")
    if not any(p.startswith("snapshots/") for p in listing):
        return _copy_plain(listing, source, dest, config, progress, stop, result)
    commits = {
        c.commit: (c, body)
        for c, body in (_read_commit(src, o) for o in listing.values() if _is_snapshot(o))
    }
    repos = sorted({c.repo_id for c, _ in commits.values()})
    if len(repos) > 1:
        raise InvalidListingError(
            f"{src.url(src.prefix)} mirrors several repos ({', '.join(repos)}); a mirror prefix "
            "holds one"
        )
    if repos:
        _refuse_another_repo(dest, repos[0])
    refs = _read_refs(src, listing)
    blobs: dict[str, _Blob] = {}
    for commit, _ in commits.values():
        for f in commit.files:
            blobs.setdefault(f.id, _mirror_blob(src, dest, listing, commit, f))
    ordered = sorted(commits.values(), key=lambda cb: cb[0].commit)
    main = refs.get("main")
    first = commits[main][0] if main in commits else ordered[0][0]
    result.repo_id, result.commit = first.repo_id, first.commit
    result.ref = "main" if main in commits else first.ref
    result.commits = [c.commit for c, _ in ordered]
    result.files = sum(len(c.files) for c, _ in ordered)
    _transfer(list(blobs.values()), source, dest, config, progress, stop, first.repo_id, result)
    for commit, body in ordered:
        _write_commit(dest, commit, body)
    for ref, sha in sorted(refs.items()):
        if sha in commits:
            _write_ref(dest, ref, sha)
        else:
            log.warning("not copying ref %s: its commit %s has no metadata in the source", ref, sha)
    return result


# -- blobs ---------------------------------------------------------------------------------------


def _transfer(
    blobs: list[_Blob],
    source: Source,
    dest: S3Prefix,
    config: MirrorConfig,
    progress: ProgressSink | None,
    stop: threading.Event | None,
    name: str,
    result: MirrorResult,
) -> None:
    """Upload the blobs the destination lacks; fill in every blob's CRC64NVME."""
    keys = [b.key for b in blobs]
    with ThreadPoolExecutor(config.transfer.concurrency, thread_name_prefix="mirror-head") as pool:
        stored = list(pool.map(dest.head, keys))
    uploads: list[tuple[_Blob, BlobUpload]] = []
    for blob, key, have in zip(blobs, keys, stored, strict=True):
        if _already_there(blob, have):
            assert have is not None
            blob.crc64nvme = have.crc64nvme
            result.blobs_skipped += 1
            result.bytes_skipped += blob.file.size
        else:
            checks = streamable_checks(blob.file.checksums)
            uploads.append((blob, BlobUpload(blob.file, key, checks)))
    result.blobs = len(blobs)
    result.bytes_total = sum(b.file.size for b in blobs)
    sink = progress or NullProgress()
    sink.start(name, sum(b.file.size for b, _ in uploads), len(uploads))
    streamer = PartStreamer(source, dest, config, progress=sink, stop=stop)
    t0 = time.monotonic()
    try:
        streamer.run([u for _, u in uploads])
    finally:
        sink.finish()
        stats = streamer.stats
        result.bytes_uploaded += stats.bytes_uploaded
        result.bytes_reused += stats.bytes_reused
        result.blobs_uploaded += stats.objects_written
        result.uploads_aborted += stats.uploads_aborted
        result.retries += stats.retries
        log.info("streamed %d bytes in %.1fs", stats.bytes_read, time.monotonic() - t0)
    for blob, upload in uploads:
        blob.crc64nvme = upload.crc64nvme
    result.uploads_aborted += _abort_leftovers(dest, {b.key for b in blobs})


def _abort_leftovers(dest: S3Prefix, done: set[str]) -> int:
    """Abort the uploads still in progress for blobs that now exist (a duplicate a crashed or
    concurrent run left behind): nothing will ever complete them, and S3 bills their parts."""
    if not done:
        return 0
    leftovers = [u for u in dest.uploads_under(dest.prefix) if u.key in done]
    for u in leftovers:
        log.info("aborting a leftover upload of %s", u.key)
        dest.abort_upload(u.key, u.upload_id)
    return len(leftovers)


def _already_there(blob: _Blob, have: StoredObject | None) -> bool:
    """A blob is skipped when an object of its size is there with a whole-object CRC64NVME
    (and, when the source recorded one, that one): keys are content ids written only after
    their check, so the CRC confirms what a HEAD can without reading the object."""
    if have is None or have.size != blob.file.size or have.crc64nvme is None:
        return False
    if blob.expected_crc is None:
        return blob.content_addressed
    return have.crc64nvme == blob.expected_crc


def _stored_crc(blob: _Blob) -> str:
    assert blob.crc64nvme is not None, f"blob {blob.id} was neither found nor uploaded"
    return blob.crc64nvme


# -- metadata ------------------------------------------------------------------------------------


def _refuse_another_repo(dest: S3Prefix, repo_id: str) -> None:
    """Refuse, before writing anything, a destination prefix holding another repo's mirror:
    a second repo's commits and refs there would repoint ``refs/main`` and break the first
    repo's pulls. The writer never mixes repos, so any one commit's metadata names the repo."""
    snapshots = S3Prefix(dest.client, dest.bucket, snapshots_prefix(dest.prefix))
    for o in snapshots.list_objects():
        if not _is_snapshot(ListedObject("snapshots/" + o.path, o.key, o.size, o.etag)):
            continue
        body = dest.get_bytes(o.key)
        if body is None:
            continue  # deleted since the listing
        try:
            there = parse_mirror_commit(body, where=dest.url(o.key)).repo_id
        except InvalidListingError:
            continue  # unreadable: replaced if it is this commit's (see _write_commit)
        if there.casefold() != repo_id.casefold():
            raise InvalidListingError(
                f"{dest.url(dest.prefix)} holds the mirror of {there}; not mirroring {repo_id} "
                "there (a mirror prefix holds one repo: choose another prefix)"
            )
        return


def _write_commit(dest: S3Prefix, commit: MirrorCommit, body: bytes) -> None:
    """Write the commit's metadata unless the same files are recorded already (a mirror run
    again keeps the first record, and its time)."""
    key = snapshot_key(dest.prefix, commit.commit)
    existing = dest.get_bytes(key)
    if existing is not None:
        try:
            same = parse_mirror_commit(existing, where=dest.url(key)).files == commit.files
        except InvalidListingError as exc:
            log.warning("replacing unreadable metadata: %s", exc)
            same = False
        if same:
            return
    dest.put_small(key, body)


def _write_ref(dest: S3Prefix, ref: str, commit: str) -> None:
    key = ref_key(dest.prefix, ref)
    if dest.get_bytes(key) != commit.encode():
        dest.put_small(key, commit.encode())


def _is_snapshot(o: ListedObject) -> bool:
    return o.path.startswith("snapshots/") and o.path.endswith(".json")


def _read_commit(src: S3Prefix, o: ListedObject) -> tuple[MirrorCommit, bytes]:
    body = src.get_bytes(o.key)
    if body is None:
        raise SourceError(f"{src.url(o.key)}: listed, then gone")
    commit = parse_mirror_commit(body, where=src.url(o.key))
    if snapshot_key(src.prefix, commit.commit) != o.key:
        raise InvalidListingError(f"{src.url(o.key)} holds commit {commit.commit}")
    return commit, body


def _read_refs(src: S3Prefix, listing: dict[str, ListedObject]) -> dict[str, str]:
    refs: dict[str, str] = {}
    start = refs_prefix(src.prefix)[len(src.prefix) :]
    for path, o in listing.items():
        if path.startswith(start):
            body = src.get_bytes(o.key) or b""
            refs[path[len(start) :]] = parse_ref_body(body, where=src.url(o.key))
    return refs


def _mirror_blob(
    src: S3Prefix,
    dest: S3Prefix,
    listing: dict[str, ListedObject],
    commit: MirrorCommit,
    f: MirrorFile,
) -> _Blob:
    """A blob of the source mirror, to be checked against the ids its metadata records."""
    rel = blob_key("", f.id)
    o = listing.get(rel)
    if o is None or o.size != f.size:
        found = "missing" if o is None else f"{o.size} bytes"
        raise SourceError(
            f"{src.url(src.prefix + rel)}: {f.path} of commit {commit.commit[:12]} needs this "
            f"blob of {f.size} bytes; it is {found}"
        )
    checks = (
        Checksum(f.id_kind, f.id, origin="mirror"),
        Checksum("crc64nvme", f.crc64nvme, encoding="base64", origin="mirror"),
    )
    file = RemoteFile(f.path, f.size, version=o.etag, checksums=checks, locator=o.key)
    return _Blob(f.id, f.id_kind, file, blob_key(dest.prefix, f.id), expected_crc=f.crc64nvme)


def _copy_plain(
    listing: dict[str, ListedObject],
    source: Source,
    dest: S3Prefix,
    config: MirrorConfig,
    progress: ProgressSink | None,
    stop: threading.Event | None,
    result: MirrorResult,
) -> MirrorResult:
    """Copy a prefix that is not a mirror, key for key, each object checked against the
    checksums its source states (HEAD) and re-uploaded with a CRC64NVME."""
    listed = [RemoteFile(o.path, o.size, version=o.etag, locator=o.key) for o in listing.values()]
    with ThreadPoolExecutor(config.transfer.concurrency, thread_name_prefix="mirror-head") as pool:
        files = list(pool.map(source.describe, listed))
    blobs = [
        _Blob(f.path, "", f, dest.prefix + f.path, _stated_crc(f), content_addressed=False)
        for f in files
    ]
    unchecked = [b.file.path for b in blobs if not streamable_checks(b.file.checksums)]
    if unchecked:
        log.warning(
            "%d object(s) state no checksum that can be checked while copying (e.g. %s): "
            "copied with a new CRC64NVME only",
            len(unchecked),
            unchecked[0],
        )
    result.files = len(blobs)
    _transfer(blobs, source, dest, config, progress, stop, dest.prefix or dest.bucket, result)
    return result


def _stated_crc(file: RemoteFile) -> str | None:
    """The whole-object CRC64NVME the source states for ``file``, if any."""
    for c in file.checksums:
        if c.algorithm == "crc64nvme" and not c.composite and c.encoding == "base64":
            return c.value
    return None
