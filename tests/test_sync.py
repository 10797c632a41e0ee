"""The two phases of a sync (prepare, execute), local re-verification and forgetting bad files,
against an in-memory source and a real PlainLayout on disk."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from prefetch.pipeline import verify
from prefetch.pipeline.engine.plan import staged_name
from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout import PlainLayout, RecordedFile
from prefetch.pipeline.progress import NullProgress
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import execute, prepare, sync
from prefetch.pipeline.verify_at_rest import forget_failures, verify_local
from prefetch.support.errors import LayoutError, LockTimeoutError
from tests.fakes.memory import MemorySource

SPEC = ModelSpec(source=parse_source_uri("s3://bucket/model"), name="model")
FILES = {
    "config.json": b'{"layers": 2}',
    "weights-1.bin": bytes(range(256)) * 64,
    "weights-2.bin": b"\x07" * 20_000,
}


class ForgetSpy:
    """A PlainLayout that records which paths it was asked to forget."""

    def __init__(self, inner: PlainLayout) -> None:
        self.inner = inner
        self.root = inner.root
        self.forgotten: list[str] = []

    def recorded(self) -> list[RecordedFile]:
        return self.inner.recorded()

    def forget(self, path: str) -> None:
        self.forgotten.append(path)
        self.inner.forget(path)


def _pulled(tmp_path: Path) -> tuple[MemorySource, PlainLayout]:
    source = MemorySource(dict(FILES))
    layout = PlainLayout(tmp_path / "dest")
    sync(SPEC, source, layout, TransferConfig())
    return source, layout


def _local(layout: PlainLayout, path: str) -> Path:
    return {r.path: r.local for r in layout.recorded()}[path]


# -- prepare / execute ---------------------------------------------------------------------------


def test_prepare_plans_every_missing_file_and_execute_publishes_them(tmp_path: Path) -> None:
    source = MemorySource(dict(FILES))
    layout = PlainLayout(tmp_path / "dest")
    with prepare(SPEC, source, layout) as plan:
        assert sorted(f.path for f in plan.files) == sorted(FILES)
        assert plan.bytes_needed == sum(len(d) for d in FILES.values())
        result = execute(plan, TransferConfig())
    assert result.files_downloaded == len(FILES)
    assert {r.path: r.local.read_bytes() for r in layout.recorded()} == FILES


def test_prepare_plans_nothing_for_a_copy_already_published(tmp_path: Path) -> None:
    source, layout = _pulled(tmp_path)
    with prepare(SPEC, source, layout) as plan:
        assert plan.files == []
        assert plan.bytes_needed == 0


def test_prepare_holds_the_models_lock_until_the_plan_closes(tmp_path: Path) -> None:
    source = MemorySource(dict(FILES))
    layout = PlainLayout(tmp_path / "dest")
    outcome: list[BaseException | None] = []

    def concurrent_prepare() -> None:
        try:
            with prepare(SPEC, source, PlainLayout(layout.root), lock_timeout=0.2):
                outcome.append(None)
        except LockTimeoutError as exc:
            outcome.append(exc)

    with prepare(SPEC, source, layout):
        thread = threading.Thread(target=concurrent_prepare)
        thread.start()
        thread.join()
    assert isinstance(outcome[0], LockTimeoutError)
    concurrent_prepare()  # closed: the lock is free again
    assert outcome[1] is None


def test_bytes_needed_counts_a_fully_preallocated_partial_as_held(tmp_path: Path) -> None:
    source = MemorySource(dict(FILES))
    layout = PlainLayout(tmp_path / "dest")
    layout.prepare()
    staging = layout.staging_dir()
    staging.mkdir(parents=True, exist_ok=True)
    snapshot = source.resolve(SPEC)
    full, short = snapshot.file("weights-1.bin"), snapshot.file("weights-2.bin")
    with open(staging / staged_name(full), "wb") as fh:
        fh.truncate(full.size)  # preallocated to its full size: its space is held
    with open(staging / staged_name(short), "wb") as fh:
        fh.truncate(short.size // 2)  # not fully allocated: still needs its whole size
    with prepare(SPEC, source, layout, snapshot=snapshot) as plan:
        assert len(plan.files) == len(FILES)
        assert plan.bytes_needed == sum(len(d) for d in FILES.values()) - full.size


def test_execute_without_a_space_check_still_publishes(tmp_path: Path) -> None:
    source = MemorySource(dict(FILES))
    layout = PlainLayout(tmp_path / "dest")
    with prepare(SPEC, source, layout) as plan:
        result = execute(plan, TransferConfig(), check_space=False, delete=True)
    assert result.files == len(FILES) and not result.up_to_date


# -- verify_local / forget_failures ----------------------------------------------------------


def test_verify_local_with_stop_set_returns_none_without_reading(tmp_path: Path) -> None:
    _, layout = _pulled(tmp_path)
    _local(layout, "weights-1.bin").write_bytes(b"\x00" * len(FILES["weights-1.bin"]))
    stop = threading.Event()
    stop.set()
    assert verify_local(layout, stop=stop) is None
    report = verify_local(layout, stop=threading.Event())
    assert report is not None and not report.ok


def test_verify_local_stops_between_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, layout = _pulled(tmp_path)
    stop = threading.Event()
    hashed: list[Path] = []
    hash_file_all = verify.hash_file_all

    def hash_then_stop(path: Path, *args: object, **kwargs: object) -> list[str]:
        hashed.append(path)
        stop.set()  # as SIGTERM would, while the first file is being read
        return hash_file_all(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(verify, "hash_file_all", hash_then_stop)
    assert verify_local(layout, stop=stop) is None
    assert len(hashed) == 1


def test_forget_failures_removes_exactly_the_files_whose_checksum_failed(tmp_path: Path) -> None:
    source, layout = _pulled(tmp_path)
    bad = _local(layout, "weights-1.bin")
    bad.write_bytes(b"\x00" * len(FILES["weights-1.bin"]))  # same size, other bytes
    truncated = _local(layout, "weights-2.bin")
    truncated.write_bytes(b"\x07" * 10)
    report = verify_local(layout)
    assert len(report.failures) == 2
    spy = ForgetSpy(layout)
    forgotten = forget_failures(spy, report)  # type: ignore[arg-type]  # a spy, see ForgetSpy
    assert forgotten == spy.forgotten == ["weights-1.bin"]
    assert not bad.exists()
    assert truncated.exists() and _local(layout, "config.json").exists()
    source.requests.clear()
    sync(SPEC, source, layout, TransferConfig())
    assert sorted(set(source.opened)) == ["weights-1.bin", "weights-2.bin"]
    assert verify_local(layout).ok


def test_forget_failures_leaves_a_clean_copy_alone(tmp_path: Path) -> None:
    _, layout = _pulled(tmp_path)
    report = verify_local(layout)
    assert report.ok
    assert forget_failures(layout, report) == []
    assert {r.path: r.local.read_bytes() for r in layout.recorded()} == FILES


@pytest.mark.parametrize("stop_set", [False, True])
def test_sync_still_runs_both_phases_and_honours_stop(tmp_path: Path, stop_set: bool) -> None:
    from prefetch.pipeline.engine.transfer import Cancelled

    source = MemorySource(dict(FILES))
    layout = PlainLayout(tmp_path / "dest")
    stop = threading.Event()
    if stop_set:
        stop.set()
        with pytest.raises(Cancelled):
            sync(SPEC, source, layout, TransferConfig(), stop=stop)
        assert layout.recorded() == []
    else:
        result = sync(SPEC, source, layout, TransferConfig(), stop=stop)
        assert result.revision == "rev-1" and result.files_downloaded == len(FILES)


# -- crash safety of publishing ------------------------------------------------------------------

_KILLED_AT_THE_RECORD = """
import os, signal, sys
from pathlib import Path
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.layout.base import RecordBook
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import sync
from prefetch.pipeline.engine.transfer import TransferConfig
from tests.fakes.memory import MemorySource

objects = {f"f{i:02d}.bin": bytes([i]) * (1000 + i) for i in range(40)}
appended = []
real_append = RecordBook.append

def append_then_die(self, key, entry):
    if len(appended) == 10:  # the 11th file is renamed into place, its record not written
        os.kill(os.getpid(), signal.SIGKILL)
    appended.append(key)
    real_append(self, key, entry)

RecordBook.append = append_then_die
spec = ModelSpec(source=parse_source_uri("s3://bucket/model"), name="model")
sync(spec, MemorySource(objects), PlainLayout(Path(sys.argv[1])), TransferConfig(concurrency=4))
"""


def test_a_pull_killed_between_a_files_rename_and_its_record_leaves_only_whole_files(
    tmp_path: Path,
) -> None:
    """kill -9 while small files publish: every file at its final path is whole (written and
    fsynced before the rename), the records name only published files, and the next pull
    fetches exactly the files without a record and ends with every file verified."""
    dest = tmp_path / "dest"
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_AT_THE_RECORD, str(dest)],
        capture_output=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    objects = {f"f{i:02d}.bin": bytes([i]) * (1000 + i) for i in range(40)}
    on_disk = {p.name: p.read_bytes() for p in dest.glob("f*.bin")}
    assert len(on_disk) == 11 and all(objects[name] == data for name, data in on_disk.items())
    layout = PlainLayout(dest)
    recorded = set(layout.book.load()["entries"])
    assert len(recorded) == 10 and recorded < set(on_disk)

    source = MemorySource(objects)
    result = sync(SPEC, source, PlainLayout(dest), TransferConfig(concurrency=4))
    assert result.files_downloaded == 30 and sorted(set(source.opened)) == sorted(
        set(objects) - recorded
    )
    report = verify_local(PlainLayout(dest))
    assert report.ok and {p.name: p.read_bytes() for p in dest.glob("f*.bin")} == objects


class DeletesDestOnFirstByte(NullProgress):
    """Progress that deletes the destination when the first bytes arrive: another process
    removing DEST while a pull runs."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest

    def advance(self, nbytes: int) -> None:
        if self.dest.exists():
            shutil.rmtree(self.dest)


def test_the_destination_deleted_mid_pull_is_a_named_error_with_the_path(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    source = MemorySource({"weights.bin": FILES["weights-1.bin"]})  # one file: its publish fails
    with pytest.raises(LayoutError) as caught:
        sync(
            SPEC, source, PlainLayout(dest), TransferConfig(), progress=DeletesDestOnFirstByte(dest)
        )
    message = str(caught.value)
    assert message.startswith(f"cannot write into {dest}: ")  # and, below it, what was missing
    assert "No such file or directory" in message and "another process" in message
    assert "[Errno" not in message and caught.value.hint
