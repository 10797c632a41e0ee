"""Measuring one tool run, and bringing the machine to the same state before each one.

A tool runs as subprocesses in their own sessions; ``run_measured`` reports wall time, user and
system CPU of the whole process tree (``os.wait4``), its peak RSS (psutil, polled), the server's
CPU meanwhile and the rest of the machine's (noise). ``Cache.settle`` deletes the destination,
syncs, drops the page cache when permitted and reads the server's data back in, so that every run
starts source warm, destination cold, nothing pending write-back.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

MiB = 1024 * 1024
GiB = 1024 * MiB
#: state directories that are not model bytes, whatever tool wrote them
STATE_DIRS = {".prefetch", ".cache", ".locks", "refs", ".no_exist"}

log_lock = threading.Lock()


def say(msg: str) -> None:
    """Progress for the person running the benchmark: stderr, so stdout stays the report."""
    with log_lock:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def mb_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6 if seconds > 0 else 0.0


def count_bytes(root: Path) -> int:
    """Bytes of regular files under root (not following symlinks), skipping tools' state dirs;
    under a Hugging Face cache only the blobs count."""
    blob_dirs = [Path(d) for d, _, _ in os.walk(root) if Path(d).name == "blobs"]
    tops = blob_dirs or [root]
    total = 0
    for top in tops:
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if d not in STATE_DIRS]
            for name in filenames:
                p = Path(dirpath, name)
                if p.is_symlink() or name.endswith((".incomplete", ".lock")):
                    continue
                total += p.stat().st_size
    return total


# ---- measuring one run ----------------------------------------------------------------------


@dataclass
class Sample:
    tool: str
    run: int
    ok: bool
    wall_s: float
    cpu_s: float
    user_s: float
    sys_s: float
    peak_rss_bytes: int
    max_rss_one_process_bytes: int
    server_cpu_s: float
    other_cpu_s: float
    bytes: int
    returncode: int
    error: str = ""
    killed: bool = False
    load_before: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def process_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def busy_cpu() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def read_proc_io(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/io") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    return out


def run_measured(
    cmds: list[list[str]],
    *,
    env: dict[str, str],
    logs: Path,
    timeout: float,
    server_pids: list[int],
    kill_when: Callable[[int], bool] | None = None,
    poll: float = 0.05,
) -> tuple[float, float, float, int, int, float, float, list[int], list[Path], bool]:
    """Start ``cmds`` together (each in its own session) and wait for all of them.

    Returns wall, user, sys, peak tree RSS, max single-process RSS, server CPU, other CPU,
    return codes, stdout paths, and whether ``kill_when`` (called with the first pid on every
    poll) fired and the processes were SIGKILLed.
    """
    logs.mkdir(parents=True, exist_ok=True)
    outs = [logs.with_name(f"{logs.name}.{i}.out") for i in range(len(cmds))]
    errs = [logs.with_name(f"{logs.name}.{i}.err") for i in range(len(cmds))]
    srv0, busy0 = process_cpu(server_pids), busy_cpu()
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.monotonic()
    for argv, out, err in zip(cmds, outs, errs, strict=True):
        with open(out, "wb") as fo, open(err, "wb") as fe:
            procs.append(
                subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=fo,
                    stderr=fe,
                    start_new_session=True,
                )
            )
    peak = 0
    fired = threading.Event()
    done = threading.Event()

    def kill_all() -> None:
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)

    def poller() -> None:
        nonlocal peak
        handles = []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                handles.append(psutil.Process(p.pid))
        while not done.is_set():
            if kill_when is not None and not fired.is_set() and kill_when(procs[0].pid):
                fired.set()
                kill_all()
            total = 0
            for h in handles:
                try:
                    tree = [h, *h.children(recursive=True)]
                except psutil.Error:
                    continue
                for q in tree:
                    with contextlib.suppress(psutil.Error):
                        total += q.memory_info().rss
            peak = max(peak, total)
            if time.monotonic() - t0 > timeout:
                say(f"timeout after {timeout:.0f}s: killing {cmds[0][0]}")
                kill_all()
                break
            done.wait(poll)

    thread = threading.Thread(target=poller, daemon=True)
    thread.start()
    user = system = 0.0
    maxrss = 0
    codes: list[int] = []
    try:
        for p in procs:
            _, status, ru = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
            codes.append(p.returncode)
            user += ru.ru_utime
            system += ru.ru_stime
            maxrss = max(maxrss, ru.ru_maxrss * 1024)
    finally:
        wall = time.monotonic() - t0
        done.set()
        thread.join()
        kill_all()  # strays left in a tool's session, if any
    server = process_cpu(server_pids) - srv0
    other = max(busy_cpu() - busy0 - user - system - server, 0.0)
    return wall, user, system, peak, maxrss, server, other, codes, outs, fired.is_set()


# ---- cache control ----------------------------------------------------------------------------


class Cache:
    """Brings the machine to the same state before every measured run."""

    def __init__(
        self, drop: bool, warm_cmds: list[list[str]], env: dict[str, str], quiet_wait: float
    ) -> None:
        self.drop = drop
        self.quiet_wait = quiet_wait
        self.load_before = 0.0
        self.warm_cmds = warm_cmds
        self.env = env
        self.note = ""
        if drop:
            try:
                with open("/proc/sys/vm/drop_caches", "w") as fh:
                    fh.write("1\n")
                self.note = "page cache dropped before every run (sync; echo 3 > drop_caches)"
            except OSError as exc:
                self.drop = False
                self.note = f"page cache NOT dropped ({exc.strerror}); destination deleted+synced"
        else:
            self.note = "page cache not dropped (--no-drop-caches or --quick); dest deleted+synced"

    def settle(self, remove: list[Path], warm: list[Path], *, warm_code: bool = True) -> None:
        """Delete ``remove``, sync, drop the page cache, read back the tools' code (unless
        ``warm_code`` is false: a cold start) and ``warm`` (the server's data), wait quiet."""
        for path in remove:  # delete first: dirty pages of deleted files need no write-back
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        os.sync()
        if self.drop:
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("3\n")
            for argv in self.warm_cmds if warm_code else []:
                subprocess.run(
                    argv,
                    env=self.env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    check=False,
                )
        buf = bytearray(8 * MiB)
        for top in warm:
            for dirpath, _, filenames in os.walk(top):
                for name in filenames:
                    with contextlib.suppress(OSError), open(Path(dirpath, name), "rb") as fh:
                        while fh.readinto(buf):
                            pass
        self.load_before = self.wait_quiet()

    def wait_quiet(self, threshold: float = 0.3) -> float:
        """Wait (up to ``quiet_wait`` s) until the rest of the machine uses < ``threshold``
        cores: other work on the 2 shared cores is the main source of noise. Returns the load."""
        deadline = time.monotonic() + self.quiet_wait
        while True:
            b0 = busy_cpu()
            time.sleep(0.5)
            load = (busy_cpu() - b0) / 0.5
            if load < threshold or time.monotonic() >= deadline:
                return round(load, 2)
