"""The engine's multi-process mode (``prefetch pull --processes N``): worker processes that each
run a :class:`~prefetch.pipeline.engine.transfer.Transfer` over a share of the plan's files.

Why: one process holds the GIL for about 0.4 s per GB it moves (bench/README.md, "The GIL,
and awscrt's native S3 client"), which caps it near 2.5 GB/s, a fifth of a 100 Gbit/s node.

What stays one, in this (the parent) process: the plan and the model's lock, the progress
(workers send their byte counts, batched, and the parent hands them to the one sink), the
publish (a worker reports each file it verified; the parent publishes it through the layout
and records it, then commits the snapshot when every worker is done) and the outcome (the
first real error of any worker, or of a worker's death, is the pull's; the other workers are
stopped). What each worker owns: its files' ``.incomplete`` partials and resume journals, in
the one staging folder, exactly as one process writes them, so a rerun resumes whatever was
interrupted, in either mode.

Workers are forked from a fork server (:func:`worker_context`: a fresh interpreter, so no
inherited locks, threads or clients); each is given the plan's files and the recipe of the
source (spec and settings), opens its own source through the front door
(:func:`prefetch.sources.open_source`) and adopts what the parent's resolve found
(:class:`~prefetch.sources.base.ReadsInWorkers`) instead of resolving again. A worker ignores
SIGINT (the parent stops it: a Ctrl-C on a terminal reaches the whole process group), stops
on SIGTERM or when the parent asks or goes away, and on Linux is killed by the kernel when its
parent dies (``PR_SET_PDEATHSIG``; the fork server ends with the pull's process), so a
``kill -9`` of the pull leaves no writer behind for the next run.

Files are shared out whole, largest first to the least loaded worker; the ranges of one large
file are not split between processes (a file's chunks, journal and sequential hash stay in
one process).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext, SpawnContext
from pathlib import Path
from typing import Any

from prefetch.pipeline.engine.transfer import PublishFn, Transfer, TransferConfig, TransferStats
from prefetch.pipeline.progress import NullProgress, ProgressSink
from prefetch.pipeline.snapshot import Checksum, RemoteFile
from prefetch.pipeline.spec import ModelSpec
from prefetch.sources import SourceSettings, open_source
from prefetch.sources.base import ReadsInWorkers, Source
from prefetch.support.errors import Cancelled, ConfigError, PrefetchError, TransferError
from prefetch.support.redact import install_filter

log = logging.getLogger(__name__)

__all__ = ["ProcessEngine", "SourceRecipe", "auto_processes", "parse_processes", "shares"]

#: Most worker processes ``--processes`` takes.
MAX_PROCESSES = 64
#: A worker sends its byte count at most this often (and before each file it reports).
FLUSH_SECONDS = 0.1
#: Seconds a stopped worker has to end on its own before it is killed.
STOP_GRACE = 15.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class SourceRecipe:
    """How a worker opens its source: the spec, the settings (without clients: no client
    crosses a process) and the layout asked for, through the one front door."""

    spec: ModelSpec
    settings: SourceSettings
    layout_name: str | None = None

    def open(self, concurrency: int) -> Source:
        settings = dataclasses.replace(self.settings, concurrency=concurrency)
        return open_source(self.spec, settings, layout=self.layout_name)


def auto_processes() -> int:
    """``--processes auto``: one per core this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)  # (Linux; elsewhere: every core)
    cores = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    return max(1, min(cores, MAX_PROCESSES))


def parse_processes(value: str | int) -> int:
    """``--processes``: a count from 1 to :data:`MAX_PROCESSES`, or ``auto``."""
    text = str(value).strip().lower()
    if text == "auto":
        return auto_processes()
    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_PROCESSES:
        raise ConfigError(f"processes: must be auto or 1 to {MAX_PROCESSES}, got {value!r}")
    return count


def shares(files: list[RemoteFile], processes: int) -> list[list[RemoteFile]]:
    """``files`` in at most ``processes`` shares of about equal bytes (largest first, each to
    the share with the fewest bytes so far; a share's count of files breaks ties), no share
    empty."""
    bins: list[list[RemoteFile]] = [[] for _ in range(max(1, processes))]
    loads = [0] * len(bins)
    for f in sorted(files, key=lambda f: (-f.size, f.path)):
        i = min(range(len(bins)), key=lambda k: (loads[k], len(bins[k])))
        bins[i].append(f)
        loads[i] += f.size
    return [b for b in bins if b]


class ProcessEngine:
    """An engine (:class:`prefetch.pipeline.sync.Engine`) over worker processes; make one per
    execute with ``functools.partial(ProcessEngine, recipe=..., processes=N)`` as the factory.

    Runs in this process instead (a Transfer, as without the flag) when there is one share of
    files or the source cannot be read from another process."""

    def __init__(
        self,
        source: Source,
        staging_dir: Path,
        publish: PublishFn,
        config: TransferConfig,
        *,
        progress: ProgressSink | None = None,
        stop: threading.Event | None = None,
        recipe: SourceRecipe,
        processes: int,
    ) -> None:
        self.source = source
        self.staging = staging_dir
        self.publish = publish
        self.config = config
        self.progress = progress or NullProgress()
        self.stop = stop or threading.Event()
        self.recipe = recipe
        self.processes = processes
        self.stats = TransferStats()

    def run(self, files: list[RemoteFile]) -> TransferStats:
        parts = shares(files, self.processes)
        if len(parts) < 2 or not isinstance(self.source, ReadsInWorkers):
            if len(parts) >= 2:
                log.info("this source is read in one process (it cannot be read from workers)")
            inner = Transfer(
                self.source, self.staging, self.publish, self.config,
                progress=self.progress, stop=self.stop,
            )  # fmt: skip
            try:
                return inner.run(files)
            finally:
                self.stats = inner.stats
        self.staging.mkdir(parents=True, exist_ok=True)
        _Supervisor(self, parts, self.source.resolved()).run()
        return self.stats


@dataclass(frozen=True)
class _Brief:
    """What a worker is given (pickled to it)."""

    recipe: SourceRecipe
    resolved: object
    staging: str
    config: TransferConfig
    files: list[RemoteFile]
    log_level: int


@dataclass
class _Worker:
    """A worker as the parent sees it."""

    process: Any  # multiprocessing's SpawnProcess (its type is private)
    events: Connection  # the worker's reports
    control: Connection  # "stop"
    ended: bool = False  # its report pipe is closed
    reported: bool = False  # it sent its outcome


class _Supervisor:
    """The parent's side of one multi-process run: start the workers, hand their reports to
    the progress sink and the publish, stop them all on the first failure (or a stop, or an
    exception here: a Ctrl-C), and raise the run's one outcome."""

    def __init__(self, engine: ProcessEngine, parts: list[list[RemoteFile]], resolved: object):
        self._engine = engine
        self._parts = parts
        self._resolved = resolved
        self._workers: list[_Worker] = []
        self._error: BaseException | None = None
        self._stopping = False

    def run(self) -> None:
        try:
            self._start()
            self._supervise()
        finally:
            self._stop_all()
            self._reap()
        if self._error is not None:
            raise self._error

    def _start(self) -> None:
        engine = self._engine
        config = engine.config
        per_worker = max(1, -(-config.concurrency // len(self._parts)))  # the flag's total
        worker_config = dataclasses.replace(config, concurrency=per_worker)
        context = worker_context(type(engine.source).__module__)
        for share in self._parts:
            brief = _Brief(
                engine.recipe, self._resolved, str(engine.staging), worker_config, share,
                logging.getLogger().getEffectiveLevel(),
            )  # fmt: skip
            events_in, events_out = context.Pipe(duplex=False)
            control_in, control_out = context.Pipe(duplex=False)
            process = context.Process(
                target=_worker_main, args=(brief, events_out, control_in),
                name="prefetch-worker", daemon=True,
            )  # fmt: skip
            process.start()
            events_out.close()  # the worker's ends: only it holds them now
            control_in.close()
            self._workers.append(_Worker(process, events_in, control_out))
        pids = ", ".join(str(w.process.pid) for w in self._workers)
        log.info("%d worker processes (pids %s)", len(self._workers), pids)

    def _supervise(self) -> None:
        while not all(w.ended for w in self._workers):
            if self._engine.stop.is_set() and not self._stopping:
                self._fail(Cancelled("stopped"))
            ready = wait([w.events for w in self._workers if not w.ended], timeout=0.2)
            for conn in ready:
                worker = next(w for w in self._workers if w.events is conn)
                self._receive(worker)

    def _receive(self, worker: _Worker) -> None:
        try:
            message = worker.events.recv()
        except (EOFError, OSError):
            worker.ended = True
            worker.events.close()
            if not worker.reported:
                self._fail(_died(worker))
            return
        try:
            self._handle(worker, message)
        except Exception as exc:  # a publish failed here (disk full, DEST removed...)
            self._fail(exc)

    def _handle(self, worker: _Worker, message: tuple[Any, ...]) -> None:
        engine, progress = self._engine, self._engine.progress
        kind = message[0]
        if kind == "bytes":
            progress.advance(message[1])
            for _ in range(message[2]):
                progress.chunk_done()
        elif kind == "verified":
            # a file a worker verified is published, also after another worker failed (as
            # one process publishes what it verified before a failure)
            file, staged, checks = message[1], Path(message[2]), message[3]
            engine.publish(file, staged, checks)
            progress.file_done(file.path, file.size)
        elif kind == "retry":
            progress.retry(message[1])
        elif kind == "checksum_failure":
            progress.checksum_failure(message[1])
        elif kind == "outcome":
            worker.reported = True
            _add_stats(engine.stats, message[1])
            if message[2] is not None:
                self._fail(_rebuilt(message[2]))

    def _fail(self, exc: BaseException) -> None:
        """The run fails with ``exc`` unless it already failed for a better reason (a worker
        stopped by the run's own stop says only "stopped"); the other workers are stopped."""
        if self._error is None or (
            isinstance(self._error, Cancelled) and not isinstance(exc, Cancelled)
        ):
            self._error = exc
        if not self._stopping:
            self._stopping = True
            for worker in self._workers:
                with contextlib.suppress(OSError):
                    worker.control.send("stop")

    def _stop_all(self) -> None:
        for worker in self._workers:
            with contextlib.suppress(OSError, ValueError):
                worker.control.send("stop")

    def _reap(self) -> None:
        """Wait for every worker to end (killing one that outlives the grace), so none still
        writes once the model's lock is released."""
        deadline = time.monotonic() + STOP_GRACE
        for worker in self._workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                log.warning("a worker process (pid %s) did not stop: killed", worker.process.pid)
                worker.process.kill()
                worker.process.join()
            worker.control.close()
            if not worker.ended:
                worker.events.close()
                worker.ended = True


def worker_context(source_module: str) -> ForkServerContext | SpawnContext:
    """Where workers start: a fork server (a fresh interpreter, started once per process, that
    imported the engine and the source's module; each worker is a fork of it: no state of the
    pull's process, and one interpreter's imports for all the workers instead of one each,
    ~0.3 CPU-s here), or spawned fresh where there is no fork server (not POSIX). The
    server, and so every worker, has the environment this process had when the server started
    (the credentials and CA variables the workers' sources read)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # (read when the server starts, the first time workers are asked for: the same modules)
    context.set_forkserver_preload(["__main__", __name__, source_module])
    return context


def _died(worker: _Worker) -> TransferError:
    """The error of a worker whose reports ended before its outcome."""
    process = worker.process
    process.join(5)
    code = process.exitcode
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            how = f"killed by {signal.Signals(-code).name}"
    else:
        how = f"exit status {code}"
    return TransferError(
        f"a worker process of the pull (pid {process.pid}) ended before it finished ({how}); "
        "the partial files are kept",
        hint="run the pull again to resume",
    )


def _add_stats(total: TransferStats, part: dict[str, Any]) -> None:
    for name, value in part.items():
        if isinstance(value, bool) or name.startswith("_"):
            continue
        if isinstance(value, int):
            setattr(total, name, getattr(total, name) + value)
        elif isinstance(value, dict):
            counts = getattr(total, name)
            for key, n in value.items():
                counts[key] = counts.get(key, 0) + n
        elif isinstance(value, list):
            getattr(total, name).extend(value)


def _stats_of(stats: TransferStats) -> dict[str, Any]:
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if f.name != "_lock"}


# -- error across the process boundary ---------------------------------------------------------


def _portable(exc: BaseException) -> tuple[type[BaseException], tuple[Any, ...], dict[str, Any]]:
    """``exc`` as its class, args and attributes (the package's errors take keyword arguments
    and more than a message, so the default pickling of exceptions cannot rebuild them);
    a TransferError with its message when its parts do not pickle."""
    parts = (type(exc), exc.args, dict(vars(exc)))
    try:
        pickle.dumps(parts)
    except Exception:
        plain = TransferError(str(exc), hint=getattr(exc, "hint", None))
        return (TransferError, plain.args, dict(vars(plain)))
    return parts


def _rebuilt(parts: tuple[type[BaseException], tuple[Any, ...], dict[str, Any]]) -> BaseException:
    cls, args, attributes = parts
    exc = cls.__new__(cls)
    BaseException.__init__(exc, *args)
    exc.__dict__.update(attributes)
    return exc


# -- the worker --------------------------------------------------------------------------------


class _Reports:
    """A worker's side of its report pipe; a lock serialises the threads that send."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            self._conn.send(message)


class _WorkerProgress(NullProgress):
    """A worker's progress sink: bytes and finished requests go to the parent in batches
    (at most every :data:`FLUSH_SECONDS`, and before each file it reports); a finished file is
    told by the parent once it has published it."""

    def __init__(self, reports: _Reports) -> None:
        self._reports = reports
        self._lock = threading.Lock()
        self._bytes = 0
        self._chunks = 0
        self._last = time.monotonic()

    def advance(self, nbytes: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._bytes += nbytes
            due = now - self._last >= FLUSH_SECONDS
        if due:
            self.flush()

    def chunk_done(self) -> None:
        with self._lock:
            self._chunks += 1

    def retry(self, reason: str) -> None:
        self._reports.send(("retry", reason))

    def checksum_failure(self, path: str) -> None:
        self._reports.send(("checksum_failure", path))

    def flush(self) -> None:
        with self._lock:
            nbytes, chunks = self._bytes, self._chunks
            self._bytes = self._chunks = 0
            self._last = time.monotonic()
        if nbytes or chunks:
            self._reports.send(("bytes", nbytes, chunks))


def _worker_main(brief: _Brief, events: Connection, control: Connection) -> None:
    """A worker process: its share of the files through one Transfer, each verified file
    reported to the parent (which publishes it), then the outcome and the figures."""
    stop = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the workers
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    _die_with_parent()
    _log_like_parent(brief.log_level)
    threading.Thread(target=_listen, args=(control, stop), daemon=True).start()
    reports = _Reports(events)
    progress = _WorkerProgress(reports)

    def verified(file: RemoteFile, staged: Path, checks: tuple[Checksum, ...]) -> None:
        progress.flush()
        reports.send(("verified", file, str(staged), checks))

    stats = TransferStats()
    error: BaseException | None = None
    try:
        source = brief.recipe.open(brief.config.concurrency)
        if isinstance(source, ReadsInWorkers):
            source.adopt(brief.resolved)
        transfer = Transfer(
            source, Path(brief.staging), verified, brief.config, progress=progress, stop=stop
        )
        try:
            transfer.run(brief.files)
        finally:
            stats = transfer.stats
    except BaseException as exc:  # told to the parent, which decides the run's outcome
        error = exc
        if not isinstance(exc, PrefetchError | OSError):
            log.debug("worker failed", exc_info=True)
    with contextlib.suppress(OSError):
        progress.flush()
        reports.send(("outcome", _stats_of(stats), None if error is None else _portable(error)))
    events.close()


def _listen(control: Connection, stop: threading.Event) -> None:
    """Set ``stop`` when the parent says so, or its end of the pipe closes (it died)."""
    with contextlib.suppress(EOFError, OSError):
        control.recv()
    stop.set()


def _die_with_parent() -> None:
    """On Linux, have the kernel kill this worker when its parent dies: the fork server, which
    ends when the pull's process does (a ``kill -9`` of the pull), or that process itself
    (spawned), so no worker still writes when the next pull takes the model's lock. ctypes:
    the standard library has no prctl, and this one call does not justify a dependency."""
    if sys.platform != "linux":
        return
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the call above
        os._exit(1)


def _log_like_parent(level: int) -> None:
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        install_filter(handler)  # never a request's signature
    if level > logging.DEBUG:
        for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "filelock"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
