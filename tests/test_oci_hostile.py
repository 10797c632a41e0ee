"""Issue 29: OCI registries under hostile input, scripted on loopback over HTTPS with the
session CA (tests/fakes/scripted_registry.py).

Item 1: every OCI metadata call is bounded by the one deadline mechanism: a manifest, a token
answer or an archive layer trickled a byte at a time ends the attempt; ``--deadline`` and
SIGTERM end a resolve; a registry mirror that trickles falls back to the next source. The
other items are named in each test's docstring."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import sync
from prefetch.sources.http.transport import HttpClient, make_http_pool
from prefetch.sources.oci.auth import RegistryAuth, parse_challenge
from prefetch.sources.oci.mirrors import OciMirrors
from prefetch.sources.oci.source import OciSource
from prefetch.support.errors import (
    InsufficientSpaceError,
    SourceError,
    TransientSourceError,
    UnsafePathError,
)

from .fakes.scripted_registry import REPO, ScriptedRegistry, digest_of, tar_of
from .support import clean_env, mounted_tmpfs, run_cli, wait_for
from .tls import TestCA

WEIGHTS = os.urandom(200_000)
CONFIG = TransferConfig(concurrency=2, retry=RetryPolicy(attempts=1, base_delay=0.01))


@pytest.fixture(autouse=True)
def no_docker_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))


@pytest.fixture
def registry(test_ca: TestCA) -> Iterator[ScriptedRegistry]:
    with ScriptedRegistry(test_ca) as reg:
        reg.trickle_every = 0.5
        yield reg


@pytest.fixture
def http(test_ca: TestCA) -> HttpClient:
    return make_http_pool(8, ca_certs=str(test_ca.ca_file))


def oci_source(
    reg: ScriptedRegistry, http: HttpClient, *, timeout: float = 1.0, namespace: str | None = None
) -> OciSource:
    src = OciSource(
        parse_source_uri(f"oci://{reg.host}/{REPO}:v1"),
        http=http,
        auth=RegistryAuth(reg.host, http, credentials=False),
        retry=RetryPolicy(attempts=1, base_delay=0.01),
        namespace=namespace,
    )
    src.metadata_timeout = timeout
    return src


@pytest.mark.parametrize("trickled", ["manifest", "token", "archive"])
def test_a_trickled_manifest_token_or_archive_layer_ends_the_attempt_in_bounded_time(
    registry: ScriptedRegistry, http: HttpClient, trickled: str
) -> None:
    registry.bearer = trickled == "token"
    archive = tar_of({"tok.json": b"{}" * 200})
    registry.model("v1", {"w.bin": WEIGHTS}, {"tokenizer": archive})
    registry.trickle.add(digest_of(archive) if trickled == "archive" else trickled)
    src = oci_source(registry, http)
    started = time.monotonic()
    with pytest.raises(TransientSourceError, match="no answer within"):
        src.resolve(ModelSpec(source=src.uri))
    assert time.monotonic() - started < 15  # 1 s (+ a 1 MiB/s allowance for the archive)


def test_a_trickling_registry_mirror_falls_back_to_the_origin(
    test_ca: TestCA, registry: ScriptedRegistry, http: HttpClient, tmp_path: Path
) -> None:
    digest = registry.model("v1", {"w.bin": WEIGHTS})
    with ScriptedRegistry(test_ca, role="mirror") as mirror:
        mirror.model("v1", {"w.bin": WEIGHTS})
        mirror.trickle.add("manifest")
        mirror.trickle_every = 0.5
        origin = oci_source(registry, http, timeout=30)
        mirrors = OciMirrors(origin, [oci_source(mirror, http, namespace=registry.host)])
        spec = ModelSpec(source=parse_source_uri(f"oci://{registry.host}/{REPO}@{digest}"))
        started = time.monotonic()
        result = sync(spec, mirrors, PlainLayout(tmp_path / "dest"), CONFIG)
    assert (tmp_path / "dest" / "w.bin").read_bytes() == WEIGHTS
    assert result.bytes_downloaded == len(WEIGHTS)
    assert time.monotonic() - started < 15


def cli_env(test_ca: TestCA, tmp_path: Path) -> dict[str, str]:
    return clean_env(tmp_path / "home", DOCKER_CONFIG=str(tmp_path / "docker"), **test_ca.env())


def test_deadline_ends_a_pull_whose_registry_trickles_the_manifest(
    test_ca: TestCA, registry: ScriptedRegistry, tmp_path: Path
) -> None:
    registry.model("v1", {"w.bin": WEIGHTS})
    registry.trickle.add("manifest")
    started = time.monotonic()
    done = run_cli(
        "pull", f"oci://{registry.host}/{REPO}:v1", str(tmp_path / "dest"),
        "--attempts", "1", "--deadline", "3s",
        env=cli_env(test_ca, tmp_path), timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert time.monotonic() - started < 20
    assert "Traceback" not in done.stderr
    assert "Error:" in done.stderr and "deadline of 3s" in done.stderr, done.stderr


def test_sigterm_ends_a_pull_whose_registry_trickles_the_manifest(
    test_ca: TestCA, registry: ScriptedRegistry, tmp_path: Path
) -> None:
    registry.model("v1", {"w.bin": WEIGHTS})
    registry.trickle.add("manifest")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefetch.cli", "pull", f"oci://{registry.host}/{REPO}:v1",
         str(tmp_path / "dest"), "--attempts", "1"],
        env=cli_env(test_ca, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: any("/manifests/" in p for p, _ in registry.requests), "a manifest GET")
        time.sleep(1.0)  # well into the trickled body
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "Traceback" not in err


def test_an_unchanged_archive_layer_is_neither_fetched_nor_unpacked_again(
    registry: ScriptedRegistry, http: HttpClient, tmp_path: Path
) -> None:
    """Item 4: what a layer unpacked to is recorded by its digest; a resolve of an unchanged
    layer whose members are published is a no-op, and the figures say what was fetched."""
    members = {"tok.json": b"{}" * 5000, "sub/vocab.txt": os.urandom(30_000)}
    archive = tar_of(members)
    registry.model("v1", {"w.bin": WEIGHTS}, {"tokenizer": archive})
    dest = tmp_path / "dest"

    def pull():  # type: ignore[no-untyped-def]
        src = oci_source(registry, http, timeout=30)
        return sync(ModelSpec(source=src.uri), src, PlainLayout(dest), CONFIG)

    first = pull()
    assert (dest / "sub" / "vocab.txt").read_bytes() == members["sub/vocab.txt"]
    assert registry.blob_requests(digest_of(archive)) == 1
    assert first.bytes_downloaded == len(WEIGHTS) + len(archive)  # the members are copies

    again = pull()
    assert registry.blob_requests(digest_of(archive)) == 1  # not fetched, so not unpacked
    assert again.up_to_date and again.bytes_downloaded == 0

    (dest / "tok.json").unlink()
    repaired = pull()
    assert registry.blob_requests(digest_of(archive)) == 2
    assert (dest / "tok.json").read_bytes() == members["tok.json"]
    assert repaired.bytes_downloaded == len(archive)


_CHALLENGES = {
    "word-run": "Bearer " + "a" * 60_000,
    "unterminated-escapes": 'Bearer realm="' + '\\"' * 30_000,
    "keys-without-values": "Bearer " + "a=" * 30_000,
    "open-quotes": "Bearer " + 'a="' * 20_000,
    "spaced-words": "Bearer " + "a " * 30_000,
}


@pytest.mark.timeout(60)  # the quadratic parse took 30 s on the first case: fail, do not hang
@pytest.mark.parametrize("name", sorted(_CHALLENGES))
def test_parse_challenge_takes_linear_time(name: str) -> None:
    """Item 3: ``parse_challenge`` reads any header in linear time."""
    started = time.monotonic()
    kind, _ = parse_challenge(_CHALLENGES[name])
    assert kind == "bearer"
    assert time.monotonic() - started < 1.0


def test_an_oversized_challenge_is_refused_unread(
    registry: ScriptedRegistry, http: HttpClient
) -> None:
    """Item 3: a 401's challenge beyond the bound is one clear error, not parsed."""
    registry.model("v1", {"w.bin": WEIGHTS})
    registry.challenge = "Bearer " + "a" * 60_000
    src = oci_source(registry, http, timeout=30)
    with pytest.raises(SourceError, match="challenge is 60007 bytes, more than the 16384"):
        src.resolve(ModelSpec(source=src.uri))


def _bomb(kind: str) -> bytes:
    """A tar of 64 MiB of zeros, compressed (a few KB)."""
    archive = tar_of({"zeros.bin": bytes(64 << 20)})
    if kind == "tar+gzip":
        return gzip.compress(archive, compresslevel=9)
    import zstandard

    return zstandard.ZstdCompressor(level=19).compress(archive)


@pytest.mark.parametrize("kind", ["tar+gzip", "tar+zstd"])
def test_a_decompression_bomb_is_refused_at_64x_its_size(
    registry: ScriptedRegistry, http: HttpClient, tmp_path: Path, kind: str
) -> None:
    """Item 6: the README's rule, 64x the layer's size, with no 1 GiB floor."""
    bomb = _bomb(kind)
    assert len(bomb) * 64 < 64 << 20
    registry.model("v1", {"w.bin": WEIGHTS}, {"data": (bomb, kind)})
    src = oci_source(registry, http, timeout=30)
    with pytest.raises(SourceError, match=r"unpacks to more than .*64x the layer's size"):
        sync(ModelSpec(source=src.uri), src, PlainLayout(tmp_path / "dest"), CONFIG)
    assert not (tmp_path / "dest" / "zeros.bin").exists()


def test_staging_is_bounded_by_its_free_space_checked_before_each_layer(
    registry: ScriptedRegistry, http: HttpClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 6: the staging folder keeps 256 MiB free; a layer that does not fit in what is left
    (the layers staged before it count) is refused before a byte of it is fetched."""
    first = tar_of({"a.bin": os.urandom(30 << 20)})
    second = tar_of({"b.bin": os.urandom(30 << 20)})
    registry.model("v1", {"w.bin": WEIGHTS}, {"one": first, "two": second})
    with mounted_tmpfs(256 + 44) as staging:
        monkeypatch.setenv("PREFETCH_OCI_STAGING", str(staging))
        src = oci_source(registry, http, timeout=30)
        with pytest.raises(InsufficientSpaceError, match="staging folder"):
            sync(ModelSpec(source=src.uri), src, PlainLayout(tmp_path / "dest"), CONFIG)
    assert registry.blob_requests(digest_of(first)) == 1
    assert registry.blob_requests(digest_of(second)) == 0


def test_a_cold_pull_through_cache_answering_200_to_a_range_is_read_from_the_next_source(
    test_ca: TestCA, registry: ScriptedRegistry, http: HttpClient, tmp_path: Path
) -> None:
    """Item 7: a mirror answering a range of a blob above one chunk with 200 and the whole blob
    lacks it for this sync: the blob comes from the origin, the pull succeeds."""
    digest = registry.model("v1", {"w.bin": WEIGHTS})
    with ScriptedRegistry(test_ca, role="mirror") as mirror:
        mirror.model("v1", {"w.bin": WEIGHTS})
        blob = next(d for d, data in mirror.blobs.items() if data == WEIGHTS)
        mirror.whole_on_range.add(blob)
        mirrors = OciMirrors(
            oci_source(registry, http, timeout=30),
            [oci_source(mirror, http, timeout=30, namespace=registry.host)],
        )
        spec = ModelSpec(source=parse_source_uri(f"oci://{registry.host}/{REPO}@{digest}"))
        config = TransferConfig(
            concurrency=2,
            chunk_size=64 * 1024,
            buffer_size=16 * 1024,
            retry=RetryPolicy(attempts=1, base_delay=0.01),
        )
        sync(spec, mirrors, PlainLayout(tmp_path / "dest"), config)
    assert (tmp_path / "dest" / "w.bin").read_bytes() == WEIGHTS
    assert mirror.blob_requests(blob) >= 1
    assert registry.blob_requests(blob) >= 4  # every chunk of it, from the origin


def test_a_bad_raw_layer_path_is_refused_before_any_archive_layer_is_fetched(
    registry: ScriptedRegistry, http: HttpClient, tmp_path: Path
) -> None:
    """Item 8: every path is checked before any blob: ``../evil.bin`` listed after an archive
    layer refuses the manifest with no request for the archive."""
    archive = tar_of({"big.bin": os.urandom(1 << 20)})
    registry.model("v1", {"../evil.bin": b"x"}, {"weights": archive}, archives_first=True)
    src = oci_source(registry, http, timeout=30)
    with pytest.raises(UnsafePathError, match=r"evil\.bin"):
        sync(ModelSpec(source=src.uri), src, PlainLayout(tmp_path / "dest"), CONFIG)
    assert registry.blob_requests(digest_of(archive)) == 0


_STAGING_PULL = """
import sys
from prefetch.sources.http.transport import make_http_pool
from prefetch.sources.oci.source import OciSource
from prefetch.sources.oci.auth import RegistryAuth
from prefetch.pipeline.spec import ModelSpec, parse_source_uri

uri, ca = sys.argv[1], sys.argv[2]
http = make_http_pool(4, ca_certs=ca)
src = OciSource(parse_source_uri(uri), http=http,
                auth=RegistryAuth(uri.split("/")[2], http, credentials=False))
src.resolve(ModelSpec(source=src.uri))
"""


def test_staging_left_by_a_killed_pull_is_reclaimed_at_the_next_pull(
    test_ca: TestCA, registry: ScriptedRegistry, http: HttpClient, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Item 10: a pull killed while a layer is staged leaves its staging folder; the next pull
    removes it, and never the folder of a pull still running."""
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setenv("PREFETCH_OCI_STAGING", str(staging))
    slow = tar_of({"slow.bin": os.urandom(4096)})
    registry.model("slow", {}, {"slow": slow})
    registry.trickle.add(digest_of(slow))
    registry.trickle_every = 0.2
    env = {**os.environ, "PREFETCH_OCI_STAGING": str(staging)}
    uri = f"oci://{registry.host}/{REPO}:slow"

    def start() -> subprocess.Popen[bytes]:
        before = set(staging.iterdir())
        proc = subprocess.Popen([sys.executable, "-c", _STAGING_PULL, uri, str(test_ca.ca_file)],
                                env=env)  # fmt: skip
        wait_for(lambda: any((d / slow_hex).exists() for d in set(staging.iterdir()) - before),
                 "a layer staged")  # fmt: skip
        return proc

    slow_hex = digest_of(slow).split(":")[1]
    killed, running = start(), None
    try:
        killed_dir = next(d for d in staging.iterdir())
        running = start()
        running_dir = next(d for d in staging.iterdir() if d != killed_dir)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        assert (killed_dir / slow_hex).exists()  # what the killed pull left

        registry.model("v1", {"w.bin": WEIGHTS})  # nothing to stage: still reclaimed
        src = oci_source(registry, http, timeout=30)
        sync(ModelSpec(source=src.uri), src, PlainLayout(tmp_path / "dest"), CONFIG)
        assert not killed_dir.exists()
        assert (running_dir / slow_hex).exists()
    finally:
        for proc in (killed, running):
            if proc is not None:
                proc.kill()
                proc.wait(10)


def test_the_agent_ends_a_resolve_at_its_sync_deadline_and_on_sigterm(
    test_ca: TestCA, registry: ScriptedRegistry, tmp_path: Path
) -> None:
    """Item 1, the agent: a registry trickling the manifest is cut at ``syncDeadline`` (a
    failure with reason ``deadline``), and SIGTERM during such a resolve ends the agent."""
    from .support import AgentProcess, config_text

    registry.model("v1", {"w.bin": WEIGHTS})
    registry.trickle.add("manifest")
    models = [{"name": "m", "source": f"oci://{registry.host}/{REPO}:v1", "syncDeadline": "3s"}]
    config = tmp_path / "models.yaml"
    config.write_text(config_text(tmp_path / "cache", models))
    agent = AgentProcess(config, cli_env(test_ca, tmp_path), tmp_path / "agent.log")
    try:

        def failed_by_deadline() -> bool:
            return agent.up() and "did not finish within the deadline of 3s" in agent.stderr()

        started = time.monotonic()
        wait_for(failed_by_deadline, "the resolve cut at syncDeadline", timeout=60,
                 dump=agent.stderr)  # fmt: skip
        assert time.monotonic() - started < 30
        requests = len(registry.requests)
        wait_for(lambda: len(registry.requests) > requests, "the next attempt's resolve")
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(20) == 0, agent.stderr()
    finally:
        agent.stop()
