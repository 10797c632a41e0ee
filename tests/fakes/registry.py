"""A real OCI registry for tests: Debian's ``docker-registry`` (distribution 2.8) on 127.0.0.1,
with filesystem storage in a temporary directory, and a small client that pushes hand-built
artifacts to it (blobs by monolithic upload, manifests by PUT) so the reader is tested against
manifests it did not write.

Given the session's :class:`tests.tls.TestCA` the registry speaks HTTPS (``http.tls`` in its
config) as ``registry.prefetch.test``, as every registry a node pulls from in production does;
without one it is plain HTTP on ``127.0.0.1`` (a loopback registry, which the OCI source speaks
plain HTTP to, as docker does for ``localhost``; or a host in ``PREFETCH_OCI_PLAIN_HTTP``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import urllib3

from tests.support import free_port

if TYPE_CHECKING:
    from tests.tls import TestCA

MODELPACK_CONFIG = "application/vnd.cncf.model.config.v1+json"
MODELPACK_ARTIFACT = "application/vnd.cncf.model.manifest.v1+json"
MODELPACK_WEIGHT = "application/vnd.cncf.model.weight.v1.raw"
MODELPACK_DOC = "application/vnd.cncf.model.doc.v1.raw"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
FILEPATH = "org.cncf.model.filepath"


def registry_binary() -> str | None:
    return shutil.which("docker-registry")


class Registry:
    """``docker-registry serve`` with a config of the test's own; ``url`` is its base URL
    (``https://registry.prefetch.test:PORT`` with ``tls``), ``host`` what an ``oci://`` ref names.

    ``proxy_of``: a pull-through cache of that registry's URL (an https origin is trusted through
    the session CA: the registry process gets ``SSL_CERT_FILE``). ``role``: the test host name it
    answers to over TLS (``registry``, or ``mirror`` for a node-local mirror)."""

    def __init__(
        self,
        root: Path,
        tls: TestCA | None = None,
        *,
        htpasswd: Path | None = None,
        proxy_of: str | None = None,
        role: str = "registry",
    ) -> None:
        self.root = root
        self.tls = tls
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        plain = f"http://127.0.0.1:{self.port}"
        self.url = plain if tls is None else tls.url(self.port, role)
        self.host = self.url.split("://", 1)[1]
        self.storage = root / "storage"
        auth = ""
        if htpasswd is not None:
            auth = f"auth:\n  htpasswd:\n    realm: test\n    path: {htpasswd}\n"
        if proxy_of is not None:  # a pull-through cache of another registry
            auth += f"proxy:\n  remoteurl: {proxy_of}\n"
        certificate = ""
        if tls is not None:
            certificate = f"  tls:\n    certificate: {tls.cert_file}\n    key: {tls.key_file}\n"
        self.config = root / "config.yml"
        self.config.write_text(
            "version: 0.1\n"
            "log:\n  level: error\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n{certificate}"
            f"{auth}"
        )
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = root / "registry.log"

    def start(self) -> None:
        binary = registry_binary()
        assert binary is not None
        log = self._log.open("ab")
        env = {**os.environ, **(self.tls.env() if self.tls is not None else {})}
        self._proc = subprocess.Popen(
            [binary, "serve", str(self.config)], stdout=log, stderr=log, env=env
        )
        http = self.client()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: {self._log.read_text()[-2000:]}")
            try:
                if http.request("GET", f"{self.url}/v2/", retries=False).status in (200, 401):
                    return
            except urllib3.exceptions.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("docker-registry did not start")

    def client(self) -> urllib3.PoolManager:
        """A urllib3 client that trusts this registry (the session CA, hostname checks on)."""
        if self.tls is None:
            return urllib3.PoolManager()
        return urllib3.PoolManager(ca_certs=str(self.tls.ca_file))

    def pusher(self, headers: dict[str, str] | None = None) -> Pusher:
        """A :class:`Pusher` to this registry."""
        return Pusher(self.url, headers, client=self.client())

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def blob_data(self, digest: str) -> Path:
        """Where the filesystem driver keeps a blob's bytes (for tampering tests)."""
        hexd = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Pushed:
    digest: str
    manifest: bytes
    layers: dict[str, str] = field(default_factory=dict)  # path -> blob digest


class Pusher:
    """Pushes blobs and manifests to ``base`` (``https://host:port``) over the distribution API;
    ``client``: the urllib3 client to push with (default: one that trusts the system's CAs and
    ``SSL_CERT_FILE``; :meth:`Registry.pusher` passes one that trusts the session CA)."""

    def __init__(
        self,
        base: str,
        headers: dict[str, str] | None = None,
        *,
        client: urllib3.PoolManager | None = None,
    ) -> None:
        self.base = base
        self.headers = headers or {}
        self.http = client or urllib3.PoolManager()

    def blob(self, repo: str, data: bytes) -> str:
        digest = sha256_digest(data)
        r = self.http.request(
            "POST", f"{self.base}/v2/{repo}/blobs/uploads/", headers=self.headers, redirect=False
        )
        assert r.status == 202, (r.status, r.data[:300])
        location = r.headers["Location"]
        if location.startswith("/"):
            location = self.base + location
        sep = "&" if "?" in location else "?"
        r = self.http.request(
            "PUT",
            f"{location}{sep}digest={digest}",
            body=data,
            headers={**self.headers, "Content-Type": "application/octet-stream"},
        )
        assert r.status == 201, (r.status, r.data[:300])
        return digest

    def manifest(self, repo: str, ref: str, doc: dict[str, object] | bytes, media: str) -> str:
        body = doc if isinstance(doc, bytes) else json.dumps(doc, indent=2).encode()
        r = self.http.request(
            "PUT",
            f"{self.base}/v2/{repo}/manifests/{ref}",
            body=body,
            headers={**self.headers, "Content-Type": media},
        )
        assert r.status == 201, (r.status, r.data[:500])
        return sha256_digest(body)

    def modelpack(
        self,
        repo: str,
        tag: str,
        files: dict[str, bytes],
        *,
        artifact_type: str | None = MODELPACK_ARTIFACT,
        config_media: str = MODELPACK_CONFIG,
        layer_media: str = MODELPACK_WEIGHT,
        paths: dict[str, str] | None = None,
    ) -> Pushed:
        """A ModelPack artifact: one raw layer per file, its path in the filepath annotation
        (``paths`` may give a layer another annotation than its file name: hostile cases)."""
        config = json.dumps(
            {
                "descriptor": {"name": repo, "createdAt": "2026-01-01T00:00:00Z"},
                "modelfs": {"type": "layers", "diffIds": []},
                "config": {"format": "safetensors"},
            }
        ).encode()
        config_digest = self.blob(repo, config)
        layers = []
        pushed = Pushed("", b"")
        for path, data in files.items():
            digest = self.blob(repo, data)
            annotated = (paths or {}).get(path, path)
            pushed.layers[path] = digest
            layers.append(
                {
                    "mediaType": layer_media,
                    "digest": digest,
                    "size": len(data),
                    "annotations": {FILEPATH: annotated},
                }
            )
        doc: dict[str, object] = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": config_media, "digest": config_digest, "size": len(config)},
            "layers": layers,
        }
        if artifact_type:
            doc["artifactType"] = artifact_type
        body = json.dumps(doc, indent=2).encode()
        pushed.manifest = body
        pushed.digest = self.manifest(repo, tag, body, OCI_MANIFEST)
        return pushed

    def artifact(
        self,
        repo: str,
        tag: str,
        layers: list[tuple[str, bytes, dict[str, str]]],
        *,
        artifact_type: str = MODELPACK_ARTIFACT,
    ) -> Pushed:
        """An artifact of any layers: (media type, bytes, annotations) each."""
        config = b'{"descriptor": {"name": "x"}, "modelfs": {"type": "layers", "diffIds": []}}'
        config_digest = self.blob(repo, config)
        descriptors = []
        pushed = Pushed("", b"")
        for media, data, notes in layers:
            digest = self.blob(repo, data)
            pushed.layers[notes.get(FILEPATH, digest)] = digest
            descriptors.append(
                {"mediaType": media, "digest": digest, "size": len(data),
                 **({"annotations": notes} if notes else {})}
            )  # fmt: skip
        doc = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "artifactType": artifact_type,
            "config": {"mediaType": MODELPACK_CONFIG, "digest": config_digest,
                       "size": len(config)},
            "layers": descriptors,
        }  # fmt: skip
        pushed.manifest = json.dumps(doc, indent=2).encode()
        pushed.digest = self.manifest(repo, tag, pushed.manifest, OCI_MANIFEST)
        return pushed
