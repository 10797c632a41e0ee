"""How the chunk engine runs (:class:`TransferConfig`) and what it counts (:class:`TransferStats`):
the settings and the tally every part of the engine (:mod:`prefetch.pipeline.engine.transfer`)
shares."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prefetch.pipeline.retry import RetryPolicy
from prefetch.support.errors import ConfigError

MiB = 1024 * 1024
#: The logger of every part of the engine (and of the mirror's watched reads): the engine
#: module's own (``<package>.transfer``, beside this module), so their lines name the logger
#: they named when the engine was one module.
ENGINE_LOGGER = __name__.rpartition(".")[0] + ".transfer"


@dataclass(frozen=True)
class TransferConfig:
    """How the engine runs.

    Peak memory of the engine is about ``concurrency * buffer_size`` (each worker thread owns one
    read buffer: 16 x 1 MiB by default) plus ``hash_workers`` 4 MiB read buffers and the HTTP
    connections' socket buffers, whatever the file or chunk size. ``chunk_size`` is the size of
    each ranged request; ``piece_size`` (or the chunk size, if smaller) the granularity of resume:
    a killed pull re-fetches at most ``concurrency * piece_size`` bytes. ``direct_io`` writes
    large files with O_DIRECT (buffered writes where the filesystem refuses it).

    ``min_rate`` and ``stall_window``: a ranged request that delivers fewer than ``min_rate``
    bytes/s over any ``stall_window`` seconds (also a server that sends nothing) is abandoned
    and retried from its last byte like a connection reset; ``min_rate=0`` turns this off.
    ``deadline``: seconds the whole transfer may take (None: no limit); when it passes the
    transfer stops, keeps its partial files and raises DeadlineExceededError.
    """

    concurrency: int = 16
    chunk_size: int = 64 * MiB
    buffer_size: int = 1 * MiB
    #: Threads that finish files (fsync, checksum read-back). More than the cores: a large file's
    #: sequential hash can only follow its download, so with fewer workers than large files in
    #: flight, a file that finished downloading waits for a worker (Hub 2 GiB, 3 shards: 2 workers
    #: 2.6 s, 4 workers 2.3 s). Each reads with a 4 MiB buffer.
    hash_workers: int = 4
    verify: bool = True
    require_checksum: bool = False
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    piece_size: int = 8 * MiB
    direct_io: bool = True
    min_rate: int = 64 * 1024
    stall_window: float = 30.0
    deadline: float | None = None
    #: The deadline as the user set it, for messages, when ``deadline`` is what is left of it
    #: after resolving (None: ``deadline`` itself).
    stated_deadline: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.concurrency <= 512:
            raise ConfigError(f"concurrency: must be between 1 and 512, got {self.concurrency}")
        if self.chunk_size < 64 * 1024:
            raise ConfigError(f"chunk size: must be at least 64KiB, got {self.chunk_size}")
        if not 4096 <= self.buffer_size <= self.chunk_size:
            raise ConfigError("buffer size: must be between 4KiB and the chunk size")
        if self.hash_workers < 1:
            raise ConfigError("hash workers: must be at least 1")
        if self.piece_size < 64 * 1024:
            raise ConfigError(f"piece size: must be at least 64KiB, got {self.piece_size}")
        if self.min_rate < 0:
            raise ConfigError(f"min rate: must be 0 (off) or more, got {self.min_rate}")
        if not self.stall_window > 0:
            raise ConfigError(f"stall timeout: must be positive, got {self.stall_window}")
        if self.deadline is not None and not self.deadline > 0:
            raise ConfigError(f"deadline: must be positive, got {self.deadline}")


@dataclass
class TransferStats:
    """What one transfer did (read by the sync result, the CLI and the metrics)."""

    bytes_downloaded: int = 0
    files_downloaded: int = 0
    files_verified: int = 0
    #: files checked with each algorithm (a file with a sidecar counts under two)
    checksum_algorithms: dict[str, int] = field(default_factory=dict)
    unverified: list[str] = field(default_factory=list)
    retries: int = 0
    chunks_downloaded: int = 0  # ranged requests completed (a run of chunks, or a small file)
    checksum_failures: int = 0
    resumed_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_downloaded += n
