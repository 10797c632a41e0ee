"""``file://`` sources (prefetch/sources/file): a directory on a mounted filesystem, copied with
the engine's chunks, verified against a SHA256SUMS sidecar, never modified."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefetch.demo.modelgen import make_model_dir
from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout import HfCacheLayout, PlainLayout, repo_dir
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import SyncResult, sync
from prefetch.sources import SourceSettings, open_source
from prefetch.sources.file.source import FileSource, parse_sidecar
from prefetch.support.errors import (
    ChecksumMismatchError,
    ConfigError,
    InvalidListingError,
    NotFoundError,
    SourceChangedError,
)

from .support import clean_env, hf_check, run_cli

MiB = 1024 * 1024
CONFIG = TransferConfig(
    concurrency=4, chunk_size=1 * MiB, buffer_size=64 * 1024,
    retry=RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.1),
)  # fmt: skip


def pull(src: Path, dest: Path, *, hf_repo: str | None = None, **fields: Any) -> SyncResult:
    spec = ModelSpec(source=parse_source_uri(f"file://{src}"), hf_repo=hf_repo, **fields)
    source = open_source(spec, SourceSettings())
    layout = HfCacheLayout(dest, hf_repo) if hf_repo else PlainLayout(dest)
    return sync(spec, source, layout, CONFIG)


def sha256sums(root: Path, paths: list[str], *, binary: bool = False) -> None:
    """``sha256sum``'s output for ``paths``, written to ``root/SHA256SUMS``."""
    mark = "*" if binary else " "
    lines = [f"{hashlib.sha256((root / p).read_bytes()).hexdigest()} {mark}{p}\n" for p in paths]
    (root / "SHA256SUMS").write_text("".join(lines))


def tree_state(root: Path) -> dict[str, tuple[int, ...]]:
    """Every entry under ``root`` (root included) with what a write would change: mode, size,
    inode, mtime and ctime (not the access time: reading may set it, which is no write)."""
    state: dict[str, tuple[int, ...]] = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        state[str(path.relative_to(root))] = (
            st.st_mode, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink,
        )  # fmt: skip
    return state


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".prefetch" not in p.parts
    }


@pytest.fixture
def model(tmp_path: Path) -> dict[str, Path]:
    return make_model_dir(tmp_path / "src", seed=5, shard_sizes=(3 * MiB + 5, 2 * MiB))


@pytest.fixture
def read_only(model: dict[str, Path], tmp_path: Path) -> Iterator[Path]:
    """The model's directory seen through a read-only bind mount (root), else its files made
    read-only (root may still write those: the tree's stat, compared by the tests, is the
    check that holds everywhere)."""
    src = tmp_path / "src"
    view = tmp_path / "ro"
    view.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(src), str(view)], capture_output=True)
    if mounted.returncode == 0:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], check=True)
        try:
            yield view
        finally:
            subprocess.run(["umount", str(view)], check=True)
        return
    view.rmdir()
    for path in [*src.rglob("*"), src]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        yield src
    finally:
        for path in [src, *src.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)


# -- a pull -----------------------------------------------------------------------------------


def test_a_directory_is_copied_verified_by_its_sidecar_and_never_modified(
    model: dict[str, Path], tmp_path: Path
) -> None:
    src = tmp_path / "src"
    listed = sorted(p for p in model if p != "config.json")
    sha256sums(src, listed)
    view = tmp_path / "ro"
    view.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(view)]).returncode != 0:
        pytest.skip("no bind mounts here (not root): see the read-only tree test instead")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], check=True)
        before = tree_state(src)
        result = pull(view, tmp_path / "dest")
        again = pull(view, tmp_path / "dest")
        after = tree_state(src)
    finally:
        subprocess.run(["umount", str(view)], check=True)
    assert tree_bytes(tmp_path / "dest") == {p: f.read_bytes() for p, f in model.items()}
    assert not (tmp_path / "dest" / "SHA256SUMS").exists()  # read, not copied
    assert result.files_verified == len(listed)
    assert result.checksum_algorithms == {"sha256": len(listed)}
    assert result.files_unverified == ["config.json"]  # not listed: copied, size only
    assert again.up_to_date and again.bytes_downloaded == 0
    assert after == before


def test_the_source_tree_is_never_written_to(
    read_only: Path, model: dict[str, Path], tmp_path: Path
) -> None:
    """Nothing (journal, lock, partial file) is created or changed under the source, even by a
    pull stopped mid-way and resumed."""
    from .test_source_conformance import StopAfter

    before = tree_state(tmp_path / "src")
    spec = ModelSpec(source=parse_source_uri(f"file://{read_only}"))
    one = dataclasses.replace(CONFIG, concurrency=1)
    progress = StopAfter(int(1.5 * MiB))
    with pytest.raises(Exception, match="stopped"):
        sync(spec, open_source(spec), PlainLayout(tmp_path / "dest"), one, progress=progress,
             stop=progress.stop)  # fmt: skip
    assert pull(read_only, tmp_path / "dest").resumed_bytes >= 1 * MiB
    assert tree_state(tmp_path / "src") == before
    assert tree_bytes(tmp_path / "dest") == {p: f.read_bytes() for p, f in model.items()}


def test_hf_repo_publishes_the_hub_layout_that_loads_offline(
    model: dict[str, Path], tmp_path: Path
) -> None:
    src = tmp_path / "src"
    sha256sums(src, sorted(model))
    home = tmp_path / "home"
    env = clean_env(home)
    proc = run_cli("pull", f"file://{src}/", str(home), "--hf-repo", "acme/local", "--json",
                   env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    repo = repo_dir(home, "acme/local")
    snapshot = repo / "snapshots" / summary["revision"]
    assert summary["path"] == str(snapshot) and summary["files_unverified"] == []
    assert (repo / "refs/main").read_text() == summary["revision"]
    for name in os.listdir(repo / "blobs"):  # named by the sidecar's sha256, as the Hub does
        assert hashlib.sha256((repo / "blobs" / name).read_bytes()).hexdigest() == name
    out = hf_check(home, 'out["main"] = hf.snapshot_download("acme/local")')
    assert out == {"main": str(snapshot)}
    assert tree_bytes(snapshot) == {p: f.read_bytes() for p, f in model.items()}
    again = run_cli("pull", f"file://{src}", str(home), "--hf-repo", "acme/local", "--json",
                    env=env)  # fmt: skip
    assert json.loads(again.stdout)["up_to_date"] is True
    assert run_cli("verify", str(home), env=env).returncode == 0


def test_files_without_a_sum_are_reported_unverified_by_the_cli(
    model: dict[str, Path], tmp_path: Path
) -> None:
    proc = run_cli("pull", f"file://{tmp_path / 'src'}", str(tmp_path / "d"), "--json",
                   env=clean_env(tmp_path / "home"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert sorted(summary["files_unverified"]) == sorted(model)
    assert summary["files_verified"] == 0
    assert "checked by size only" in proc.stderr


# -- the sidecar ------------------------------------------------------------------------------


def test_a_file_that_does_not_match_its_sum_fails_naming_it(
    model: dict[str, Path], tmp_path: Path
) -> None:
    src = tmp_path / "src"
    shard = "model-00001-of-00002.safetensors"
    sha256sums(src, sorted(model))
    sums = (src / "SHA256SUMS").read_text()
    good = hashlib.sha256(model[shard].read_bytes()).hexdigest()
    (src / "SHA256SUMS").write_text(sums.replace(good, "0" * 64))
    with pytest.raises(ChecksumMismatchError) as err:
        pull(src, tmp_path / "dest")
    assert err.value.path == shard
    assert not (tmp_path / "dest" / shard).exists()


def test_a_file_the_sidecar_lists_that_is_missing_is_an_error_naming_it(
    model: dict[str, Path], tmp_path: Path
) -> None:
    src = tmp_path / "src"
    sha256sums(src, sorted(model))
    model["config.json"].unlink()
    with pytest.raises(NotFoundError, match=r"SHA256SUMS lists config\.json, which is not in"):
        pull(src, tmp_path / "dest")
    # left out by the patterns, it is not missing
    pull(src, tmp_path / "dest", exclude=("config.json",))


def test_the_sidecar_reads_sha256sum_text_binary_and_escaped_lines() -> None:
    a, b, c = "a" * 64, "B" * 64, "c" * 64
    body = f"{a}  x/one.bin\n{b} *./two.bin\r\n# note\n\n\\{c}  back\\\\slash\\nline\n"
    assert parse_sidecar(body.encode(), "S") == {
        "x/one.bin": a, "two.bin": "b" * 64, "back\\slash\nline": c,
    }  # fmt: skip
    with pytest.raises(Exception, match="line 1 is not '<sha256>  <path>'"):
        parse_sidecar(b"abc  x\n", "S")


# -- what a directory may hold ----------------------------------------------------------------


def test_links_inside_the_root_are_copied_links_out_of_it_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "blobs").mkdir(parents=True)
    (src / "blobs" / "abc").write_bytes(b"weights")
    (src / "model.bin").symlink_to("blobs/abc")
    (src / "again").symlink_to("blobs")  # a directory: not descended into
    pull(src, tmp_path / "d1")
    assert tree_bytes(tmp_path / "d1") == {"blobs/abc": b"weights", "model.bin": b"weights"}
    (tmp_path / "secret").write_bytes(b"not yours")
    (src / "leak.bin").symlink_to(tmp_path / "secret")
    with pytest.raises(InvalidListingError, match=r"leak\.bin: a symbolic link to .*secret, "
                       "outside .*never followed"):  # fmt: skip
        pull(src, tmp_path / "d2")
    assert not (tmp_path / "d2" / "leak.bin").exists()
    pull(src, tmp_path / "d3", exclude=("leak.bin",))
    (src / "leak.bin").unlink()
    (src / "gone.bin").symlink_to("nowhere")
    with pytest.raises(InvalidListingError, match=r"gone\.bin: a dangling symbolic link"):
        pull(src, tmp_path / "d4")
    (src / "gone.bin").unlink()
    (src / "loop.bin").symlink_to("loop.bin")
    with pytest.raises(InvalidListingError, match=r"loop\.bin: a symbolic link that cannot be "
                       "followed"):  # fmt: skip
        pull(src, tmp_path / "d5")


def test_a_fifo_is_refused_by_name_unless_the_patterns_leave_it_out(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    os.mkfifo(src / "pipe")
    with pytest.raises(InvalidListingError, match=r"pipe: a FIFO, not a regular file"):
        pull(src, tmp_path / "d")
    assert pull(src, tmp_path / "d", exclude=("pipe",)).files_downloaded == 1


def test_a_prefetch_destination_is_read_without_its_state(
    model: dict[str, Path], tmp_path: Path
) -> None:
    """A directory prefetch published to (a PVC filled by an earlier pull) is a source: its
    ``.prefetch`` state (journals, lock, records) is not part of the model."""
    pull(tmp_path / "src", tmp_path / "first")
    pull(tmp_path / "first", tmp_path / "second")
    assert tree_bytes(tmp_path / "second") == {p: f.read_bytes() for p, f in model.items()}


# -- the destination --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["inside", "same", "around"])
def test_a_destination_overlapping_the_source_is_refused_before_any_write(
    model: dict[str, Path], tmp_path: Path, where: str
) -> None:
    src = tmp_path / "src"
    dest = {"inside": src / "out", "same": src, "around": tmp_path}[where]
    before = tree_state(src)
    words = "is inside the source" if where != "around" else "source .* is inside the destination"
    with pytest.raises(ConfigError, match=words):
        pull(src, dest)
    assert tree_state(src) == before


# -- a file that changes ----------------------------------------------------------------------


def test_a_file_rewritten_in_place_mid_read_is_a_changed_object(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(b"x" * 100)
    spec = ModelSpec(source=parse_source_uri(f"file://{src}"))
    source = FileSource(spec.source)
    (listed,) = source.resolve(spec).files
    reader = source.open_range(listed, 0, 100)
    buf = memoryview(bytearray(60))
    assert reader.readinto(buf) == 60
    with (src / "w.bin").open("r+b") as f:  # same inode, same size: only the mtime tells
        f.write(b"y")
    os.utime(src / "w.bin", ns=(0, listed_mtime(listed) + 1_000_000))
    with pytest.raises(SourceChangedError, match="changed during the download"):
        reader.readinto(buf)  # the last bytes: the identity is checked
    reader.close()
    with pytest.raises(SourceChangedError):  # and any later read of the old version
        source.open_range(listed, 0, 10)


def listed_mtime(file: Any) -> int:
    return int(file.version.split("-")[1])


def test_a_file_changed_since_a_stopped_pull_is_fetched_again_from_its_start(
    model: dict[str, Path], tmp_path: Path
) -> None:
    """Its version (inode, mtime, size) names its partial file and journal: the new version
    does not resume from the old one's bytes."""
    from .test_source_conformance import StopAfter

    src, dest = tmp_path / "src", tmp_path / "dest"
    shard = "model-00001-of-00002.safetensors"
    one = dataclasses.replace(CONFIG, concurrency=1)
    spec = ModelSpec(source=parse_source_uri(f"file://{src}"), include=(shard,))
    progress = StopAfter(int(1.5 * MiB))
    with pytest.raises(Exception, match="stopped"):
        sync(spec, open_source(spec), PlainLayout(dest), one, progress=progress,
             stop=progress.stop)  # fmt: skip
    new = os.urandom(model[shard].stat().st_size)
    tmp = src / "new.tmp"
    tmp.write_bytes(new)
    os.replace(tmp, model[shard])
    result = sync(spec, open_source(spec), PlainLayout(dest), one)
    assert (dest / shard).read_bytes() == new
    assert result.resumed_bytes == 0 and result.bytes_downloaded == len(new)


# -- how bytes move ---------------------------------------------------------------------------


def test_bytes_no_hash_needs_are_copied_in_the_kernel(
    model: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a per-range hash (no sum, or a sequential sha256 read back from the partial
    file) the engine copies with copy_file_range; a one-chunk file whose sha256 is computed as
    it arrives is read with pread."""
    copied: list[int] = []
    real = os.copy_file_range

    def spy(src: int, dst: int, count: int, offset_src: int, offset_dst: int) -> int:
        n = real(src, dst, count, offset_src, offset_dst)
        copied.append(n)
        return n

    monkeypatch.setattr(os, "copy_file_range", spy)
    pull(tmp_path / "src", tmp_path / "plain")
    assert sum(copied) == sum(f.stat().st_size for f in model.values())
    copied.clear()
    sha256sums(tmp_path / "src", sorted(model))
    result = pull(tmp_path / "src", tmp_path / "summed")
    shards = sum(f.stat().st_size for p, f in model.items() if p.endswith(".safetensors"))
    assert sum(copied) == shards  # the small files were hashed as they were read
    assert result.files_verified == len(model)
    assert tree_bytes(tmp_path / "summed") == {p: f.read_bytes() for p, f in model.items()}


@pytest.mark.parametrize("code", [errno.EXDEV, errno.EINVAL, errno.ENOSYS])
def test_where_the_kernel_cannot_copy_bytes_are_read_and_written(
    model: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    def refuse(*args: int) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "copy_file_range", refuse)
    result = pull(tmp_path / "src", tmp_path / "d")
    assert tree_bytes(tmp_path / "d") == {p: f.read_bytes() for p, f in model.items()}
    assert result.retries == 0


# -- one clear line per mistake ---------------------------------------------------------------


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("Error:")]


@pytest.mark.parametrize(
    ("make", "said"),
    [
        ("missing", "Error: {src}: no such directory"),
        ("file", "Error: {src}: not a directory (a file:// source names a directory)"),
        ("empty", "Error: {src}: the directory holds no files"),
    ],
)
def test_a_source_that_is_no_model_directory_says_so_in_one_line(
    tmp_path: Path, make: str, said: str
) -> None:
    src = tmp_path / "src"
    if make == "file":
        src.write_text("x")
    elif make == "empty":
        (src / "sub").mkdir(parents=True)
    proc = run_cli("pull", f"file://{src}", str(tmp_path / "d"), env=clean_env(tmp_path / "h"))
    assert error_lines(proc) == [said.format(src=src)]


def test_a_directory_this_user_cannot_read_says_permission_denied(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the pull as user nobody")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    env = clean_env(Path("/nonexistent"))
    probe = subprocess.run([*nobody, sys.executable, "-c", "import prefetch.cli"], env=env,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"user nobody cannot run this Python environment: {probe.stderr[-200:]}")
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="prefetch-file-"))
    try:
        top.chmod(0o777)
        src = top / "src"
        (src / "sub").mkdir(parents=True)
        (src / "sub" / "w.bin").write_bytes(b"x")
        src.chmod(0o700)  # root's: nobody may not list it
        cmd = [*nobody, sys.executable, "-m", "prefetch.cli", "pull", f"file://{src}",
               str(top / "d")]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert error_lines(proc) == [
            f"Error: {src}: permission denied (cannot list it as uid 65534)"
        ]
        src.chmod(0o755)
        (src / "sub").chmod(0o700)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert error_lines(proc) == [
            f"Error: {src / 'sub'}: permission denied (cannot list it as uid 65534)"
        ]
    finally:
        shutil.rmtree(top)


@pytest.mark.parametrize(
    ("uri", "said"),
    [
        ("file://host/x", "'host' is a host"),
        ("file:relative/x", "expected file:///absolute/path"),
        ("file:///a/../etc", "'..' is not allowed"),
        ("file:///", "the root directory is not a model"),
    ],
)
def test_a_malformed_file_uri_is_refused(uri: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        parse_source_uri(uri)


def test_file_uris_read_as_written() -> None:
    uri = parse_source_uri("file://localhost/mnt/models//llama#1/")
    assert str(uri) == "file:///mnt/models/llama#1/"
    assert ModelSpec(source=uri).name == "llama-1"
    with pytest.raises(Exception, match="file:// sources have no revisions"):
        ModelSpec(source=uri, revision="main")


# -- the agent --------------------------------------------------------------------------------


@pytest.mark.parametrize("hf_repo", [None, "acme/local"])
def test_the_agent_syncs_a_directory_to_ready(
    model: dict[str, Path], tmp_path: Path, hf_repo: str | None
) -> None:
    from prefetch.agent.loop import Agent

    from .support import AgentThread, config_text, is_ready, model_status, wait_for

    src = tmp_path / "src"
    sha256sums(src, sorted(model))
    before = tree_state(src)
    entry: dict[str, Any] = {"name": "local", "source": f"file://{src}/"}
    if hf_repo:
        entry["hfRepo"] = hf_repo
    config = tmp_path / "models.yaml"
    config.write_text(config_text(tmp_path / "cache", [entry]))
    agent = Agent(config, serve=False, tick=0.2)
    with AgentThread(agent):
        wait_for(lambda: is_ready(agent, "local"), "local ready", dump=agent.status)
        status = model_status(agent, "local")
    assert status["state"] == "ready" and status["last_error"] is None
    cache = tmp_path / "cache"
    published = (
        repo_dir(cache, hf_repo) / "snapshots" / status["revision"]
        if hf_repo
        else cache / "models" / "local"
    )
    assert tree_bytes(published) == {p: f.read_bytes() for p, f in model.items()}
    assert tree_state(src) == before


def test_prefetch_mirror_refuses_a_directory_in_one_line(tmp_path: Path) -> None:
    proc = run_cli("mirror", f"file://{tmp_path}", "s3://bucket/m/", env=clean_env(tmp_path))
    assert error_lines(proc) == [
        f"Error: prefetch mirror does not read 'file://{tmp_path}': its sources are hf://, "
        "s3://, oci://"
    ]


#: ``prefetch`` with every read and kernel copy slowed down: a pull that can be killed mid-way
SLOW_PULL = (
    "import os, sys, time\n"
    "def slow(real):\n"
    "    def call(*args):\n"
    "        time.sleep(0.05)\n"
    "        return real(*args)\n"
    "    return call\n"
    "os.preadv = slow(os.preadv)\n"
    "os.copy_file_range = slow(os.copy_file_range)\n"
    "from prefetch.cli import main\n"
    "main()\n"
)


def test_kill_9_mid_pull_then_resume_copies_only_what_was_in_flight(tmp_path: Path) -> None:
    from .support import journaled_bytes, kill_9_when

    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    data = os.urandom(24 * MiB)
    (src / "model.safetensors").write_bytes(data)
    sha256sums(src, ["model.safetensors"])
    before = tree_state(src)
    args = ["pull", f"file://{src}", str(dest), "--json", "--concurrency", "2",
            "--chunk-size", "1MiB"]  # fmt: skip
    env = clean_env(tmp_path / "home")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_PULL, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    partial = dest / ".prefetch" / "partial"
    kill_9_when(proc, lambda: journaled_bytes(partial) >= 8 * MiB, "pull", interval=0.005)
    second = run_cli(*args, env=env)
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout)
    assert summary["resumed_bytes"] >= 8 * MiB
    assert summary["bytes_downloaded"] <= 24 * MiB - summary["resumed_bytes"]
    assert summary["files_verified"] == 1 and summary["checksum_algorithms"] == {"sha256": 1}
    assert (dest / "model.safetensors").read_bytes() == data
    assert tree_state(src) == before
