"""How long a download holds the GIL, in seconds per GB: prefetch's engine vs awscrt's S3 client.

On a node with dozens of cores and 100-200 Gbit/s, one Python process is bounded by the time
its threads hold the GIL per byte: at most 1 / (GIL-held seconds per GB) GB/s, however many
cores there are. This measures that figure directly.

Method: the worker process finds the address of CPython 3.11's GIL ``locked`` flag
(``_PyRuntime.ceval.gil``: the field after the switch interval and the last holder's thread
state, found by matching both, twice, with two switch intervals), then starts a sampler
*process* that reads that flag from ``/proc/PID/mem`` at random intervals (about every 0.5 ms)
while the download runs, as a SCHED_FIFO process so that it wakes on time however busy the
machine is (a starved sampler would miss the busy moments). The sampler never touches the
worker's GIL, so it does not perturb what it measures (it costs a few % of one core).
GIL-held seconds = the fraction of time the flag was set (each sample weighted by the time
since the previous one: the wake-up rate differs between a busy and an idle machine) x wall
time. Checked: a busy loop for 1 s then 1 s asleep reads 55%; 0.5 s / 1.5 s reads 27%; two
sha256 of 256 MiB (OpenSSL, GIL released) read 0%: about +2-5 points. Needs root (ptrace
rights on the worker; SCHED_FIFO) and CPython 3.11.

Modes, each a fresh subprocess, alternated over ``--runs`` rounds against one local SeaweedFS:
  prefetch            the engine in-process (sync of an S3 prefix, verify on, defaults) with the
                      client the CLI makes (a LazyS3Client): with static keys, as here, every
                      request is signed and sent without botocore (prefetch/sources/s3/direct.py)
  prefetch-lean       the same on a boto3 client (as with IRSA or a profile): botocore's
                      credentials and signer, the request on the transport seam (sources/s3/sdk.py)
  prefetch-botocore   the same with every request through botocore (S3Source.signed_requests=False)
  prefetch-pN         the engine over the front door (open_source, as `prefetch pull`), run by
                      N processes (N=1: the in-process Transfer; N>1: the multi-process mode,
                      prefetch/pipeline/engine/processes.py); every worker's GIL is sampled too (the
                      flag's address translated by libpython's load address in that process),
                      and CPU counts the fork server and the workers it forked
  awscrt              awscrt.s3.S3Client, one GET_OBJECT per object straight to a file
                      (recv_filepath: parts, parallelism and writes all native), part 8 MiB,
                      no checksum validation

    python bench/gil.py --size 2GiB --runs 3
    python bench/gil.py --size 1GiB --runs 3 --modes prefetch-p1,prefetch-p2
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import resource
import select
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GB = 1e9
BUCKET, PREFIX = "gil", "model"
MODES = ("prefetch", "prefetch-lean", "prefetch-botocore", "awscrt")
#: A node of the issue's projection: 64 cores, 100 Gbit/s.
NODE_GB_S = 100e9 / 8 / GB


# ---- the GIL flag ------------------------------------------------------------------------------


def gil_locked_address() -> int:
    """The address of the GIL's ``locked`` int in this process (CPython 3.11 layout:
    interval (unsigned long), last_holder (pointer), locked (int))."""
    if sys.version_info[:2] != (3, 11):
        raise SystemExit(f"bench/gil.py reads CPython 3.11's GIL layout, not {sys.version}")
    base = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
    current = ctypes.pythonapi.PyThreadState_Get
    current.restype = ctypes.c_void_p
    me = current()

    def candidates(interval_us: int) -> set[int]:
        found = set()
        for off in range(0, 1 << 15, 8):
            if (
                ctypes.c_ulong.from_address(base + off).value == interval_us
                and ctypes.c_void_p.from_address(base + off + 8).value == me
                and ctypes.c_int.from_address(base + off + 16).value == 1
            ):
                found.add(off)
        return found

    before = sys.getswitchinterval()
    first = candidates(round(before * 1e6))
    sys.setswitchinterval(0.0071)
    try:
        second = candidates(7100)
    finally:
        sys.setswitchinterval(before)
    both = first & second
    if len(both) != 1:
        raise SystemExit(f"cannot locate the GIL flag (candidates {sorted(both)})")
    return base + both.pop() + 16


def translated(address: int, pid: int) -> int:
    """``address`` (in this process) in process ``pid`` running the same Python: the same
    offset from the start of the file mapped where it lies (libpython, or the executable)."""
    path, offset = "", 0
    for start, end, name in _maps(os.getpid()):
        if start <= address < end:
            path = name
    if not path:
        raise SystemExit("the GIL flag is not in a file's mapping")
    offset = address - min(start for start, _, name in _maps(os.getpid()) if name == path)
    return min(start for start, _, name in _maps(pid) if name == path) + offset


def _maps(pid: int) -> list[tuple[int, int, str]]:
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        out.append((low, high, fields[5] if len(fields) > 5 else ""))
    return out


def sample(pid: int, address: int, period: float) -> None:
    """Sampler process: read the flag until stdin closes, print {"samples", "locked"}."""
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:  # wake on time whatever else runs: a starved sampler would under-sample busy moments
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except OSError:
        print("gil.py: no SCHED_FIFO for the sampler (not root?)", file=sys.stderr)
    print("ready", flush=True)
    samples = locked = 0
    held = watched = cpu = 0.0
    last = time.monotonic()
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], period * random.uniform(0.5, 1.5))
        if ready:
            break
        try:
            value = int.from_bytes(os.pread(fd, 4, address), "little")
        except OSError:
            break
        now = time.monotonic()
        # each sample stands for the time since the previous one: the wake-up rate differs
        # between a busy and an idle machine, a plain count would weigh busy moments more
        span = min(now - last, 10 * period)
        last = now
        samples += 1
        if samples % 64 == 1:
            cpu = _cpu_of(pid, cpu)
        locked += value != 0
        watched += span
        held += span if value else 0.0
    fraction = held / max(watched, 1e-9)
    cpu = _cpu_of(pid, cpu)
    counts = {"samples": samples, "locked": locked, "held_fraction": fraction, "held_s": held,
              "cpu_s": cpu}  # fmt: skip
    print(json.dumps(counts), flush=True)


def _cpu_of(pid: int, last: float) -> float:
    """CPU seconds (user + system) process ``pid`` has used; ``last`` once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return last
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the workloads -----------------------------------------------------------------------------


def prepare_prefetch(endpoint: str, dest: Path, *, mode: str) -> Callable[[], int]:
    from prefetch.demo.locals3 import REGION, SeaweedS3
    from prefetch.pipeline.engine.transfer import TransferConfig
    from prefetch.pipeline.layout import PlainLayout
    from prefetch.pipeline.spec import ModelSpec, parse_source_uri
    from prefetch.pipeline.sync import sync
    from prefetch.sources.s3.factory import lazy_s3_client
    from prefetch.sources.s3.source import S3Source

    server = SeaweedS3(endpoint=endpoint)
    spec = ModelSpec(source=parse_source_uri(f"s3://{BUCKET}/{PREFIX}/"))
    if mode == "prefetch":
        client: Any = lazy_s3_client(
            endpoint_url=server.endpoint, access_key=server.access_key,
            secret_key=server.secret_key, region=REGION, max_pool_connections=24,
        )  # fmt: skip
    else:
        client = server.client(max_pool_connections=24)
    source = S3Source(client, spec.source)
    source.signed_requests = mode != "prefetch-botocore"

    def go() -> int:
        return sync(spec, source, PlainLayout(dest), TransferConfig()).bytes_downloaded

    return go


def prepare_processes(endpoint: str, dest: Path, processes: int) -> Callable[[], int]:
    """The engine over the front door (as `prefetch pull` opens it), in ``processes``
    processes; the workers reach the server with the variables set here."""
    import functools

    from prefetch.demo.locals3 import SeaweedS3
    from prefetch.pipeline.engine.processes import ProcessEngine, SourceRecipe
    from prefetch.pipeline.engine.transfer import Transfer, TransferConfig
    from prefetch.pipeline.layout import PlainLayout
    from prefetch.pipeline.spec import ModelSpec, parse_source_uri
    from prefetch.pipeline.sync import EngineFactory, execute, prepare
    from prefetch.sources import SourceSettings, open_source

    server = SeaweedS3(endpoint=endpoint)
    os.environ.update(server.aws_env(dest.parent / "aws"))
    spec = ModelSpec(source=parse_source_uri(f"s3://{BUCKET}/{PREFIX}/"))
    config = TransferConfig()
    settings = SourceSettings(s3_endpoint=endpoint, concurrency=config.concurrency)
    engine: EngineFactory = Transfer
    if processes > 1:
        recipe = SourceRecipe(spec, settings)
        engine = functools.partial(ProcessEngine, recipe=recipe, processes=processes)

    def go() -> int:
        source = open_source(spec, settings)
        with prepare(spec, source, PlainLayout(dest)) as plan:
            return execute(plan, config, engine=engine).bytes_downloaded

    return go


def prepare_awscrt(endpoint: str, dest: Path) -> Callable[[], int]:
    from awscrt import auth, http, io, s3

    from prefetch.demo.locals3 import ACCESS_KEY, REGION, SECRET_KEY, SeaweedS3

    listing = SeaweedS3(endpoint=endpoint).client().list_objects_v2(Bucket=BUCKET, Prefix=PREFIX)
    objects = [(o["Key"], o["Size"]) for o in listing.get("Contents", [])]
    host = endpoint.removeprefix("http://")
    bootstrap = io.ClientBootstrap(io.EventLoopGroup(), io.DefaultHostResolver(io.EventLoopGroup()))
    credentials = auth.AwsCredentialsProvider.new_static(ACCESS_KEY, SECRET_KEY)
    client = s3.S3Client(
        bootstrap=bootstrap,
        region=REGION,
        tls_mode=s3.S3RequestTlsMode.DISABLED,
        signing_config=s3.create_default_s3_signing_config(
            region=REGION, credential_provider=credentials
        ),
        part_size=8 * 1024 * 1024,
        throughput_target_gbps=float(os.environ.get("GIL_BENCH_CRT_GBPS", "10")),
    )

    def go() -> int:
        done = []
        for key, _ in objects:
            target = dest / key
            target.parent.mkdir(parents=True, exist_ok=True)
            headers = http.HttpHeaders([("Host", host)])
            request = http.HttpRequest("GET", f"/{BUCKET}/{key}", headers)
            done.append(
                client.make_request(
                    type=s3.S3RequestType.GET_OBJECT, request=request, recv_filepath=str(target)
                ).finished_future
            )
        for future in done:
            future.result()
        return sum(size for _, size in objects)

    return go


def worker(mode: str, endpoint: str, dest: Path, period: float) -> None:
    """One measured download in this process, with the sampler watching; prints one JSON line.
    Imports, clients and (for awscrt) the listing are set up before the measured window."""
    processes = int(mode.removeprefix("prefetch-p")) if mode.startswith("prefetch-p") else 0
    if mode == "awscrt":
        go = prepare_awscrt(endpoint, dest)
    elif processes:
        go = prepare_processes(endpoint, dest, processes)
    else:
        go = prepare_prefetch(endpoint, dest, mode=mode)
    address = gil_locked_address()
    sampler = subprocess.Popen(
        [sys.executable, __file__, "--sample", str(os.getpid()), str(address), str(period)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert sampler.stdout is not None and sampler.stdout.readline().strip() == "ready"
    watcher = WorkerSamplers(address, period, processes) if processes > 1 else None
    t0, r0 = time.monotonic(), _rusage()
    nbytes = go()
    wall, r1 = time.monotonic() - t0, _rusage()
    out, _ = sampler.communicate("stop\n", timeout=30)
    counts = json.loads(out)
    fraction = counts["held_fraction"]
    row = {"mode": mode, "bytes": nbytes, "wall_s": wall, "cpu_s": r1 - r0,
           "gil_fraction": fraction, "gil_s": fraction * wall,
           "samples": counts["samples"]}  # fmt: skip
    if watcher is not None:
        row["workers"] = watcher.results()
        row["cpu_s"] += watcher.server_cpu()
    print(json.dumps(row))


def _descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, parent) of ``pid``'s children and grandchildren, from /proc's children lists."""
    out = []
    for child in _children(pid):
        out.append((child, pid))
        out += [(grandchild, child) for grandchild in _children(child)]
    return out


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _rusage() -> float:
    """CPU seconds of this process and its waited-for children (the engine's workers; the
    samplers are waited for after the second reading)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


class WorkerSamplers:
    """A sampler on each engine worker process as it appears (a thread polls this process's
    children for multiprocessing's spawned workers); each reports when its worker ends."""

    def __init__(self, address: int, period: float, workers: int) -> None:
        import threading

        self._address, self._period, self._workers = address, period, workers
        self._samplers: dict[int, subprocess.Popen[str]] = {}
        self.server_pid = 0  # the fork server, once seen
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        """Poll for workers with cheap reads of /proc (psutil's recursive children() scans
        every process of the machine: polled every few ms, this process's GIL time was
        mostly that)."""
        me = os.getpid()
        seen: set[int] = set()
        while not self._done.is_set() and len(self._samplers) < self._workers:
            for pid, parent in _descendants(me):
                if pid in seen:
                    continue
                try:
                    line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    if sys.argv[0].encode() in line:
                        continue  # forked, not yet the program it runs: look again
                    seen.add(pid)
                    # a worker: spawned, or forked by the fork server (this process's child;
                    # its children are the workers)
                    if b"forkserver" in line and parent == me:
                        self.server_pid = pid
                        continue
                    if not (b"spawn_main" in line or b"forkserver" in line):
                        continue
                    address = translated(self._address, pid)
                except (OSError, ValueError):
                    continue
                self._samplers[pid] = subprocess.Popen(
                    [sys.executable, __file__, "--sample", str(pid), str(address),
                     str(self._period)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
            time.sleep(0.005)

    def server_cpu(self) -> float:
        """CPU seconds of the fork server (its imports) and of the workers it forked and
        reaped (RUSAGE_CHILDREN of this process does not see them: the server is alive)."""
        if not self.server_pid:
            return 0.0
        fields = Path(f"/proc/{self.server_pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        return ticks / os.sysconf("SC_CLK_TCK")

    def results(self) -> list[dict[str, Any]]:
        """Each worker's counts (its sampler ends when it cannot read the worker any more)."""
        self._done.set()
        self._thread.join()
        rows = []
        for pid, sampler in self._samplers.items():
            out, _ = sampler.communicate("stop\n", timeout=30)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if lines:
                rows.append({"pid": pid, **json.loads(lines[-1])})
        return rows


# ---- the driver --------------------------------------------------------------------------------


def drive(args: argparse.Namespace) -> None:
    from prefetch.demo.locals3 import SeaweedS3
    from prefetch.demo.modelgen import generate_model, upload_model
    from prefetch.support.units import parse_size

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    size = parse_size(args.size, field="--size")
    assert size is not None
    files = generate_model(work / "src", size, shards=args.shards)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with SeaweedS3(data_dir=work / "s3") as server:
        upload_model(server.client(), BUCKET, PREFIX, files)
        shutil.rmtree(work / "src")
        for run in range(1, args.runs + 1):
            for mode in modes:
                dest = work / "dest"
                shutil.rmtree(dest, ignore_errors=True)
                os.sync()
                line = subprocess.run(
                    [sys.executable, __file__, "--worker", mode, server.endpoint, str(dest),
                     str(args.period)],
                    check=True, capture_output=True, text=True,
                ).stdout.strip().splitlines()[-1]  # fmt: skip
                row = json.loads(line)
                results[mode].append(row)
                workers = " ".join(f"worker GIL {w['held_s']:.2f}s CPU {w['cpu_s']:.2f}s "
                                   f"({w['samples']} samples)"
                                   for w in row.get("workers", []))  # fmt: skip
                print(f"run {run} {mode:18s} {row['wall_s']:6.2f}s cpu {row['cpu_s']:5.2f}s "
                      f"GIL {100 * row['gil_fraction']:4.1f}% = {row['gil_s']:.2f}s "
                      f"({row['samples']} samples) {workers}",
                      file=sys.stderr, flush=True)  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    print(report(results, args))
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(results, indent=1) + "\n")


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    lines = [
        f"`python bench/gil.py --size {args.size} --shards {args.shards} --runs {args.runs} "
        f"--modes {args.modes} --crt-gbps {args.crt_gbps}`",
        "",
        "| mode | wall s (median) | CPU s / GB | GIL held | GIL-held s / GB | one process, "
        "GIL-bound: GB/s | cores for 12.5 GB/s (CPU-bound) |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for mode, rows in results.items():
        if not rows:
            continue
        gb = rows[0]["bytes"] / GB
        wall = statistics.median(r["wall_s"] for r in rows)
        cpu = statistics.median(r["cpu_s"] for r in rows) / gb
        frac = statistics.median(r["gil_fraction"] for r in rows)
        gil = statistics.median(r["gil_s"] for r in rows) / gb
        bound = f"{1 / gil:.1f}" if gil > 0 else "-"
        lines.append(
            f"| {mode} | {wall:.2f} | {cpu:.2f} | {100 * frac:.0f}% | {gil:.3f} | {bound} | "
            f"{cpu * NODE_GB_S:.0f} |"
        )
    procs = {m: rows for m, rows in results.items() if rows and rows[0].get("workers")}
    if procs:
        lines += [
            "",
            "Multi-process modes: the GIL of each process, seconds held per GB that process "
            "moved (a worker: the pull's bytes / workers, the shares being equal in bytes; the "
            "parent: per GB of the pull)",
            "",
            "| mode | parent GIL s / GB | worker GIL s / GB (each, median of runs) | one worker, "
            "GIL-bound: GB/s | workers for 12.5 GB/s |",
            "|---|--:|--:|--:|--:|",
        ]
    for mode, rows in procs.items():
        gb = rows[0]["bytes"] / GB
        parent = statistics.median(r["gil_s"] for r in rows) / gb
        per = [w["held_s"] / (gb / len(r["workers"])) for r in rows for w in r["workers"]]
        worker = statistics.median(per)
        lines.append(
            f"| {mode} | {parent:.3f} | {worker:.3f} ({', '.join(f'{x:.2f}' for x in per)}) | "
            f"{1 / worker:.1f} | {NODE_GB_S * worker:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--sample":
        sample(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], Path(sys.argv[4]), float(sys.argv[5]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="2GiB", help="model size (shards, multipart CRC64NVME)")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--period", type=float, default=0.0005, help="mean seconds between samples")
    p.add_argument(
        "--crt-gbps", default="10", help="awscrt's throughput_target_gbps (sets its connections)"
    )
    p.add_argument("--workdir", default=str(REPO / "bench" / "results" / "gil-work"))
    p.add_argument("--json", dest="json_out", default=str(REPO / "bench" / "results" / "gil.json"))
    args = p.parse_args()
    os.environ["GIL_BENCH_CRT_GBPS"] = args.crt_gbps  # the workers inherit it
    drive(args)


if __name__ == "__main__":
    main()
