"""Archive layers (tar, tar+gzip) from a real registry: unpacked safely, every member checked,
nothing published when the archive or a member is hostile."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.layout.hf import HfCacheLayout
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import sync
from prefetch.sources import SourceSettings, open_source
from prefetch.sources.oci.archive import unpack_layer
from prefetch.support.errors import ChecksumMismatchError, SourceError, UnsafePathError

from .fakes.registry import FILEPATH, Pusher, Registry

MiB = 1024 * 1024
CONFIG = TransferConfig(
    concurrency=4, chunk_size=1 * MiB, buffer_size=64 * 1024,
    retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.1),
)  # fmt: skip
TAR = "application/vnd.cncf.model.weight.v1.tar"
TGZ = "application/vnd.kitops.modelkit.model.v1.tar+gzip"
RAW = "application/vnd.cncf.model.weight.v1.raw"


@pytest.fixture(scope="module")
def pusher(registry: Registry) -> Pusher:
    return registry.pusher()


@pytest.fixture(autouse=True)
def staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "staging"
    folder.mkdir()
    monkeypatch.setenv("PREFETCH_OCI_STAGING", str(folder))
    return folder


def tar_of(entries: list[tarfile.TarInfo | tuple[str, bytes]], *, gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for entry in entries:
            if isinstance(entry, tarfile.TarInfo):
                tar.addfile(entry)
            else:
                name, data = entry
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue()) if gz else buf.getvalue()


def link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def pull(registry: Registry, repo: str, dest: Path, hf_repo: str | None = None):  # type: ignore[no-untyped-def]
    spec = ModelSpec(source=parse_source_uri(f"oci://{registry.host}/{repo}:v1"), hf_repo=hf_repo)
    layout = HfCacheLayout(dest, hf_repo) if hf_repo else PlainLayout(dest)
    return sync(spec, open_source(spec, SourceSettings(concurrency=4)), layout, CONFIG)


def nothing_published(dest: Path) -> bool:
    return not dest.exists() or not [p for p in dest.rglob("*") if ".prefetch" not in p.parts]


def test_tar_and_tar_gzip_layers_are_unpacked_and_load_offline(registry, pusher, tmp_path, staging):
    from huggingface_hub import snapshot_download

    weights = os.urandom(2 * MiB + 3)
    pusher.artifact("arch/ok", "v1", [
        (TAR, tar_of([("model.safetensors", weights)]), {FILEPATH: "model.safetensors"}),
        (TGZ, tar_of([link("./tokenizer", "", tarfile.DIRTYPE), ("./tokenizer/vocab.json", b"{}"),
                      link("tokenizer/alias.json", "vocab.json")], gz=True), {}),
        (RAW, b'{"a": 1}', {FILEPATH: "config.json"}),
    ])  # fmt: skip
    home = tmp_path / "home"
    pull(registry, "arch/ok", home, hf_repo="acme/arch")
    snap = Path(snapshot_download("acme/arch", cache_dir=home / "hub", local_files_only=True))
    assert (snap / "model.safetensors").read_bytes() == weights
    assert (snap / "tokenizer/vocab.json").read_bytes() == b"{}"
    assert (snap / "tokenizer/alias.json").read_bytes() == b"{}"  # a link inside: a copy
    assert (snap / "config.json").read_bytes() == b'{"a": 1}'
    pull(registry, "arch/ok", home, hf_repo="acme/arch")  # again: up to date


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([("ok.bin", b"x"), link("escape", "../../../../etc/passwd")], "out of the destination"),
        ([link("abs", "/etc/passwd")], "out of the destination"),
        ([link("hard", "/etc/passwd", tarfile.LNKTYPE)], "out of the destination"),
        ([("../evil.bin", b"x")], r"\.\."),
        ([("/abs.bin", b"x")], "cannot be unpacked safely"),
    ],
)  # fmt: skip
def test_a_hostile_archive_is_refused_and_nothing_is_published(
    registry, pusher, tmp_path, staging, entries, message
):
    repo = f"arch/evil{abs(hash(message + str(len(entries)))) % 10_000}"
    pusher.artifact(repo, "v1", [(TAR, tar_of(entries), {FILEPATH: "x"})])
    with pytest.raises(UnsafePathError, match=message):
        pull(registry, repo, tmp_path / "d")
    assert nothing_published(tmp_path / "d")
    assert not list(staging.rglob("*.bin"))  # the staging is gone too
    assert not (tmp_path / "etc").exists()


def test_a_device_file_is_refused(registry, pusher, tmp_path):
    dev = tarfile.TarInfo("dev0")
    dev.type = tarfile.CHRTYPE
    pusher.artifact("arch/dev", "v1", [(TAR, tar_of([dev]), {})])
    with pytest.raises(UnsafePathError, match="device files"):
        pull(registry, "arch/dev", tmp_path / "d")


def test_a_tampered_archive_is_refused_and_nothing_is_published(registry, pusher, tmp_path):
    pushed = pusher.artifact("arch/tamper", "v1", [
        (TAR, tar_of([("w.bin", os.urandom(100_000))]), {FILEPATH: "w.bin"}),
    ])  # fmt: skip
    data = registry.blob_data(pushed.layers["w.bin"])
    content = bytearray(data.read_bytes())
    content[5000] ^= 0xFF
    data.write_bytes(bytes(content))
    with pytest.raises(ChecksumMismatchError):
        pull(registry, "arch/tamper", tmp_path / "d")
    assert nothing_published(tmp_path / "d")


def test_a_decompression_bomb_is_bounded(tmp_path):
    bomb = tar_of([("zeros.bin", bytes(8 * MiB))], gz=True)
    import hashlib

    with pytest.raises(SourceError, match="unpacks to more than"):
        unpack_layer(
            io.BytesIO(bomb), kind="tar+gzip", size=len(bomb),
            digest_hex=hashlib.sha256(bomb).hexdigest(), staging=tmp_path,
            what="bomb", max_unpacked=1 * MiB,
        )  # fmt: skip


def test_a_tar_zstd_layer_is_unpacked_and_published(registry, pusher, tmp_path, staging):
    import zstandard

    weights = os.urandom(MiB + 7)
    layer = zstandard.ZstdCompressor().compress(tar_of([("model.safetensors", weights)]))
    pusher.artifact("arch/zst", "v1", [
        ("application/vnd.cncf.model.weight.v1.tar+zstd", layer, {}),
        (RAW, b'{"a": 2}', {FILEPATH: "config.json"}),
    ])  # fmt: skip
    dest = tmp_path / "dest"
    pull(registry, "arch/zst", dest)
    assert (dest / "model.safetensors").read_bytes() == weights
    assert (dest / "config.json").read_bytes() == b'{"a": 2}'
