"""Hostile paths and hostile directories: a listing that could write outside DEST, into the tool's
own state or over another listed file is refused before any byte is fetched; a revision that is
not a git ref name is refused before any request; the tool's directories never follow a symlink
out of DEST; a redirect off HTTP is one clear error."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from hypothesis import given
from hypothesis import strategies as st

from prefetch.agent.config import parse_config
from prefetch.pipeline.layout import PlainLayout, make_dirs_inside, safe_join
from prefetch.pipeline.layout.hf import HfCacheLayout
from prefetch.pipeline.snapshot import RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import SyncResult, sync
from prefetch.sources.hf.source import HubOptions, open_hub_source
from prefetch.support.errors import (
    ConfigError,
    InvalidListingError,
    LayoutError,
    SourceError,
    TransientSourceError,
    UnsafePathError,
)
from prefetch.support.paths import file_dir_conflicts, path_problem, ref_name_problem

from .fakes.hubserver import HubServer
from .support import FAST, clean_env, pull_s3, put, run_cli
from .tls import TestCA

REPO = "acme/tiny"
Tamper = Callable[[dict[str, object]], dict[str, object]]
FILES = {"config.json": b'{"a": 1}', "weights/model.bin": os.urandom(300_000)}

# -- strategies --------------------------------------------------------------------------------

_SAFE_CHARS = st.characters(
    codec="utf-8", exclude_categories=("Cc", "Cs"), exclude_characters="/\x85"
)
safe_segment = st.text(_SAFE_CHARS, min_size=1, max_size=20).filter(lambda s: s not in (".", ".."))
safe_path = st.lists(safe_segment, min_size=1, max_size=5).map("/".join)
control_char = st.sampled_from([chr(c) for c in (*range(0x20), 0x7F, 0x85, 0x9B)])


def _snapshot(*paths: str, size: int = 1) -> Snapshot:
    return Snapshot("s3://b/p/", "r", tuple(RemoteFile(p, size) for p in paths))


# -- the path validator --------------------------------------------------------------------------


@given(st.lists(safe_segment, max_size=4), st.lists(safe_segment, max_size=4), st.sampled_from(
    ["..", ".", ""]))  # fmt: skip
def test_any_path_with_a_dotdot_dot_or_empty_segment_is_refused(
    before: list[str], after: list[str], bad: str
) -> None:
    path = "/".join([*before, bad, *after])
    assert path_problem(path) is not None
    with pytest.raises(UnsafePathError) as info:
        _snapshot(path)
    assert info.value.path == path


@given(safe_path)
def test_any_absolute_path_is_refused(path: str) -> None:
    assert path_problem("/" + path) is not None
    with pytest.raises(UnsafePathError):
        _snapshot("/" + path)


@given(safe_path, st.integers(min_value=0, max_value=20), control_char)
def test_any_path_with_a_control_character_is_refused_and_named_escaped(
    path: str, at: int, char: str
) -> None:
    bad = path[:at] + char + path[at:]
    with pytest.raises(UnsafePathError) as info:
        _snapshot(bad)
    assert char not in str(info.value)  # printed escaped: no raw newline or escape sequence


@given(safe_path)
def test_any_path_of_safe_segments_is_accepted_and_safe_join_stays_inside_root(path: str) -> None:
    root = Path("/nonexistent-root-for-joining")
    assert path_problem(path) is None
    assert _snapshot(path).files[0].path == path
    joined = safe_join(root, path)
    assert joined.parts[: len(root.parts)] == root.parts
    assert os.path.normpath(joined) == str(joined)  # nothing left to resolve: no ".." anywhere
    assert joined.relative_to(root).as_posix() == path


@given(safe_path)
def test_the_tools_state_directory_is_reserved_in_every_listing(path: str) -> None:
    with pytest.raises(UnsafePathError, match="reserved"):
        _snapshot(f".prefetch/{path}")


def test_a_listed_negative_size_or_duplicate_path_is_refused() -> None:
    with pytest.raises(InvalidListingError, match="invalid size"):
        _snapshot("a.bin", size=-1)
    with pytest.raises(UnsafePathError, match="twice"):
        _snapshot("a.bin", "a.bin")


def test_paths_that_differ_only_in_case_are_two_files() -> None:
    assert [f.path for f in _snapshot("README.md", "readme.md").files] == ["README.md", "readme.md"]


def test_one_name_in_two_unicode_normalisations_is_refused_naming_both() -> None:
    nfc, nfd = "caf\u00e9.json", "cafe\u0301.json"
    with pytest.raises(UnsafePathError, match="two Unicode normalisations") as info:
        _snapshot(nfc, nfd)
    assert repr(nfc) in str(info.value) and repr(nfd) in str(info.value)


def test_names_in_two_normalisations_are_refused_before_any_download(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    _upload(s3_client, bucket, {"caf\u00e9.bin": b"one", "cafe\u0301.bin": b"two", "c.bin": b"x"})
    with pytest.raises(UnsafePathError, match="two Unicode normalisations"):
        pull_s3(s3_client, f"s3://{bucket}/m/", tmp_path / "dest")
    assert not (tmp_path / "dest" / "c.bin").exists()


def test_names_that_differ_only_in_case_are_both_published(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    _upload(s3_client, bucket, {"README.md": b"upper", "readme.md": b"lower"})
    assert pull_s3(s3_client, f"s3://{bucket}/m/", tmp_path / "dest").files == 2
    assert (tmp_path / "dest" / "README.md").read_bytes() == b"upper"
    assert (tmp_path / "dest" / "readme.md").read_bytes() == b"lower"


# -- the file/directory conflict detector --------------------------------------------------------


@given(st.sets(st.lists(st.sampled_from("abc"), min_size=1, max_size=4).map("/".join)))
def test_conflicts_are_exactly_the_files_another_path_needs_as_a_directory(paths: set[str]) -> None:
    expected = {p for p in paths if any(q.startswith(p + "/") for q in paths)}
    found = file_dir_conflicts(paths)
    assert {file for file, _ in found} == expected
    assert all(under.startswith(file + "/") and under in paths for file, under in found)
    if expected:
        with pytest.raises(UnsafePathError, match="both as a file and as a directory"):
            _snapshot(*sorted(paths))
    else:
        _snapshot(*sorted(paths))


# -- the ref-name validator ----------------------------------------------------------------------

ref_component = st.text(st.sampled_from("abcXYZ019_-.+="), min_size=1, max_size=8).filter(
    lambda c: not c.startswith(".") and not c.endswith((".lock", ".")) and ".." not in c
)


@given(st.lists(ref_component, min_size=1, max_size=4).map("/".join))
def test_any_ref_of_valid_components_is_accepted(ref: str) -> None:
    if ref.startswith("-"):
        assert ref_name_problem(ref) is not None
    else:
        assert ref_name_problem(ref) is None


@given(
    st.lists(ref_component, min_size=1, max_size=3).map("/".join),
    st.sampled_from(["..", "@{", " ", "~", "^", ":", "?", "*", "[", "\\", "\n", "\x7f", "//"]),
    st.integers(min_value=0, max_value=30),
)
def test_any_ref_containing_a_forbidden_sequence_is_refused(ref: str, bad: str, at: int) -> None:
    assert ref_name_problem(ref[:at] + bad + ref[at:]) is not None


@pytest.mark.parametrize(
    "ref", ["", "/main", "-x", "main/", "main.", "x.lock", "a/.b", "@", "a/b.lock/c"]
)
def test_refs_git_refuses_are_refused(ref: str) -> None:
    assert ref_name_problem(ref) is not None


@pytest.mark.parametrize("uri", ["hf://acme/tiny@../../x", "hf://acme/tiny"])
def test_a_revision_that_is_not_a_ref_name_is_a_spec_error(uri: str) -> None:
    revision = None if "@" in uri else "../../x"
    with pytest.raises(ConfigError, match="not a valid branch, tag or commit"):
        ModelSpec(source=parse_source_uri(uri), revision=revision)
    assert ModelSpec(source=parse_source_uri("hf://acme/tiny"), revision="refs/pr/1")


# -- the manifest --------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"\xff\xfe not json", b"[]", b'{"entries": 3}'])
def test_a_corrupt_manifest_is_a_layout_error_naming_the_file_and_the_way_out(
    tmp_path: Path, content: bytes
) -> None:
    layout = PlainLayout(tmp_path)
    layout.book.manifest.parent.mkdir(parents=True)
    layout.book.manifest.write_bytes(content)
    with pytest.raises(LayoutError) as info:
        layout.recorded()
    assert str(layout.book.manifest) in str(info.value)
    assert info.value.hint is not None and "mv " in info.value.hint


# -- directories never followed out of DEST ------------------------------------------------------


def test_safe_join_and_make_dirs_refuse_a_symlinked_directory_below_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "sub").symlink_to(outside)
    with pytest.raises(LayoutError, match="symbolic link"):
        safe_join(root, "sub/x.bin")
    with pytest.raises(LayoutError, match="symbolic link"):
        make_dirs_inside(root, root / "sub" / "deeper")
    assert list(outside.iterdir()) == []


def test_a_symlinked_destination_itself_is_the_users_choice(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "dest").symlink_to(real)
    make_dirs_inside(tmp_path / "dest", tmp_path / "dest" / "a" / "b")
    assert (real / "a" / "b").is_dir()
    assert safe_join(tmp_path / "dest", "a/b/c") == tmp_path / "dest" / "a" / "b" / "c"


# -- S3 integration ------------------------------------------------------------------------------


def _upload(client: Any, bucket: str, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        put(client, bucket, f"m/{key}", data)


@pytest.mark.parametrize("hostile", [".prefetch/manifest.json", ".prefetch/lock"])
def test_an_object_named_like_the_tools_state_is_refused_before_any_download(
    s3_client: Any, bucket: str, tmp_path: Path, hostile: str
) -> None:
    dest = tmp_path / "dest"
    _upload(s3_client, bucket, FILES)
    pull_s3(s3_client, f"s3://{bucket}/m/", dest)
    manifest = (dest / ".prefetch" / "manifest.json").read_bytes()
    put(s3_client, bucket, "m/weights/new.bin", b"new")
    put(s3_client, bucket, f"m/{hostile}", b"not json at all")
    with pytest.raises(UnsafePathError, match="reserved") as info:
        pull_s3(s3_client, f"s3://{bucket}/m/", dest)
    assert info.value.path == hostile
    assert (dest / ".prefetch" / "manifest.json").read_bytes() == manifest
    assert not (dest / "weights" / "new.bin").exists()
    assert pull_s3(s3_client, f"s3://{bucket}/m/", dest, exclude=(".prefetch/*",)).files == 3


def test_a_file_and_a_directory_of_one_name_are_refused_before_any_download(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    _upload(s3_client, bucket, {"a": b"file", "a/b": b"under it", "c.bin": b"x" * 1000})
    with pytest.raises(UnsafePathError, match="both as a file and as a directory"):
        pull_s3(s3_client, f"s3://{bucket}/m/", tmp_path / "dest")
    assert not (tmp_path / "dest" / "c.bin").exists()


@pytest.mark.parametrize("link", ["weights", ".prefetch"])
def test_a_plain_layout_directory_symlinked_outside_dest_is_never_written_through(
    s3_client: Any, bucket: str, tmp_path: Path, link: str
) -> None:
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (dest / link).symlink_to(outside)
    _upload(s3_client, bucket, FILES)
    with pytest.raises(LayoutError, match="symbolic link"):
        pull_s3(s3_client, f"s3://{bucket}/m/", dest)
    assert list(outside.iterdir()) == []


# -- Hub integration -----------------------------------------------------------------------------


@pytest.fixture
def hub(test_ca: TestCA) -> Iterator[HubServer]:
    with HubServer(test_ca, tree_page_size=50) as server:
        server.add_commit(REPO, FILES, lfs=100_000)
        yield server
        assert server.errors == []


def _pull_hub(hub: HubServer, dest: Path) -> SyncResult:
    spec = ModelSpec(source=parse_source_uri(f"hf://{REPO}"))
    pool = urllib3.PoolManager(maxsize=8, retries=False)
    options = HubOptions(endpoint=hub.endpoint, token=False, http=pool, retry=FAST.retry)
    try:
        source = open_hub_source(spec, options)
        return sync(spec, source, HfCacheLayout(dest, REPO), FAST)
    finally:
        pool.clear()


def _resolves(hub: HubServer, path: str = "") -> list[str]:
    return [r.url_path for r in hub.requests if "/resolve/" in r.url_path and path in r.url_path]


@pytest.mark.parametrize("link", ["hub", "hub/models--acme--tiny/blobs", ".prefetch"])
def test_a_hub_cache_directory_symlinked_outside_dest_is_never_written_through(
    hub: HubServer, tmp_path: Path, link: str
) -> None:
    dest, outside = tmp_path / "home", tmp_path / "outside"
    outside.mkdir()
    (dest / link).parent.mkdir(parents=True, exist_ok=True)
    (dest / link).symlink_to(outside)
    with pytest.raises(LayoutError, match="symbolic link"):
        _pull_hub(hub, dest)
    assert list(outside.iterdir()) == []
    assert _resolves(hub) == []


def test_a_snapshot_folder_symlinked_outside_dest_is_never_filled(
    hub: HubServer, tmp_path: Path
) -> None:
    dest, outside = tmp_path / "home", tmp_path / "outside"
    outside.mkdir()
    snapshots = dest / "hub" / "models--acme--tiny" / "snapshots"
    snapshots.mkdir(parents=True)
    (snapshots / hub.repos[REPO].branches["main"]).symlink_to(outside)
    with pytest.raises(LayoutError, match="symbolic link"):
        _pull_hub(hub, dest)
    assert list(outside.iterdir()) == []


def test_a_revision_that_is_not_a_ref_name_is_refused_before_any_request(
    hub: HubServer, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    args = ("pull", f"hf://{REPO}", str(home), "--revision", "../../x", "--endpoint", hub.endpoint)
    proc = run_cli(*args, env=clean_env(tmp_path / "hf"))
    assert proc.returncode == 1, proc.stderr
    assert "Error: revision: '../../x' is not a valid branch, tag or commit" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert hub.requests == []
    assert not (home / "hub").exists()


def _drop(key: str) -> Tamper:
    def tamper(entry: dict[str, object]) -> dict[str, object]:
        if entry.get("path") == "weights/model.bin":
            entry = {k: v for k, v in entry.items() if k != key}
        return entry

    return tamper


def _set(key: str, value: object) -> Tamper:
    def tamper(entry: dict[str, object]) -> dict[str, object]:
        return {**entry, key: value} if entry.get("path") == "weights/model.bin" else entry

    return tamper


@pytest.mark.parametrize(
    ("tamper", "match"),
    [
        (_set("size", -5), "invalid size -5"),
        (_drop("oid"), "malformed tree entry"),
        (_set("lfs", {"size": 300_000}), "malformed tree entry"),
        (_set("lfs", {"oid": "not-a-sha", "size": 300_000, "pointerSize": 130}), "malformed"),
        (_set("lfs", {"oid": "a" * 64, "size": 7, "pointerSize": 130}), "two sizes"),
    ],
    ids=["negative-size", "no-oid", "lfs-without-oid", "lfs-bad-sha256", "lfs-other-size"],
)
def test_a_hostile_tree_entry_is_one_clear_error_before_any_byte(
    hub: HubServer, tmp_path: Path, tamper: Tamper, match: str
) -> None:
    hub.tamper_tree = tamper
    with pytest.raises(InvalidListingError, match=match):
        _pull_hub(hub, tmp_path / "home")
    trees = [r for r in hub.requests if "/tree/" in r.url_path]
    assert len(trees) == 1  # not retried: the server's answer will not improve
    assert _resolves(hub) == []
    assert list((tmp_path / "home").rglob("blobs/*")) == []


@pytest.mark.parametrize("path", ["../../evil.bin", "/etc/evil", "a\nb.bin", ".prefetch/lock"])
def test_a_hub_tree_entry_with_an_unsafe_path_is_refused_before_any_byte(
    hub: HubServer, tmp_path: Path, path: str
) -> None:
    hub.tamper_tree = _set("path", path)
    with pytest.raises(UnsafePathError) as info:
        _pull_hub(hub, tmp_path / "home")
    assert info.value.path == path
    assert _resolves(hub) == []


@pytest.mark.parametrize("location", ["file:///etc/passwd", "ftp://127.0.0.1/x", "gopher://x"])
def test_a_redirect_off_http_is_one_clear_error_not_retried(
    hub: HubServer, tmp_path: Path, location: str
) -> None:
    hub.hostile_redirects["config.json"] = location
    with pytest.raises(SourceError, match="not an HTTP") as info:
        _pull_hub(hub, tmp_path / "home")
    assert not isinstance(info.value, TransientSourceError)
    assert len(_resolves(hub, "config.json")) == 1


def test_a_config_revision_that_is_not_a_ref_name_is_refused_where_it_is_written() -> None:
    config = "cacheDir: /tmp/x\nmodels:\n  - name: tiny\n    source: hf://acme/tiny\n"
    with pytest.raises(ConfigError, match=r"models\[0\]\.revision: '-x' is not a valid"):
        parse_config(config + "    revision: -x\n")
    assert parse_config(config + "    revision: refs/pr/1\n").models[0].revision == "refs/pr/1"


def test_forgetting_a_file_whose_link_was_planted_outside_never_deletes_the_target(
    hub: HubServer, tmp_path: Path
) -> None:
    home, outside = tmp_path / "home", tmp_path / "precious.json"
    _pull_hub(hub, home)
    outside.write_bytes(b'{"b": 2}')  # the size of config.json, other content
    layout = HfCacheLayout(home, REPO)
    link = layout.snapshots / hub.repos[REPO].branches["main"] / "config.json"
    link.unlink()
    link.symlink_to(outside)
    layout.forget("config.json")
    assert outside.read_bytes() == b'{"b": 2}'
    assert not link.is_symlink()
