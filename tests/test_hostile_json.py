"""Hostile review, issue 22: JSON written by someone else (Hub answers, a mirror's
``snapshots/<commit>.json``) read with bounds: deep nesting, NaN and huge numbers are one clear
error naming the document, never a RecursionError."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from prefetch.sources.s3_mirror.format import parse_mirror_commit
from prefetch.support.errors import InvalidListingError, SourceError, TransientSourceError
from prefetch.support.safejson import load_json

from .support import clean_env, run_cli, upload
from .test_hf_metadata import API, TREE, CannedHub, _json, _resolve, _source

COMMIT = "c" * 40
DEEP = b"[" * 100_000 + b"]" * 100_000
DEEP_OBJECT = b'{"sha": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}"


@pytest.mark.parametrize(
    ("url", "body"),
    [
        (f"{API}/revision/main?expand=sha", DEEP_OBJECT),
        (TREE, DEEP),
        (TREE, b'[{"type": "file", "path": "a", "size": NaN, "oid": "' + b"b" * 40 + b'"}]'),
        (TREE, b'[{"type": "file", "path": "a", "size": 1e999, "oid": "' + b"b" * 40 + b'"}]'),
        (TREE, b'[{"type": "file", "path": "a", "size": ' + b"9" * 5000 + b"}]"),
    ],
    ids=["revision-deep", "tree-deep", "tree-nan", "tree-infinite", "tree-huge-int"],
)
def test_hostile_hub_json_is_one_clear_error_naming_the_url(url: str, body: bytes) -> None:
    answers = {f"{API}/revision/main?expand=sha": [_json({"sha": COMMIT})], TREE: [_json([])]}
    http = CannedHub({**answers, url: [(200, {"Content-Type": "application/json"}, body)]})
    with pytest.raises(SourceError, match=r"is (not JSON|JSON nested)") as err:
        _resolve(_source(http), "main")
    assert not isinstance(err.value, TransientSourceError)
    assert url.split("?")[0] in str(err.value)
    assert len(str(err.value)) < 400


class _DeepHub:
    """Answers every GET with deeply nested JSON."""

    def __enter__(self) -> str:
        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(DEEP)))
                self.end_headers()
                self.wfile.write(DEEP)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_cli_pull_from_a_hub_answering_deep_json_is_one_error_line(tmp_path: Path) -> None:
    with _DeepHub() as endpoint:
        proc = run_cli("pull", "hf://acme/x", str(tmp_path / "d"), "--endpoint", endpoint,
                       env=clean_env(tmp_path / "hf"))  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "RecursionError" not in proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("Error: resolving acme/x@main: the answer of ")
    assert "is JSON nested 100000 deep" in first


# -- a mirror's metadata -----------------------------------------------------------------------


def snapshot(**changes: Any) -> bytes:
    doc = {
        "format": "model-prefetch-mirror/1", "repo_id": "acme/x", "repo_type": "model",
        "commit": COMMIT, "ref": "main", "source": "hf://acme/x", "mirrored_at": "2026",
        "files": [],
    }  # fmt: skip
    return json.dumps({**doc, **changes}).encode()


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b'{"format": ' + DEEP + b"}", "nested"),
        (snapshot().replace(b'"files": []', b'"files": ' + DEEP), "nested"),
        (snapshot().replace(b'"files": []', b'"files": [{"size": NaN}]'), "NaN"),
        (b"\xff\xfe{}", "not UTF-8"),
    ],
    ids=["deep-object", "deep-files", "nan", "not-utf8"],
)
def test_hostile_mirror_metadata_is_one_clear_error(body: bytes, words: str) -> None:
    where = f"s3://bkt/m/snapshots/{COMMIT}.json"
    with pytest.raises(InvalidListingError, match=words) as err:
        parse_mirror_commit(body, where=where)
    assert where in str(err.value)


def test_a_cli_pull_of_a_mirror_with_deep_metadata_is_one_error_line(
    s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    upload(s3_client, bucket, "m", tmp_path, 64 * 1024)  # a prefix with objects beside it
    s3_client.put_object(Bucket=bucket, Key=f"m/snapshots/{COMMIT}.json",
                         Body=b'{"format": ' + DEEP + b"}")  # fmt: skip
    s3_client.put_object(Bucket=bucket, Key="m/refs/main", Body=COMMIT.encode())
    dest = tmp_path / "dest"
    proc = run_cli("pull", f"s3://{bucket}/m", str(dest), env=s3_env)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "RecursionError" not in proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("Error: ") and f"m/snapshots/{COMMIT}.json" in first
    assert "nested 100001 deep" in first
    assert not dest.exists() or not any(p.is_file() for p in dest.rglob("*"))


def test_load_json_bounds() -> None:
    assert load_json(b'{"a": [1, 2.5, "x"]}', where="d", max_bytes=100) == {"a": [1, 2.5, "x"]}
    assert load_json(b'["[[[[", "\\"[["]', where="d", max_bytes=100, max_depth=1) == [
        "[[[[",
        '"[[',
    ]  # brackets inside strings do not count
    with pytest.raises(SourceError, match="d is 101 bytes of JSON"):
        load_json(b" " * 101, where="d", max_bytes=100)
    with pytest.raises(SourceError, match="Infinity is no JSON number"):
        load_json(b"[-Infinity]", where="d", max_bytes=100)
