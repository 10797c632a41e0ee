"""The chunk engine against an in-memory source: request grouping, resume granularity, hashing
while downloading, and the O_DIRECT write path with its fallbacks.

The S3 and Hub tests run the same engine against real servers; these pin down behaviour that is
hard to provoke there (a failure after exactly N bytes, a filesystem refusing O_DIRECT).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import itertools
import mmap
import os
import threading
from pathlib import Path

import pytest

from prefetch.pipeline import verify
from prefetch.pipeline.engine import transfer
from prefetch.pipeline.engine.partial_file import PageBuffers, no_space
from prefetch.pipeline.engine.plan import group_chunks, plan_chunks
from prefetch.pipeline.engine.transfer import Transfer, TransferConfig
from prefetch.pipeline.progress import NullProgress
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.snapshot import Checksum, RemoteFile
from prefetch.support.errors import (
    ChecksumMismatchError,
    InsufficientSpaceError,
    SourceChangedError,
    SourceError,
    TransferError,
)
from tests.fakes.memory import MemoryReader, MemorySource, crc32_file, sha256_file

KiB = 1024
MiB = 1024 * KiB
NO_RETRY = RetryPolicy(attempts=1, base_delay=0.0, max_delay=0.0)


def run(
    source: MemorySource, files: list[RemoteFile], staging: Path, dest: Path, **config: object
) -> object:
    def publish(file: RemoteFile, staged: Path, checksum: Checksum | None) -> None:
        target = dest / file.path
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, target)

    cfg = TransferConfig(
        **{"concurrency": 4, "buffer_size": 256 * KiB, "retry": NO_RETRY, **config}
    )
    return Transfer(source, staging, publish, cfg).run(files)


def test_group_chunks_makes_runs_of_consecutive_missing_pieces() -> None:
    chunks = plan_chunks(10 * MiB, 1 * MiB, None)
    assert group_chunks(chunks, list(range(10)), 4 * MiB) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # a hole in what is missing starts a new request; unsorted input is fine
    assert group_chunks(chunks, [7, 1, 2, 5, 6], 4 * MiB) == [[1, 2], [5, 6, 7]]
    # a request never exceeds the request size, but one chunk larger than it is still one request
    assert group_chunks(plan_chunks(3 * MiB, 2 * MiB, None), [0, 1], 1 * MiB) == [[0], [1]]


def test_one_request_spans_many_pieces(tmp_path: Path) -> None:
    data = os.urandom(10 * MiB + 123)
    source = MemorySource({"w.bin": data})
    run(
        source,
        [crc32_file("w.bin", data)],
        tmp_path / "st",
        tmp_path / "out",
        chunk_size=4 * MiB,
        piece_size=1 * MiB,
    )
    assert (tmp_path / "out" / "w.bin").read_bytes() == data
    assert sorted((s, e) for _, s, e in source.requests) == [
        (0, 4 * MiB),
        (4 * MiB, 8 * MiB),
        (8 * MiB, 10 * MiB + 123),
    ]


def test_a_failed_request_keeps_its_finished_pieces_for_the_next_pull(tmp_path: Path) -> None:
    """Resume granularity is the piece, not the request: a 16 MiB request that fails after 5.5 MiB
    leaves 5 pieces journaled, and the next pull asks only for the rest."""
    data = os.urandom(16 * MiB)
    file = sha256_file("shard.safetensors", data)
    staging, out = tmp_path / "st", tmp_path / "out"
    broken = MemorySource({file.path: data}, fail_after=5 * MiB + MiB // 2)
    with pytest.raises(SourceError, match="failed on purpose"):
        run(broken, [file], staging, out, concurrency=1, chunk_size=16 * MiB, piece_size=1 * MiB)
    assert broken.requests == [(file.path, 0, 16 * MiB)]
    assert not (out / file.path).exists()

    healthy = MemorySource({file.path: data})
    stats = run(
        healthy, [file], staging, out, concurrency=1, chunk_size=16 * MiB, piece_size=1 * MiB
    )
    assert healthy.requests == [(file.path, 5 * MiB, 16 * MiB)]
    assert healthy.served == 11 * MiB
    assert stats.resumed_bytes == 5 * MiB  # type: ignore[attr-defined]
    assert (out / file.path).read_bytes() == data


@pytest.mark.parametrize("size", [9 * MiB, 20 * MiB + 4097])
def test_sequential_checksums_are_hashed_while_downloading(tmp_path: Path, size: int) -> None:
    """sha256 of a large file is fed in file order as contiguous pieces land (out of order across
    4 streams), so only the tail is hashed after the last byte; the result is the file's sha256."""
    data = os.urandom(size)
    file = sha256_file("big.bin", data)
    fed: list[tuple[int, int]] = []
    real = verify.hash_range

    def spy(h: verify.Hasher, path: Path, start: int, end: int, direct: bool = True) -> None:
        fed.append((start, end))
        real(h, path, start, end, direct)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verify, "hash_range", spy)
        run(
            MemorySource({file.path: data}),
            [file],
            tmp_path / "st",
            tmp_path / "out",
            chunk_size=2 * MiB,
            piece_size=1 * MiB,
        )
    assert (tmp_path / "out" / file.path).read_bytes() == data
    # the ranges handed to the hasher tile the file exactly, in order
    assert len(fed) > 1, "hashed in one go at the end, not while downloading"
    assert fed[0][0] == 0 and fed[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(fed))


def test_sequential_checksum_mismatch_is_caught_and_names_the_file(tmp_path: Path) -> None:
    data = os.urandom(12 * MiB)
    file = sha256_file("big.bin", data)
    corrupt = bytearray(data)
    corrupt[7 * MiB + 5] ^= 0x01
    with pytest.raises(ChecksumMismatchError, match=r"big\.bin"):
        run(
            MemorySource({file.path: bytes(corrupt)}),
            [file],
            tmp_path / "st",
            tmp_path / "out",
            chunk_size=2 * MiB,
            piece_size=1 * MiB,
        )
    assert not (tmp_path / "out" / file.path).exists()
    assert not list((tmp_path / "st").glob("*.incomplete")), "a corrupt download is not kept"


def _record_open_flags(mp: pytest.MonkeyPatch) -> list[int]:
    flags: list[int] = []
    real = os.open

    def spy(path: object, flag: int, *args: object, **kwargs: object) -> int:
        flags.append(flag)
        return real(path, flag, *args, **kwargs)  # type: ignore[arg-type]

    mp.setattr(os, "open", spy)
    return flags


def direct_io_supported(directory: Path) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".direct-probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def pull_one(data: bytes, where: Path, **config: object) -> Path:
    """Run one large sha256-verified file through the engine; return where it landed."""
    run(
        MemorySource({"a.bin": data}),
        [sha256_file("a.bin", data)],
        where / "st",
        where / "out",
        chunk_size=4 * MiB,
        piece_size=1 * MiB,
        **config,
    )
    return where / "out" / "a.bin"


def test_large_files_are_written_with_o_direct(tmp_path: Path) -> None:
    if not direct_io_supported(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    data = os.urandom(9 * MiB + 1000)  # large, with an unaligned tail written buffered
    small = os.urandom(4000)
    files = [crc32_file("big.bin", data), crc32_file("small.json", small)]
    with pytest.MonkeyPatch.context() as mp:
        flags = _record_open_flags(mp)
        run(
            MemorySource({"big.bin": data, "small.json": small}),
            files,
            tmp_path / "st",
            tmp_path / "out",
            chunk_size=4 * MiB,
            piece_size=1 * MiB,
        )
    assert sum(1 for f in flags if f & os.O_DIRECT and f & os.O_WRONLY) == 1  # the large file only
    assert (tmp_path / "out" / "big.bin").read_bytes() == data
    assert (tmp_path / "out" / "small.json").read_bytes() == small

    with pytest.MonkeyPatch.context() as mp:
        flags = _record_open_flags(mp)
        assert pull_one(data, tmp_path / "buffered", direct_io=False).read_bytes() == data
    assert not any(f & os.O_DIRECT for f in flags), "direct_io=False: no O_DIRECT at all"


def _huge_page_advised(view: memoryview) -> bool:
    """Is the mapping holding ``view`` advised onto transparent huge pages (``hg`` among its
    VmFlags in /proc/self/smaps)?"""
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return "hg" in line.split()
    return False


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text() or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="no transparent huge pages here",
)
def test_large_files_are_written_from_buffers_on_huge_pages(tmp_path: Path) -> None:
    if not direct_io_supported(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    data = os.urandom(9 * MiB)
    advised: list[bool] = []
    real = os.pwrite

    def spy(fd: int, buf: memoryview, offset: int) -> int:
        advised.append(_huge_page_advised(buf))
        return real(fd, buf, offset)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "pwrite", spy)
        assert pull_one(data, tmp_path / "out", buffer_size=1 * MiB).read_bytes() == data
    assert advised and all(advised), "every write comes from a buffer advised onto huge pages"


def test_each_thread_gets_a_page_aligned_buffer_of_its_own() -> None:
    buffers = PageBuffers(5000, 3)  # (not a whole number of pages: each still starts on one)
    views = [buffers.take() for _ in range(7)]  # more than ``count``: another mapping
    starts = [ctypes.addressof(ctypes.c_char.from_buffer(v)) for v in views]
    assert all(len(v) == 5000 for v in views)
    assert all(a % 4096 == 0 for a in starts)
    spans = sorted((a, a + 5000) for a in starts)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans)), "no overlap"


def test_o_direct_refused_at_open_falls_back_to_buffered(tmp_path: Path) -> None:
    """Filesystems without O_DIRECT (older tmpfs, some FUSE and network mounts) refuse the open
    with EINVAL: writes and the sha256 read-back go through the page cache instead."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open
    refused: list[int] = []

    def refusing_open(path: object, flag: int, *args: object, **kwargs: object) -> int:
        if flag & os.O_DIRECT:
            refused.append(flag)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flag, *args, **kwargs)  # type: ignore[arg-type]

    data = os.urandom(9 * MiB)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "open", refusing_open)
        assert pull_one(data, tmp_path).read_bytes() == data
    assert any(f & os.O_WRONLY for f in refused) and any(f & os.O_WRONLY == 0 for f in refused)


def test_o_direct_refused_at_write_falls_back_to_buffered(tmp_path: Path) -> None:
    """Some filesystems accept O_DIRECT at open and refuse the write (EINVAL)."""
    if not direct_io_supported(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    real_pwrite = os.pwrite
    refused: list[int] = []

    def pwrite(fd: int, buf: object, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, buf, offset)  # type: ignore[arg-type]

    data = os.urandom(9 * MiB)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "pwrite", pwrite)
        assert pull_one(data, tmp_path).read_bytes() == data
    assert refused, "the O_DIRECT descriptor was tried first"


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("where", ["tmp", "shm"])
@pytest.mark.parametrize("start,end", [(0, 5 * MiB), (4097, 9 * MiB - 3), (8 * MiB - 1, 9 * MiB)])
def test_hash_range_reads_any_range(
    tmp_path: Path, where: str, start: int, end: int, direct: bool
) -> None:
    base = tmp_path if where == "tmp" else Path("/dev/shm")
    if not (base.is_dir() and os.access(base, os.W_OK)):
        pytest.skip(f"{base} is not writable")
    path = base / f"hash-range-{os.getpid()}.bin"
    data = os.urandom(9 * MiB)
    path.write_bytes(data)
    try:
        h = verify.new_hasher("sha256")
        verify.hash_range(h, path, start, end, direct)
        assert h.digest() == hashlib.sha256(data[start:end]).digest()
        with pytest.raises(OSError, match="shorter"):
            verify.hash_range(verify.new_hasher("sha256"), path, 0, len(data) + 10)
    finally:
        path.unlink()


def test_describes_run_a_window_ahead_of_downloads_not_all_up_front(tmp_path: Path) -> None:
    """A describe may hold a small object's body in memory (S3: fetched whole by one GET) until
    its download runs: at most ``concurrency`` files are described ahead of their downloads."""
    objects = {f"f{i:03d}.bin": os.urandom(1000 + i) for i in range(200)}
    source = MemorySource(objects)
    run(source, [crc32_file(p, d) for p, d in objects.items()], tmp_path / "st", tmp_path / "out")
    ahead = worst = 0
    for kind, _ in source.events:
        ahead += 1 if kind == "describe" else -1
        worst = max(worst, ahead)
    assert worst <= 2 * 4, f"{worst} files were described before their download started"
    assert all((tmp_path / "out" / p).read_bytes() == d for p, d in objects.items())


def test_a_one_chunk_file_is_hashed_as_it_arrives_and_keeps_no_journal(tmp_path: Path) -> None:
    """Small files (one chunk) get their sha256 inline, never read back, and no journal file: a
    one-chunk file has nothing to resume. Corruption is still caught."""
    data = os.urandom(300 * KiB)
    file = sha256_file("tokenizer.json", data)
    big = os.urandom(3 * MiB)
    big_file = sha256_file("big.bin", big)
    with pytest.MonkeyPatch.context() as mp:
        read_back: list[str] = []
        real = verify.hash_file
        mp.setattr(
            verify,
            "hash_file",
            lambda p, c, *a, **k: read_back.append(str(p)) or real(p, c, *a, **k),
        )
        run(MemorySource({file.path: data}), [file], tmp_path / "st", tmp_path / "out")
    assert read_back == [] and (tmp_path / "out" / file.path).read_bytes() == data

    corrupt = bytearray(data)
    corrupt[12345] ^= 0x40
    with pytest.raises(ChecksumMismatchError, match=r"tokenizer\.json"):
        run(MemorySource({file.path: bytes(corrupt)}), [file], tmp_path / "st2", tmp_path / "o2")

    # interrupted: a one-chunk file leaves no journal, a multi-chunk file one to resume from
    with pytest.raises(SourceError):
        run(
            MemorySource({file.path: data}, fail_after=100 * KiB),
            [file],
            tmp_path / "st3",
            tmp_path / "o3",
        )
    assert list((tmp_path / "st3").glob("*.incomplete"))
    assert not list((tmp_path / "st3").glob("*.journal"))
    with pytest.raises(SourceError):
        run(
            MemorySource({big_file.path: big}, fail_after=MiB + 10),
            [big_file],
            tmp_path / "st4",
            tmp_path / "o4",
            concurrency=1,
            chunk_size=1 * MiB,
            piece_size=1 * MiB,
        )
    (journal,) = (tmp_path / "st4").glob("*.journal")
    assert len(journal.read_text().splitlines()) == 2  # the header and the one finished chunk


def test_a_small_file_is_created_written_and_fsynced_by_a_worker_not_the_coordinator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of one chunk is one io task (fetch, write, hash, fsync): the coordinator, whose
    every system call also waits for the GIL behind the download threads, only checks and
    publishes. Its partial file is durable before it is published."""
    events: list[tuple[str, str, str]] = []  # (call, thread, path or fd)
    real_open, real_fsync, real_fallocate = os.open, os.fsync, os.posix_fallocate
    names: dict[int, str] = {}

    def spy_open(path: object, *args: object, **kwargs: object) -> int:
        fd = real_open(path, *args, **kwargs)  # type: ignore[arg-type]
        names[fd] = str(path)
        if str(path).endswith(".incomplete"):
            events.append(("open", threading.current_thread().name, str(path)))
        return fd

    def spy_fsync(fd: int) -> None:
        real_fsync(fd)
        events.append(("fsync", threading.current_thread().name, names.get(fd, "")))

    def spy_fallocate(fd: int, offset: int, length: int) -> None:
        events.append(("fallocate", threading.current_thread().name, names.get(fd, "")))
        real_fallocate(fd, offset, length)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "posix_fallocate", spy_fallocate)
    objects = {f"f{i}.json": os.urandom(3000 + i) for i in range(20)}
    published: list[tuple[str, bool]] = []
    dest = tmp_path / "out"

    def publish(file: RemoteFile, staged: Path, checks: tuple[Checksum, ...]) -> None:
        synced = ("fsync", str(staged)) in {(call, path) for call, _, path in events}
        published.append((file.path, synced and bool(checks)))
        dest.mkdir(exist_ok=True)
        os.replace(staged, dest / file.path)

    cfg = TransferConfig(concurrency=4, buffer_size=256 * KiB, retry=NO_RETRY)
    files = [sha256_file(p, d) for p, d in objects.items()]
    Transfer(MemorySource(objects), tmp_path / "st", publish, cfg).run(files)
    assert {(dest / p).read_bytes() == d for p, d in objects.items()} == {True}
    assert sorted(published) == sorted((p, True) for p in objects)  # fsynced, then published
    assert [e for e in events if e[0] == "fallocate"] == []  # one write: nothing to preallocate
    assert {thread for call, thread, _ in events} <= {f"prefetch-io_{i}" for i in range(4)}


def test_a_small_file_with_one_corrupt_byte_is_fetched_again_then_refused_unpublished(
    tmp_path: Path,
) -> None:
    data = os.urandom(100 * KiB)
    file = sha256_file("small.bin", data)
    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 0x01
    source = MemorySource({file.path: bytes(corrupt)})
    with pytest.raises(ChecksumMismatchError, match=r"small\.bin"):
        run(source, [file], tmp_path / "st", tmp_path / "out")
    assert source.opened == ["small.bin", "small.bin"]  # deleted, fetched once more, refused
    assert not (tmp_path / "out").exists()
    assert list((tmp_path / "st").iterdir()) == []  # nothing left that looks resumable


def test_a_journal_left_by_an_earlier_plan_goes_when_the_file_now_fits_one_write(
    tmp_path: Path,
) -> None:
    """Pulled before with 64 KiB pieces and killed, now with the default 8 MiB: the file is
    fetched whole and the old journal (which no longer applies) is removed with it."""
    data = os.urandom(200 * KiB)
    file = sha256_file("w.bin", data)
    staging = tmp_path / "st"
    with pytest.raises(SourceError):
        run(
            MemorySource({file.path: data}, fail_after=100 * KiB),
            [file],
            staging,
            tmp_path / "out",
            chunk_size=64 * KiB,
            piece_size=64 * KiB,
            buffer_size=64 * KiB,
        )
    assert list(staging.glob("*.journal"))
    run(MemorySource({file.path: data}), [file], staging, tmp_path / "out")
    assert (tmp_path / "out" / "w.bin").read_bytes() == data
    assert list(staging.iterdir()) == []


class _HeldCoordinatorSource(MemorySource):
    """Describes ``later`` only once the coordinator is inside ``first``'s publish."""

    def __init__(self, objects: dict[str, bytes], later: str, publishing: threading.Event) -> None:
        super().__init__(objects)
        self.later, self.publishing = later, publishing
        self.later_opened = threading.Event()

    def describe(self, file: RemoteFile) -> RemoteFile:
        if file.path == self.later:
            assert self.publishing.wait(10), "the first file was never published"
        return super().describe(file)

    def open_range(self, file: RemoteFile, start: int, end: int) -> MemoryReader:
        reader = super().open_range(file, start, end)
        if file.path == self.later:
            self.later_opened.set()
        return reader


def test_a_small_file_is_downloaded_by_the_task_that_described_it_not_queued_by_the_coordinator(
    tmp_path: Path,
) -> None:
    """A small file's describe and download are one io task: the coordinator (one thread that
    checks and publishes every file) sees the file once, ready to publish, instead of once
    between describe and download. Here the coordinator is held inside the first file's publish
    until the second file's download has started; had the coordinator to queue that download
    after the describe, it would never start."""
    objects = {"a.json": os.urandom(1000), "b.json": os.urandom(2000)}  # a is described first
    publishing = threading.Event()
    source = _HeldCoordinatorSource(objects, "b.json", publishing)
    dest = tmp_path / "out"
    waited: list[bool] = []

    def publish(file: RemoteFile, staged: Path, checks: tuple[Checksum, ...]) -> None:
        if file.path == "a.json":
            publishing.set()
            waited.append(source.later_opened.wait(10))
        dest.mkdir(exist_ok=True)
        os.replace(staged, dest / file.path)

    cfg = TransferConfig(concurrency=2, buffer_size=256 * KiB, retry=NO_RETRY)
    files = [sha256_file(p, d) for p, d in objects.items()]
    Transfer(source, tmp_path / "st", publish, cfg).run(files)
    assert waited == [True], "b.json was downloaded only after the coordinator published a.json"
    assert {p: (dest / p).read_bytes() for p in objects} == objects


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="lists descriptors in /proc")
def test_a_small_file_that_fails_to_download_leaves_no_descriptor_open(tmp_path: Path) -> None:
    data = os.urandom(100 * KiB)
    file = sha256_file("small.bin", data)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(SourceError, match="failed on purpose"):
        run(MemorySource({file.path: data}, fail_after=10 * KiB), [file], tmp_path / "st", tmp_path)
    assert set(os.listdir("/proc/self/fd")) <= before


class _ChangingSource(MemorySource):
    """Every read finds the object changed (as a 412 on the pinned ETag would say)."""

    def open_range(self, file: RemoteFile, start: int, end: int) -> MemoryReader:
        raise SourceChangedError(f"{file.path}: changed while downloading")


def test_a_small_file_that_changed_mid_download_leaves_nothing_resumable(tmp_path: Path) -> None:
    data = os.urandom(100 * KiB)
    file = sha256_file("small.bin", data)
    with pytest.raises(SourceChangedError, match=r"small\.bin"):
        run(_ChangingSource({file.path: data}), [file], tmp_path / "st", tmp_path / "out")
    assert list((tmp_path / "st").iterdir()) == []
    assert not (tmp_path / "out").exists()


class _CountingProgress(NullProgress):
    def __init__(self) -> None:
        self.chunks = 0

    def chunk_done(self) -> None:
        self.chunks += 1


def test_the_engine_counts_the_ranged_requests_it_completed_not_a_plan(tmp_path: Path) -> None:
    """The chunks metric comes from the engine: a resumed file counts only the requests made for
    its missing part, a small file its one read, an empty file none."""
    data = os.urandom(16 * MiB)
    big = sha256_file("shard.safetensors", data)
    small = sha256_file("config.json", b"{}")
    empty = sha256_file("empty.txt", b"")
    staging, out = tmp_path / "st", tmp_path / "out"
    broken = MemorySource({big.path: data}, fail_after=5 * MiB + MiB // 2)
    with pytest.raises(SourceError, match="failed on purpose"):
        run(broken, [big], staging, out, concurrency=1, chunk_size=4 * MiB, piece_size=1 * MiB)
    objects = {big.path: data, small.path: b"{}", empty.path: b""}
    source = MemorySource(objects)
    progress = _CountingProgress()
    cfg = TransferConfig(
        concurrency=1, chunk_size=4 * MiB, piece_size=1 * MiB, buffer_size=256 * KiB, retry=NO_RETRY
    )

    def publish(file: RemoteFile, staged: Path, checks: tuple[Checksum, ...]) -> None:
        os.replace(staged, tmp_path / file.path)

    stats = Transfer(source, staging, publish, cfg, progress=progress).run([big, small, empty])
    # 11 MiB left of the big file: 4 + 4 + 3 MiB; the small file: one read
    assert len(source.requests) == 4
    assert stats.chunks_downloaded == progress.chunks == 4


def test_a_transfer_runs_once(tmp_path: Path) -> None:
    transfer = Transfer(MemorySource({}), tmp_path, lambda *a: None, TransferConfig())
    transfer.run([])
    with pytest.raises(TransferError, match="runs once"):
        transfer.run([])


@pytest.mark.parametrize("call", ["pwrite", "fsync"])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_is_one_error_wherever_the_write_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, code: int
) -> None:
    def full(*args: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, call, full)
    data = os.urandom(2 * MiB)
    with pytest.raises(InsufficientSpaceError, match="no space left on the device under") as info:
        run(MemorySource({"w.bin": data}), [sha256_file("w.bin", data)], tmp_path / "st", tmp_path)
    assert "while writing w.bin (2097152 bytes)" in str(info.value)
    assert "free some space" in (info.value.hint or "")


def test_no_space_names_only_a_full_disk() -> None:
    err = no_space(OSError(errno.EDQUOT, "Disk quota exceeded"), Path("/cache"), "a.bin")
    assert isinstance(err, InsufficientSpaceError)
    assert str(err).startswith("no space left on the device under /cache while writing a.bin")
    assert no_space(OSError(errno.EIO, "I/O error"), Path("/cache")) is None


def test_the_public_names_are_the_engines_own() -> None:
    assert "PrefetchError" not in transfer.__all__
    assert all(hasattr(transfer, name) for name in transfer.__all__)
