"""prefetch/pipeline/engine/journal.py: what a resume journal records, what a later run replays from
it, and what survives a writer killed mid-line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from prefetch.pipeline.engine.journal import Journal

HEADER: dict[str, Any] = {
    "version": "etag-1",
    "size": 30,
    "chunks": [[0, 10], [10, 20], [20, 30]],
    "checksum": {"algorithm": "crc32c", "value": "AAAAAA==", "encoding": "base64"},
}


def lines(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_recorded_chunks_are_replayed_by_the_next_run_in_any_order(tmp_path: Path) -> None:
    path = tmp_path / "w.journal"
    j = Journal.open(path, HEADER, partial_exists=False)
    j.record(2, [7, 10])  # chunks finish out of order
    j.record(0, ["ab" * 16])
    j.record(1, None)
    assert j.done == {2: [7, 10], 0: ["ab" * 16], 1: None}
    j.close()
    assert lines(path)[0] == HEADER
    again = Journal.open(path, HEADER, partial_exists=True)
    assert again.done == {2: [7, 10], 0: ["ab" * 16], 1: None}
    again.close()


def test_each_record_reaches_the_file_before_record_returns(tmp_path: Path) -> None:
    path = tmp_path / "w.journal"
    j = Journal.open(path, HEADER, partial_exists=False)
    j.record(1, [5, 10])
    assert lines(path)[1:] == [{"i": 1, "r": [5, 10]}]  # not held in a buffer until close
    j.close()


def test_a_journal_without_its_partial_file_is_started_over(tmp_path: Path) -> None:
    path = tmp_path / "w.journal"
    j = Journal.open(path, HEADER, partial_exists=False)
    j.record(0, [1, 10])
    j.close()
    fresh = Journal.open(path, HEADER, partial_exists=False)  # the .incomplete file is gone
    assert fresh.done == {}
    fresh.close()
    assert lines(path) == [HEADER]


def test_an_unreadable_header_starts_the_file_over(tmp_path: Path) -> None:
    path = tmp_path / "w.journal"
    for text in ("", "{not json\n", '{"version": "etag-1"}\n{"i": 0, "r": [1, 10]}\n'):
        path.write_text(text)
        j = Journal.open(path, HEADER, partial_exists=True)
        assert j.done == {}, text
        j.close()
        assert lines(path) == [HEADER]


def test_a_writer_killed_mid_line_leaves_every_complete_line_replayable(tmp_path: Path) -> None:
    path = tmp_path / "w.journal"
    child = textwrap.dedent(
        """
        import json, os, signal, sys
        from pathlib import Path
        from prefetch.pipeline.engine.journal import Journal

        j = Journal.open(Path(sys.argv[1]), json.loads(sys.argv[2]), partial_exists=False)
        j.record(0, [11, 10])
        j.record(2, [33, 10])
        with open(sys.argv[1], "a") as fh:  # the next record, cut short by the kill
            fh.write('{"i": 1, "r": [2')
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", child, str(path), json.dumps(HEADER)], capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    again = Journal.open(path, HEADER, partial_exists=True)
    assert again.done == {0: [11, 10], 2: [33, 10]}
    again.close()


def test_an_in_memory_journal_writes_nothing_and_ignores_one_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "w.journal"
    path.write_text(json.dumps(HEADER) + '\n{"i": 0, "r": [1, 10]}\n')
    j = Journal.open(path, HEADER, partial_exists=True, persist=False)
    assert j.done == {}
    j.record(1, [2, 10])
    assert j.done == {1: [2, 10]}
    j.close()
    assert path.read_text() == json.dumps(HEADER) + '\n{"i": 0, "r": [1, 10]}\n'


def test_remove_deletes_the_journal_and_is_safe_to_repeat(tmp_path: Path) -> None:
    path = tmp_path / "w.journal"
    j = Journal.open(path, HEADER, partial_exists=False)
    j.record(0, [1, 10])
    j.remove()
    assert not path.exists()
    j.remove()  # already gone: no error
    j.record(1, [2, 10])  # a late record after remove stays in memory, writes no file
    assert not path.exists() and j.done == {0: [1, 10], 1: [2, 10]}


# -- moved from test_units.py ---------------------------------------------------------------------


def test_journal_resumes_matching_header_and_survives_a_torn_line(tmp_path):
    path = tmp_path / "x.journal"
    header = {"version": "e1", "size": 10, "chunks": [[0, 5], [5, 10]]}
    j = Journal.open(path, header, partial_exists=True)
    j.record(1, [123, 5])
    j.close()
    with open(path, "a") as fh:
        fh.write('{"i": 0, "r"')  # torn by a crash
    again = Journal.open(path, header, partial_exists=True)
    assert again.done == {1: [123, 5]}
    again.close()
    other = Journal.open(path, {**header, "version": "e2"}, partial_exists=True)
    assert other.done == {}
    other.close()
    assert json.loads(path.read_text().splitlines()[0])["version"] == "e2"


def test_records_after_a_torn_line_survive_the_next_crash(tmp_path: Path) -> None:
    """A resumed journal starts from a clean file: what it records after the torn line of the last
    crash is replayed after a second crash instead of being glued onto the fragment."""
    path = tmp_path / "w.journal"
    first = Journal.open(path, HEADER, partial_exists=False)
    first.record(0, [11, 10])
    first.close()
    with path.open("a") as fh:
        fh.write('{"i": 2, "r": [3')  # torn by a kill
    second = Journal.open(path, HEADER, partial_exists=True)
    second.record(1, [22, 10])
    second.close()  # and the second run is killed too
    third = Journal.open(path, HEADER, partial_exists=True)
    assert third.done == {0: [11, 10], 1: [22, 10]}
    third.close()
