"""The Store (what is cached, how recently wanted, eviction) and `prefetch ls` / `prefetch gc`."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from prefetch.agent.config import parse_config, spec_digest
from prefetch.cli import main
from prefetch.pipeline.layout import model_lock
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.store import Store, tree_size
from prefetch.support.errors import LayoutError, LockTimeoutError

from .support import publish_plain


def spec(name: str, *, pin: bool = False, hf_repo: str | None = None) -> ModelSpec:
    return ModelSpec(
        source=parse_source_uri(f"s3://bucket/{name}"), name=name, pin=pin, hf_repo=hf_repo
    )


def make_hub_entry(cache: Path, repo_id: str, data: bytes) -> Path:
    repo = cache / "hub" / ("models--" + repo_id.replace("/", "--"))
    sha = hashlib.sha256(data).hexdigest()
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / sha).write_bytes(data)
    snap = repo / "snapshots" / ("c" * 40)
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(f"../../blobs/{sha}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c" * 40)
    return repo


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def test_lists_both_layouts_with_usage(cache: Path) -> None:
    a, b = spec("alpha"), spec("beta", pin=True)
    publish_plain(cache, a, {"config.json": b"{}", "w.bin": b"x" * 1000})
    publish_plain(cache, b, {"w.bin": b"y" * 500})
    make_hub_entry(cache, "org/gamma", b"z" * 300)
    store = Store(cache, clock=lambda: 1_000_000.0)
    store.record_sync(a, digest=spec_digest(a), revision="rev-alpha", files=2, bytes_total=1002)
    store.touch(b, when=999.0)

    entries = {e.key: e for e in store.list([a])}
    assert set(entries) == {"models/alpha", "models/beta", "hub/models--org--gamma"}
    alpha, beta, gamma = (
        entries[k] for k in ("models/alpha", "models/beta", "hub/models--org--gamma")
    )
    assert alpha.kind == "plain" and alpha.revision == "rev-alpha"
    assert alpha.size >= 1002 and alpha.complete is True and alpha.last_used == 1_000_000.0
    assert alpha.wanted is True and alpha.wanted_by == ("alpha",)
    assert beta.wanted is False and beta.pinned and beta.complete is None and beta.last_used == 999
    assert gamma.kind == "hub" and gamma.repo_id == "org/gamma" and gamma.name == "org/gamma"
    assert gamma.size == 300 + 40  # blob + refs/main; the snapshot symlink not counted
    assert gamma.revision == "main=cccccccccccc"
    assert all(e.wanted is None for e in store.list())  # no config given: unknown
    hub_spec = spec("gamma-mirror", hf_repo="org/gamma")
    assert store.entry_key(hub_spec) == "hub/models--org--gamma"
    assert store.list([hub_spec])[0].wanted is True


def test_copy_intact_follows_records_and_files(cache: Path) -> None:
    a = spec("alpha")
    layout = publish_plain(cache, a, {"w.bin": b"x" * 1000})
    store = Store(cache)
    digest = spec_digest(a)
    assert not store.copy_intact(a, digest)  # never synced by the agent
    store.record_sync(a, digest=digest, revision="r", files=1, bytes_total=1000)
    assert store.copy_intact(a, digest)
    assert not store.copy_intact(a, "other-digest")
    (layout.root / "w.bin").write_bytes(b"x" * 10)  # truncated
    assert not store.copy_intact(a, digest)
    (layout.root / "w.bin").write_bytes(b"x" * 1000)
    store.record_verify(a, ok=False)
    assert not store.copy_intact(a, digest)
    store.record_sync(a, digest=digest, revision="r", files=1, bytes_total=1000)
    assert store.copy_intact(a, digest)


def test_eviction_candidates_lru_not_pinned_not_wanted_not_busy(cache: Path) -> None:
    store = Store(cache)
    specs = {n: spec(n, pin=(n == "pinned")) for n in ("old", "mid", "new", "pinned", "kept")}
    for when, s in enumerate(specs.values()):
        publish_plain(cache, s, {"w.bin": b"x" * 100})
        store.touch(s, when=float(when))
    store.set_last_used("models/new", 50.0)
    store.set_last_used("models/old", 1.0)
    store.set_last_used("models/mid", 2.0)
    store.set_last_used("models/pinned", 0.0)  # the oldest, but pinned
    wanted = [specs["kept"]]
    order = [e.key for e in store.eviction_candidates(wanted)]
    assert order == ["models/old", "models/mid", "models/new"]
    assert [e.key for e in store.eviction_candidates(wanted, busy={"models/old"})] == [
        "models/mid",
        "models/new",
    ]
    with_pinned = [e.key for e in store.eviction_candidates(wanted, include_pinned=True)]
    assert with_pinned[0] == "models/pinned"


def test_evict_takes_the_model_lock(cache: Path) -> None:
    s = spec("alpha")
    layout = publish_plain(cache, s, {"w.bin": b"x" * 4096})
    store = Store(cache)
    (entry,) = store.list()
    held = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with model_lock(layout.lock_path(), timeout=5):
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(5)
    try:
        with pytest.raises(LockTimeoutError):
            store.evict(entry, lock_timeout=0.2)
        assert layout.root.is_dir()
    finally:
        release.set()
        t.join()
    assert store.evict(entry) == entry.size
    assert not layout.root.exists()
    assert store.list() == []
    assert not (cache / ".trash").exists() or not os.listdir(cache / ".trash")


def test_evict_refuses_a_trash_folder_that_is_a_symlink_out_of_the_cache(
    cache: Path, tmp_path: Path
) -> None:
    layout = publish_plain(cache, spec("alpha"), {"w.bin": b"x" * 64})
    outside = tmp_path / "outside"
    outside.mkdir()
    (cache / ".trash").symlink_to(outside)
    store = Store(cache)
    (entry,) = store.list()
    with pytest.raises(LayoutError, match="symbolic link"):
        store.evict(entry)
    assert (layout.root / "w.bin").read_bytes() == b"x" * 64
    assert list(outside.iterdir()) == []


def test_a_cache_entry_key_is_checked_as_its_layout_checks_names(cache: Path) -> None:
    store = Store(cache)
    for key in ("models/..", "models/a/b", "hub/datasets--x", "hub/models--a/..", "tmp/x"):
        with pytest.raises(LayoutError, match="not a cache entry"):
            store.set_last_used(key, 1.0)


def test_tree_size_ignores_symlinks(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"1234")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_bytes(b"12")
    (tmp_path / "d" / "link").symlink_to("../a")
    assert tree_size(tmp_path) == 6


# -- the CLI -------------------------------------------------------------------------------------


def write_config(path: Path, cache: Path, names: list[str]) -> Path:
    models = "".join(f"  - {{name: {n}, source: 's3://bucket/{n}'}}\n" for n in names)
    path.write_text(f"cacheDir: {cache}\nmodels:\n{models}" if names else f"cacheDir: {cache}\n")
    parse_config(path.read_text())  # the test's own config must be valid
    return path


def test_ls_and_gc(cache: Path, tmp_path: Path) -> None:
    store = Store(cache)
    for n, pin in (("wanted", False), ("unwanted", False), ("pinned", True)):
        s = spec(n, pin=pin)
        publish_plain(cache, s, {"w.bin": b"x" * 2048})
        store.touch(s)
    config = write_config(tmp_path / "models.yaml", cache, ["wanted"])
    runner = CliRunner()

    result = runner.invoke(main, ["ls", "--config", str(config), "--json"])
    assert result.exit_code == 0, result.output
    listed = {e["name"]: e for e in json.loads(result.stdout)}
    assert {n: (e["wanted"], e["pinned"]) for n, e in listed.items()} == {
        "wanted": (True, False),
        "unwanted": (False, False),
        "pinned": (False, True),
    }
    assert listed["wanted"]["size"] >= 2048 and listed["wanted"]["last_used"]

    text = runner.invoke(main, ["ls", "--cache-dir", str(cache), "--config", str(config)])
    assert text.exit_code == 0
    header, *rows = text.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "KIND", "SIZE"]
    assert any(r.startswith("unwanted") and " no " in r for r in rows)

    dry = runner.invoke(main, ["gc", "--config", str(config), "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    assert [e["name"] for e in json.loads(dry.stdout)["evicted"]] == ["unwanted"]
    assert (cache / "models" / "unwanted").is_dir()

    done = runner.invoke(main, ["gc", "--config", str(config)])
    assert done.exit_code == 0, done.output
    assert "evicted models/unwanted" in done.stderr
    assert "kept models/pinned: pinned" in done.stderr
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["pinned", "wanted"]

    forced = runner.invoke(main, ["gc", "--config", str(config), "--include-pinned"])
    assert forced.exit_code == 0
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["wanted"]


def test_gc_refuses_without_a_config(cache: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["gc", "--cache-dir", str(cache), "--config", str(tmp_path / "missing.yaml")]
    )
    assert result.exit_code == 1
    assert "config file not found" in result.stderr


def test_an_entry_holding_nothing_is_not_counted_and_one_holding_anything_is(cache: Path) -> None:
    """A sync makes the entry to hold the model's lock; if it stops before its first byte
    (making room failed), the entry stays, with the lock file in it, and is not an entry."""
    store = Store(cache)
    plain, hub = spec("fresh"), spec("hubby", hf_repo="org/hubby")
    for s in (plain, hub):
        layout = store.layout(s)
        layout.prepare()
        with model_lock(layout.lock_path(), timeout=1):
            pass
    store.record_pin(plain)  # a config load writes the pin of an entry on disk
    assert store.entry_dir(plain).is_dir() and store.entry_dir(hub).is_dir()
    assert store.list() == [] and store.eviction_candidates([]) == []

    partial = store.layout(plain).staging_dir() / "w.bin.incomplete"
    partial.write_bytes(b"x" * 10)  # something to resume: counted (and evictable)
    assert [e.key for e in store.list()] == ["models/fresh"]
    partial.unlink()
    (store.entry_dir(hub) / "blobs" / "foreign").write_bytes(b"y")  # a file not ours: counted
    assert [e.key for e in store.list()] == ["hub/models--org--hubby"]
    publish_plain(cache, plain, {"w.bin": b"z" * 100})  # recorded: counted
    assert [e.key for e in store.list()] == ["hub/models--org--hubby", "models/fresh"]
