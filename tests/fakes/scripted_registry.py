"""An OCI registry of one repository, scripted for hostile cases, speaking HTTPS with the
session CA (it stands in for a remote registry or a registry mirror).

It serves what the test puts in it (:meth:`ScriptedRegistry.model`) and misbehaves as told:
``trickle`` (``"manifest"``, ``"token"`` or a blob digest: the answer's bytes one every
``trickle_every`` seconds), ``whole_on_range`` (blob digests answered ``200`` and the whole blob
to a ``Range``, as a cold pull-through cache does), ``bearer`` (every ``/v2/`` request needs a
token from ``/token``), ``challenge`` (the ``WWW-Authenticate`` value of its 401s). Every
request is counted in ``requests`` as ``(path, range)``."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import re
import tarfile
import threading
import time
from typing import Any

from tests.tls import TestCA

MODELPACK_CONFIG = "application/vnd.cncf.model.config.v1+json"
MODELPACK_ARTIFACT = "application/vnd.cncf.model.manifest.v1+json"
RAW = "application/vnd.cncf.model.weight.v1.raw"
TAR = "application/vnd.cncf.model.weight.v1.tar"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
FILEPATH = "org.cncf.model.filepath"
REPO = "models/m"
TOKEN = "scripted-token"


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tar_of(files: dict[str, bytes], padding: int = 0) -> bytes:
    """A tar archive of ``files``, then ``padding`` zero bytes more (a valid blob: tar readers
    stop at the end-of-archive blocks)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue() + bytes(padding)


class ScriptedRegistry:
    def __init__(self, test_ca: TestCA, role: str = "registry") -> None:
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[str, bytes] = {}
        self.trickle: set[str] = set()
        self.trickle_every = 1.0
        self.whole_on_range: set[str] = set()
        self.bearer = False
        self.challenge: str | None = None
        self.requests: list[tuple[str, str | None]] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        registry = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                registry._answer(self)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.socket = test_ca.server_context().wrap_socket(
            self._server.socket, server_side=True
        )
        self.port = self._server.server_address[1]
        self.host = f"{test_ca.host_for(role)}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> ScriptedRegistry:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()

    # -- content --------------------------------------------------------------------------------

    def blob(self, data: bytes) -> str:
        digest = digest_of(data)
        self.blobs[digest] = data
        return digest

    def model(
        self,
        tag: str,
        raw: dict[str, bytes],
        archives: dict[str, bytes | tuple[bytes, str]] | None = None,
        *,
        archives_first: bool = False,
    ) -> str:
        """A ModelPack manifest under ``tag``: a raw layer per ``raw`` file and an archive
        layer per ``archives`` entry (its annotation the key; a tar, or ``(blob, "tar+gzip")``
        and the like), the raw ones first unless ``archives_first``; its digest."""
        config = self.blob(json.dumps({"config": {"format": "safetensors"}}).encode())
        raw_layers = [(RAW, path, data) for path, data in raw.items()]
        archive_layers = [
            (f"{TAR}+{v[1][4:]}" if isinstance(v, tuple) and v[1] != "tar" else TAR, path,
             v[0] if isinstance(v, tuple) else v)
            for path, v in (archives or {}).items()
        ]  # fmt: skip
        ordered = archive_layers + raw_layers if archives_first else raw_layers + archive_layers
        layers: list[dict[str, Any]] = [
            {
                "mediaType": media,
                "digest": self.blob(data),
                "size": len(data),
                "annotations": {FILEPATH: path},
            }
            for media, path, data in ordered
        ]
        doc = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "artifactType": MODELPACK_ARTIFACT,
            "config": {"mediaType": MODELPACK_CONFIG, "digest": config, "size": 30},
            "layers": layers,
        }
        body = json.dumps(doc).encode()
        digest = digest_of(body)
        self.manifests[tag] = self.manifests[digest] = body
        return digest

    def blob_requests(self, digest: str) -> int:
        with self._lock:
            return sum(1 for path, _ in self.requests if path.endswith(f"/blobs/{digest}"))

    # -- answers --------------------------------------------------------------------------------

    def _answer(self, h: http.server.BaseHTTPRequestHandler) -> None:
        path = h.path.split("?", 1)[0]
        with self._lock:
            self.requests.append((path, h.headers.get("Range")))
        if path == "/token":
            body = json.dumps({"token": TOKEN, "expires_in": 300}).encode()
            return self._send(h, 200, body, "token", {"Content-Type": "application/json"})
        if self.challenge is not None or (
            self.bearer and h.headers.get("Authorization") != f"Bearer {TOKEN}"
        ):
            realm = f'Bearer realm="https://{self.host}/token",service="scripted"'
            return self._send(h, 401, b"{}", "", {"WWW-Authenticate": self.challenge or realm})
        m = re.fullmatch(rf"/v2/{REPO}/(manifests|blobs)/([^/]+)", path)
        if m is None:
            return self._send(h, 404, b"{}", "", {})
        if m.group(1) == "manifests":
            body = self.manifests.get(m.group(2))
            if body is None:
                return self._send(h, 404, b"{}", "", {})
            headers = {"Content-Type": OCI_MANIFEST, "Docker-Content-Digest": digest_of(body)}
            return self._send(h, 200, body, "manifest", headers)
        digest = m.group(2)
        data = self.blobs.get(digest)
        if data is None:
            return self._send(h, 404, b"{}", "", {})
        wanted = re.fullmatch(r"bytes=(\d+)-(\d+)", h.headers.get("Range") or "")
        if wanted is None or digest in self.whole_on_range:
            return self._send(h, 200, data, digest, {"Docker-Content-Digest": digest})
        start, end = int(wanted.group(1)), min(int(wanted.group(2)), len(data) - 1)
        headers = {"Content-Range": f"bytes {start}-{end}/{len(data)}"}
        return self._send(h, 206, data[start : end + 1], digest, headers)

    def _send(
        self,
        h: http.server.BaseHTTPRequestHandler,
        status: int,
        body: bytes,
        kind: str,
        headers: dict[str, str],
    ) -> None:
        h.send_response(status)
        for name, value in headers.items():
            h.send_header(name, value)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        try:
            if kind not in self.trickle:
                h.wfile.write(body)
                return
            for i in range(len(body)):  # until the client gives up
                if self._closing.is_set():
                    return
                h.wfile.write(body[i : i + 1])
                h.wfile.flush()
                time.sleep(self.trickle_every)
        except OSError:
            pass  # the client went away
