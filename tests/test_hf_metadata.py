"""The Hub source's metadata (revision to commit, the commit's tree) and token lookup on our own
HTTP layer: what huggingface_hub would find and say, without importing it (issue 15: importing
it was most of a no-op pull's CPU). The end-to-end cases run against tests/fakes/hubserver.py;
the protocol corners (pages, redirects, answers that are not the Hub's JSON) against canned
answers."""

from __future__ import annotations

import http.server
import io
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3

from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.snapshot import RemoteFile
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.sources.hf.source import HubSource, hub_token
from prefetch.support.errors import InvalidListingError, SourceError, TransientSourceError

from .fakes.hubserver import HubServer
from .support import HUB_REPO, HUB_TOKEN, REPO_ROOT, clean_env, run_cli, server_files
from .tls import TestCA

ENDPOINT = "http://hub.test"
COMMIT = "c" * 40
API = f"{ENDPOINT}/api/models/acme/x"
TREE = f"{API}/tree/{COMMIT}?recursive=true&expand=false"

# -- a no-op pull ----------------------------------------------------------------------------------

_RUN_AND_LIST_HUGGINGFACE_HUB = """
import sys
from prefetch.cli import main
try:
    main(sys.argv[1:], prog_name="prefetch")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(f"huggingface_hub imported: {'huggingface_hub' in sys.modules}", file=sys.stderr)
sys.exit(code)
"""


def test_a_hub_pull_and_its_no_op_repeat_never_import_huggingface_hub(
    model_dir: Path, tmp_path: Path, test_ca: TestCA
) -> None:
    with HubServer(test_ca, token=HUB_TOKEN) as hub:
        hub.add_commit(HUB_REPO, model_dir)
        home = tmp_path / "hf-home"
        home.mkdir()
        (home / "token").write_text(HUB_TOKEN + "\n")  # found as `hf auth login` leaves it
        env = clean_env(home, HF_ENDPOINT=hub.endpoint)
        run = [sys.executable, "-c", _RUN_AND_LIST_HUGGINGFACE_HUB, "pull", f"hf://{HUB_REPO}",
               str(tmp_path / "dest"), "--json"]  # fmt: skip
        for expected_files in (len(server_files(hub)), 0):
            proc = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120,
                                  cwd=REPO_ROOT)  # fmt: skip
            assert proc.returncode == 0, proc.stderr
            assert json.loads(proc.stdout)["files_downloaded"] == expected_files
            assert proc.stderr.strip().splitlines()[-1] == "huggingface_hub imported: False"
        assert json.loads(proc.stdout)["up_to_date"] is True
        assert hub.errors == []


# -- the token -------------------------------------------------------------------------------------

_TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HOME", "HF_TOKEN_PATH", "XDG_CACHE_HOME",
               "HF_OIDC_RESOURCE")  # fmt: skip


def _token_env(tmp_path: Path, case: str) -> dict[str, str]:
    """The token variables of one case (files written under ``tmp_path``)."""
    home, xdg, elsewhere = tmp_path / "home", tmp_path / "xdg", tmp_path / "elsewhere" / "tok"
    for path, text in [(home / "token", "hf_file\r\n"), (xdg / "huggingface/token", " hf_xdg "),
                       (elsewhere, "hf_elsewhere")]:  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {
        "env-before-file": {"HF_TOKEN": "hf_env", "HF_HOME": str(home)},
        "old-name": {"HUGGING_FACE_HUB_TOKEN": "hf_old", "HF_HOME": str(home)},
        "blank-env-then-file": {"HF_TOKEN": "  ", "HF_HOME": str(home)},
        "token-path": {"HF_HOME": str(home), "HF_TOKEN_PATH": str(elsewhere)},
        "xdg-default": {"XDG_CACHE_HOME": str(xdg)},
        "none": {"HF_HOME": str(tmp_path / "empty")},
    }[case]


@pytest.mark.parametrize(
    "case",
    ["env-before-file", "old-name", "blank-env-then-file", "token-path", "xdg-default", "none"],
)
def test_the_token_is_the_one_huggingface_hub_finds(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = _token_env(tmp_path, case)
    env = {k: v for k, v in clean_env(tmp_path).items() if k not in _TOKEN_VARS}
    code = "import json, huggingface_hub; print(json.dumps(huggingface_hub.get_token()))"
    proc = subprocess.run([sys.executable, "-c", code], env={**env, **values}, capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    for name in _TOKEN_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    assert hub_token() == json.loads(proc.stdout)


@pytest.mark.parametrize("case", ["oauth-login", "oidc"])
def test_what_only_huggingface_hub_can_do_is_left_to_it(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    for name in _TOKEN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    (tmp_path / "token").write_text("hf_oauth_expiring")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_from_the_library")
    assert hub_token() == "hf_oauth_expiring"  # a plain login: read here
    if case == "oauth-login":  # a browser login: its token is refreshed by the library
        (tmp_path / "stored_tokens").write_text(
            "[default]\nhf_token = hf_oauth_expiring\nrefresh_token = r\nexpires_at = 1\n"
        )
    else:
        monkeypatch.setenv("HF_OIDC_RESOURCE", "acme/x")
    assert hub_token() == "hf_from_the_library"


# -- answers that are not the Hub's --------------------------------------------------------------


class CannedHub:
    """A urllib3-like client answering each URL from a list of (status, headers, body)."""

    def __init__(self, answers: dict[str, list[tuple[int, dict[str, str], bytes]]]) -> None:
        self.answers = answers
        self.sent: list[tuple[str, dict[str, str]]] = []

    def request(self, method: str, url: str, **kwargs: Any) -> urllib3.HTTPResponse:
        self.sent.append((url, dict(kwargs["headers"])))
        assert kwargs["redirect"] is False and kwargs["retries"] is False
        queue = self.answers[url]
        status, headers, body = queue.pop(0) if len(queue) > 1 else queue[0]
        return urllib3.HTTPResponse(body=io.BytesIO(body), headers=headers, status=status,
                                    preload_content=False)  # fmt: skip


def _source(http: CannedHub, token: str | None = "hf_secret") -> HubSource:
    return HubSource(parse_source_uri("hf://acme/x"), endpoint=ENDPOINT, token=token, http=http,
                     retry=RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.01))  # fmt: skip


def _resolve(source: HubSource, revision: str = COMMIT) -> list[str]:
    spec = ModelSpec(source=parse_source_uri("hf://acme/x"), revision=revision)
    return [f.path for f in source.resolve(spec).files]


def _entry(path: str) -> dict[str, object]:
    return {"type": "file", "path": path, "size": 3, "oid": "b" * 40}


def _json(value: object, **headers: str) -> tuple[int, dict[str, str], bytes]:
    return 200, {"Content-Type": "application/json", **headers}, json.dumps(value).encode()


@pytest.mark.parametrize(
    ("url", "answer", "words"),
    [
        (f"{API}/revision/main?expand=sha", (200, {}, b"<html>gateway</html>"), "is not JSON"),
        (f"{API}/revision/main?expand=sha", _json({"id": "acme/x"}), "gave no commit sha"),
        (TREE, (200, {}, b'[{"type": "file", "pa'), "is not JSON"),
        (TREE, _json({"error": "no"}), "dict JSON, not a list"),
        (TREE, _json(["a.bin"]), "malformed tree entry"),
    ],
    ids=["revision-html", "revision-without-sha", "tree-cut-short", "tree-object", "tree-strings"],
)
def test_an_answer_that_is_not_the_hubs_json_is_one_clear_error_not_retried(
    url: str, answer: tuple[int, dict[str, str], bytes], words: str
) -> None:
    answers = {f"{API}/revision/main?expand=sha": [_json({"sha": COMMIT})], TREE: [_json([])]}
    http = CannedHub({**answers, url: [answer]})
    with pytest.raises(SourceError, match=words) as err:
        _resolve(_source(http), "main")
    assert not isinstance(err.value, TransientSourceError)
    if words == "is not JSON":
        assert url.split("?")[0] in str(err.value)  # names the URL that answered
    assert [u for u, _ in http.sent].count(url) == 1
    assert "hf_secret" not in str(err.value)


def test_a_cli_pull_from_a_server_that_answers_html_is_one_error_line(
    tmp_path: Path, test_ca: TestCA
) -> None:
    with _HtmlServer(test_ca) as endpoint:
        proc = run_cli("pull", "hf://acme/x", str(tmp_path / "d"), "--endpoint", endpoint,
                       env=clean_env(tmp_path / "hf"))  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.startswith("Error: resolving acme/x@main: the answer of ")
    assert f"{endpoint}/api/models/acme/x/revision/main is not JSON" in proc.stderr
    assert "Traceback" not in proc.stderr


class _HtmlServer:
    """An HTTPS server (the session CA, hub.prefetch.test) that answers every GET with an HTML
    page (a captive portal, a proxy's error page, a web server at the wrong port)."""

    def __init__(self, tls: TestCA) -> None:
        self.tls = tls

    def __enter__(self) -> str:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = b"<html><body>Welcome</body></html>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = self.tls.server_context()
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self.tls.url(self._server.server_address[1], "hub")

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()


# -- pages and redirects ---------------------------------------------------------------------------


def test_the_tree_is_followed_through_its_pages_and_the_token_stays_on_the_hub() -> None:
    relative = f"/api/models/acme/x/tree/{COMMIT}?recursive=true&cursor=2"
    page2, page3 = f"{ENDPOINT}{relative}", "http://pages.test/tree?cursor=3"
    http = CannedHub({
        TREE: [_json([_entry("a"), {"type": "directory", "path": "d", "oid": "e" * 40}],
                     Link=f'<{relative}>; rel="next"')],
        page2: [_json([_entry("d/b")], Link=f'<{page3}>; rel="next", <{TREE}>; rel="first"')],
        page3: [_json([_entry("d/c")])],
    })  # fmt: skip
    assert _resolve(_source(http)) == ["a", "d/b", "d/c"]
    assert [u for u, _ in http.sent] == [TREE, page2, page3]
    tokens = [h.get("Authorization") for _, h in http.sent]
    assert tokens == ["Bearer hf_secret", "Bearer hf_secret", None]  # not off the Hub's origin


def test_pages_that_loop_are_refused() -> None:
    http = CannedHub({TREE: [_json([_entry("a")], Link=f'<{TREE}>; rel="next"')]})
    with pytest.raises(SourceError, match="pages loop back"):
        _resolve(_source(http))
    assert len(http.sent) == 1


@pytest.mark.parametrize(
    ("header", "target", "words"),
    [
        ("Link", "http://hub.test:port/next", "a next page from .* to a malformed URL"),
        ("Link", "ftp://hub.test/next", "refusing a next page to .*not an HTTP"),
        ("Location", "http://[::1/x", "a redirect from .* to a malformed URL"),
    ],
)
def test_a_next_page_or_redirect_that_is_no_http_url_is_one_clear_error(
    header: str, target: str, words: str
) -> None:
    value = f'<{target}>; rel="next"' if header == "Link" else target
    status = 200 if header == "Link" else 302
    http = CannedHub({TREE: [(status, {header: value}, b"[]")]})
    with pytest.raises(SourceError, match=words) as err:
        _resolve(_source(http))
    assert not isinstance(err.value, TransientSourceError) and len(http.sent) == 1


def test_a_download_redirect_to_a_malformed_url_is_one_clear_error() -> None:
    locator = f"{ENDPOINT}/acme/x/resolve/{COMMIT}/w.bin"
    http = CannedHub({locator: [(302, {"Location": "https://cdn.test:443x/blob"}, b"")]})
    file = RemoteFile(path="w.bin", size=10, version="a" * 64, blob_id="a" * 64, locator=locator)
    with pytest.raises(SourceError, match=r"a redirect from .* to a malformed URL") as err:
        _source(http).open_range(file, 0, 10)
    assert not isinstance(err.value, TransientSourceError)


def test_a_renamed_repo_is_followed_to_its_new_name() -> None:
    moved = f"{ENDPOINT}/api/models/acme/y/revision/main?expand=sha"
    http = CannedHub({
        f"{API}/revision/main?expand=sha": [(307, {"Location": moved}, b"")],
        moved: [_json({"sha": COMMIT})],
        TREE: [_json([_entry("a")])],
    })  # fmt: skip
    assert _resolve(_source(http), "main") == ["a"]
    assert [u for u, _ in http.sent] == [f"{API}/revision/main?expand=sha", moved, TREE]


def test_an_unreachable_hub_is_retried_then_named(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    source = HubSource(parse_source_uri("hf://acme/x"), endpoint=f"http://127.0.0.1:{port}",
                       token=None, http=urllib3.PoolManager(retries=False),
                       retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.01))  # fmt: skip
    with pytest.raises(TransientSourceError, match="resolving acme/x@main: giving up after 2"):
        _resolve(source, "main")


@pytest.fixture
def hub(model_dir: Path, test_ca: TestCA) -> Iterator[HubServer]:
    with HubServer(test_ca, tree_page_size=3) as server:
        server.add_commit(HUB_REPO, model_dir)
        yield server


def test_a_hostile_entry_on_the_last_page_still_refuses_the_whole_listing(hub: HubServer) -> None:
    last = max(hub.files(HUB_REPO))
    hub.tamper_tree = lambda e: {**e, "lfs": {"size": 1}} if e["path"] == last else e
    source = HubSource(parse_source_uri(f"hf://{HUB_REPO}"), endpoint=hub.endpoint, token=None,
                       http=urllib3.PoolManager(retries=False))  # fmt: skip
    with pytest.raises(InvalidListingError, match=f"malformed tree entry .*{last}"):
        source.resolve(ModelSpec(source=parse_source_uri(f"hf://{HUB_REPO}")))
    assert len([r for r in hub.requests if "/tree/" in r.url_path]) > 1  # it was a later page
    assert not [r for r in hub.requests if "/resolve/" in r.url_path]
