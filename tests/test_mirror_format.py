"""The mirror format (prefetch/sources/s3_mirror/format.py): keys, round trip, and refusal of
anything malformed before a byte is fetched."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefetch.sources.s3_mirror.format import (
    FORMAT,
    MirrorCommit,
    MirrorFile,
    blob_key,
    parse_mirror_commit,
    parse_ref_body,
    ref_key,
    snapshot_key,
)
from prefetch.support.errors import InvalidListingError

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHA1 = "a" * 40
SHA256 = "b" * 64
CRC = "AAAAAAAAAAA="


def _commit(**changes: Any) -> MirrorCommit:
    base: dict[str, Any] = {
        "repo_id": "org/name",
        "commit": COMMIT,
        "ref": "main",
        "source": "hf://org/name@main",
        "mirrored_at": "2026-12-03T18:00:00Z",
        "files": (
            MirrorFile("config.json", 12, SHA1, "git-sha1", CRC),
            MirrorFile("model.safetensors", 1 << 33, SHA256, "sha256", "ZmlsZWNyYzY="),
        ),
    }
    return MirrorCommit(**(base | changes))


def _body(**changes: Any) -> bytes:
    data = json.loads(_commit().to_json())
    data.update(changes)
    return json.dumps(data).encode()


def _file_body(**changes: Any) -> bytes:
    data = json.loads(_commit().to_json())
    data["files"][0].update(changes)
    return json.dumps(data).encode()


def test_keys_are_content_addressed_under_the_prefix() -> None:
    assert blob_key("hf/org/name/", SHA256) == f"hf/org/name/blobs/{SHA256}"
    assert snapshot_key("p/", COMMIT) == f"p/snapshots/{COMMIT}.json"
    assert ref_key("p/", "refs/pr/1") == "p/refs/refs/pr/1"
    assert ref_key("", "main") == "refs/main"


def test_metadata_round_trips_with_files_sorted_by_path_and_the_format_named() -> None:
    commit = _commit(files=tuple(reversed(_commit().files)))
    body = commit.to_json()
    assert json.loads(body)["format"] == FORMAT
    assert [f["path"] for f in json.loads(body)["files"]] == ["config.json", "model.safetensors"]
    parsed = parse_mirror_commit(body, where="s3://b/p/snapshots/x.json")
    assert parsed == _commit()
    assert parsed.total_bytes == 12 + (1 << 33)


_segment = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._-", min_size=1, max_size=12)
_path = (
    st.lists(_segment, min_size=1, max_size=3)
    .map("/".join)
    .filter(lambda p: all(s not in (".", "..") for s in p.split("/")))
)
_file = st.builds(
    lambda path, size, kind, hexid: MirrorFile(
        path, size, hexid[: 40 if kind == "git-sha1" else 64], kind, CRC
    ),
    _path,
    st.integers(min_value=0, max_value=1 << 40),
    st.sampled_from(["git-sha1", "sha256"]),
    st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
)


@given(st.lists(_file, max_size=8, unique_by=lambda f: f.path))
def test_any_valid_commit_survives_a_round_trip(files: list[MirrorFile]) -> None:
    commit = _commit(files=tuple(sorted(files, key=lambda f: f.path)))
    assert parse_mirror_commit(commit.to_json(), where="w") == commit


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"not json", "not JSON"),
        (b"[]", "not a JSON object"),
        (_body(format="model-prefetch-mirror/2"), "format"),
        (_body(commit="abc"), "not 40 hex"),
        (_body(commit=None), "'commit' is NoneType"),
        (_body(repo_id="../etc"), "not a repo id"),
        (_body(repo_type="dataset"), "only models"),
        (_body(ref="../../x"), "ref"),
        (_body(files={}), "'files' is dict"),
        (_file_body(path="../escape"), "unsafe path"),
        (_file_body(path="a//b"), "unsafe path"),
        (_file_body(size=-1), "size -1"),
        (_file_body(size=True), "'size' is bool"),
        (_file_body(id_kind="md5"), "id_kind"),
        (_file_body(id=SHA256), "not a git-sha1"),
        (_file_body(id="Z" * 40), "not a git-sha1"),
        (_file_body(crc64nvme="nope"), "crc64nvme"),
        (_file_body(path="model.safetensors"), "twice"),
    ],
)
def test_malformed_metadata_is_refused_naming_where_it_was_read(body: bytes, words: str) -> None:
    with pytest.raises(InvalidListingError) as e:
        parse_mirror_commit(body, where="s3://bucket/p/snapshots/x.json")
    assert words in str(e.value)
    assert "s3://bucket/p/snapshots/x.json" in str(e.value)


def test_a_missing_field_is_named() -> None:
    data = json.loads(_commit().to_json())
    del data["files"][1]["crc64nvme"]
    with pytest.raises(InvalidListingError, match=r"files\[1\] has no 'crc64nvme'"):
        parse_mirror_commit(json.dumps(data).encode(), where="w")


def test_a_ref_body_holds_one_commit_sha() -> None:
    assert parse_ref_body(COMMIT.encode() + b"\n", where="r") == COMMIT
    for bad in (b"", b"main", COMMIT.upper().encode(), b"\xff" * 40):
        with pytest.raises(InvalidListingError, match="40-hex"):
            parse_ref_body(bad, where="s3://b/p/refs/main")
