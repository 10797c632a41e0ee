"""Tests of tests/fakes/hubserver.py: the protocol against the real huggingface_hub client (run in a
subprocess, since it reads its environment at import), and the raw HTTP details and fault modes
with http.client."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import ssl
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import trustme

from tests.fakes.hubserver import (
    HubServer,
    default_lfs_rule,
    git_blob_sha1,
    make_model_dir,
    write_random_file,
)
from tests.support import HUB_SHARDS
from tests.tls import TestCA

REPO = "acme/tiny"
TOKEN = "hf_test_token_123"
SHARDS = HUB_SHARDS  # the shards of conftest's model_dir


# ------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def hub(model_dir: Path, test_ca: TestCA) -> Iterator[HubServer]:
    with HubServer(test_ca, tree_page_size=4) as server:
        server.add_commit(REPO, model_dir)
        yield server
        assert server.errors == []


def _repo_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _hf(hub: HubServer, home: Path, body: str, **params: object) -> dict:
    """Run ``body`` with huggingface_hub in a fresh interpreter; it fills the dict ``out``."""
    script = textwrap.dedent(
        """
        import json, sys
        import huggingface_hub as hf
        from huggingface_hub import errors

        def err(fn):
            try:
                fn()
            except Exception as e:
                response = getattr(e, "response", None)
                return [type(e).__name__, getattr(response, "status_code", None)]
            return None

        params = json.loads(sys.argv[1])
        out = {}
        """
    )
    script += textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGING")) and "proxy" not in k.lower()
    }
    env.update(
        HF_ENDPOINT=hub.endpoint,
        HF_HOME=str(home),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_ENABLE_HF_TRANSFER="0",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_IMPLICIT_TOKEN="1",
        NO_PROXY="127.0.0.1,localhost",
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(params)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=home,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _connect(url: str, timeout: float = 10) -> http.client.HTTPConnection:
    """A connection to ``url``'s host: TLS for https (the default context, which trusts the
    session CA through SSL_CERT_FILE, and checks the host name)."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        context = ssl.create_default_context()
        return http.client.HTTPSConnection(
            parts.hostname, parts.port, timeout=timeout, context=context
        )
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def _request(
    url: str, method: str = "GET", headers: dict[str, str] | None = None, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection, no redirects; a body cut short is returned as is."""
    parts = urlsplit(url)
    conn = _connect(url)
    try:
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request(method, target, body=body, headers=headers or {})
        resp = conn.getresponse()
        try:
            data = resp.read()
        except http.client.IncompleteRead as exc:
            data = exc.partial
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


def _cdn_url(hub: HubServer, path: str) -> str:
    status, headers, _ = _request(f"{hub.endpoint}/{REPO}/resolve/main/{path}", "HEAD")
    assert status == 302
    return headers["location"]


# ----------------------------------------------------------------- the real huggingface_hub


def test_snapshot_download_by_branch_and_by_sha_with_token(
    hub: HubServer, model_dir: Path, tmp_path: Path
) -> None:
    hub.token = TOKEN
    sha = hub.repos[REPO].branches["main"]
    out = _hf(
        hub,
        tmp_path,
        """
        out["branch"] = hf.snapshot_download(params["repo"], token=params["token"])
        out["sha"] = hf.snapshot_download(
            params["repo"], revision=params["sha"], token=params["token"],
            cache_dir=params["cache2"],
        )
        """,
        repo=REPO,
        token=TOKEN,
        sha=sha,
        cache2=str(tmp_path / "cache2"),
    )
    expected = _repo_files(model_dir)
    for key in ("branch", "sha"):
        assert Path(out[key]).name == sha
        assert _repo_files(Path(out[key])) == expected  # every file, byte for byte
    assert (tmp_path / "hub/models--acme--tiny/refs/main").read_text() == sha

    reqs = hub.requests
    tree_pages = [r for r in reqs if "/tree/" in r.path]
    entries = len(expected) + 2  # + the directories subdir/ and subdir/nested/
    assert len(tree_pages) == 2 * -(-entries // hub.tree_page_size)  # paged, for both downloads
    assert sum("cursor=" in r.path for r in tree_pages) == len(tree_pages) - 2
    cdn = [r for r in reqs if r.port == "cdn"]
    assert len(cdn) == 2 * len(SHARDS)
    assert all(r.authorization is None for r in cdn)
    assert all(r.authorization == f"Bearer {TOKEN}" for r in reqs if r.port == "hub")


def test_missing_or_wrong_token_gets_401(hub: HubServer, tmp_path: Path) -> None:
    hub.token = TOKEN
    out = _hf(
        hub,
        tmp_path,
        """
        out["none"] = err(lambda: hf.snapshot_download(params["repo"]))
        out["wrong"] = err(lambda: hf.HfApi().model_info(params["repo"], token="hf_wrong"))
        out["file"] = err(lambda: hf.hf_hub_download(params["repo"], "config.json"))
        out["ok"] = hf.HfApi().model_info(params["repo"], token=params["token"]).sha
        """,
        repo=REPO,
        token=TOKEN,
    )
    assert out["none"] == ["RepositoryNotFoundError", 401]
    assert out["wrong"] == ["HfHubHTTPError", 401]
    assert out["file"] == ["RepositoryNotFoundError", 401]
    assert out["ok"] == hub.repos[REPO].branches["main"]
    assert {r.status for r in hub.requests if r.authorization is None} == {401}


def test_not_found_errors_map_to_client_exceptions(hub: HubServer, tmp_path: Path) -> None:
    out = _hf(
        hub,
        tmp_path,
        """
        out["repo"] = err(lambda: hf.snapshot_download("acme/missing"))
        out["rev"] = err(lambda: hf.snapshot_download(params["repo"], revision="nope"))
        out["entry"] = err(lambda: hf.hf_hub_download(params["repo"], "nope.json"))
        out["info_rev"] = err(lambda: hf.HfApi().model_info(params["repo"], revision="nope"))
        """,
        repo=REPO,
    )
    assert out["repo"] == ["RepositoryNotFoundError", 404]
    assert out["rev"] == ["RevisionNotFoundError", 404]
    assert out["entry"] == ["RemoteEntryNotFoundError", 404]
    assert out["info_rev"] == ["RevisionNotFoundError", 404]
    sha = hub.repos[REPO].branches["main"]
    assert (tmp_path / f"hub/models--acme--tiny/.no_exist/{sha}/nope.json").exists()


def test_api_metadata_seen_by_the_client(hub: HubServer, tmp_path: Path) -> None:
    sha = hub.repos[REPO].branches["main"]
    v2 = hub.add_commit(REPO, {"config.json": b'{"v": 2}'}, inherit=True, branch="refs/pr/1")
    hub.add_tag(REPO, "v1.0", sha)
    out = _hf(
        hub,
        tmp_path,
        """
        api = hf.HfApi()
        info = api.model_info(params["repo"], files_metadata=True)
        out["sha"] = info.sha
        out["siblings"] = {
            s.rfilename: [s.size, s.blob_id, s.lfs.sha256 if s.lfs else None]
            for s in info.siblings
        }
        out["tree"] = sorted(
            [f.path, type(f).__name__]
            for f in api.list_repo_tree(params["repo"], "subdir", recursive=True)
        )
        out["top"] = sorted(f.path for f in api.list_repo_tree(params["repo"]))
        out["expanded"] = sorted(
            {f.last_commit.oid for f in api.list_repo_tree(params["repo"], expand=True)}
        )
        out["paths"] = [
            [p.path, type(p).__name__] for p in api.get_paths_info(
                params["repo"], ["config.json", "subdir", "missing.txt"], expand=True
            )
        ]
        refs = api.list_repo_refs(params["repo"], include_pull_requests=True)
        out["refs"] = [
            [r.ref, r.target_commit] for r in refs.branches + refs.tags + refs.pull_requests
        ]
        out["pr_sha"] = api.model_info(params["repo"], revision="refs/pr/1").sha
        pr_path = hf.hf_hub_download(params["repo"], "config.json", revision="refs/pr/1")
        out["pr_config"] = open(pr_path).read()
        out["tag_sha"] = api.model_info(params["repo"], revision="v1.0", expand=["sha"]).sha
        """,
        repo=REPO,
    )
    files = hub.files(REPO)
    assert out["sha"] == sha
    assert out["siblings"] == {p: [f.size, f.blob_id, f.sha256] for p, f in files.items()}
    assert out["tree"] == [
        ["subdir/extra.txt", "RepoFile"],
        ["subdir/nested", "RepoFolder"],
        ["subdir/nested/deep.json", "RepoFile"],
    ]
    assert out["top"] == sorted({p.split("/")[0] for p in files})
    assert out["expanded"] == [sha]
    assert out["paths"] == [["config.json", "RepoFile"], ["subdir", "RepoFolder"]]
    assert sorted(out["refs"]) == sorted(
        [["refs/heads/main", sha], ["refs/tags/v1.0", sha], ["refs/pr/1", v2]]
    )
    assert out["pr_sha"] == v2
    assert out["pr_config"] == '{"v": 2}'
    assert out["tag_sha"] == sha


def test_client_survives_429_and_a_cut_body(hub: HubServer, tmp_path: Path) -> None:
    # huggingface_hub reads bodies in 10 MiB chunks and drops a partial chunk when the connection
    # breaks, so only a cut after 10 MiB makes it resume with a Range request.
    chunk = 10 << 20
    write_random_file(tmp_path / "big.safetensors", chunk + (2 << 20), "big")
    hub.add_commit(REPO, {"big.safetensors": tmp_path / "big.safetensors"}, inherit=True)
    limited = hub.faults.rate_limit(retry_after=0, port="cdn", method="GET")
    cut = hub.faults.cut(chunk + (1 << 20), port="cdn", method="GET")
    out = _hf(
        hub,
        tmp_path,
        """out["path"] = hf.hf_hub_download(params["repo"], "big.safetensors")""",
        repo=REPO,
    )
    assert Path(out["path"]).read_bytes() == (tmp_path / "big.safetensors").read_bytes()
    assert limited.hits == cut.hits == 1
    gets = [r for r in hub.requests if r.port == "cdn"]
    assert [r.status for r in gets] == [429, 200, 206]
    assert gets[2].headers["range"] == f"bytes={chunk}-"


def test_client_follows_same_host_small_file_redirect(
    model_dir: Path, tmp_path: Path, test_ca: TestCA
) -> None:
    with HubServer(test_ca, small_file_redirect=True) as hub:
        hub.add_commit(REPO, model_dir)
        out = _hf(
            hub,
            tmp_path,
            """out["path"] = hf.hf_hub_download(params["repo"], "config.json")""",
            repo=REPO,
        )
        assert Path(out["path"]).read_bytes() == (model_dir / "config.json").read_bytes()
        statuses = [
            (r.method, r.status, "resolve-cache" if "/resolve-cache/" in r.path else "resolve")
            for r in hub.requests
        ]
        assert statuses == [
            ("HEAD", 307, "resolve"),
            ("HEAD", 200, "resolve-cache"),
            ("GET", 200, "resolve-cache"),
        ]
        assert hub.errors == []


# ---------------------------------------------------------------------------- raw protocol


def test_resolve_regular_file_headers(hub: HubServer, model_dir: Path) -> None:
    data = (model_dir / "config.json").read_bytes()
    status, headers, body = _request(f"{hub.endpoint}/{REPO}/resolve/main/config.json")
    assert status == 200 and body == data
    assert headers["etag"] == f'"{git_blob_sha1(data)}"'
    assert headers["x-repo-commit"] == hub.repos[REPO].branches["main"]
    assert headers["content-length"] == str(len(data))
    assert headers["accept-ranges"] == "bytes"
    assert "x-linked-etag" not in headers  # as on huggingface.co: only LFS redirects carry it
    assert not [k for k in headers if k.startswith("x-xet")]
    head_status, head_headers, head_body = _request(
        f"{hub.endpoint}/{REPO}/resolve/main/subdir%2Fnested/deep.json", "HEAD"
    )
    assert (head_status, head_body) == (200, b"")
    assert head_headers["content-length"] == str(
        (model_dir / "subdir/nested/deep.json").stat().st_size
    )


def test_lfs_file_redirects_to_cdn_port(hub: HubServer, model_dir: Path) -> None:
    hub.token = TOKEN
    auth = {"Authorization": f"Bearer {TOKEN}"}
    shard = "model-00002-of-00002.safetensors"
    data = (model_dir / shard).read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    for method in ("HEAD", "GET"):
        status, headers, _ = _request(f"{hub.endpoint}/{REPO}/resolve/main/{shard}", method, auth)
        assert status == 302
        assert headers["x-linked-etag"] == headers["etag"] == f'"{sha256}"'
        assert headers["x-linked-size"] == str(len(data))
        assert headers["x-repo-commit"] == hub.repos[REPO].branches["main"]
        location = urlsplit(headers["location"])
        assert f"{location.scheme}://{location.netloc}" == hub.cdn_endpoint != hub.endpoint
        assert location.path == f"/cdn/{sha256}" and "Signature=" in location.query
    status, headers, body = _request(headers["location"])  # the CDN needs no token
    assert status == 200 and body == data
    assert shard in headers["content-disposition"]
    location = _request(f"{hub.endpoint}/{REPO}/resolve/main/{shard}", "HEAD", auth)[1]["location"]
    assert _request(location.replace("Signature=", "Signature=0"))[0] == 403
    assert [r.authorization for r in hub.requests if r.port == "cdn"] == [None, None]


def test_hub_and_cdn_are_two_https_hosts_with_the_session_certificate(
    hub: HubServer, test_ca: TestCA
) -> None:
    hub_url, cdn_url = urlsplit(hub.endpoint), urlsplit(hub.cdn_endpoint)
    assert (hub_url.scheme, hub_url.hostname) == ("https", test_ca.host_for("hub"))
    assert (cdn_url.scheme, cdn_url.hostname) == ("https", test_ca.host_for("cdn"))
    assert hub_url.hostname != cdn_url.hostname  # "another host" for the credential rules
    status, _, _ = _request(f"{hub.endpoint}/api/models/{REPO}")
    assert status == 200
    untrusted_context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # trusts another CA only
    untrusted_context.load_verify_locations(cadata=trustme.CA().cert_pem.bytes().decode())
    untrusted = http.client.HTTPSConnection(
        hub_url.hostname, hub_url.port, timeout=5, context=untrusted_context
    )
    with pytest.raises(ssl.SSLCertVerificationError):
        untrusted.request("GET", f"/api/models/{REPO}")
    untrusted.close()


def test_without_a_ca_the_hub_speaks_plain_http_on_loopback(model_dir: Path) -> None:
    with HubServer() as server:
        server.add_commit(REPO, model_dir)
        assert server.endpoint.startswith("http://127.0.0.1:")
        assert server.cdn_endpoint.startswith("http://127.0.0.1:")
        assert server.env == {"HF_ENDPOINT": server.endpoint}
        assert _request(f"{server.endpoint}/api/models/{REPO}")[0] == 200


def test_tree_listing_pages_and_oids(hub: HubServer, model_dir: Path) -> None:
    url = f"{hub.endpoint}/api/models/{REPO}/tree/main?recursive=true&expand=false"
    entries, pages = [], 0
    while url:
        status, headers, body = _request(url)
        assert status == 200
        entries += json.loads(body)
        pages += 1
        link = headers.get("link")
        url = link.split(";")[0].strip("<>") if link else ""
        if link:
            assert link.endswith('; rel="next"')
    files = hub.files(REPO)
    assert pages == -(-len(entries) // hub.tree_page_size) > 1
    by_path = {e["path"]: e for e in entries}
    assert set(by_path) == set(files) | {"subdir", "subdir/nested"}
    commit = hub.repos[REPO].commits[hub.repos[REPO].branches["main"]]
    assert by_path["subdir"] == {
        "type": "directory",
        "oid": commit.trees["subdir"],
        "size": 0,
        "path": "subdir",
    }
    for path, f in files.items():
        entry = by_path[path]
        assert (entry["type"], entry["size"], entry["oid"]) == ("file", f.size, f.blob_id)
        if f.is_lfs:
            assert entry["lfs"] == {
                "oid": f.sha256,
                "size": f.size,
                "pointerSize": len(f.lfs_pointer),
            }
        else:
            assert "lfs" not in entry and f.blob_id == git_blob_sha1(
                (model_dir / path).read_bytes()
            )
        assert "xetHash" not in entry


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_tree_and_blob_oids_match_git(hub: HubServer, model_dir: Path, tmp_path: Path) -> None:
    """The oids are real git object ids: a git repo with the same content (LFS files as
    pointers) has the same root tree."""
    git = ["git", "-c", "core.autocrlf=false", "-C", str(tmp_path / "g")]
    subprocess.run(["git", "init", "-q", str(tmp_path / "g")], check=True)
    for path, f in hub.files(REPO).items():
        target = tmp_path / "g" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(f.lfs_pointer if f.is_lfs else f.read())
    subprocess.run([*git, "add", "-A"], check=True)
    tree = subprocess.run([*git, "write-tree"], check=True, capture_output=True, text=True)
    commit = hub.repos[REPO].commits[hub.repos[REPO].branches["main"]]
    assert tree.stdout.strip() == commit.trees[""]


@pytest.mark.parametrize("where", ["hub", "cdn"])
@pytest.mark.parametrize(
    ("range_header", "expected"),
    [
        ("bytes=0-9", (206, 0, 10)),
        ("bytes=100-", (206, 100, None)),
        ("bytes=-7", (206, -7, None)),
        ("bytes=5-99999999999", (206, 5, None)),  # end clamped to size - 1
        ("bytes=SIZE-", (416, 0, 0)),
        ("bytes=SIZE-SIZE", (416, 0, 0)),
        ("bytes=9-3", (200, 0, None)),  # invalid: ignored
    ],
)
def test_range_semantics(
    hub: HubServer, model_dir: Path, where: str, range_header: str, expected: tuple
) -> None:
    path = "tokenizer.json" if where == "hub" else "model-00002-of-00002.safetensors"
    data = (model_dir / path).read_bytes()
    size = len(data)
    url = f"{hub.endpoint}/{REPO}/resolve/main/{path}" if where == "hub" else _cdn_url(hub, path)
    status, headers, body = _request(
        url, headers={"Range": range_header.replace("SIZE", str(size))}
    )
    want_status, start, length = expected
    assert status == want_status
    if status == 416:
        assert headers["content-range"] == f"bytes */{size}"
        return
    start = start % size
    want = data[start : start + length if length else None]
    assert body == want and headers["content-length"] == str(len(want))
    if status == 206:
        assert headers["content-range"] == f"bytes {start}-{start + len(want) - 1}/{size}"


def test_error_codes_of_the_three_not_found_cases(hub: HubServer) -> None:
    sha = hub.repos[REPO].branches["main"]
    cases = [
        ("/api/models/acme/missing/revision/main", "RepoNotFound"),
        ("/acme/missing/resolve/main/config.json", "RepoNotFound"),
        (f"/api/models/{REPO}/revision/nope", "RevisionNotFound"),
        (f"/api/models/{REPO}/tree/nope", "RevisionNotFound"),
        (f"/{REPO}/resolve/{'0' * 40}/config.json", "RevisionNotFound"),
        (f"/{REPO}/resolve/main/nope.json", "EntryNotFound"),
        (f"/{REPO}/resolve/main/subdir", "EntryNotFound"),
    ]
    for path, code in cases:
        for method in ("GET", "HEAD"):
            status, headers, body = _request(hub.endpoint + path, method)
            assert (status, headers["x-error-code"]) == (404, code), path
            if method == "GET":
                assert "error" in json.loads(body)
            if code == "EntryNotFound":
                assert headers["x-repo-commit"] == sha


def test_revisions_encoded_or_not(hub: HubServer) -> None:
    pr = hub.add_commit(REPO, {"a.txt": b"pr"}, branch="refs/pr/1")
    main = hub.repos[REPO].branches["main"]
    for rev, want in [
        ("refs%2Fpr%2F1", pr),
        ("refs/pr/1", pr),
        ("main", main),
        ("refs%2Fheads%2Fmain", main),
        (main, main),
    ]:
        status, _, body = _request(f"{hub.endpoint}/api/models/{REPO}/revision/{rev}")
        assert status == 200 and json.loads(body)["sha"] == want, rev
        status, headers, body = _request(f"{hub.endpoint}/{REPO}/resolve/{rev}/.gitattributes")
        assert headers.get("x-repo-commit") == want, rev
    status, _, body = _request(f"{hub.endpoint}/{REPO}/resolve/refs%2Fpr%2F1/a.txt")
    assert (status, body) == (200, b"pr")
    status, _, body = _request(f"{hub.endpoint}/api/models/{REPO}")
    info = json.loads(body)
    assert (info["id"], info["sha"], info["private"]) == (REPO, main, False)
    assert "lastModified" in info and {"rfilename": "config.json"} in info["siblings"]


def test_private_and_gated_repos(hub: HubServer, model_dir: Path) -> None:
    hub.add_repo("acme/private", private=True, allowed_tokens={"hf_ok"})
    hub.add_commit("acme/private", {"a.txt": b"x"})
    hub.add_repo("acme/gated", gated=True, allowed_tokens={"hf_ok"})
    hub.add_commit("acme/gated", {"a.txt": b"x"})
    for repo, code, anonymous, other in [
        ("acme/private", "RepoNotFound", 401, 404),
        ("acme/gated", "GatedRepo", 401, 403),
    ]:
        url = f"{hub.endpoint}/{repo}/resolve/main/a.txt"
        assert _request(url)[0] == anonymous
        status, headers, _ = _request(url, headers={"Authorization": "Bearer hf_bad"})
        assert (status, headers["x-error-code"]) == (other, code)
        assert _request(url, headers={"Authorization": "Bearer hf_ok"})[0] == 200


def test_paths_info_form_and_json(hub: HubServer) -> None:
    url = f"{hub.endpoint}/api/models/{REPO}/paths-info/main"
    form = b"paths=config.json&paths=subdir%2Fnested&paths=nope&expand=false"
    status, _, body = _request(
        url, "POST", {"Content-Type": "application/x-www-form-urlencoded"}, form
    )
    assert status == 200
    assert [(e["path"], e["type"]) for e in json.loads(body)] == [
        ("config.json", "file"),
        ("subdir/nested", "directory"),
    ]
    payload = json.dumps({"paths": ["model-00001-of-00002.safetensors"], "expand": True})
    status, _, body = _request(url, "POST", {"Content-Type": "application/json"}, payload.encode())
    (entry,) = json.loads(body)
    assert entry["lfs"]["size"] == SHARDS[0] and entry["lastCommit"]["id"]


# ---------------------------------------------------------------------------------- faults


def test_fault_cut_closes_the_connection_after_n_bytes(hub: HubServer) -> None:
    url = _cdn_url(hub, "model-00001-of-00002.safetensors")
    rule = hub.faults.cut(1000, port="cdn")
    status, headers, body = _request(url)
    assert status == 200 and headers["content-length"] == str(SHARDS[0])
    assert len(body) == 1000
    assert len(_request(url)[2]) == SHARDS[0]  # count=1: the next one is whole
    assert rule.hits == 1 and hub.faults.active == []
    # A body no longer than after_bytes is not cut and does not use up the rule.
    rule = hub.faults.cut(10_000, count=1)
    assert _request(f"{hub.endpoint}/{REPO}/resolve/main/config.json")[0] == 200
    assert rule.hits == 0 and rule.remaining == 1


def test_fault_corrupt_flips_one_byte_on_both_ports(hub: HubServer, model_dir: Path) -> None:
    shard = "model-00001-of-00002.safetensors"
    data = (model_dir / shard).read_bytes()
    offset = 3 << 19
    hub.faults.corrupt(hub.file(REPO, shard), offset=offset)
    body = _request(_cdn_url(hub, shard))[2]
    assert len(body) == len(data) and body != data
    assert [i for i in range(0, len(data), 4096) if body[i : i + 4096] != data[i : i + 4096]] == [
        offset - offset % 4096
    ]
    assert body[offset] == data[offset] ^ 0xFF
    ranged = _request(_cdn_url(hub, shard), headers={"Range": f"bytes={offset - 2}-{offset + 2}"})
    assert (
        ranged[2]
        == data[offset - 2 : offset] + bytes([data[offset] ^ 0xFF]) + data[offset + 1 : offset + 3]
    )
    untouched = _request(_cdn_url(hub, shard), headers={"Range": "bytes=0-99"})
    assert untouched[2] == data[:100]
    config = hub.file(REPO, "config.json")
    hub.faults.corrupt(config, offset=0, count=1)
    first = _request(f"{hub.endpoint}/{REPO}/resolve/main/config.json")[2]
    second = _request(f"{hub.endpoint}/{REPO}/resolve/main/config.json")[2]
    assert first[0] == config.read()[0] ^ 0xFF and second == config.read()


def test_fault_status_rate_limit_and_server_errors(hub: HubServer) -> None:
    url = f"{hub.endpoint}/api/models/{REPO}/revision/main"
    hub.faults.rate_limit(retry_after=3, count=1)
    status, headers, body = _request(url)
    assert (status, headers["retry-after"]) == (429, "3") and "error" in json.loads(body)
    hub.faults.fail(500, count=2, path="/tree/")
    assert _request(url)[0] == 200  # does not match the path filter
    tree = f"{hub.endpoint}/api/models/{REPO}/tree/main"
    assert [_request(tree)[0] for _ in range(3)] == [500, 500, 200]
    hub.faults.fail(503, count=None, port="cdn")
    cdn = _cdn_url(hub, "model-00001-of-00002.safetensors")
    assert [_request(cdn, "HEAD")[0] for _ in range(3)] == [503, 503, 503]
    hub.faults.clear()
    assert _request(cdn, "HEAD")[0] == 200
    assert [r.faults for r in hub.requests[:2]] == [["fail"], []]


def test_fault_throttle_and_delay(hub: HubServer) -> None:
    shard = hub.file(REPO, "model-00002-of-00002.safetensors")
    url = _cdn_url(hub, shard.path)
    hub.faults.throttle(2_000_000, file=shard)
    started = time.monotonic()
    body = _request(url, headers={"Range": "bytes=0-599999"})[2]
    elapsed = time.monotonic() - started
    assert len(body) == 600_000 and 0.2 <= elapsed < 2.0  # (600 kB - one 100 kB chunk) / rate
    hub.faults.clear()
    hub.faults.delay(0.3, method="HEAD")
    started = time.monotonic()
    assert _request(url, "HEAD")[0] == 200
    assert time.monotonic() - started >= 0.3
    started = time.monotonic()
    assert _request(url, "HEAD")[0] == 200
    assert time.monotonic() - started < 0.3


# ------------------------------------------------------------------------ recording, lifecycle


def test_requests_are_recorded_and_clearable(hub: HubServer) -> None:
    _request(f"{hub.endpoint}/api/models/{REPO}", headers={"X-Test": "yes"})
    (rec,) = hub.requests
    assert (rec.port, rec.method, rec.url_path, rec.status) == (
        "hub",
        "GET",
        f"/api/models/{REPO}",
        200,
    )
    assert rec.headers["x-test"] == "yes"
    hub.clear_requests()
    assert hub.requests == []


def test_keep_alive_and_stop_leaves_no_threads(model_dir: Path, test_ca: TestCA) -> None:
    before = {t.name for t in threading.enumerate()}
    server = HubServer(test_ca).start()
    server.add_commit(REPO, model_dir)
    conn = _connect(server.endpoint, timeout=5)
    for _ in range(3):  # one connection, three requests
        conn.request("GET", f"/{REPO}/resolve/main/config.json")
        assert conn.getresponse().read()
    server.stop()  # with the keep-alive connection still open
    conn.close()
    assert {t.name for t in threading.enumerate()} <= before
    assert server.errors == []


# -------------------------------------------------------------------------------- helpers


def test_write_random_file_is_deterministic_and_valid_safetensors(tmp_path: Path) -> None:
    size = 9 << 20 | 123
    digest = write_random_file(tmp_path / "a", size, "s", safetensors=True)
    write_random_file(tmp_path / "b", size, "s", safetensors=True)
    write_random_file(tmp_path / "c", size, "t", safetensors=True)
    a = (tmp_path / "a").read_bytes()
    assert len(a) == size and hashlib.sha256(a).hexdigest() == digest
    assert a == (tmp_path / "b").read_bytes() != (tmp_path / "c").read_bytes()
    header_len = int.from_bytes(a[:8], "little")
    header = json.loads(a[8 : 8 + header_len])
    assert (8 + header_len) % 8 == 0
    assert header["weight"]["data_offsets"] == [0, size - 8 - header_len]
    pages = {a[i : i + 4096] for i in range(4096, size - 4096, 4096)}
    assert len(pages) == len(range(4096, size - 4096, 4096))  # no two pages alike
    for small in (0, 1, 100):
        write_random_file(tmp_path / "s", small, 1, safetensors=True)
        assert (tmp_path / "s").stat().st_size == small


def test_make_model_dir_layout(tmp_path: Path) -> None:
    files = make_model_dir(tmp_path, seed=3, shard_sizes=(1000, 2000, 3000))
    assert set(files) == {
        ".gitattributes",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "subdir/extra.txt",
        "subdir/nested/deep.json",
        "model.safetensors.index.json",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    }
    assert [files[f"model-0000{i}-of-00003.safetensors"].stat().st_size for i in (1, 2, 3)] == [
        1000,
        2000,
        3000,
    ]
    assert [p for p in files if default_lfs_rule(p, files[p].stat().st_size)] == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    assert (
        make_model_dir(tmp_path / "again", seed=3, shard_sizes=(1000, 2000, 3000)).keys()
        == files.keys()
    )
    assert (tmp_path / "again/config.json").read_bytes() == files["config.json"].read_bytes()


def test_command_line_server(model_dir: Path) -> None:
    command = [sys.executable, "tests/fakes/hubserver.py", "--repo", REPO, "--dir", str(model_dir)]
    with subprocess.Popen(
        command, cwd=Path(__file__).parent.parent, stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            ready = json.loads(proc.stdout.readline())
            status, _, body = _request(f"{ready['endpoint']}/api/models/{REPO}")
            assert status == 200 and json.loads(body)["sha"] == ready["sha"]
        finally:
            proc.terminate()
            assert proc.wait(timeout=10) == 0
