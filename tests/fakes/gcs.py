"""A Cloud Storage emulator for the tests: ``gcp-storage-emulator`` (PyPI) in a subprocess,
plain HTTP on loopback, put behind the TLS front (:class:`tests.fakes.s3proxy.S3FaultProxy`,
session CA) by :func:`tls_front`.

What the emulator lacks, and the front adds (:func:`generation_gate`): it ignores the
``generation`` of a media GET and serves the object's current bytes, where Cloud Storage answers
404 for a generation that no longer exists. The gate answers so, from the emulator's own
metadata, so a replaced object is seen as Cloud Storage shows it. Paging (``maxResults``,
``pageToken``) and ``fields`` are ignored by it too: paging is tested on a scripted fake.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import urllib3

from ..tls import TestCA
from .s3proxy import S3FaultProxy


def emulator_installed() -> bool:
    return importlib.util.find_spec("gcp_storage_emulator") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GcsEmulator:
    """``gcp-storage-emulator start --in-memory`` on a free loopback port."""

    def __init__(self, log_dir: Path) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = log_dir / "gcs-emulator.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.http = urllib3.PoolManager(retries=False)

    def start(self) -> None:
        args = [sys.executable, "-m", "gcp_storage_emulator", "start", "--port", str(self.port),
                "--host", "127.0.0.1", "--in-memory", "-q"]  # fmt: skip
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if self.http.request("GET", f"{self.endpoint}/storage/v1/b").status == 200:
                    return
            except urllib3.exceptions.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"the GCS emulator did not start: {self._log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)

    def create_bucket(self, name: str) -> None:
        body = json.dumps({"name": name}).encode()
        resp = self.http.request("POST", f"{self.endpoint}/storage/v1/b?project=test", body=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
        assert resp.status in (200, 409), resp.data[:300]

    def upload(self, bucket: str, name: str, data: bytes) -> dict[str, object]:
        """Upload ``data`` as ``name`` (a new generation); the object's metadata."""
        url = (f"{self.endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=media"
               f"&name={quote(name, safe='')}")  # fmt: skip
        resp = self.http.request("POST", url, body=data,
                                 headers={"Content-Type": "application/octet-stream"})  # fmt: skip
        assert resp.status == 200, resp.data[:300]
        meta: dict[str, object] = json.loads(resp.data)
        return meta

    def upload_dir(self, bucket: str, prefix: str, files: dict[str, Path]) -> None:
        for rel, path in files.items():
            self.upload(bucket, f"{prefix}{rel}", path.read_bytes())

    def metadata(self, bucket: str, name: str) -> dict[str, object] | None:
        url = f"{self.endpoint}/storage/v1/b/{bucket}/o/{quote(name, safe='')}"
        resp = self.http.request("GET", url)
        if resp.status == 404:
            return None
        meta: dict[str, object] = json.loads(resp.data)
        return meta


def generation_gate(emulator: GcsEmulator) -> Callable[[str, str], tuple[int, bytes] | None]:
    """Answers a media GET of a generation the object no longer has with Cloud Storage's 404
    (see the module's docstring); lets everything else through."""

    def gate(method: str, path: str) -> tuple[int, bytes] | None:
        parts = urlsplit(path)
        query = parse_qs(parts.query)
        wanted = query.get("generation", [None])[0]
        segments = parts.path.split("/")
        # /storage/v1/b/<bucket>/o/<name> (or /download/storage/v1/...)
        if method != "GET" or wanted is None or "o" not in segments:
            return None
        at = segments.index("o")
        bucket, name = segments[at - 1], unquote("/".join(segments[at + 1 :]))
        meta = emulator.metadata(bucket, name)
        if meta is not None and str(meta.get("generation")) == wanted:
            return None
        body = {"error": {"code": 404, "message": "No such object: " + f"{bucket}/{name}"}}
        return 404, json.dumps(body).encode()

    return gate


def tls_front(emulator: GcsEmulator, ca: TestCA) -> S3FaultProxy:
    """The emulator behind the fault-injecting TLS front (not started: use it as a context
    manager), at ``https://prefetch.test:<port>``, generations enforced."""
    return S3FaultProxy(emulator.endpoint, ca, role="", gate=generation_gate(emulator))
