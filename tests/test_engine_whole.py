"""The engine's whole-object path (prefetch/pipeline/engine/whole.py): a small file whose
describe brought its bytes is checked and written by the io task that described it, with one
create, one write, one fsync and one close, and no ranged read; every other file (a source
without DescribesWhole, a large file, a file past the memory budget) goes the generic way."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path

import pytest

from prefetch.pipeline.engine import whole
from prefetch.pipeline.engine.coordinator import Coordinator
from prefetch.pipeline.engine.partial_file import DIRECT_MIN_SIZE
from prefetch.pipeline.engine.transfer import Transfer, TransferConfig, TransferStats
from prefetch.pipeline.engine.whole import BodyBudget
from prefetch.pipeline.progress import NullProgress
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.snapshot import Checksum, RemoteFile
from prefetch.sources.base import DescribesWhole
from prefetch.support.errors import (
    Cancelled,
    ChecksumMismatchError,
    InsufficientSpaceError,
    MissingChecksumError,
    SourceError,
)
from tests.fakes.memory import MemorySource, crc32_file, sha256_file

KiB = 1024
MiB = 1024 * KiB
NO_RETRY = RetryPolicy(attempts=1, base_delay=0.0, max_delay=0.0)


class WholeMemorySource(MemorySource):
    """A MemorySource that describes a file with its bytes (as S3 does for small objects);
    ``bodies`` overrides what a describe brings (a corrupt copy), ``whole_calls`` counts them."""

    def __init__(self, objects: dict[str, bytes], **kwargs: int) -> None:
        super().__init__(objects, **kwargs)
        self.bodies: dict[str, bytes] = {}
        self.whole_calls: list[str] = []
        self.within: dict[str, float | None] = {}

    def describe_whole(
        self, file: RemoteFile, *, within: float | None = None
    ) -> tuple[RemoteFile, bytes | None]:
        with self.lock:
            self.whole_calls.append(file.path)
            self.within[file.path] = within
        return file, self.bodies.get(file.path, self.objects[file.path])


class _Progress(NullProgress):
    def __init__(self) -> None:
        self.advanced = 0
        self.done: list[str] = []
        self.failures: list[str] = []

    def advance(self, n: int) -> None:
        self.advanced += n

    def file_done(self, path: str, size: int) -> None:
        self.done.append(path)

    def checksum_failure(self, path: str) -> None:
        self.failures.append(path)


def run(
    source: MemorySource,
    files: list[RemoteFile],
    tmp: Path,
    progress: _Progress | None = None,
    **config: object,
) -> TransferStats:
    dest = tmp / "out"

    def publish(file: RemoteFile, staged: Path, checks: tuple[Checksum, ...]) -> None:
        dest.mkdir(exist_ok=True)
        os.replace(staged, dest / file.path)

    cfg = TransferConfig(**{"concurrency": 4, "retry": NO_RETRY, **config})  # type: ignore[arg-type]  # the test passes TransferConfig's fields as objects
    return Transfer(source, tmp / "st", publish, cfg, progress=progress).run(files)


def test_the_capability_is_what_the_engine_looks_for() -> None:
    assert isinstance(WholeMemorySource({}), DescribesWhole)
    assert not isinstance(MemorySource({}), DescribesWhole)


def test_a_small_file_described_with_its_bytes_costs_one_create_write_fsync_and_no_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = {f"f{i}.json": os.urandom(3000 + i) for i in range(12)}
    calls: list[tuple[str, str]] = []  # (call, path) on a partial file
    names: dict[int, str] = {}
    real_open, real_write, real_fsync, real_pwrite = os.open, os.write, os.fsync, os.pwrite

    def spy_open(path: object, *args: object, **kwargs: object) -> int:
        fd = real_open(path, *args, **kwargs)  # type: ignore[arg-type]  # a spy forwards os.open's own arguments
        names[fd] = str(path)
        if str(path).endswith(".incomplete"):
            calls.append(("open", str(path)))
        return fd

    def spy(name: str, real: object) -> object:
        def call(fd: int, *args: object) -> object:
            if names.get(fd, "").endswith(".incomplete"):
                calls.append((name, names[fd]))
            return real(fd, *args)  # type: ignore[operator]  # the spied os function, called as it was

        return call

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "write", spy("write", real_write))
    monkeypatch.setattr(os, "pwrite", spy("pwrite", real_pwrite))
    monkeypatch.setattr(os, "fsync", spy("fsync", real_fsync))
    source = WholeMemorySource(objects)
    progress = _Progress()
    files = [sha256_file(p, d) for p, d in objects.items()]
    stats = run(source, files, tmp_path, progress)
    assert {p: (tmp_path / "out" / p).read_bytes() for p in objects} == objects
    assert sorted(source.whole_calls) == sorted(objects)  # one describe with the bytes each
    assert source.opened == []  # and no ranged read
    per_file: dict[str, list[str]] = {}
    for call, path in calls:
        per_file.setdefault(path, []).append(call)
    assert sorted(per_file.values()) == [["open", "write", "fsync"]] * len(objects)
    total = sum(map(len, objects.values()))
    assert (stats.bytes_downloaded, progress.advanced) == (total, total)
    assert (stats.files_downloaded, stats.files_verified) == (len(objects), len(objects))
    assert stats.chunks_downloaded == len(objects)  # one request each
    assert stats.checksum_algorithms == {"sha256": len(objects)}
    assert sorted(progress.done) == sorted(objects)
    assert list((tmp_path / "st").iterdir()) == []  # no journal, no partial left


def test_every_kind_of_check_is_computed_over_the_bytes(tmp_path: Path) -> None:
    data = os.urandom(300 * KiB + 7)
    md5 = hashlib.md5(data).hexdigest()
    parts = (100 * KiB, 100 * KiB, 100 * KiB + 7)
    outer = hashlib.md5(
        b"".join(
            hashlib.md5(data[s : s + n]).digest()
            for s, n in zip((0, 100 * KiB, 200 * KiB), parts, strict=True)
        )
    )
    kinds = {
        "crc.bin": crc32_file("crc.bin", data),
        "sha.bin": sha256_file("sha.bin", data),
        "md5.bin": RemoteFile(
            "md5.bin",
            len(data),
            version=md5,
            described=True,
            checksums=(Checksum("md5", md5, origin="etag"),),
        ),
        "parts.bin": RemoteFile(
            "parts.bin",
            len(data),
            version="p",
            described=True,
            checksums=(
                Checksum(
                    "md5", f"{outer.hexdigest()}-3", part_sizes=parts, origin="multipart etag"
                ),
            ),
        ),
        "both.bin": RemoteFile(
            "both.bin",
            len(data),
            version="b",
            described=True,
            checksums=(
                *crc32_file("both.bin", data).checksums,
                Checksum("sha256", hashlib.sha256(data).hexdigest(), origin="sidecar"),
            ),
        ),
    }
    source = WholeMemorySource(dict.fromkeys(kinds, data))
    stats = run(source, list(kinds.values()), tmp_path)
    assert stats.files_verified == len(kinds) and source.opened == []
    assert stats.checksum_algorithms == {"crc32": 2, "sha256": 2, "md5": 2}
    # and a corrupt body fails each kind of check
    source = WholeMemorySource(dict.fromkeys(kinds, data))
    source.bodies = dict.fromkeys(kinds, data[:-1] + bytes([data[-1] ^ 1]))
    stats = run(source, list(kinds.values()), tmp_path / "again")
    assert stats.checksum_failures == len(kinds) and sorted(source.opened) == sorted(kinds)


def test_a_corrupt_body_is_deleted_fetched_once_more_by_a_ranged_read_then_refused(
    tmp_path: Path,
) -> None:
    data = os.urandom(100 * KiB)
    file = sha256_file("small.bin", data)
    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 0x01
    source = WholeMemorySource({file.path: bytes(corrupt)})
    progress = _Progress()
    with pytest.raises(ChecksumMismatchError, match=r"small\.bin"):
        run(source, [file], tmp_path, progress)
    assert (source.whole_calls, source.opened) == (["small.bin"], ["small.bin"])
    assert progress.failures == ["small.bin", "small.bin"]
    assert not (tmp_path / "out").exists()
    assert list((tmp_path / "st").iterdir()) == []


def test_a_body_corrupted_on_the_way_is_fetched_again_and_published(tmp_path: Path) -> None:
    data = os.urandom(100 * KiB)
    file = sha256_file("small.bin", data)
    source = WholeMemorySource({file.path: data})
    source.bodies[file.path] = data[:-1] + b"\0"
    stats = run(source, [file], tmp_path)
    assert (tmp_path / "out" / "small.bin").read_bytes() == data
    assert (stats.checksum_failures, stats.files_verified, stats.chunks_downloaded) == (1, 1, 2)
    assert stats.bytes_downloaded == 2 * len(data)


def test_large_files_and_sources_without_the_capability_go_the_generic_way(
    tmp_path: Path,
) -> None:
    small, large = os.urandom(10 * KiB), os.urandom(DIRECT_MIN_SIZE + 1)
    files = [sha256_file("s.bin", small), sha256_file("l.bin", large)]
    plain = MemorySource({"s.bin": small, "l.bin": large})
    run(plain, files, tmp_path / "a")
    assert sorted(plain.opened) == ["l.bin", "s.bin"]
    capable = WholeMemorySource({"s.bin": small, "l.bin": large})
    run(capable, files, tmp_path / "b")
    assert capable.whole_calls == ["s.bin"]  # a large file is described without its bytes
    assert capable.opened == ["l.bin"]
    assert (tmp_path / "b" / "out" / "l.bin").read_bytes() == large
    assert (tmp_path / "b" / "out" / "s.bin").read_bytes() == small


def test_past_the_memory_budget_a_file_is_described_without_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(whole, "WHOLE_BUDGET", 50 * KiB)
    objects = {"a.bin": os.urandom(40 * KiB), "b.bin": os.urandom(60 * KiB)}
    source = WholeMemorySource(objects)
    run(source, [sha256_file(p, d) for p, d in objects.items()], tmp_path, concurrency=1)
    assert (source.whole_calls, source.opened) == (["a.bin"], ["b.bin"])
    assert {p: (tmp_path / "out" / p).read_bytes() for p in objects} == objects


def test_the_budget_is_given_back() -> None:
    budget = BodyBudget(100)
    assert budget.reserve(60) and not budget.reserve(41) and budget.reserve(40)
    assert not budget.reserve(1)
    budget.release(60)
    assert budget.reserve(60)


def test_a_failed_describe_gives_its_reservation_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each file's reservation is released whatever becomes of it: with room for one body, a
    file refused (no checksum, --require-checksum) leaves room for the next."""
    monkeypatch.setattr(whole, "WHOLE_BUDGET", 10 * KiB)
    data = os.urandom(8 * KiB)
    bare = RemoteFile("bare.bin", len(data), version="v", described=True)
    source = WholeMemorySource({"bare.bin": data, "ok.bin": data})
    with pytest.raises(MissingChecksumError):
        run(source, [bare], tmp_path / "a", require_checksum=True)
    stats = run(source, [bare, sha256_file("ok.bin", data)], tmp_path / "b", concurrency=1)
    assert source.whole_calls == ["bare.bin", "bare.bin", "ok.bin"] and source.opened == []
    assert stats.unverified == ["bare.bin"] and stats.files_verified == 1


def test_without_verify_nothing_is_hashed_and_the_file_is_published(tmp_path: Path) -> None:
    data = os.urandom(5 * KiB)
    file = sha256_file("a.bin", data)
    source = WholeMemorySource({"a.bin": data})
    source.bodies["a.bin"] = b"x" * len(data)  # would fail its check
    stats = run(source, [file], tmp_path, verify=False)
    assert (tmp_path / "out" / "a.bin").read_bytes() == b"x" * len(data)
    assert (stats.files_downloaded, stats.files_verified, stats.checksum_failures) == (1, 0, 0)


def test_what_an_earlier_run_left_is_overwritten_and_its_journal_removed(tmp_path: Path) -> None:
    """A crash leaves a whole file's ``.incomplete`` (no journal); an earlier plan with smaller
    pieces, a journal too. The next run writes the file afresh and removes both."""
    data = os.urandom(200 * KiB)
    file = sha256_file("w.bin", data)
    staging = tmp_path / "st"
    with pytest.raises(Exception, match="failed on purpose"):
        run(
            MemorySource({file.path: data}, fail_after=100 * KiB),
            [file],
            tmp_path,
            chunk_size=64 * KiB,
            piece_size=64 * KiB,
            buffer_size=64 * KiB,
        )
    (journal,) = staging.glob("*.journal")
    partial = journal.with_suffix(".incomplete")
    partial.write_bytes(os.urandom(300 * KiB))  # longer than the file, and wrong
    source = WholeMemorySource({file.path: data})
    run(source, [file], tmp_path)
    assert (tmp_path / "out" / "w.bin").read_bytes() == data and source.opened == []
    assert list(staging.iterdir()) == []


def test_a_publish_that_fails_leaves_only_the_partial_and_the_next_run_replaces_it(
    tmp_path: Path,
) -> None:
    data = os.urandom(50 * KiB)
    file = sha256_file("a.bin", data)
    staging = tmp_path / "st"

    def crash(f: RemoteFile, staged: Path, checks: tuple[Checksum, ...]) -> None:
        raise OSError(errno.EIO, "the disk went away")

    cfg = TransferConfig(concurrency=2, retry=NO_RETRY)
    with pytest.raises(OSError, match="went away"):
        Transfer(WholeMemorySource({"a.bin": data}), staging, crash, cfg).run([file])
    assert [p.suffix for p in staging.iterdir()] == [".incomplete"]  # never a journal
    run(WholeMemorySource({"a.bin": data}), [file], tmp_path)
    assert (tmp_path / "out" / "a.bin").read_bytes() == data
    assert list(staging.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="lists descriptors in /proc")
def test_a_full_disk_fails_the_write_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write

    def full(fd: int, data: object) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".incomplete"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)  # type: ignore[arg-type]  # a spy forwards os.write's arguments

    data = os.urandom(20 * KiB)
    before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(InsufficientSpaceError, match=r"a\.bin"):
        run(WholeMemorySource({"a.bin": data}), [sha256_file("a.bin", data)], tmp_path)
    monkeypatch.undo()
    assert set(os.listdir("/proc/self/fd")) <= before
    assert list((tmp_path / "st").iterdir()) == []


# -- one io task for a batch of small files ------------------------------------------------------


def test_small_files_are_described_in_batches_one_task_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 small files on 2 io threads: 8 describe tasks (batches of up to SMALL_BATCH, smaller
    near the end so every thread keeps a share), not 40."""
    tasks: list[object] = []
    real_submit = Coordinator.submit

    def counting(self: Coordinator[object], pool: object, task: object, *args: object) -> None:
        tasks.append(task)
        real_submit(self, pool, task, *args)  # type: ignore[arg-type]  # a spy forwards submit's arguments

    monkeypatch.setattr(Coordinator, "submit", counting)
    objects = {f"f{i:02}.json": os.urandom(1000 + i) for i in range(40)}
    source = WholeMemorySource(objects)
    stats = run(source, [sha256_file(p, d) for p, d in objects.items()], tmp_path, concurrency=2)
    assert [len(t.files) for t in tasks] == [8, 8, 8, 8, 4, 2, 1, 1]  # type: ignore[attr-defined]  # only batch tasks are recorded
    assert stats.files_verified == 40 and stats.chunks_downloaded == 40
    assert {p: (tmp_path / "out" / p).read_bytes() for p in objects} == objects


class _FailingOn(WholeMemorySource):
    def __init__(self, objects: dict[str, bytes], failing: str) -> None:
        super().__init__(objects)
        self.failing = failing

    def describe_whole(
        self, file: RemoteFile, *, within: float | None = None
    ) -> tuple[RemoteFile, bytes | None]:
        if file.path == self.failing:
            raise SourceError(f"{file.path}: refused on purpose")
        return super().describe_whole(file, within=within)


def test_a_failure_in_a_batch_deletes_what_it_wrote_and_keeps_what_it_only_described(
    tmp_path: Path,
) -> None:
    """Files a batch wrote before one failed are deleted (the coordinator never sees them; a
    file of one write is never resumed); a file it only described keeps an earlier run's
    partial and journal, to resume."""
    resumable = os.urandom(200 * KiB)
    big = sha256_file("m.bin", resumable)
    pieces = {"chunk_size": 64 * KiB, "piece_size": 64 * KiB, "buffer_size": 64 * KiB}
    with pytest.raises(SourceError, match="failed on purpose"):
        run(MemorySource({"m.bin": resumable}, fail_after=100 * KiB), [big], tmp_path, **pieces)
    staging = tmp_path / "st"
    left = sorted(p.name for p in staging.iterdir())
    objects = {f"s{i}.json": os.urandom(1000 + i) for i in range(3)}
    objects["t.bin"] = os.urandom(300 * KiB)  # the largest: described last, and refused
    files = [sha256_file(p, d) for p, d in objects.items()]
    source = _FailingOn({**objects, "m.bin": resumable}, "t.bin")
    with pytest.raises(SourceError, match="refused on purpose"):
        run(source, [*files, big], tmp_path, concurrency=1, **pieces)
    assert source.whole_calls == ["s0.json", "s1.json", "s2.json", "m.bin"]  # one batch
    assert sorted(p.name for p in staging.iterdir()) == left  # m.bin's partial and journal
    assert not (tmp_path / "out").exists()


def test_a_stop_is_seen_between_the_files_of_a_batch(tmp_path: Path) -> None:
    stop = threading.Event()

    class Stopping(WholeMemorySource):
        def describe_whole(
            self, file: RemoteFile, *, within: float | None = None
        ) -> tuple[RemoteFile, bytes | None]:
            stop.set()  # as a signal handler would, while the first file is described
            return super().describe_whole(file, within=within)

    objects = {f"f{i}.json": os.urandom(1000 + i) for i in range(4)}
    source = Stopping(objects)
    cfg = TransferConfig(concurrency=1, retry=NO_RETRY)
    transfer = Transfer(source, tmp_path / "st", lambda *a: None, cfg, stop=stop)
    with pytest.raises(Cancelled):
        transfer.run([sha256_file(p, d) for p, d in objects.items()])
    assert source.whole_calls == ["f0.json"]
    assert list((tmp_path / "st").iterdir()) == []


def test_a_small_files_whole_get_is_given_the_time_the_stall_rule_allows_its_bytes(
    tmp_path: Path,
) -> None:
    """--stall-timeout plus the file's size at --min-rate: what a ranged read of the same bytes
    would be allowed; with the rule off, nothing (the source's own bound holds)."""
    data = os.urandom(128 * KiB)
    source = WholeMemorySource({"a.bin": data})
    run(source, [sha256_file("a.bin", data)], tmp_path, stall_window=3.0, min_rate=64 * KiB)
    assert source.within == {"a.bin": 3.0 + 2.0}
    source = WholeMemorySource({"a.bin": data})
    run(source, [sha256_file("a.bin", data)], tmp_path / "off", min_rate=0)
    assert source.within == {"a.bin": None}
