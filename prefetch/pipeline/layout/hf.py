"""The Hugging Face cache layout, exactly as huggingface_hub 2.x reads it offline.

::

    <cache_dir>/                                  = HF_HOME (vLLM runs with HF_HUB_OFFLINE=1)
    ├── hub/models--<org>--<name>/                what huggingface_hub sees, nothing else in it
    │   ├── blobs/<blob>                          content, named by its id (below)
    │   ├── snapshots/<commit>/<path>             relative symlinks: ../../blobs/<blob>, one more
    │   │                                         ../ per directory level of <path>
    │   └── refs/<revision>                       the bare commit sha, no newline
    └── .prefetch/hub/models--<org>--<name>/      ours: lock, partial/, manifest.json
                                                  (published.jsonl between commits)

Our state lives outside ``hub/``: huggingface_hub's ``scan_cache_dir`` takes every entry of
``hub/`` but ``.locks`` for a repo and warns about anything else, and it must see pristine repos.

Blob names: what huggingface_hub gives Hub files (sha256 for LFS, git blob sha1 otherwise). For
S3 mirrors (``--hf-repo``): the object's sha256 when the engine verified one (sidecar or S3
SHA256), so a later Hub pull of the repo finds the blob; otherwise ``s3-<ETag>-<size>``, which
every ranged read was pinned to and which changes iff the object does. A 64-hex name is never
anything but the content's sha256, and no file is hashed twice to get one (a full re-read).

Publishing: ``publish`` renames a verified file from ``partial/`` into ``blobs/``; ``commit``
builds the snapshot's links in a hidden directory renamed into place (huggingface_hub offline
takes any existing snapshot folder as complete), compacts the records and writes the ref last.
A blob published earlier is only linked. With ``delete``, a commit also removes the snapshots
its ref moved away from that no ref names (after a grace period), then blobs nothing links.
:class:`HfCacheLayout` decides and records; :class:`~prefetch.pipeline.layout.hf_tree.HubRepoTree`
makes each change to the folder huggingface_hub reads.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import os
import re
import time
from pathlib import Path

from prefetch.pipeline import verify
from prefetch.pipeline.backends import backend
from prefetch.pipeline.layout.base import (
    FileRecord,
    RecordBook,
    RecordedFile,
    Records,
    SnapshotRecord,
    entry_checksums,
    file_entry,
    make_dirs_inside,
    refuse_symlinks,
    safe_join,
)
from prefetch.pipeline.layout.hf_tree import (
    HubRepoTree,
    fsync_dir,
    move_into,
    points_to,
    safe_name,
)
from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec
from prefetch.support.errors import LayoutError
from prefetch.support.paths import STATE_DIR, path_problem

HUB_DIR = "hub"
REPO_PREFIX = "models--"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")  # an ETag that names a blob as it is
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def repo_folder(repo_id: str) -> str:
    """``org/name`` -> ``models--org--name``, refusing ids that would not be one safe folder."""
    if not _REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id:
        raise LayoutError(f"not a Hub repo id usable in the cache: {repo_id!r}")
    return REPO_PREFIX + repo_id.replace("/", "--")


def repo_id_of(folder: str) -> str:
    """``models--org--name`` -> ``org/name``."""
    return folder.removeprefix(REPO_PREFIX).replace("--", "/")


def is_repo_folder(name: str) -> bool:
    """Is ``name`` (an entry of ``hub/``) a model repo folder, ours or not?"""
    return name.startswith(REPO_PREFIX)


def repo_dir(cache_dir: Path, repo_id: str) -> Path:
    """Where the Hub repo ``repo_id`` lives in a cache: ``cache_dir/hub/models--<org>--<name>``
    (LayoutError for an id that would not be one safe folder, see ``repo_folder``)."""
    return Path(cache_dir) / HUB_DIR / repo_folder(repo_id)


def repo_state_dir(cache_dir: Path, folder: str) -> Path:
    """Our state (lock, partials, records, the Store's usage) for the repo folder ``folder`` of
    ``cache_dir/hub``: ``cache_dir/.prefetch/hub/<folder>``, outside ``hub/`` (see the module
    docstring). LayoutError unless ``folder`` is one safe ``models--*`` folder name."""
    return Path(cache_dir) / STATE_DIR / HUB_DIR / check_repo_folder(folder)


def check_repo_folder(folder: str) -> str:
    """``folder`` if it is one safe ``models--*`` folder name for ``hub/`` (ours or another
    tool's: its id need not round-trip through ``repo_folder``); else LayoutError."""
    problem = path_problem(folder)
    if problem is None and (not is_repo_folder(folder) or "/" in folder):
        problem = f"not a {REPO_PREFIX}* folder"
    if problem is not None:
        raise LayoutError(f"not a Hub repo folder in the cache: {folder!r}: {problem}")
    return folder


def _verified_sha256(checksum: Checksum | None) -> str | None:
    """The hex sha256 of the whole content, when that is what the engine verified."""
    if checksum is None or checksum.algorithm != "sha256" or checksum.part_sizes is not None:
        return None
    value = checksum.value.strip().strip('"')
    if checksum.encoding == "base64":
        try:
            value = base64.b64decode(value, validate=True).hex()
        except (binascii.Error, ValueError):
            return None
    value = value.lower()
    return value if _SHA256.match(value) else None


class HfCacheLayout:
    """One Hub repository in the Hugging Face cache under ``cache_dir`` (= HF_HOME)."""

    def __init__(self, cache_dir: Path, repo_id: str) -> None:
        self.cache_dir = Path(cache_dir)
        self.repo_id = repo_id
        self.root = repo_dir(self.cache_dir, repo_id)
        self.folder = self.root.name
        #: The folder huggingface_hub reads (blobs/, snapshots/, refs/), changed safely.
        self.tree = HubRepoTree(self.cache_dir, self.root)
        self.blobs = self.tree.blobs
        self.snapshots = self.tree.snapshots
        self.refs = self.tree.refs
        self.state = repo_state_dir(self.cache_dir, self.folder)
        self.book = RecordBook(self.state)
        self._entries: dict[str, FileRecord] | None = None
        self._index: dict[tuple[str, int], str] | None = None

    # -- paths -----------------------------------------------------------------------------------

    def lock_path(self) -> Path:
        return self.state / "lock"

    def staging_dir(self) -> Path:
        return self.state / "partial"

    def prepare(self) -> None:
        make_dirs_inside(self.cache_dir, self.staging_dir())
        for d in (self.blobs, self.snapshots):  # scan_cache_dir wants snapshots/ to exist
            make_dirs_inside(self.cache_dir, d)

    def model_path(self, snapshot: Snapshot) -> Path:
        return self.snapshots / safe_name(snapshot.revision_id, "snapshot id")

    def blob_path(self, blob: str) -> Path:
        return self.tree.blob_path(blob)

    # -- records ---------------------------------------------------------------------------------

    def _loaded(self) -> dict[str, FileRecord]:
        if self._entries is None:
            self._entries = self.book.load()["entries"]
            self._index = None
        return self._entries

    def _blob_for(self, file: RemoteFile) -> str | None:
        """The blob we published for this exact source version (None: none yet)."""
        if self._index is None:
            self._index = {
                (str(version), int(e["size"])): blob
                for blob, e in sorted(self._loaded().items())
                for version in e.get("versions", [e.get("version", "")])
            }
        blob = self._index.get((file.version, file.size))
        if blob is None and file.blob_id and file.version == file.blob_id:
            # a Hub file whose content we already hold under its id (e.g. from an S3 mirror
            # named by the sha256 it was verified with)
            entry = self._loaded().get(file.blob_id)
            if entry is not None and int(entry["size"]) == file.size:
                blob = file.blob_id
        return blob

    def _blob_ok(self, blob: str, size: int) -> bool:
        try:
            return self.blob_path(blob).stat().st_size == size
        except FileNotFoundError:
            return False

    def is_current(self, file: RemoteFile) -> bool:
        blob = self._blob_for(file) if file.version else None
        return blob is not None and self._blob_ok(blob, file.size)

    # -- publish ---------------------------------------------------------------------------------

    def blob_name(self, file: RemoteFile, checksum: Checksum | None, staged: Path) -> str:
        """The name of a verified file's blob (see the module docstring)."""
        if file.blob_id and file.version == file.blob_id:
            return safe_name(file.blob_id, "blob id")  # a Hub file: the Hub names it
        sha256 = _verified_sha256(checksum)
        if sha256 is not None:
            return sha256
        if file.version:
            etag = file.version.strip('"')
            if _NAME.match(etag) and len(etag) <= 100:
                return f"s3-{etag}-{file.size}"
            return f"s3-{hashlib.sha1(etag.encode()).hexdigest()}-{file.size}"
        # no version to name it by (a server without ETags): hash the content itself
        return verify.hash_file(staged, Checksum("sha256", ""))

    def publish(self, file: RemoteFile, staged: Path, checksums: tuple[Checksum, ...]) -> None:
        # a verified sha256 (served, or a sidecar's) names the blob by its content
        naming = next((c for c in checksums if _verified_sha256(c)), None)
        blob = self.blob_name(file, naming or (checksums[0] if checksums else None), staged)
        target = self.blob_path(blob)
        self.tree.make_dir(self.blobs)
        self.tree.make_dir(self.snapshots)  # scan_cache_dir wants it to exist
        move_into(staged, target)
        entry = file_entry(file, checksums or verify.checks_for(file.checksums))
        # the same content may come from several source versions (two S3 objects with one
        # sha256): remember them all, or each pull would fetch one of them again
        previous = self._loaded().get(blob)
        versions = {file.version}
        if previous is not None:
            versions.update(previous.get("versions", [previous.get("version", "")]))
        entry["blob"] = blob
        entry["versions"] = sorted(v for v in versions if v)
        self.book.append(blob, entry)
        self._loaded()[blob] = entry
        if self._index is not None:
            self._index[(file.version, file.size)] = blob

    # -- commit ----------------------------------------------------------------------------------

    def commit(
        self, snapshot: Snapshot, spec: ModelSpec, *, delete: bool, superseded_grace: float = 0.0
    ) -> list[str]:
        data = self.book.load()
        entries = data["entries"]
        self._entries, self._index = entries, None
        commit = safe_name(snapshot.revision_id, "snapshot id")
        links: dict[str, str] = {}
        for f in snapshot.files:
            blob = self._blob_for(f)
            if blob is None or not self._blob_ok(blob, f.size):
                raise LayoutError(
                    f"{f.path}: its blob is missing from {self.blobs} (removed during the pull?)",
                    hint="run the pull again",
                )
            links[f.path] = blob
        self.tree.make_dir(self.snapshots)
        self.tree.remove_leftovers()
        final = refuse_symlinks(self.cache_dir, self.snapshots / commit)
        self.tree.place_snapshot(final, links)
        snaps = data.setdefault("snapshots", {})
        previous = dict(snaps.get(commit, {}).get("files", {}))
        deleted: list[str] = []
        if delete:
            deleted = self.tree.delete_extra(final, set(links))
            files = links
        else:
            files = {p: b for p, b in previous.items() if (final / p).is_symlink()} | links
        ref = snapshot.requested_revision
        if ref is None:
            # an S3 or OCI source: its snapshot is what "main" means offline (a Hub model pinned
            # to a commit gets no ref, whether the Hub or one of its mirrors served it)
            ref = backend(spec.source.scheme).offline_ref
        # every ref this snapshot was pulled for (a branch and a tag may name one commit)
        refs = sorted({*_refs_of(snaps.get(commit, {})), *([ref] if ref else [])})
        snaps[commit] = {"files": dict(sorted(files.items())), "source": snapshot.source,
                         "refs": refs}  # fmt: skip
        if delete:
            self._remove_unreferenced_blobs(entries)
        data["format"] = 1
        data["repo_id"] = self.repo_id
        self.book.compact(data)
        for d in (self.blobs, final):
            fsync_dir(d)
        if ref is not None:
            self.tree.write_ref(ref, commit)
            if delete:
                deleted += self._prune_superseded(data, ref, commit, superseded_grace)
        return deleted

    def _prune_superseded(self, data: Records, ref: str, current: str, grace: float) -> list[str]:
        """Remove the snapshots we made for ``ref`` that it has moved away from and no other ref
        names, ``grace`` seconds after a commit first found them so (a vLLM that read the old ref
        just before it moved is still opening that snapshot's files), then the blobs only they
        linked. Runs after the new ref is written: readers switch first, then the old copy goes.
        Returns the removed files as ``path@<commit>``."""
        snaps = data["snapshots"]
        named = self.tree.ref_targets()
        now = time.time()
        changed = False
        removed: list[str] = []
        for commit, snap in sorted(snaps.items()):
            if commit == current or ref not in _refs_of(snap):
                continue
            if commit in named:  # another ref (a tag, say) still names it: keep it
                changed |= snap.pop("superseded", None) is not None
                continue
            if "superseded" not in snap:  # first found superseded: the grace starts now
                snap["superseded"] = now
                changed = True
            if now - snap["superseded"] < grace:
                continue
            self.tree.remove_snapshot(commit)
            removed += [f"{path}@{commit[:12]}" for path in sorted(snap.get("files", {}))]
            del snaps[commit]
            changed = True
        if removed:
            self._remove_unreferenced_blobs(data["entries"])
        if changed:
            self.book.compact(data)
        return removed

    def _remove_unreferenced_blobs(self, entries: dict[str, FileRecord]) -> None:
        """Delete blobs we published that no snapshot (ours or not) links any more."""
        for blob in self.tree.remove_unlinked(entries):
            del entries[blob]
        self._index = None

    # -- what is there ---------------------------------------------------------------------------

    def recorded(self) -> list[RecordedFile]:
        """Every file of every snapshot we recorded that is still on disk; a blob shared by
        several snapshots is listed once (its other links are listed only if they point
        elsewhere). ``path`` is the repo path, ``@<commit>`` added when several snapshots exist."""
        data = self.book.load()
        entries = data["entries"]
        present = [
            (commit, snap)
            for commit, snap in sorted(data.get("snapshots", {}).items())
            if (self.snapshots / commit).is_dir()
        ]
        out: list[RecordedFile] = []
        seen: set[str] = set()
        for commit, snap in present:
            for path, blob in sorted(snap.get("files", {}).items()):
                entry = entries.get(blob)
                if entry is None:
                    continue
                local = safe_join(self.snapshots / commit, path)
                if blob in seen and points_to(local, self.blob_path(blob)):
                    continue
                seen.add(blob)
                out.append(
                    RecordedFile(
                        path=f"{path}@{commit[:12]}" if len(present) > 1 else path,
                        local=local,
                        size=int(entry["size"]),
                        version=str(entry.get("version", "")),
                        checksums=entry_checksums(entry),
                    )
                )
        return out

    def forget(self, path: str) -> None:
        """Drop the blob behind a recorded file (it failed re-verification): the next sync sees
        it missing and fetches it again; its links come back valid with it. A link that leads
        anywhere but our blobs/ (planted) is removed itself, never what it points to."""
        for rec in self.recorded():
            if rec.path == path:
                target = Path(os.path.realpath(rec.local))
                ours = target.parent == Path(os.path.realpath(self.blobs))
                with contextlib.suppress(OSError):
                    (target if ours else rec.local).unlink()
                self._entries = self._index = None
                return


def _refs_of(snap: SnapshotRecord) -> list[str]:
    """The refs a snapshot record was pulled for (older records kept one, as "revision")."""
    if "refs" in snap:
        return list(snap["refs"])
    return [snap["revision"]] if snap.get("revision") else []


def hub_layouts(cache_dir: Path) -> list[HfCacheLayout]:
    """The layouts of every ``hub/models--*`` repo under ``cache_dir`` (recorded by us or not)."""
    hub = Path(cache_dir) / HUB_DIR
    out: list[HfCacheLayout] = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for d in sorted(hub.iterdir()):
            if is_repo_folder(d.name) and d.is_dir() and not d.is_symlink():
                with contextlib.suppress(LayoutError):
                    out.append(HfCacheLayout(Path(cache_dir), repo_id_of(d.name)))
    return out


__all__ = [
    "HUB_DIR",
    "REPO_PREFIX",
    "HfCacheLayout",
    "check_repo_folder",
    "hub_layouts",
    "is_repo_folder",
    "repo_dir",
    "repo_folder",
    "repo_id_of",
    "repo_state_dir",
]
