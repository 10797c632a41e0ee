"""Azurite, Microsoft's Azure Storage emulator (npm package ``azurite``), serving Blob over HTTPS
with the session CA's certificate, for the ``az://`` tests.

Found as ``$PREFETCH_TEST_AZURITE`` (the ``azurite-blob`` script, or a folder whose
``node_modules/.bin`` has it) or ``azurite-blob`` on PATH; :func:`azurite_program` is None when
neither is there (the tests skip, saying how to install it). Started with
``--skipApiVersionCheck`` (azure-storage-blob asks for a newer API version than Azurite knows)
and checking every SharedKey signature it is sent. Its well-known account is
``devstoreaccount1``, addressed path-style (``https://host:port/devstoreaccount1/...``): the
source is pointed at it with ``AZURE_STORAGE_BLOB_ENDPOINT``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from ..tls import TestCA

ACCOUNT = "devstoreaccount1"
#: Azurite's published well-known key (not a secret: every copy of Azurite has it).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
INSTALL_HINT = (
    "Azurite is not installed: npm install azurite@3.37.0 into a folder and set "
    "PREFETCH_TEST_AZURITE to it (or put azurite-blob on PATH)"
)


def azurite_program() -> str | None:
    """The ``azurite-blob`` script to run, or None."""
    chosen = os.environ.get("PREFETCH_TEST_AZURITE", "").strip()
    if chosen:
        path = Path(chosen)
        for candidate in (path, path / "node_modules" / ".bin" / "azurite-blob"):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
        return None
    return shutil.which("azurite-blob")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Azurite:
    """One Azurite Blob service on 127.0.0.1 (``with Azurite(...) as az:``)."""

    def __init__(self, program: str, data: Path, tls: TestCA, *, oauth: bool = False) -> None:
        self.tls = tls
        self.port = _free_port()
        data.mkdir(parents=True, exist_ok=True)
        args = [
            program, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
            "--location", str(data), "--cert", str(tls.cert_file), "--key", str(tls.key_file),
            "--skipApiVersionCheck", "--disableProductStyleUrl", "--loose", "--silent",
            "--disableTelemetry",
        ]  # fmt: skip
        if oauth:
            args += ["--oauth", "basic"]
        self._log = (data / "azurite.log").open("wb")
        self._proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        self.base = tls.url(self.port)
        self.endpoint = f"{self.base}/{ACCOUNT}"

    def __enter__(self) -> Azurite:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"azurite exited: {self._proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError("azurite did not start in 30 s")

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._log.close()

    def env(self) -> dict[str, str]:
        """What a ``prefetch`` process needs to reach it with the account key."""
        return {"AZURE_STORAGE_BLOB_ENDPOINT": self.endpoint, "AZURE_STORAGE_KEY": KEY}

    def service(self, endpoint: str | None = None) -> Any:
        """azure-storage-blob's client of the account, trusting the session CA."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient(
            endpoint or self.endpoint,
            credential={"account_name": ACCOUNT, "account_key": KEY},
            connection_verify=str(self.tls.ca_file),
        )

    def container(self, name: str) -> Any:
        """A container (made if missing)."""
        client = self.service().get_container_client(name)
        if not client.exists():
            client.create_container()
        return client

    def upload(
        self, container: str, prefix: str, files: dict[str, bytes], *, content_md5: bool = True
    ) -> None:
        """``files`` under ``prefix``; ``content_md5=False``: uploaded in blocks of 1 MiB, so
        a blob over 1 MiB has no Content-MD5 (as azcopy and the SDKs upload large files)."""
        client = self.container(container)
        for rel, data in files.items():
            if content_md5 or len(data) <= 1024 * 1024:
                client.upload_blob(f"{prefix}{rel}", data, overwrite=True)
            else:
                blob = client.get_blob_client(f"{prefix}{rel}")
                ids = []
                for n, off in enumerate(range(0, len(data), 1024 * 1024)):
                    block = f"{n:08d}".encode().hex()
                    blob.stage_block(block, data[off : off + 1024 * 1024])
                    ids.append(block)
                from azure.storage.blob import BlobBlock

                blob.commit_block_list([BlobBlock(block_id=b) for b in ids])
