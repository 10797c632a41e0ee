"""``az://`` (Azure Blob Storage) end to end against Azurite, Microsoft's emulator, over HTTPS
with the session CA: pulls by the CLI (byte-identical, verified, resumable after kill -9, the
Hub layout loaded offline), the portal's URL form, SharedKey / SAS / Entra credentials, one-line
errors, a SAS never printed, a blob replaced mid-pull caught by If-Match, the per-range MD5 of a
blob without Content-MD5, and the agent syncing an az:// model to ready."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from prefetch.demo.modelgen import random_bytes
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import sync
from prefetch.sources import SourceSettings, open_source
from prefetch.support.errors import (
    AccessDeniedError,
    ConfigError,
    SourceChangedError,
)

from .fakes.azurite import ACCOUNT, INSTALL_HINT, KEY, Azurite, azurite_program
from .fakes.s3proxy import S3FaultProxy
from .support import FAST, AgentThread, config_text, is_ready, journaled_bytes, run_cli, wait_for
from .tls import TestCA

MiB = 1024 * 1024
CONTAINER = "models"


def model_files(tag: str, big: int = 5 * MiB + 7) -> dict[str, bytes]:
    return {
        "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
        "docs/read me (ü) +1%.md": b"a name to escape, signed as sent",
        "tokenizer/tokenizer.json": random_bytes(70_000, f"{tag}: tokenizer"),
        "model-00001-of-00002.safetensors": random_bytes(big, f"{tag}: shard 1"),
        "model-00002-of-00002.safetensors": random_bytes(3 * MiB + 1, f"{tag}: shard 2"),
    }


def tree(dest: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(dest)): p.read_bytes()
        for p in dest.rglob("*")
        if p.is_file() and ".prefetch" not in p.parts
    }


@pytest.fixture
def az_env(azurite: Azurite, tmp_path: Path) -> dict[str, str]:
    """A ``prefetch`` subprocess's environment: Azurite's endpoint and the account key, no
    other Azure variable of this machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "IDENTITY_"))}
    env.update(azurite.env(), HF_HOME=str(tmp_path / "hf-home"), PYTHONUNBUFFERED="1")
    env.pop("PREFETCH_DEBUG", None)
    return env


@pytest.fixture
def azurite_program_path() -> str:
    program = azurite_program()
    if program is None:
        pytest.skip(INSTALL_HINT)
    return program


def uploaded(azurite: Azurite, prefix: str, *, content_md5: bool = True) -> dict[str, bytes]:
    files = model_files(prefix)
    azurite.upload(CONTAINER, prefix, files, content_md5=content_md5)
    return files


# -- pulls ---------------------------------------------------------------------------------------


def test_a_pull_is_byte_identical_and_every_file_verified(azurite, az_env, tmp_path):
    files = uploaded(azurite, "llama/")
    dest = tmp_path / "dest"
    run = run_cli("pull", f"az://{ACCOUNT}/{CONTAINER}/llama", str(dest), "--json", env=az_env)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert tree(dest) == files
    assert summary["files_verified"] == len(files) and not summary["files_unverified"]
    assert summary["checksum_algorithms"] == {"md5": len(files)}  # the blobs' Content-MD5
    again = run_cli("pull", f"az://{ACCOUNT}/{CONTAINER}/llama", str(dest), "--json", env=az_env)
    assert json.loads(again.stdout)["bytes_downloaded"] == 0  # a no-op
    check = run_cli("verify", str(dest), env=az_env)
    assert check.returncode == 0, check.stderr


def test_the_portal_url_form_pulls_the_same_blobs(azurite, az_env, tmp_path):
    files = uploaded(azurite, "portal/")
    url = f"https://{ACCOUNT}.blob.core.windows.net/{CONTAINER}/portal/"
    run = run_cli("pull", url, str(tmp_path / "dest"), "--json", env=az_env)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["served_by"] == f"az://{ACCOUNT}/{CONTAINER}/portal/"
    assert tree(tmp_path / "dest") == files


def test_blobs_without_content_md5_are_checked_range_by_range(azurite, az_env, tmp_path):
    """Uploaded in blocks (no Content-MD5): each <= 4 MiB range is checked against the MD5
    the service states for it; a byte flipped on the wire fails the file, nothing published."""
    files = uploaded(azurite, "blocks/", content_md5=False)
    shard = "model-00001-of-00002.safetensors"
    with S3FaultProxy(azurite.base, azurite.tls, role="mirror") as proxy:
        env = dict(az_env, AZURE_STORAGE_BLOB_ENDPOINT=f"{proxy.endpoint}/{ACCOUNT}")
        uri = f"az://{ACCOUNT}/{CONTAINER}/blocks/"
        good = run_cli("pull", uri, str(tmp_path / "good"), "--json", env=env)
        assert good.returncode == 0, good.stderr
        assert tree(tmp_path / "good") == files
        ranged = [r for k, r in proxy.get_ranges if k.endswith(shard)]
        assert len(ranged) >= 2  # 5 MiB in ranges of at most 4 MiB
        proxy.faults.flip_key = f"{CONTAINER}/blocks/{shard}"
        proxy.faults.flip_offset = 4 * MiB + 2
        bad = run_cli("pull", uri, str(tmp_path / "bad"), env=env)
    assert bad.returncode != 0
    assert shard in bad.stderr and "md5 of bytes 4194304-" in bad.stderr, bad.stderr
    assert not (tmp_path / "bad" / shard).exists()


def test_the_hub_layout_loads_offline_with_huggingface_hub(azurite, az_env, tmp_path):
    files = uploaded(azurite, "hub/")
    home = tmp_path / "home"
    run = run_cli("pull", f"az://{ACCOUNT}/{CONTAINER}/hub", str(home), "--hf-repo", "acme/azl",
                  env=az_env)  # fmt: skip
    assert run.returncode == 0, run.stderr
    script = (
        "import json, sys\nfrom huggingface_hub import snapshot_download\n"
        "print(snapshot_download('acme/azl', cache_dir=sys.argv[1], local_files_only=True))\n"
    )
    env = dict(az_env, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", script, str(home / "hub")], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert tree(Path(out.stdout.strip())) == files


@pytest.mark.slow
def test_a_pull_killed_with_sigkill_resumes_without_fetching_it_again(azurite, az_env, tmp_path):
    files = {f"s{i}.safetensors": random_bytes(24 * MiB, f"resume {i}") for i in range(2)}
    azurite.upload(CONTAINER, "resume/", files)
    dest = tmp_path / "dest"
    args = [sys.executable, "-m", "prefetch.cli", "pull", f"az://{ACCOUNT}/{CONTAINER}/resume",
            str(dest), "--json", "--concurrency", "2", "--chunk-size", "4MiB"]  # fmt: skip
    total = sum(len(d) for d in files.values())
    with S3FaultProxy(azurite.base, azurite.tls, role="mirror") as proxy:
        proxy.faults.throttle_bps = 8 * MiB
        env = dict(az_env, AZURE_STORAGE_BLOB_ENDPOINT=f"{proxy.endpoint}/{ACCOUNT}")
        proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                published = sum(f.stat().st_size for f in dest.glob("*.safetensors"))
                if journaled_bytes(dest / ".prefetch" / "partial") + published >= 0.8 * total:
                    break
                time.sleep(0.01)
            assert proc.poll() is None, "the pull finished before it could be killed"
            proc.kill()
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
    second = subprocess.run(args, env=az_env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout)
    assert summary["resumed_bytes"] > 0
    assert summary["bytes_downloaded"] < 0.3 * total, summary
    assert tree(dest) == files


def test_a_blob_replaced_mid_pull_is_caught_by_if_match(azurite, tmp_path, monkeypatch):
    uploaded(azurite, "swap/")
    for name, value in azurite.env().items():
        monkeypatch.setenv(name, value)
    spec = ModelSpec(source=parse_source_uri(f"az://{ACCOUNT}/{CONTAINER}/swap/"))
    source = open_source(spec, SourceSettings())
    snapshot = source.resolve(spec)
    shard = snapshot.file("model-00002-of-00002.safetensors")
    azurite.upload(CONTAINER, "swap/", {shard.path: b"another version"})
    # the service refused the pinned read (If-Match: 412 ConditionNotMet)
    with pytest.raises(SourceChangedError, match=r"changed during the download \(ConditionNotMet"):
        source.open_range(shard, 0, 1024)
    with pytest.raises(SourceChangedError):
        sync(spec, source, PlainLayout(tmp_path / "d"), FAST, snapshot=snapshot)
    assert not (tmp_path / "d" / shard.path).exists()


# -- credentials and errors ----------------------------------------------------------------------


def sas_token(azurite: Azurite, **permissions: bool) -> str:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    expiry = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    return str(generate_container_sas(
        ACCOUNT, CONTAINER, account_key=KEY,
        permission=ContainerSasPermissions(**(permissions or {"read": True, "list": True})),
        expiry=expiry,
    ))  # fmt: skip


def test_a_sas_in_the_environment_or_on_the_uri_pulls_and_is_never_printed(
    azurite, az_env, tmp_path
):
    files = uploaded(azurite, "sas/")
    token = sas_token(azurite)
    signature = dict(p.split("=", 1) for p in token.split("&"))["sig"]
    env = {k: v for k, v in az_env.items() if k != "AZURE_STORAGE_KEY"}
    by_env = run_cli("-vv", "pull", f"az://{ACCOUNT}/{CONTAINER}/sas", str(tmp_path / "a"),
                     env=dict(env, AZURE_STORAGE_SAS_TOKEN=token))  # fmt: skip
    assert by_env.returncode == 0, by_env.stderr
    assert tree(tmp_path / "a") == files
    uri = f"az://{ACCOUNT}/{CONTAINER}/sas/?{token}"
    on_uri = run_cli("-vv", "pull", uri, str(tmp_path / "b"), "--json", env=env)
    assert on_uri.returncode == 0, on_uri.stderr
    assert tree(tmp_path / "b") == files
    for run in (by_env, on_uri):
        assert "GET /" in run.stderr  # -vv did log the requests
        assert signature not in run.stdout + run.stderr
        assert signature.replace("%2B", "+") not in run.stdout + run.stderr
    manifest = (tmp_path / "b" / ".prefetch" / "manifest.json").read_text()
    assert signature not in manifest


def test_a_sas_without_list_permission_says_access_denied_in_one_line(azurite, az_env, tmp_path):
    uploaded(azurite, "nolist/")
    env = {k: v for k, v in az_env.items() if k != "AZURE_STORAGE_KEY"}
    env["AZURE_STORAGE_SAS_TOKEN"] = sas_token(azurite, read=True)
    run = run_cli("pull", f"az://{ACCOUNT}/{CONTAINER}/nolist", str(tmp_path / "d"), env=env)
    assert run.returncode != 0
    error = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "access denied with a SAS (AZURE_STORAGE_SAS_TOKEN)" in error[0]
    assert "Traceback" not in run.stderr


def test_a_wrong_key_is_one_line_naming_the_key(azurite, az_env, tmp_path):
    uploaded(azurite, "wrongkey/")
    wrong = "A" * 86 + "=="
    run = run_cli("-vv", "pull", f"az://{ACCOUNT}/{CONTAINER}/wrongkey", str(tmp_path / "d"),
                  env=dict(az_env, AZURE_STORAGE_KEY=wrong))  # fmt: skip
    assert run.returncode != 0
    assert "Error: listing az://" in run.stderr
    assert "access denied with the account key (AZURE_STORAGE_KEY)" in run.stderr
    assert "Traceback" not in run.stderr and wrong not in run.stderr
    assert KEY not in run.stderr


def test_a_missing_container_and_an_empty_prefix_are_named(azurite, az_env, tmp_path):
    uploaded(azurite, "present/")
    gone = run_cli("pull", f"az://{ACCOUNT}/no-such-container/m", str(tmp_path / "a"),
                   env=az_env)  # fmt: skip
    assert gone.returncode != 0
    assert "container does not exist in account devstoreaccount1" in gone.stderr, gone.stderr
    empty = run_cli("pull", f"az://{ACCOUNT}/{CONTAINER}/absent", str(tmp_path / "b"), env=az_env)
    assert empty.returncode != 0 and "no blobs under az://" in empty.stderr, empty.stderr


def test_an_unknown_account_is_one_line_naming_it(az_env, tmp_path):
    env = dict(az_env, AZURE_STORAGE_BLOB_ENDPOINT="https://127.0.0.1:9/{account}")
    run = run_cli("pull", "az://nosuchaccount/models/m", str(tmp_path / "d"), "--attempts", "1",
                  env=env)  # fmt: skip
    assert run.returncode != 0
    assert "Error: listing az://nosuchaccount/models/m/" in run.stderr
    assert "127.0.0.1:9" in run.stderr
    assert "Hint: check the account name" in run.stderr, run.stderr
    assert "AZURE_STORAGE_BLOB_ENDPOINT" in run.stderr


def test_a_bad_key_is_a_config_error() -> None:
    from prefetch.sources.azure.auth import account_for

    with pytest.raises(ConfigError, match="AZURE_STORAGE_KEY: the account key is not base64"):
        account_for("acct1", "", {"AZURE_STORAGE_KEY": "not base64!"})


def test_the_connection_string_gives_the_key_and_the_endpoint(azurite, tmp_path, monkeypatch):
    files = uploaded(azurite, "conn/")
    monkeypatch.delenv("AZURE_STORAGE_KEY", raising=False)
    monkeypatch.delenv("AZURE_STORAGE_BLOB_ENDPOINT", raising=False)
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING",
        f"DefaultEndpointsProtocol=https;AccountName={ACCOUNT};AccountKey={KEY};"
        f"BlobEndpoint={azurite.endpoint};",
    )
    spec = ModelSpec(source=parse_source_uri(f"az://{ACCOUNT}/{CONTAINER}/conn"))
    result = sync(spec, open_source(spec), PlainLayout(tmp_path / "d"), FAST)
    assert result.files_verified == len(files) and tree(tmp_path / "d") == files


class ScriptedToken:
    """azure-identity's credential interface, answering with a token a test made."""

    def __init__(self, token: str) -> None:
        self.token, self.scopes = token, []

    def get_token(self, *scopes: str) -> Any:
        from azure.core.credentials import AccessToken

        self.scopes.append(scopes)
        return AccessToken(self.token, int(time.time()) + 3600)


def entra_jwt() -> str:
    """An unsigned JWT with the claims Azurite's ``--oauth basic`` checks (issuer, audience,
    validity; it does not check signatures)."""
    import base64

    def part(doc: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")

    now = int(time.time())
    tenant = "ab1f708d-50f6-404c-a006-d71b2ac7a606"
    claims = {
        "aud": "https://storage.azure.com",
        "iss": f"https://sts.windows.net/{tenant}/",
        "iat": now - 60,
        "nbf": now - 60,
        "exp": now + 3600,
        "tid": tenant,
    }
    return f"{part({'alg': 'RS256', 'typ': 'JWT'})}.{part(claims)}.c2ln"


def test_entra_tokens_are_sent_as_bearer_to_the_account_only(
    test_ca, tmp_path, azurite_program_path
):
    """Azurite with ``--oauth basic`` accepts a token for Azure Storage and refuses a request
    without one; the token comes from azure-identity's interface (scripted here)."""
    from prefetch.sources.azure.auth import Account, EntraToken
    from prefetch.sources.azure.source import AzureBlobSource
    from prefetch.sources.http.transport import make_http_pool

    with Azurite(azurite_program_path, tmp_path / "oauth", test_ca, oauth=True) as server:
        server.upload(CONTAINER, "entra/", {"config.json": b"{}", "w.bin": b"x" * 100})
        credential = ScriptedToken(entra_jwt())
        spec = ModelSpec(source=parse_source_uri(f"az://{ACCOUNT}/{CONTAINER}/entra"))
        pool = make_http_pool(8, ca_certs=str(test_ca.ca_file))
        account = Account(ACCOUNT, server.endpoint, EntraToken(credential))
        source = AzureBlobSource(spec.source, account, pool)
        result = sync(spec, source, PlainLayout(tmp_path / "d"), FAST)
        assert result.files_downloaded == 2
        assert credential.scopes[0] == ("https://storage.azure.com/.default",)
        assert len(credential.scopes) == 1  # one token, reused until it nears its expiry
        bad = AzureBlobSource(
            spec.source, Account(ACCOUNT, server.endpoint, EntraToken(ScriptedToken("x.y.z"))), pool
        )
        with pytest.raises(AccessDeniedError, match="Microsoft Entra"):
            bad.resolve(spec)


# -- the agent -----------------------------------------------------------------------------------


def test_the_agent_syncs_an_az_model_to_ready(azurite, tmp_path, monkeypatch):
    from prefetch.agent.loop import Agent

    files = uploaded(azurite, "agent/")
    for name, value in azurite.env().items():
        monkeypatch.setenv(name, value)
    cache = tmp_path / "cache"
    models = [{"name": "azm", "source": f"az://{ACCOUNT}/{CONTAINER}/agent"}]
    (tmp_path / "models.yaml").write_text(config_text(cache, models))
    agent = Agent(tmp_path / "models.yaml", serve=False, tick=0.2)
    with AgentThread(agent):
        wait_for(lambda: is_ready(agent, "azm"), "the az:// model to be ready", timeout=60)
    assert tree(cache / "models" / "azm") == files


class TokenEndpoint:
    """A managed identity's token endpoint (App Service's ``IDENTITY_ENDPOINT`` protocol, which
    azure-identity speaks), scripted: answers every request with ``token``."""

    def __init__(self, token: str, tls: TestCA) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler

        from .fakes.tlsserver import TLSThreadingHTTPServer

        self.requests: list[tuple[str, dict[str, str]]] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                endpoint.requests.append((self.path, dict(self.headers.items())))
                body = json.dumps({
                    "access_token": token, "expires_on": str(int(time.time()) + 3600),
                    "resource": "https://storage.azure.com", "token_type": "Bearer",
                }).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = TLSThreadingHTTPServer(("127.0.0.1", 0), Handler, tls.server_context())
        self.url = f"{tls.url(self._server.server_address[1])}/msi/token"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def test_entra_through_azure_identity_pulls_with_a_managed_identity(
    test_ca, tmp_path, azurite_program_path, az_env
):
    """The CLI with no key, a managed identity's endpoint in the environment: azure-identity's
    DefaultAzureCredential gets the token, Azurite (``--oauth basic``) accepts it, and -vv
    never prints it."""
    token = entra_jwt()
    endpoint = TokenEndpoint(token, test_ca)
    try:
        with Azurite(azurite_program_path, tmp_path / "oauth", test_ca, oauth=True) as server:
            files = {"config.json": b"{}", "w.safetensors": random_bytes(3 * MiB, "entra")}
            server.upload(CONTAINER, "mi/", files)
            env = {k: v for k, v in az_env.items() if k != "AZURE_STORAGE_KEY"}
            env.update(
                AZURE_STORAGE_BLOB_ENDPOINT=server.endpoint,
                IDENTITY_ENDPOINT=endpoint.url,
                IDENTITY_HEADER="header-of-the-identity",
            )
            run = run_cli("-vv", "pull", f"az://{ACCOUNT}/{CONTAINER}/mi", str(tmp_path / "d"),
                          env=env)  # fmt: skip
            assert run.returncode == 0, run.stderr[-3000:]
            assert tree(tmp_path / "d") == files
            assert token.split(".")[1] not in run.stdout + run.stderr
            path, headers = endpoint.requests[0]
            assert "resource=https" in path and "storage.azure.com" in path
            assert headers.get("X-IDENTITY-HEADER") == "header-of-the-identity"
            no_identity = {k: v for k, v in env.items() if k != "IDENTITY_ENDPOINT"}
            refused = run_cli("pull", f"az://{ACCOUNT}/{CONTAINER}/mi", str(tmp_path / "e"),
                              env=no_identity)  # fmt: skip
            assert refused.returncode != 0
            assert "access denied with no credentials" in refused.stderr, refused.stderr
    finally:
        endpoint.close()


# -- hostile servers -----------------------------------------------------------------------------


class Recorder:
    """An HTTPS server recording every request, answering each with ``status`` and
    ``headers``."""

    def __init__(self, tls: TestCA, status: int, headers: dict[str, str]) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler

        from .fakes.tlsserver import TLSThreadingHTTPServer

        self.requests: list[tuple[str, dict[str, str]]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                recorder.requests.append((self.path, dict(self.headers.items())))
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self._server = TLSThreadingHTTPServer(("127.0.0.1", 0), Handler, tls.server_context())
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.mark.parametrize("credential", ["key", "sas"])
def test_a_redirect_to_another_host_is_not_followed_and_gets_no_credential(
    test_ca: TestCA, credential: str
) -> None:
    from prefetch.sources.azure.auth import Account, Sas, SharedKey
    from prefetch.sources.azure.source import AzureBlobSource
    from prefetch.sources.http.transport import make_http_pool
    from prefetch.support.errors import SourceError

    other = Recorder(test_ca, 200, {})
    target = f"https://{test_ca.host_for('proxy')}:{other.port}/stolen"
    origin = Recorder(test_ca, 307, {"Location": target})
    try:
        endpoint = f"{test_ca.url(origin.port, 'hub')}/{ACCOUNT}"
        cred = SharedKey(ACCOUNT, KEY, "test") if credential == "key" else Sas(
            "sv=2021-12-02&sp=rl&sig=S3cretSig%3D", "test"
        )  # fmt: skip
        spec = ModelSpec(source=parse_source_uri(f"az://{ACCOUNT}/{CONTAINER}/m"))
        pool = make_http_pool(4, ca_certs=str(test_ca.ca_file))
        source = AzureBlobSource(spec.source, Account(ACCOUNT, endpoint, cred), pool)
        with pytest.raises(SourceError, match=r"answered 307 \(a redirect: not followed") as err:
            source.resolve(spec)
        assert "S3cretSig" not in str(err.value)
        assert len(origin.requests) >= 1
        assert other.requests == []  # never followed: neither the key's signature nor the SAS
    finally:
        origin.close()
        other.close()
