#!/usr/bin/env python3
"""Benchmark ``prefetch pull`` against the tools users would pick instead (issue 4).

One run generates a model-like data set, serves it from a local S3 server (SeaweedFS) and a local
Hugging Face Hub-compatible server, then measures every tool several times in alternation
(A B C A B C ...). Before each measured run the destination is deleted, dirty pages are synced,
the page cache is dropped (root only; noted when not permitted) and the server's data plus the
tools' own code are read back in, so every run starts from the same state: source warm (as a
remote server's would be), destination cold, nothing pending write-back.

Each tool runs as a subprocess in its own session; we report wall time, MB/s (10^6 bytes/s),
CPU seconds (user+sys of the whole process tree, from ``os.wait4`` of each child), peak RSS of the
whole process tree (psutil, polled every 50 ms) and the server's CPU seconds meanwhile. Then
``prefetch`` alone: verification off vs on, resume after SIGKILL at 50%, scaling with model size,
and many small files. A Markdown report goes to stdout, everything to a JSON file.

    python bench/run.py                          # 4 GiB, 3 runs, every tool found
    python bench/run.py --size 64MiB --runs 1 --quick --json /tmp/b.json
    python bench/run.py --tools s3,ceiling --scaling none --no-resume --no-small-files

See bench/README.md for what each row runs and how to read the results.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prefetch.executables import find_executable  # noqa: E402
from prefetch.locals3 import SeaweedS3  # noqa: E402
from prefetch.modelgen import generate_model, upload_model  # noqa: E402
from prefetch.units import parse_size  # noqa: E402

MiB = 1024 * 1024
GiB = 1024 * MiB
BUCKET = "bench"
MODEL_PREFIX = "model"
SMALL_PREFIX = "small"
SCALE_PREFIX = "scale"
HUB_REPO = "acme/bench"
BIN_DIR = Path(sys.executable).parent
#: How each external tool prints its version (warm-up runs and the report's tool versions).
VERSION_ARG = {
    "s5cmd": "version",
    "rclone": "version",
    "aws": "--version",
    "hf": "version",
    "weed": "version",
    "curl": "--version",
    "dd": "--version",
}
#: state directories that are not model bytes, whatever tool wrote them
STATE_DIRS = {".prefetch", ".cache", ".locks", "refs", ".no_exist"}

log_lock = threading.Lock()


def say(msg: str) -> None:
    """Progress for the person running the benchmark: stderr, so stdout stays the report."""
    with log_lock:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def find_bin(name: str) -> str | None:
    """A tool's real executable: next to this Python first (skips pyenv shims), then PATH."""
    return find_executable(name)


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

    def settle(self, remove: list[Path], warm: list[Path]) -> None:
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
            for argv in self.warm_cmds:
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


# ---- data ------------------------------------------------------------------------------------


class RandomStream(io.RawIOBase):
    """``size`` seeded pseudo-random bytes, for uploads that need no local copy."""

    def __init__(self, size: int, seed: int) -> None:
        self._left = size
        self._rng = random.Random(seed)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._left)
        if n <= 0:
            return 0
        b[:n] = self._rng.randbytes(n)
        self._left -= n
        return n


def s3_upload_stream(client: Any, key: str, size: int, seed: int, part_size: int) -> None:
    from boto3.s3.transfer import TransferConfig as S3Config

    cfg = S3Config(multipart_threshold=part_size, multipart_chunksize=part_size, max_concurrency=4)
    client.upload_fileobj(
        io.BufferedReader(RandomStream(size, seed), 4 * MiB),
        BUCKET,
        key,
        Config=cfg,
        ExtraArgs={"ChecksumAlgorithm": "CRC64NVME"},
    )


def s3_put_small(client: Any, prefix: str, count: int, size: int) -> int:
    """``count`` objects of ``size`` bytes, single-part with SHA256 (as real uploads of mid-size
    files are); returns the bytes uploaded."""
    rng = random.Random(7)
    blobs = [(f"{prefix}/file-{i:05d}.bin", rng.randbytes(size)) for i in range(count)]

    def put(item: tuple[str, bytes]) -> None:
        client.put_object(Bucket=BUCKET, Key=item[0], Body=item[1], ChecksumAlgorithm="SHA256")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, blobs))
    return count * size


@dataclass
class DataSet:
    root: Path
    total: int
    files: int
    shards: int
    shard_size: int
    small_files: int
    small_file_size: int
    part_size: int


def make_dataset(args: argparse.Namespace, root: Path) -> tuple[DataSet, Any]:
    shards = args.shards or max(1, round(args.size / (768 * MiB)))
    say(
        f"generating {shards} shard(s) of ~{args.size // shards / MiB:.0f} MiB "
        f"+ {args.model_small_files} small files under {root}"
    )
    files = generate_model(
        root,
        args.size,
        shards=shards,
        small_files=args.model_small_files,
        small_file_size=args.model_small_file_size,
    )
    total = sum(f.size for f in files)
    data = DataSet(
        root,
        total,
        len(files),
        shards,
        args.size // shards,
        args.model_small_files,
        args.model_small_file_size,
        args.part_size,
    )
    return data, files


# ---- tools -----------------------------------------------------------------------------------


@dataclass
class Tool:
    name: str
    group: str  # s3 | hub | ceiling | small
    label: str  # what it runs, for the report
    cmds: Callable[[Path], list[list[str]]]
    env: dict[str, str]
    warm: list[Path]
    servers: list[int]
    count: Callable[[Path, list[Path]], int] = lambda dest, outs: count_bytes(dest)
    missing: str = ""  # why it is not available, when it is not
    json_out: bool = False


def prefetch_cmd() -> list[str]:
    exe = find_bin("prefetch")
    return [exe] if exe else [sys.executable, "-m", "prefetch.cli"]


def baseline_cmd(package_dir: str) -> list[str]:
    """``prefetch`` run with the package in ``package_dir`` (``python -m`` would put the current
    directory, the repository, first on sys.path)."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(package_dir).resolve())!r}); "
        "sys.argv[0] = 'prefetch'; from prefetch.cli import main; main()"
    )
    return [sys.executable, "-c", code]


def curl_sum(dest: Path, outs: list[Path]) -> int:
    total = 0
    for out in outs:
        for line in out.read_text().split():
            with contextlib.suppress(ValueError):
                total += int(float(line))
    return total


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.workdir).resolve()
        self.logs = self.work / "logs"
        self.results: dict[str, Any] = {}
        self.servers: list[Any] = []
        self.hub_proc: subprocess.Popen[bytes] | None = None
        self.notes: list[str] = []

    # -- environment

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = str(REPO) + (
            os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
        )
        for k in ("PREFETCH_DEBUG", "PREFETCH_CONCURRENCY", "PREFETCH_CHUNK_SIZE"):
            env.pop(k, None)
        env["HF_HUB_DISABLE_TELEMETRY"] = "1"
        env["HF_HOME"] = str(self.work / "hf-home-unused")
        env["DO_NOT_TRACK"] = "1"
        return env

    def s3_env(self, server: SeaweedS3) -> dict[str, str]:
        env = self.base_env()
        (self.work / "aws-config").write_text("[default]\nregion = us-east-1\n")
        (self.work / "aws-credentials").write_text("")
        (self.work / "rclone.conf").write_text("")
        env.update(
            AWS_ENDPOINT_URL=server.endpoint,
            AWS_ACCESS_KEY_ID=server.access_key,
            AWS_SECRET_ACCESS_KEY=server.secret_key,
            AWS_DEFAULT_REGION="us-east-1",
            AWS_REGION="us-east-1",
            AWS_CONFIG_FILE=str(self.work / "aws-config"),
            AWS_SHARED_CREDENTIALS_FILE=str(self.work / "aws-credentials"),
            AWS_EC2_METADATA_DISABLED="true",
            RCLONE_CONFIG=str(self.work / "rclone.conf"),
            RCLONE_CONFIG_BENCHS3_TYPE="s3",
            RCLONE_CONFIG_BENCHS3_PROVIDER="Other",
            RCLONE_CONFIG_BENCHS3_ENDPOINT=server.endpoint,
            RCLONE_CONFIG_BENCHS3_ACCESS_KEY_ID=server.access_key,
            RCLONE_CONFIG_BENCHS3_SECRET_ACCESS_KEY=server.secret_key,
            RCLONE_CONFIG_BENCHS3_REGION="us-east-1",
            RCLONE_CONFIG_BENCHS3_FORCE_PATH_STYLE="true",
        )
        return env

    def warm_cmds(self) -> list[list[str]]:
        cmds = [
            [
                sys.executable,
                "-c",
                "import boto3, s3transfer.manager, huggingface_hub, prefetch.cli, prefetch.sync, "
                "prefetch.sources.s3, prefetch.transfer; boto3.client('s3', "
                "region_name='us-east-1')",
            ]
        ]
        for name in ("s5cmd", "rclone", "aws", "hf", "curl", "dd"):
            exe = find_bin(name)
            if exe:
                cmds.append([exe, VERSION_ARG[name]])
        return cmds

    # -- servers

    def start_s3(self, name: str, *, keep: bool = False) -> SeaweedS3:
        data_dir = self.work / name
        if not keep:
            shutil.rmtree(data_dir, ignore_errors=True)
        server = SeaweedS3(data_dir=data_dir).start()
        self.servers.append(server)
        client = server.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=BUCKET)
        return server

    def stop_s3(self, server: SeaweedS3) -> None:
        server.stop()
        self.servers.remove(server)
        shutil.rmtree(server.data_dir or "", ignore_errors=True)

    def start_hub(self, root: Path) -> str:
        argv = [
            sys.executable,
            str(REPO / "tests" / "hubserver.py"),
            "--repo",
            HUB_REPO,
            "--dir",
            str(root),
            "--page-size",
            "1000",
        ]
        with open(self.logs / "hubserver.err", "wb") as err:
            self.hub_proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.base_env(),
            )
        assert self.hub_proc.stdout is not None
        line = self.hub_proc.stdout.readline()
        if not line:
            raise RuntimeError(f"hub server did not start: {(self.logs / 'hubserver.err')}")
        return str(json.loads(line)["endpoint"])

    def stop_hub(self) -> None:
        proc, self.hub_proc = self.hub_proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def cleanup(self) -> None:
        self.stop_hub()
        for server in list(self.servers):
            with contextlib.suppress(Exception):
                self.stop_s3(server)
        if not self.args.reuse:
            shutil.rmtree(self.work, ignore_errors=True)
        else:
            shutil.rmtree(self.work / "dest", ignore_errors=True)

    # -- tool catalogue

    def s3_tools(self, server: SeaweedS3, prefix: str, data_root: Path, total: int) -> list[Tool]:
        env = self.s3_env(server)
        warm = [server.data_dir] if server.data_dir else []
        srv = [server._proc.pid] if server._proc else []
        uri = f"s3://{BUCKET}/{prefix}/"
        pf = prefetch_cmd()
        s5 = find_bin("s5cmd")
        rc = find_bin("rclone")
        aws = find_bin("aws")
        a = self.args
        tools = [
            Tool(
                "prefetch",
                "s3",
                "prefetch pull (verify on, defaults)",
                lambda d: [[*pf, "pull", uri, str(d), "--json"]],
                env,
                warm,
                srv,
                json_out=True,
            ),
            Tool(
                "prefetch-noverify",
                "s3",
                "prefetch pull --no-verify",
                lambda d: [[*pf, "pull", uri, str(d), "--json", "--no-verify"]],
                env,
                warm,
                srv,
                json_out=True,
            ),
        ]
        if a.baseline:
            tools.append(
                Tool(
                    "prefetch-baseline",
                    "s3",
                    f"prefetch pull with the package from {a.baseline}",
                    lambda d: [[*baseline_cmd(self.args.baseline), "pull", uri, str(d), "--json"]],
                    env,
                    warm,
                    srv,
                    json_out=True,
                )
            )
        for spec in a.prefetch_variant:
            name, _, extra = spec.partition("=")
            words = extra.split()
            tools.append(
                Tool(
                    f"prefetch-{name}",
                    "s3",
                    f"prefetch pull {extra}",
                    lambda d, x=words: [[*pf, "pull", uri, str(d), "--json", *x]],
                    env,
                    warm,
                    srv,
                    json_out=True,
                )
            )
        s5_tuned = a.s5cmd_tuned.split()

        def s5cmd(name: str, label: str, global_flags: list[str], cp_flags: list[str]) -> Tool:
            return Tool(
                name,
                "s3",
                label,
                lambda d: [
                    [
                        s5 or "s5cmd",
                        "--endpoint-url",
                        server.endpoint,
                        *global_flags,
                        "cp",
                        *cp_flags,
                        f"s3://{BUCKET}/{prefix}/*",
                        f"{d}/",
                    ]
                ],
                env,
                warm,
                srv,
                missing="" if s5 else "not available: s5cmd not installed",
            )

        def rclone(name: str, label: str, flags: list[str]) -> Tool:
            return Tool(
                name,
                "s3",
                label,
                lambda d: [[rc or "rclone", "copy", *flags, f"benchs3:{BUCKET}/{prefix}", str(d)]],
                env,
                warm,
                srv,
                missing="" if rc else "not available: rclone not installed",
            )

        tools += [
            s5cmd("s5cmd", "s5cmd cp (defaults: 256 workers, -c 5, -p 50)", [], []),
            s5cmd("s5cmd-tuned", f"s5cmd {a.s5cmd_tuned}", s5_tuned[:2], s5_tuned[2:]),
            rclone("rclone", "rclone copy (defaults)", []),
            rclone(
                "rclone-mts8",
                "rclone copy --multi-thread-streams 8",
                ["--multi-thread-streams", "8"],
            ),
            Tool(
                "aws",
                "s3",
                "aws s3 cp --recursive (awscli defaults)",
                lambda d: [
                    [
                        aws or "aws",
                        "--endpoint-url",
                        server.endpoint,
                        "s3",
                        "cp",
                        uri,
                        str(d),
                        "--recursive",
                        "--only-show-errors",
                    ]
                ],
                env,
                warm,
                srv,
                missing="" if aws else "not available: aws (awscli) not installed",
            ),
            Tool(
                "boto3",
                "s3",
                f"boto3 TransferManager (download_file's engine), max_concurrency="
                f"{a.boto3_concurrency}, chunk {a.boto3_chunk_size // MiB} MiB",
                lambda d: [
                    [
                        sys.executable,
                        str(REPO / "bench" / "clients.py"),
                        "boto3",
                        "--bucket",
                        BUCKET,
                        "--prefix",
                        prefix,
                        "--dest",
                        str(d),
                        "--concurrency",
                        str(a.boto3_concurrency),
                        "--chunk-size",
                        str(a.boto3_chunk_size),
                    ]
                ],
                env,
                warm,
                srv,
            ),
        ]
        return tools

    def ceiling_tools(self, server: SeaweedS3, prefix: str, total: int) -> list[Tool]:
        env = self.s3_env(server)
        warm = [server.data_dir] if server.data_dir else []
        srv = [server._proc.pid] if server._proc else []
        curl = find_bin("curl")
        streams = self.args.ceiling_streams
        tools: list[Tool] = []
        if curl:
            configs = self.curl_configs(server, prefix, streams)
            tools.append(
                Tool(
                    "ceiling-get",
                    "ceiling",
                    f"{streams} curl processes, {self.args.ceiling_chunk_size // MiB} MiB ranged "
                    "GETs (presigned) of the same objects into /dev/null: the server's limit",
                    lambda d: [[curl, "-sS", "--fail", "-K", str(c)] for c in configs],
                    env,
                    warm,
                    srv,
                    count=curl_sum,
                )
            )
        else:
            tools.append(
                Tool(
                    "ceiling-get",
                    "ceiling",
                    "curl ranged GETs",
                    lambda d: [],
                    env,
                    warm,
                    srv,
                    missing="not available: curl not installed",
                )
            )
        dd = find_bin("dd")
        for name, flags, what in (
            ("ceiling-dd", "oflag=direct conv=fsync", "the disk's sequential write limit"),
            ("dd-buffered", "conv=fsync", "through the page cache (for reference, not a ceiling)"),
        ):
            tools.append(
                Tool(
                    name,
                    "ceiling",
                    f"dd if=/dev/zero bs=16M {flags} of=DEST, same byte count: {what}",
                    lambda d, flags=flags: [
                        [
                            "sh",
                            "-c",
                            f"exec {dd} if=/dev/zero of={d}/dd.bin "
                            f"bs=16M count={total} iflag=count_bytes {flags} "
                            "status=none",
                        ]
                    ],
                    env,
                    warm,
                    srv,
                    missing="" if dd else "not available: dd not found",
                )
            )
        return tools

    def curl_configs(self, server: SeaweedS3, prefix: str, streams: int) -> list[Path]:
        client = server.client()
        objects = []
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=f"{prefix}/"
        ):
            objects += [(o["Key"], o["Size"]) for o in page.get("Contents", [])]
        step = self.args.ceiling_chunk_size
        jobs: list[tuple[str, int, int]] = []
        for key, size in objects:
            url = client.generate_presigned_url(
                "get_object", Params={"Bucket": BUCKET, "Key": key}, ExpiresIn=24 * 3600
            )
            jobs += [(url, s, min(s + step, size) - 1) for s in range(0, size, step)] or [
                (url, 0, -1)
            ]
        # big ranges first, dealt round-robin, so the streams finish together
        jobs.sort(key=lambda j: j[2] - j[1], reverse=True)
        configs = []
        for i in range(streams):
            lines = []
            for url, start, end in jobs[i::streams]:
                if lines:
                    lines.append("next")
                lines.append(f'url = "{url}"')
                if end >= 0:
                    lines.append(f'range = "{start}-{end}"')
                lines += ['output = "/dev/null"', 'write-out = "%{size_download}\\n"']
            path = self.work / f"curl-{prefix}-{i}.cfg"
            path.write_text("\n".join(lines) + "\n")
            configs.append(path)
        return configs

    def hub_tools(self, endpoint: str, data: DataSet) -> list[Tool]:
        env = self.base_env()
        env["HF_ENDPOINT"] = endpoint
        env["HF_HUB_ETAG_TIMEOUT"] = "60"
        warm = [data.root]
        srv = [self.hub_proc.pid] if self.hub_proc else []
        pf = prefetch_cmd()
        hf = find_bin("hf")

        def with_home(argv: list[str], d: Path) -> list[str]:
            # a fresh HF_HOME per run, inside the destination (deleted with it)
            return ["env", f"HF_HOME={d}", *argv]

        tools = []
        if self.args.baseline:
            tools.append(
                Tool(
                    "hf-prefetch-baseline",
                    "hub",
                    f"prefetch pull hf://{HUB_REPO} with the package from {self.args.baseline}",
                    lambda d: [
                        with_home(
                            [
                                *baseline_cmd(self.args.baseline),
                                "pull",
                                f"hf://{HUB_REPO}",
                                str(d),
                                "--json",
                            ],
                            d / ".prefetch-hf-home",
                        )
                    ],
                    env,
                    warm,
                    srv,
                    json_out=True,
                )
            )
        return [
            Tool(
                "hf-prefetch",
                "hub",
                f"prefetch pull hf://{HUB_REPO} (verify on, defaults)",
                lambda d: [
                    with_home(
                        [*pf, "pull", f"hf://{HUB_REPO}", str(d), "--json"], d / ".prefetch-hf-home"
                    )
                ],
                env,
                warm,
                srv,
                json_out=True,
            ),
            *tools,
            Tool(
                "hf-snapshot",
                "hub",
                "huggingface_hub.snapshot_download (defaults, fresh HF_HOME)",
                lambda d: [
                    with_home(
                        [
                            sys.executable,
                            str(REPO / "bench" / "clients.py"),
                            "snapshot",
                            "--repo",
                            HUB_REPO,
                        ],
                        d,
                    )
                ],
                env,
                warm,
                srv,
            ),
            Tool(
                "hf-cli",
                "hub",
                f"hf download {HUB_REPO} (fresh HF_HOME)",
                lambda d: [with_home([hf or "hf", "download", HUB_REPO], d)],
                env,
                warm,
                srv,
                missing="" if hf else "not available: hf CLI not installed",
            ),
        ]

    # -- measuring

    def measure(
        self,
        tool: Tool,
        run: int,
        dest: Path,
        expected: int,
        *,
        kill_when: Callable[[int], bool] | None = None,
        poll: float = 0.05,
        settle: bool = True,
    ) -> Sample:
        if settle:
            self.cache.settle([dest], tool.warm)
        dest.mkdir(parents=True, exist_ok=True)
        cmds = tool.cmds(dest)
        timeout = max(self.args.timeout, expected / (20 * 1e6))
        wall, user, system, peak, maxrss, server, other, codes, outs, fired = run_measured(
            cmds,
            env=tool.env,
            logs=self.logs / f"{tool.name}-{run}",
            timeout=timeout,
            server_pids=tool.servers,
            kill_when=kill_when,
            poll=poll,
        )
        got = tool.count(dest, outs) if not fired else 0
        ok = not fired and all(c == 0 for c in codes) and got == expected
        error = ""
        if not fired and not ok:
            err_file = outs[0].with_suffix(".err")
            tail = err_file.read_text(errors="replace").strip().splitlines()[-3:]
            error = f"exit {codes}, {got} of {expected} bytes: " + " | ".join(tail)
        extra: dict[str, Any] = {}
        if tool.json_out and not fired:
            with contextlib.suppress(ValueError, OSError):
                text = outs[0].read_text().strip().splitlines()
                extra = json.loads(text[-1]) if text else {}
        sample = Sample(
            tool.name,
            run,
            ok,
            round(wall, 3),
            round(user + system, 3),
            round(user, 3),
            round(system, 3),
            peak,
            maxrss,
            round(server, 3),
            round(other, 3),
            got,
            codes[0] if codes else -1,
            error,
            fired,
            self.cache.load_before if settle else 0.0,
            extra,
        )
        say(
            f"  {tool.name:<18} run {run}: {wall:7.2f}s {mb_s(expected, wall):7.0f} MB/s "
            f"cpu {user + system:6.2f}s rss {peak / MiB:6.0f} MiB server {server:5.2f}s"
            f"{'' if ok or fired else '  FAILED: ' + error}"
        )
        return sample

    def alternate(
        self, tools: list[Tool], runs: int, expected: int, tag: str
    ) -> list[dict[str, Any]]:
        """Each available tool ``runs`` times, in rounds: A B C, A B C, ..."""
        samples: dict[str, list[Sample]] = {t.name: [] for t in tools}
        live = [t for t in tools if not t.missing]
        for run in range(1, runs + 1):
            say(f"{tag}: round {run} of {runs}")
            for tool in live:
                samples[tool.name].append(self.measure(tool, run, self.work / "dest", expected))
        self.cache.settle([self.work / "dest"], [])
        return [summarize(t, samples[t.name], expected) for t in tools]

    # -- phases

    def run(self) -> dict[str, Any]:
        a = self.args
        self.work.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.cache = Cache(a.drop_caches, self.warm_cmds(), self.base_env(), a.quiet_wait)
        want = set(a.tools)
        t_start = time.monotonic()
        marker = self.work / "dataset.json"
        shape = {
            k: getattr(a, k)
            for k in ("size", "shards", "model_small_files", "model_small_file_size", "part_size")
        }
        reuse = (
            a.reuse and marker.is_file() and json.loads(marker.read_text()).get("shape") == shape
        )
        if reuse:
            data = DataSet(**{**json.loads(marker.read_text())["data"], "root": self.work / "src"})
            server = self.start_s3("seaweed-main", keep=True)
            say(f"reusing the data set in {self.work} ({data.total / MiB:.0f} MiB)")
        else:
            marker.unlink(missing_ok=True)
            data, files = make_dataset(a, self.work / "src")
            server = self.start_s3("seaweed-main")
            say(
                f"uploading {data.total / MiB:.0f} MiB to {server.endpoint} "
                f"(multipart, {a.part_size // MiB} MiB parts, CRC64NVME)"
            )
            t0 = time.monotonic()
            upload_model(
                server.client(),
                BUCKET,
                MODEL_PREFIX,
                files,
                part_size=a.part_size,
                multipart_threshold=a.part_size,
                create_bucket=False,
            )
            say(f"uploaded in {time.monotonic() - t0:.1f}s")
            if a.reuse:
                saved = {k: v for k, v in asdict(data).items() if k != "root"}
                marker.write_text(json.dumps({"shape": shape, "data": saved}))
        variants = {f"prefetch-{v.partition('=')[0]}" for v in a.prefetch_variant}
        variants |= {"prefetch-baseline", "hf-prefetch-baseline"} if a.baseline else set()
        tools = [
            t
            for t in self.s3_tools(server, MODEL_PREFIX, data.root, data.total)
            if t.name in want or t.name in variants or "s3" in want
        ]
        tools += [
            t
            for t in self.ceiling_tools(server, MODEL_PREFIX, data.total)
            if t.name in want or "ceiling" in want
        ]
        hub_wanted = [n for n in ("hf-prefetch", "hf-snapshot", "hf-cli") if n in want] or (
            "hub" in want
        )
        if hub_wanted:
            endpoint = self.start_hub(data.root)
            say(f"hub server at {endpoint}")
            tools += [
                t
                for t in self.hub_tools(endpoint, data)
                if t.name in want or t.name in variants or "hub" in want
            ]
        for t in tools:
            if t.missing:
                say(f"skipping {t.name}: {t.missing}")
        rows = self.alternate(tools, a.runs, data.total, "compare")
        self.stop_hub()
        self.results["compare"] = {"expected_bytes": data.total, "rows": rows}

        if a.small_files > 0 and "small" in want:
            say(f"uploading {a.small_files} x {a.small_file_size // 1024} KiB")
            small_total = s3_put_small(
                server.client(), SMALL_PREFIX, a.small_files, a.small_file_size
            )
            small_names = {"prefetch", "s5cmd", "rclone", "aws", "boto3"}
            small_tools = [
                t
                for t in self.s3_tools(server, SMALL_PREFIX, data.root, small_total)
                if t.name in small_names
            ]
            self.results["small_files"] = {
                "files": a.small_files,
                "file_size": a.small_file_size,
                "expected_bytes": small_total,
                "rows": self.alternate(small_tools, a.runs, small_total, "small files"),
            }

        if a.resume and "resume" in want:
            self.results["resume"] = self.resume(server, data.total)

        if a.reuse:
            server.stop()
            self.servers.remove(server)
        else:
            self.stop_s3(server)
            shutil.rmtree(data.root, ignore_errors=True)

        if a.scaling and "scaling" in want:
            self.results["scaling"] = self.scaling(a.scaling)

        self.results["dataset"] = {
            k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(data).items()
        }
        self.results["elapsed_s"] = round(time.monotonic() - t_start, 1)
        return self.results

    def resume(self, server: SeaweedS3, total: int) -> dict[str, Any]:
        """SIGKILL ``prefetch pull`` once it has written half the bytes, pull again, count."""
        tool = next(
            t for t in self.s3_tools(server, MODEL_PREFIX, Path(), total) if t.name == "prefetch"
        )
        dest = self.work / "dest"
        trials = []
        for run in range(1, self.args.runs + 1):
            say(f"resume: trial {run} of {self.args.runs}")
            seen: dict[str, int] = {}

            def kill_when(pid: int, seen: dict[str, int] = seen) -> bool:
                wchar = read_proc_io(pid).get("wchar", 0)
                if wchar >= total // 2:
                    seen["written"] = wchar
                    return True
                return False

            # A small model can finish between two polls: try again on a clean DEST (3 times).
            for _ in range(3):
                first = self.measure(tool, run, dest, total, kill_when=kill_when, poll=0.002)
                if first.killed:
                    break
                shutil.rmtree(dest, ignore_errors=True)
            if not first.killed:
                trials.append({"error": "the pull finished before it could be killed at 50%"})
                continue
            second = self.measure(tool, run, dest, total, settle=False)
            j = second.extra
            downloaded = int(j.get("bytes_downloaded", 0))
            written = seen["written"]
            refetched = max(downloaded + written - total, 0)
            trials.append(
                {
                    "ok": second.ok,
                    "killed_after_bytes": written,
                    "second_pull_bytes_downloaded": downloaded,
                    "second_pull_resumed_bytes": int(j.get("resumed_bytes", 0)),
                    "refetched_bytes": refetched,
                    "refetched_pct": round(100 * refetched / total, 2),
                    "second_pull_wall_s": second.wall_s,
                    "error": second.error,
                }
            )
            say(
                f"  killed at {written / MiB:.0f} MiB; second pull fetched {downloaded / MiB:.0f}"
                f" MiB; re-fetched {refetched / MiB:.1f} MiB = {100 * refetched / total:.2f}%"
            )
        self.cache.settle([dest], [])
        good = [t["refetched_pct"] for t in trials if "refetched_pct" in t]
        return {
            "trials": trials,
            "median_refetched_pct": statistics.median(good) if good else None,
            "expected_bytes": total,
        }

    def scaling(self, points: list[int]) -> dict[str, Any]:
        unit = min(points)
        if any(p % unit for p in points):
            raise SystemExit(f"--scaling: every point must be a multiple of {unit} bytes")
        count = max(points) // unit
        server = self.start_s3("seaweed-scale")
        try:
            say(f"scaling: uploading {count} x {unit / MiB:.0f} MiB (streamed, no local copy)")
            client = server.client()
            names = [f"shard-{i:03d}.safetensors" for i in range(1, count + 1)]
            for i, name in enumerate(names):
                s3_upload_stream(
                    client, f"{SCALE_PREFIX}/{name}", unit, 1000 + i, self.args.part_size
                )
            base = next(
                t for t in self.s3_tools(server, SCALE_PREFIX, Path(), 0) if t.name == "prefetch"
            )
            tools = []
            for p in sorted(points):
                inc = [x for n in names[: p // unit] for x in ("--include", n)]
                tools.append(
                    Tool(
                        f"prefetch@{p / GiB:g}GiB",
                        "scaling",
                        f"prefetch pull {p / GiB:g} GiB",
                        lambda d, inc=inc: [
                            [
                                *prefetch_cmd(),
                                "pull",
                                f"s3://{BUCKET}/{SCALE_PREFIX}/",
                                str(d),
                                "--json",
                                *inc,
                            ]
                        ],
                        base.env,
                        base.warm,
                        base.servers,
                        json_out=True,
                    )
                )
            rows = []
            samples: dict[str, list[Sample]] = {t.name: [] for t in tools}
            for run in range(1, self.args.scaling_runs + 1):
                say(f"scaling: round {run} of {self.args.scaling_runs}")
                for t, p in zip(tools, sorted(points), strict=True):
                    samples[t.name].append(self.measure(t, run, self.work / "dest", p))
            for t, p in zip(tools, sorted(points), strict=True):
                row = summarize(t, samples[t.name], p)
                row["size_bytes"] = p
                rows.append(row)
            self.cache.settle([self.work / "dest"], [])
        finally:
            self.stop_s3(server)
        return {"points": rows, **linearity(rows)}


def linearity(rows: list[dict[str, Any]]) -> dict[str, Any]:
    pts = [(r["size_bytes"], r["median_wall_s"]) for r in rows if r.get("median_wall_s")]
    if len(pts) < 2:
        return {}
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    intercept = my - slope * mx
    worst = max(abs(y - (intercept + slope * x)) / y for x, y in pts)
    return {
        "fit_seconds_per_gib": round(slope * GiB, 3),
        "fit_fixed_seconds": round(intercept, 3),
        "fit_worst_deviation_pct": round(100 * worst, 1),
        "mb_s_smallest_vs_largest": [pts and rows[0]["mb_s"], rows[-1]["mb_s"]],
    }


def summarize(tool: Tool, samples: list[Sample], expected: int) -> dict[str, Any]:
    row: dict[str, Any] = {
        "tool": tool.name,
        "group": tool.group,
        "label": tool.label,
        "available": not tool.missing,
        "note": tool.missing,
    }
    good = [s for s in samples if s.ok]
    row["runs"] = [asdict(s) for s in samples]
    row["ok"] = bool(samples) and len(good) == len(samples)
    if not good:
        row.update(
            median_wall_s=None,
            mb_s=None,
            cpu_s=None,
            peak_rss_mib=None,
            server_cpu_s=None,
            other_cpu_s=None,
        )
        if samples:
            row["note"] = samples[-1].error
        return row
    wall = statistics.median(s.wall_s for s in good)
    row.update(
        median_wall_s=round(wall, 3),
        mb_s=round(mb_s(expected, wall), 1),
        cpu_s=round(statistics.median(s.cpu_s for s in good), 2),
        peak_rss_mib=round(max(s.peak_rss_bytes for s in good) / MiB, 1),
        server_cpu_s=round(statistics.median(s.server_cpu_s for s in good), 2),
        other_cpu_s=round(statistics.median(s.other_cpu_s for s in good), 2),
        walls=[s.wall_s for s in good],
    )
    return row


# ---- report ------------------------------------------------------------------------------------


def fmt(v: Any, spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


def ratio_rows(rows: list[dict[str, Any]]) -> None:
    """Time of each row over the prefetch row of its group (>1: slower than prefetch)."""
    ref = {"s3": "prefetch", "ceiling": "prefetch", "hub": "hf-prefetch"}
    walls = {r["tool"]: r["median_wall_s"] for r in rows}
    for r in rows:
        base = walls.get(ref.get(r["group"], "prefetch"))
        r["time_vs_prefetch"] = (
            round(r["median_wall_s"] / base, 2) if base and r["median_wall_s"] else None
        )


def table(rows: list[dict[str, Any]], title: str) -> str:
    out = [
        f"### {title}",
        "",
        "| tool | runs | median s | MB/s | time / prefetch | CPU s | peak RSS MiB | server CPU s "
        "| other load CPU s | what |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        if not r["available"]:
            out.append(f"| {r['tool']} | - | - | - | - | - | - | - | - | {r['note']} |")
            continue
        walls = ", ".join(f"{w:.2f}" for w in r.get("walls", []))
        note = r["label"] + ("" if r["ok"] else f" **FAILED** {r['note']}")
        out.append(
            f"| {r['tool']} | {walls} | {fmt(r['median_wall_s'], '.2f')} | {fmt(r['mb_s'], '.0f')}"
            f" | {fmt(r.get('time_vs_prefetch'), '.2f')} | {fmt(r['cpu_s'], '.2f')}"
            f" | {fmt(r['peak_rss_mib'], '.0f')} | {fmt(r['server_cpu_s'], '.2f')}"
            f" | {fmt(r['other_cpu_s'], '.2f')} | {note} |"
        )
    return "\n".join(out)


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = {r["tool"]: r for r in res.get("compare", {}).get("rows", [])}
    out: list[dict[str, Any]] = []

    def wall(name: str) -> float | None:
        r = rows.get(name)
        return r["median_wall_s"] if r and r["available"] else None

    pf = wall("prefetch")
    rivals = {n: wall(n) for n in ("s5cmd", "s5cmd-tuned", "rclone", "rclone-mts8")}
    rivals = {n: w for n, w in rivals.items() if w}
    if pf and rivals:
        best = min(rivals, key=lambda n: rivals[n])
        out.append(
            {
                "target": "S3: wall <= best of s5cmd/rclone",
                "value": f"{pf:.2f}s vs {best} {rivals[best]:.2f}s",
                "met": pf <= rivals[best],
            }
        )
    hp, hs = wall("hf-prefetch"), wall("hf-snapshot")
    if hp and hs:
        out.append(
            {
                "target": "Hub: >= 2x snapshot_download",
                "value": f"{hs / hp:.2f}x",
                "met": hs / hp >= 2,
            }
        )
    elif hs:
        out.append(
            {
                "target": "Hub: >= 2x snapshot_download",
                "value": "hf-prefetch not available",
                "met": None,
            }
        )
    ceil = [
        rows[n]["mb_s"] for n in ("ceiling-get", "ceiling-dd") if n in rows and rows[n].get("mb_s")
    ]
    if pf and ceil:
        c = min(ceil)
        got = rows["prefetch"]["mb_s"]
        out.append(
            {
                "target": ">= 90% of the ceiling (min of GET and dd)",
                "value": f"{100 * got / c:.0f}% ({got:.0f} of {c:.0f} MB/s)",
                "met": got >= 0.9 * c,
            }
        )
    rss = [
        r["peak_rss_mib"]
        for r in res.get("compare", {}).get("rows", [])
        if r["tool"] in ("prefetch", "prefetch-noverify", "hf-prefetch") and r["peak_rss_mib"]
    ]
    rss += [
        r["peak_rss_mib"] for r in res.get("scaling", {}).get("points", []) if r["peak_rss_mib"]
    ]
    if rss:
        out.append(
            {
                "target": "peak RSS <= 150 MB",
                "value": f"{max(rss) * MiB / 1e6:.0f} MB "
                "(max over prefetch rows and scaling points)",
                "met": max(rss) * MiB <= 150e6,
            }
        )
    pct = res.get("resume", {}).get("median_refetched_pct")
    if pct is not None:
        out.append({"target": "resume re-fetches <= 5%", "value": f"{pct:.2f}%", "met": pct <= 5})
    return out


def report(res: dict[str, Any]) -> str:
    meta = res["meta"]
    parts = [
        f"## model-prefetch benchmark ({meta['date']})",
        "",
        f"`{meta['command']}`",
        "",
        f"Data: {res['dataset']['total'] / MiB:.0f} MiB in {res['dataset']['files']} files "
        f"({res['dataset']['shards']} shards); {meta['runs']} run(s) per tool, alternating; "
        f"{meta['cache']}. Machine: {meta['cpus']} CPUs shared by client and server, "
        f"{meta['mem_gib']} GiB RAM. MB/s = 10^6 bytes/s. CPU s = user+sys of the tool's process "
        "tree; server CPU s = SeaweedFS / hub server meanwhile; other load = the rest of the "
        "machine (noise).",
        "",
    ]
    if "compare" in res:
        rows = res["compare"]["rows"]
        ratio_rows(rows)
        parts += [
            table(
                [r for r in rows if r["group"] in ("s3", "ceiling")], "S3 (SeaweedFS), whole model"
            ),
            "",
        ]
        hub = [r for r in rows if r["group"] == "hub"]
        if hub:
            parts += [table(hub, "Hugging Face Hub (local Hub-compatible server)"), ""]
        on = next((r for r in rows if r["tool"] == "prefetch"), None)
        off = next((r for r in rows if r["tool"] == "prefetch-noverify"), None)
        if on and off and on.get("median_wall_s") and off.get("median_wall_s"):
            res["verify_cost"] = {
                "verify_on_s": on["median_wall_s"],
                "verify_off_s": off["median_wall_s"],
                "cost_pct": round(100 * (on["median_wall_s"] / off["median_wall_s"] - 1), 1),
                "cpu_on_s": on["cpu_s"],
                "cpu_off_s": off["cpu_s"],
            }
            v = res["verify_cost"]
            parts += [
                f"Verification: on {v['verify_on_s']:.2f}s / off {v['verify_off_s']:.2f}s "
                f"({v['cost_pct']:+.1f}% wall), CPU {v['cpu_on_s']:.2f}s vs "
                f"{v['cpu_off_s']:.2f}s.",
                "",
            ]
    if "small_files" in res:
        s = res["small_files"]
        ratio_rows(s["rows"])
        parts += [
            table(s["rows"], f"Many small files ({s['files']} x {s['file_size'] // 1024} KiB)"),
            "",
        ]
    if "resume" in res:
        r = res["resume"]
        parts += ["### Resume after SIGKILL at 50%", ""]
        for t in r["trials"]:
            if "refetched_pct" in t:
                parts.append(
                    f"- killed after {t['killed_after_bytes'] / MiB:.0f} MiB written; the "
                    f"second pull fetched {t['second_pull_bytes_downloaded'] / MiB:.0f} MiB "
                    f"(resumed {t['second_pull_resumed_bytes'] / MiB:.0f} MiB from the "
                    f"journal): re-fetched {t['refetched_bytes'] / MiB:.1f} MiB = "
                    f"**{t['refetched_pct']:.2f}%**{'' if t['ok'] else ' FAILED'}"
                )
            else:
                parts.append(f"- {t['error']}")
        parts.append("")
    if "scaling" in res:
        sc = res["scaling"]
        parts += [
            "### Scaling (prefetch pull, verify on)",
            "",
            "| size | median s | MB/s | CPU s | peak RSS MiB | runs |",
            "|--:|--:|--:|--:|--:|---|",
        ]
        for r in sc["points"]:
            parts.append(
                f"| {r['size_bytes'] / GiB:g} GiB | {fmt(r['median_wall_s'], '.2f')} | "
                f"{fmt(r['mb_s'], '.0f')} | {fmt(r['cpu_s'], '.2f')} | "
                f"{fmt(r['peak_rss_mib'], '.0f')} | "
                f"{', '.join(f'{w:.2f}' for w in r.get('walls', []))} |"
            )
        if "fit_seconds_per_gib" in sc:
            parts += [
                "",
                f"Linear fit: {sc['fit_fixed_seconds']:.2f}s + "
                f"{sc['fit_seconds_per_gib']:.2f}s/GiB; worst point off the line by "
                f"{sc['fit_worst_deviation_pct']:.1f}%.",
            ]
        parts.append("")
    res["targets"] = targets(res)
    if res["targets"]:
        parts += ["### Targets", "", "| target | value | met |", "|---|---|---|"]
        for t in res["targets"]:
            met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
            parts.append(f"| {t['target']} | {t['value']} | {met} |")
        parts.append("")
    return "\n".join(parts)


# ---- command line ------------------------------------------------------------------------------

ALL_TOOLS = [
    "prefetch",
    "prefetch-noverify",
    "s5cmd",
    "s5cmd-tuned",
    "rclone",
    "rclone-mts8",
    "aws",
    "boto3",
    "hf-prefetch",
    "hf-snapshot",
    "hf-cli",
    "ceiling-get",
    "ceiling-dd",
    "dd-buffered",
]
GROUPS = {"s3", "hub", "ceiling", "small", "resume", "scaling"}


def size_list(text: str) -> list[int]:
    if text.strip().lower() in ("", "none", "off", "0"):
        return []
    return [parse_size(p.strip(), field="--scaling") for p in text.split(",") if p.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--size", default="4GiB", help="total size of the model's shards")
    p.add_argument("--shards", type=int, default=0, help="shard count (default: ~768 MiB each)")
    p.add_argument(
        "--model-small-files",
        type=int,
        default=100,
        help="small files inside the model (besides config/tokenizer JSON)",
    )
    p.add_argument("--model-small-file-size", default="100KiB")
    p.add_argument("--part-size", default="8MiB", help="multipart part size of the upload")
    p.add_argument("--runs", type=int, default=3, help="measured runs per tool")
    p.add_argument(
        "--tools",
        default="all",
        help=f"comma list of tools and groups: {','.join(ALL_TOOLS)}; "
        f"groups {','.join(sorted(GROUPS))}; 'all'",
    )
    p.add_argument("--skip", default="", help="comma list of tools/groups to leave out")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny and fast (for the test): no cache drop, 1 run, small extras",
    )
    p.add_argument(
        "--scaling",
        default=None,
        help="model sizes for the scaling test, e.g. 1GiB,2GiB,4GiB,8GiB; 'none'",
    )
    p.add_argument("--scaling-runs", type=int, default=None, help="runs per scaling point")
    p.add_argument("--small-files", type=int, default=None, help="count for the small-files test")
    p.add_argument("--small-file-size", default="100KiB")
    p.add_argument("--no-resume", dest="resume", action="store_false")
    p.add_argument("--no-small-files", dest="no_small", action="store_true")
    p.add_argument("--no-drop-caches", dest="drop_caches", action="store_false", default=None)
    p.add_argument(
        "--s5cmd-tuned",
        default="--numworkers 16 -c 8 -p 16",
        help="global flags (first two words) then cp flags for the tuned s5cmd row",
    )
    p.add_argument("--boto3-concurrency", type=int, default=16)
    p.add_argument("--boto3-chunk-size", default="16MiB")
    p.add_argument("--ceiling-streams", type=int, default=8)
    p.add_argument("--ceiling-chunk-size", default="64MiB")
    p.add_argument(
        "--prefetch-variant",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="an extra prefetch row, e.g. c8='--concurrency 8' (repeatable)",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=None,
        help="before each run, wait up to this many seconds for other load on the "
        "machine to drop below 0.3 cores (default 60; 0 with --quick)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="also run prefetch with the package found in DIR (DIR/prefetch/...) "
        "first on PYTHONPATH: rows prefetch-baseline and hf-prefetch-baseline, for "
        "before/after figures of an engine change",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per tool run (minimum)")
    p.add_argument(
        "--workdir",
        default=str(REPO / "bench" / "results" / "work"),
        help="data sets, server data, destinations, logs (deleted afterwards)",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="keep the work dir's data set and S3 data, and reuse them next time when "
        "the shape flags match (for repeated runs; delete the work dir when done)",
    )
    p.add_argument(
        "--json", dest="json_out", default=str(REPO / "bench" / "results" / "bench.json")
    )
    a = p.parse_args(argv)
    a.command = "python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    a.size = parse_size(a.size, field="--size")
    a.model_small_file_size = parse_size(a.model_small_file_size, field="--model-small-file-size")
    a.small_file_size = parse_size(a.small_file_size, field="--small-file-size")
    a.part_size = parse_size(a.part_size, field="--part-size")
    a.boto3_chunk_size = parse_size(a.boto3_chunk_size, field="--boto3-chunk-size")
    a.ceiling_chunk_size = parse_size(a.ceiling_chunk_size, field="--ceiling-chunk-size")
    if a.quick:
        a.drop_caches = False if a.drop_caches is None else a.drop_caches
        a.scaling = a.scaling if a.scaling is not None else f"{a.size // 2},{a.size}"
        a.scaling_runs = a.scaling_runs or 1
        a.small_files = 100 if a.small_files is None else a.small_files
    a.drop_caches = True if a.drop_caches is None else a.drop_caches
    a.quiet_wait = (0.0 if a.quick else 60.0) if a.quiet_wait is None else a.quiet_wait
    a.scaling = size_list(a.scaling if a.scaling is not None else "1GiB,2GiB,4GiB,8GiB")
    a.scaling_runs = a.scaling_runs or a.runs
    a.small_files = 1000 if a.small_files is None else a.small_files
    if a.no_small:
        a.small_files = 0
    names = {t.strip() for t in a.tools.split(",") if t.strip()}
    if "all" in names:
        names = set(ALL_TOOLS) | GROUPS
    names -= {t.strip() for t in a.skip.split(",") if t.strip()}
    unknown = names - set(ALL_TOOLS) - GROUPS
    if unknown:
        p.error(f"--tools: unknown {sorted(unknown)}")
    if names & {"resume", "scaling", "small"} and "prefetch" not in names:
        names.add("prefetch")
    a.tools = sorted(names)
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    handler = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        res = bench.run()
    finally:
        bench.cleanup()
        signal.signal(signal.SIGTERM, handler)
    res["meta"] = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": args.command,
        "runs": args.runs,
        "cache": bench.cache.note,
        "cpus": os.cpu_count(),
        "mem_gib": round(psutil.virtual_memory().total / GiB),
        "python": platform.python_version(),
        "versions": tool_versions(),
        "tools": args.tools,
    }
    text = report(res)
    print(text)
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, sort_keys=True, default=str) + "\n")
    say(f"JSON written to {out}")
    return 0


def tool_versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for name in ("s5cmd", "rclone", "aws", "weed", "curl"):
        exe = find_bin(name)
        if exe:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                r = subprocess.run(
                    [exe, VERSION_ARG[name]], capture_output=True, text=True, timeout=30
                )
                first = (r.stdout or r.stderr).strip().splitlines()
                out[name] = first[0] if first else ""
    for mod in ("boto3", "botocore", "huggingface_hub", "awscrt", "urllib3"):
        with contextlib.suppress(Exception):
            out[mod] = __import__(mod).__version__
    return out


if __name__ == "__main__":
    sys.exit(main())
