"""Acceptance of issue 32 (``gs://``, ``az://``, ``file://``) as a user reads README.md and
docs/pulling.md: the ``prefetch`` CLI as a subprocess and the agent with a config file, against
gcp-storage-emulator behind the TLS front, Azurite over HTTPS and real directories.

Each scheme: a multi-file model pulled byte-identical with the documented ``--json`` summary,
checked again by ``prefetch verify``; a corrupt source fails naming the file and publishes it
nowhere; ``--hf-repo`` loads offline with huggingface_hub; a pull killed with ``kill -9`` resumes
(slow). Then the agent syncing one of each to ready, the documented variables and credential
forms, bad input (one ``Error:`` line, nothing half-written), ``--help``, the chart's schema and
``prefetch mirror``'s refusal.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pytest

from prefetch.demo.modelgen import make_model_dir, random_bytes

from .fakes.azurite import ACCOUNT, KEY, Azurite
from .fakes.gcs import GcsEmulator, tls_front
from .fakes.s3proxy import S3FaultProxy
from .support import (
    AgentProcess,
    clean_env,
    config_text,
    hf_check,
    journaled_bytes,
    kill_9_when,
    run_cli,
)
from .tls import TestCA

MiB = 1024 * 1024
REPO = Path(__file__).resolve().parent.parent
SCHEMES = ("gs", "az", "file")
_names = iter(range(1_000_000))
#: the checksum each source states, as docs/pulling.md says (file://: its SHA256SUMS)
ALGORITHM = {"gs": "crc32c", "az": "md5", "file": "sha256"}
#: the documented recipe for a SHA256SUMS sidecar (docs/pulling.md)
SHA256SUMS_RECIPE = (
    "find . -type f ! -name SHA256SUMS -printf '%P\\n' | sort | xargs sha256sum > SHA256SUMS"
)


def model_files(root: Path, seed: int) -> dict[str, Path]:
    """A small multi-file model: two shards of several chunks, JSON files, nested folders."""
    return make_model_dir(root, seed=seed, shard_sizes=(1 * MiB + 3, 600_000),
                          extra_files={"sub/dir/notes.txt": b"nested"})  # fmt: skip


def tree(dest: Path) -> dict[str, bytes]:
    """The model files under ``dest`` (the tool's own ``.prefetch`` state left out)."""
    return {
        str(p.relative_to(dest)): p.read_bytes()
        for p in sorted(dest.rglob("*"))
        if p.is_file() and ".prefetch" not in p.relative_to(dest).parts
    }


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


def assert_one_error(proc: subprocess.CompletedProcess[str], *said: str) -> str:
    """Non-zero exit, exactly one ``Error:`` line saying each of ``said``, no traceback."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    for text in said:
        assert text in lines[0], proc.stderr
    return lines[0]


@dataclass
class Served:
    """A model served by one backend: the URI a user types, the environment the CLI runs in,
    the bytes, and how to corrupt one file at its source."""

    scheme: str
    uri: str
    env: dict[str, str]
    files: dict[str, bytes]
    where: Path
    corrupt: dict[str, object] = field(default_factory=dict)


def gcs_env(endpoint: str, work: Path) -> dict[str, str]:
    env = clean_env(work / "hf-home", STORAGE_EMULATOR_HOST=endpoint)
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_OAUTH_ACCESS_TOKEN",
                 "CLOUDSDK_AUTH_ACCESS_TOKEN"):  # fmt: skip
        env.pop(name, None)
    return env


def az_env(azurite: Azurite, work: Path) -> dict[str, str]:
    env = {k: v for k, v in clean_env(work / "hf-home").items()
           if not k.startswith(("AZURE_", "IDENTITY_"))}  # fmt: skip
    env.update(azurite.env())
    return env


@pytest.fixture
def front(gcs_emulator: GcsEmulator, test_ca: TestCA) -> Iterator[S3FaultProxy]:
    with tls_front(gcs_emulator, test_ca) as proxy:
        yield proxy


def serve_gs(emulator: GcsEmulator, front: S3FaultProxy, tmp_path: Path) -> Served:
    bucket = f"accept-{next(_names)}-{os.getpid()}"
    emulator.create_bucket(bucket)
    files = model_files(tmp_path / "model", seed=11)
    emulator.upload_dir(bucket, "models/tiny/", files)
    emulator.upload(bucket, "models/tinyX/other.bin", b"a sibling prefix, not the model")
    return Served("gs", f"gs://{bucket}/models/tiny", gcs_env(front.endpoint, tmp_path),
                  {r: p.read_bytes() for r, p in files.items()}, tmp_path / "model",
                  {"bucket": bucket, "front": front, "emulator": emulator})  # fmt: skip


def serve_az(azurite: Azurite, tmp_path: Path) -> Served:
    prefix = f"accept{next(_names)}/"
    files = {r: p.read_bytes() for r, p in model_files(tmp_path / "model", seed=12).items()}
    azurite.upload("models", prefix, files)
    return Served("az", f"az://{ACCOUNT}/models/{prefix.rstrip('/')}", az_env(azurite, tmp_path),
                  files, tmp_path / "model", {"azurite": azurite, "prefix": prefix})  # fmt: skip


def serve_file(tmp_path: Path) -> Served:
    src = tmp_path / "model"
    files = {r: p.read_bytes() for r, p in model_files(src, seed=13).items()}
    subprocess.run(["sh", "-c", SHA256SUMS_RECIPE], cwd=src, check=True)
    return Served("file", f"file://{src}/", clean_env(tmp_path / "hf-home"), files, src)


@pytest.fixture
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Served:
    """The model served by the scheme the test is parametrized with."""
    scheme = request.param
    if scheme == "gs":
        emulator = request.getfixturevalue("gcs_emulator")
        return serve_gs(emulator, request.getfixturevalue("front"), tmp_path)
    if scheme == "az":
        return serve_az(request.getfixturevalue("azurite"), tmp_path)
    return serve_file(tmp_path)


by_scheme = pytest.mark.parametrize("served", SCHEMES, indirect=True)


# -- a pull, verified -----------------------------------------------------------------------------


@by_scheme
def test_a_multi_file_model_is_pulled_byte_identical_and_verify_rechecks_it(
    served: Served, tmp_path: Path
) -> None:
    dest = tmp_path / "dest"
    proc = run_cli("pull", served.uri, str(dest), "--json", "--chunk-size", "256KiB",
                   env=served.env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert tree(dest) == served.files
    n = len(served.files)
    assert summary["files"] == n and summary["files_verified"] == n
    assert summary["files_unverified"] == [] and summary["checksum_failures"] == 0
    assert (
        summary["bytes_total"]
        == summary["bytes_downloaded"]
        == sum(map(len, served.files.values()))
    )
    assert summary["checksum_algorithms"] == {ALGORITHM[served.scheme]: n}
    assert summary["up_to_date"] is False and summary["seconds"] >= 0
    assert summary["path"] == str(dest) and summary["source"] == served.uri
    again = run_cli("pull", served.uri, str(dest), "--json", env=served.env)
    assert again.returncode == 0, again.stderr
    second = json.loads(again.stdout)
    assert second["up_to_date"] is True and second["bytes_downloaded"] == 0
    check = run_cli("verify", str(dest), env=served.env)
    assert check.returncode == 0, check.stderr
    shard = dest / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[MiB // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = run_cli("verify", str(dest), env=served.env)
    assert bad.returncode != 0 and "model-00001-of-00002.safetensors" in bad.stdout + bad.stderr


def corrupt_at_source(served: Served, path: str) -> None:
    """One byte of ``path`` no longer matches what the source states for it."""
    if served.scheme == "gs":  # flipped on the wire, every time: the object's CRC32C disagrees
        front = served.corrupt["front"]
        assert isinstance(front, S3FaultProxy)
        name = quote(f"models/tiny/{path}", safe="")
        front.faults.flip_key = f"v1/b/{served.corrupt['bucket']}/o/{name}"
        front.faults.flip_offset = 1000
    elif served.scheme == "az":  # the blob's Content-MD5 is another content's
        from azure.storage.blob import ContentSettings

        azurite = served.corrupt["azurite"]
        assert isinstance(azurite, Azurite)
        blob = azurite.container("models").get_blob_client(f"{served.corrupt['prefix']}{path}")
        wrong = bytearray(hashlib.md5(b"other bytes").digest())
        blob.set_http_headers(ContentSettings(content_md5=wrong))
    else:  # the file changed after its SHA256SUMS line was written
        target = served.where / path
        data = bytearray(target.read_bytes())
        data[1000] ^= 0x01
        target.write_bytes(bytes(data))


@by_scheme
def test_a_file_that_does_not_match_its_checksum_fails_naming_it_and_is_not_published(
    served: Served, tmp_path: Path
) -> None:
    bad = "model-00001-of-00002.safetensors"
    corrupt_at_source(served, bad)
    dest = tmp_path / "dest"
    proc = run_cli("pull", served.uri, str(dest), "--json", env=served.env)
    line = assert_one_error(proc, "checksum mismatch", bad)
    assert ALGORITHM[served.scheme] in line
    assert json.loads(proc.stdout)["error_reason"] == "checksum_mismatch"
    assert not (dest / bad).exists()
    assert all(served.files[p] == data for p, data in tree(dest).items())
    if served.scheme != "file":
        return  # the layout's rule is the same for every source: once is enough
    # --hf-repo: the snapshot appears whole or not at all
    home = tmp_path / "home"
    hub = run_cli("pull", served.uri, str(home), "--hf-repo", "acme/bad", env=served.env)
    assert_one_error(hub, "checksum mismatch", bad)
    assert not list(home.glob("hub/models--acme--bad/snapshots/*/*"))


def test_a_wrong_sha256sums_line_fails_the_file_it_names(tmp_path: Path) -> None:
    served = serve_file(tmp_path)
    sums = served.where / "SHA256SUMS"
    lines = sums.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.endswith("config.json"))
    lines[at] = "0" * 64 + lines[at][64:]
    sums.write_text("\n".join(lines) + "\n")
    proc = run_cli("pull", served.uri, str(tmp_path / "dest"), env=served.env)
    assert_one_error(proc, "checksum mismatch for config.json", "sha256 (sidecar)", "0" * 64)
    assert not (tmp_path / "dest" / "config.json").exists()


# -- the Hugging Face layout ----------------------------------------------------------------------


@by_scheme
def test_hf_repo_publishes_a_layout_huggingface_hub_loads_offline(
    served: Served, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    proc = run_cli("pull", served.uri, str(home), "--hf-repo", "acme/llama", "--json",
                   env=served.env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    out = hf_check(  # HF_HUB_OFFLINE=1, HF_HOME=home
        home,
        """
        import pathlib
        root = hf.snapshot_download("acme/llama", local_files_only=True)
        out["root"] = root
        out["files"] = {str(p.relative_to(root)): p.read_bytes().hex()
                        for p in sorted(pathlib.Path(root).rglob("*")) if p.is_file()}
        out["config"] = open(hf.hf_hub_download("acme/llama", "config.json")).read()
        """,
    )
    assert out["root"] == summary["path"]
    assert out["files"] == {p: d.hex() for p, d in served.files.items()}
    assert out["config"] == served.files["config.json"].decode()
    check = run_cli("verify", str(home), env=served.env)
    assert check.returncode == 0, check.stderr


# -- resume after kill -9 -------------------------------------------------------------------------

#: a pull whose reads are slowed down (a directory copies too fast to be killed mid-way)
SLOW_PULL = (
    "import os, time\n"
    "def slow(f):\n"
    "    def g(*a, **k):\n"
    "        time.sleep(0.05)\n"
    "        return f(*a, **k)\n"
    "    return g\n"
    "os.pread = slow(os.pread)\n"
    "os.preadv = slow(os.preadv)\n"
    "os.copy_file_range = slow(os.copy_file_range)\n"
    "from prefetch.cli import main\n"
    "main()\n"
)


@pytest.mark.slow
@pytest.mark.parametrize("served", SCHEMES, indirect=True)
def test_a_pull_killed_with_sigkill_fetches_less_than_everything_the_second_time(
    served: Served, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    big = {f"model-0000{i}-of-00002.safetensors": random_bytes(12 * MiB, f"kill {i}")
           for i in (1, 2)}  # fmt: skip
    env = dict(served.env)
    uri = served.uri
    slow: S3FaultProxy | None = None
    if served.scheme == "gs":
        emulator = served.corrupt["emulator"]
        assert isinstance(emulator, GcsEmulator)
        for path, data in big.items():
            emulator.upload(str(served.corrupt["bucket"]), f"big/{path}", data)
        uri = f"gs://{served.corrupt['bucket']}/big"
        slow = served.corrupt["front"]  # type: ignore[assignment]  # a fixture's proxy
    elif served.scheme == "az":
        azurite = request.getfixturevalue("azurite")
        azurite.upload("models", "big-kill/", big)
        uri = f"az://{ACCOUNT}/models/big-kill"
        slow = S3FaultProxy(azurite.base, azurite.tls, role="mirror").__enter__()
        env["AZURE_STORAGE_BLOB_ENDPOINT"] = f"{slow.endpoint}/{ACCOUNT}"
    else:
        src = tmp_path / "big"
        src.mkdir()
        for path, data in big.items():
            (src / path).write_bytes(data)
        uri = f"file://{src}"
    args = ["pull", uri, str(tmp_path / "dest"), "--json", "--concurrency", "2",
            "--chunk-size", "1MiB"]  # fmt: skip
    if slow is not None:
        slow.faults.throttle_bps = 4 * MiB
        cmd = [sys.executable, "-m", "prefetch.cli", *args]
    else:
        cmd = [sys.executable, "-c", SLOW_PULL, *args]
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        partial = tmp_path / "dest" / ".prefetch" / "partial"
        kill_9_when(proc, lambda: journaled_bytes(partial) >= 6 * MiB, "pull", interval=0.005)
        if slow is not None:
            slow.faults.throttle_bps = 0
        second = run_cli(*args, env=env)
    finally:
        if slow is not None and served.scheme == "az":
            slow.__exit__(None, None, None)
    assert second.returncode == 0, second.stderr
    summary = json.loads(second.stdout)
    assert summary["resumed_bytes"] >= 6 * MiB
    assert summary["bytes_downloaded"] < summary["bytes_total"]
    assert tree(tmp_path / "dest") == big


# -- the agent ------------------------------------------------------------------------------------


def test_the_agent_syncs_one_model_of_each_scheme_to_ready_and_publishes_them(
    gcs_emulator: GcsEmulator, front: S3FaultProxy, azurite: Azurite, tmp_path: Path
) -> None:
    gs = serve_gs(gcs_emulator, front, tmp_path / "gs")
    az = serve_az(azurite, tmp_path / "az")
    local = serve_file(tmp_path / "file")
    cache = tmp_path / "cache"
    config = tmp_path / "models.yaml"
    models = [
        {"name": "from-gcs", "source": gs.uri},
        {"name": "from-azure", "source": az.uri, "hfRepo": "acme/azure", "revision": "c" * 40},
        {"name": "from-dir", "source": local.uri, "hfRepo": "acme/dir"},
    ]
    config.write_text(config_text(cache, models))
    env = dict(gs.env, **{k: v for k, v in az.env.items() if k.startswith("AZURE_")})
    agent = AgentProcess(config, env, tmp_path / "agent.log")
    try:
        body = agent.ready_then_terminated(timeout=90)
    finally:
        agent.stop()
    assert {m["name"]: m["state"] for m in body["models"]} == dict.fromkeys(
        ("from-gcs", "from-azure", "from-dir"), "ready"
    ), body
    assert tree(cache / "models" / "from-gcs") == gs.files
    out = hf_check(
        cache,
        """
        import pathlib
        for repo in ("acme/azure", "acme/dir"):
            root = pathlib.Path(hf.snapshot_download(repo, local_files_only=True))
            out[repo] = {str(p.relative_to(root)): p.read_bytes().hex()
                         for p in sorted(root.rglob("*")) if p.is_file()}
        """,
    )
    assert out["acme/azure"] == {p: d.hex() for p, d in az.files.items()}
    assert (cache / "hub/models--acme--azure/snapshots" / ("c" * 40)).is_dir()  # its revision
    assert out["acme/dir"] == {p: d.hex() for p, d in local.files.items()}


# -- the documented variables and credential forms ------------------------------------------------


def test_storage_emulator_host_as_host_port_means_plain_http(
    gcs_emulator: GcsEmulator, front: S3FaultProxy, tmp_path: Path
) -> None:
    served = serve_gs(gcs_emulator, front, tmp_path)
    env = dict(served.env, STORAGE_EMULATOR_HOST=gcs_emulator.endpoint.removeprefix("http://"))
    proc = run_cli("pull", served.uri, str(tmp_path / "dest"), env=env)
    assert proc.returncode == 0, proc.stderr
    assert tree(tmp_path / "dest") == served.files


def test_an_access_token_is_used_and_never_printed_even_at_vv(
    gcs_emulator: GcsEmulator, front: S3FaultProxy, tmp_path: Path
) -> None:
    served = serve_gs(gcs_emulator, front, tmp_path)
    token = "ya29.acceptance-secret-token"
    env = dict(served.env, GOOGLE_OAUTH_ACCESS_TOKEN=token)
    proc = run_cli("-vv", "pull", served.uri, str(tmp_path / "dest"), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "GET " in proc.stderr  # -vv logged the requests
    assert token not in proc.stdout + proc.stderr
    assert tree(tmp_path / "dest") == served.files


@pytest.mark.parametrize(
    "credentials",
    [
        "a missing file",
        pytest.param("not JSON", marks=pytest.mark.slow),
        pytest.param("a broken service-account key", marks=pytest.mark.slow),
    ],
)
def test_google_application_credentials_that_cannot_be_read_are_one_error_naming_them(
    gcs_emulator: GcsEmulator, front: S3FaultProxy, tmp_path: Path, credentials: str
) -> None:
    """docs/pulling.md: an emulator is read anonymously *unless* GOOGLE_APPLICATION_CREDENTIALS
    is given; credentials named that cannot be loaded are an error, not a silent anonymous
    pull (which a private bucket would refuse as "no credentials were found")."""
    served = serve_gs(gcs_emulator, front, tmp_path)
    path = tmp_path / "credentials.json"
    if credentials == "not JSON":
        path.write_text("this is not JSON\n")
    elif credentials == "a broken service-account key":
        path.write_text(json.dumps({
            "type": "service_account", "project_id": "p", "private_key_id": "k",
            "private_key": "-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n",
            "client_email": "sa@p.iam.gserviceaccount.com",
            "token_uri": "https://127.0.0.1:9/token",
        }))  # fmt: skip
    dest = tmp_path / "dest"
    env = dict(served.env, GOOGLE_APPLICATION_CREDENTIALS=str(path))
    proc = run_cli("pull", served.uri, str(dest), env=env)
    assert_one_error(proc, "GOOGLE_APPLICATION_CREDENTIALS", str(path))
    assert tree(dest) == {} if dest.exists() else True


@pytest.mark.slow
def test_azure_sas_token_connection_string_and_portal_url_all_pull(
    azurite: Azurite, tmp_path: Path
) -> None:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    served = serve_az(azurite, tmp_path)
    import datetime

    sas = generate_container_sas(
        ACCOUNT, "models", account_key=KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1),
    )  # fmt: skip
    no_key = {k: v for k, v in served.env.items() if k != "AZURE_STORAGE_KEY"}
    by_sas = run_cli("-vv", "pull", served.uri, str(tmp_path / "sas"),
                     env=dict(no_key, AZURE_STORAGE_SAS_TOKEN=sas))  # fmt: skip
    assert by_sas.returncode == 0, by_sas.stderr
    signature = dict(p.split("=", 1) for p in sas.split("&"))["sig"]
    assert signature not in by_sas.stdout + by_sas.stderr
    connection = {k: v for k, v in no_key.items() if k != "AZURE_STORAGE_BLOB_ENDPOINT"}
    connection["AZURE_STORAGE_CONNECTION_STRING"] = (
        f"DefaultEndpointsProtocol=https;AccountName={ACCOUNT};AccountKey={KEY};"
        f"BlobEndpoint={azurite.endpoint};"
    )
    by_string = run_cli("pull", served.uri, str(tmp_path / "conn"), env=connection)
    assert by_string.returncode == 0, by_string.stderr
    prefix = served.uri.split("/models/", 1)[1]
    portal = f"https://{ACCOUNT}.blob.core.windows.net/models/{prefix}"
    by_portal = run_cli("pull", portal, str(tmp_path / "portal"), "--json", env=served.env)
    assert by_portal.returncode == 0, by_portal.stderr
    assert json.loads(by_portal.stdout)["served_by"] == served.uri + "/"
    templated = dict(served.env, AZURE_STORAGE_BLOB_ENDPOINT=f"{azurite.base}/{{account}}")
    by_template = run_cli("pull", served.uri, str(tmp_path / "tmpl"), env=templated)
    assert by_template.returncode == 0, by_template.stderr
    for dest in ("sas", "conn", "portal", "tmpl"):
        assert tree(tmp_path / dest) == served.files


# -- bad input ------------------------------------------------------------------------------------

BAD_INPUT = [
    ("gs", "gs://no-such-bucket-acceptance/m", {}, "the bucket does not exist"),
    ("gs", "gs://{bucket}/no/such/prefix", {}, "no objects under gs://{bucket}/no/such/prefix/"),
    ("gs", "gs://Bad_Bucket!/m", {}, "malformed GCS URI"),
    ("gs", "gs://{bucket}/models/tiny", {"STORAGE_EMULATOR_HOST": "ftp://x"},
     "STORAGE_EMULATOR_HOST"),
    ("az", "az://{account}/no-such-container/m", {}, "container does not exist"),
    ("az", "az://{account}/models/no/such/prefix", {}, "no blobs under az://"),
    ("az", "az://{account}", {}, "malformed Azure URI"),
    ("az", "az://{account}/models/{prefix}", {"AZURE_STORAGE_KEY": "A" * 86 + "=="},
     "access denied with the account key (AZURE_STORAGE_KEY)"),
    ("az", "az://{account}/models/{prefix}", {"AZURE_STORAGE_KEY": "not base64!"},
     "AZURE_STORAGE_KEY"),
    ("az", "https://example.com/models/x", {}, "unsupported source URI"),
    ("az", "az://{account}/models/{prefix}",
     {"AZURE_STORAGE_KEY": "", "AZURE_STORAGE_AUTH_MODE": "login"}, "Microsoft Entra"),
    ("file", "file://{src}/no-such-dir", {}, "no such directory"),
    ("file", "file://{src}/config.json", {}, "not a directory"),
    ("file", "file://host{src}", {}, "malformed file URI"),
    ("file", "file://{src}/../model", {}, "'..' is not allowed"),
]  # fmt: skip


@pytest.mark.parametrize(("served", "uri", "extra", "said"), BAD_INPUT, indirect=["served"])
def test_bad_input_is_one_error_line_and_leaves_no_file(
    served: Served, tmp_path: Path, uri: str, extra: dict[str, str], said: str
) -> None:
    prefix = str(served.corrupt.get("prefix", "")).rstrip("/")
    names = {"bucket": served.corrupt.get("bucket", ""), "account": ACCOUNT, "prefix": prefix,
             "src": served.where}  # fmt: skip
    dest = tmp_path / "dest"
    proc = run_cli("pull", uri.format(**names), str(dest), "--attempts", "2", "--json",
                   env=dict(served.env, **extra))  # fmt: skip
    line = assert_one_error(proc, said.format(**names))
    summary = json.loads(proc.stdout)  # --json: still one object, with the error and its reason
    assert line == f"Error: {summary['error']}" and summary["error_reason"]
    assert summary["bytes_downloaded"] == 0
    assert [line for line in proc.stderr.splitlines()
            if not line.startswith(("Error: ", "Hint: "))] == []  # fmt: skip
    assert not dest.exists() or tree(dest) == {}
    assert not dest.exists() or not list(dest.rglob("*.incomplete"))


def test_a_destination_inside_the_source_is_refused_and_a_read_only_source_never_changes(
    tmp_path: Path,
) -> None:
    served = serve_file(tmp_path)
    src = served.where

    def state() -> dict[str, tuple[int, ...]]:
        return {str(p): (p.lstat().st_mode, p.lstat().st_size, p.lstat().st_ino,
                         p.lstat().st_mtime_ns, p.lstat().st_ctime_ns)
                for p in [src, *sorted(src.rglob("*"))]}  # fmt: skip

    before = state()
    for dest in (src / "out", src, src / "sub" / "dir"):
        inside = run_cli("pull", served.uri, str(dest), env=served.env)
        assert_one_error(inside, "inside the source")
    inner = run_cli("pull", f"file://{src}/sub", str(src), env=served.env)
    assert_one_error(inner, "inside the destination")
    assert state() == before
    for path in [*src.rglob("*"), src]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        before = state()
        proc = run_cli("pull", served.uri, str(tmp_path / "dest"), "--json", env=served.env)
        assert proc.returncode == 0, proc.stderr
        assert state() == before
        assert tree(tmp_path / "dest") == served.files
    finally:
        for path in [src, *src.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)


# -- help, README, the chart's schema, prefetch mirror --------------------------------------------


def test_pull_help_and_readme_show_the_three_schemes() -> None:
    proc = run_cli("pull", "--help", env=clean_env(Path("/nonexistent")))
    assert proc.returncode == 0
    for form in ("gs://bucket/prefix", "az://account/container/prefix", "file:///"):
        assert form in proc.stdout
    examples = proc.stdout.split("\nExamples:\n", 1)[1]  # README: --help ends with examples
    for example in ("$ prefetch pull gs://", "$ prefetch pull az://", "$ prefetch pull file:///"):
        assert example in examples
    readme = (REPO / "README.md").read_text()
    for example in ("prefetch pull gs://", "prefetch pull az://", "prefetch pull file:///"):
        assert example in readme


def test_the_chart_schema_accepts_the_documented_sources() -> None:
    import jsonschema

    schema = json.loads((REPO / "charts/model-prefetch/values.schema.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    models = [
        {"name": "a", "source": "gs://my-bucket/models/llama"},
        {"name": "b", "source": "gs://my-bucket/models/llama", "hfRepo": "org/llama"},
        {"name": "c", "source": "az://myaccount/models/llama-70b"},
        {"name": "d", "source": "https://myaccount.blob.core.windows.net/models/llama-70b"},
        {"name": "e", "source": "az://myaccount/models/llama-70b", "hfRepo": "org/llama2"},
        {"name": "f", "source": "file:///mnt/models/llama/"},
        {"name": "g", "source": "file:///mnt/models/llama", "hfRepo": "org/llama3"},
    ]
    values = {
        "config": {"models": models},
        "extraVolumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models",
                                                                      "readOnly": True}}],
        "extraVolumeMounts": [{"name": "models", "mountPath": "/mnt/models", "readOnly": True}],
    }  # fmt: skip
    assert [e.message for e in validator.iter_errors(values)] == []


@pytest.mark.parametrize(
    "uri",
    ["gs://my-bucket/models/llama", "az://myaccount/models/llama", "file:///mnt/models/llama",
     "https://myaccount.blob.core.windows.net/models/llama"],
)  # fmt: skip
def test_prefetch_mirror_refuses_these_sources_in_one_line(uri: str, tmp_path: Path) -> None:
    proc = run_cli("mirror", uri, "s3://my-mirror/hf/org/name/", env=clean_env(tmp_path))
    assert_one_error(proc, "prefetch mirror does not read", uri)


@pytest.mark.parametrize(
    "source",
    ["gs://my-bucket/models/llama", "az://myaccount/models/llama",
     "https://myaccount.blob.core.windows.net/models/llama", "file:///mnt/models/llama"],
)  # fmt: skip
def test_revision_is_the_commit_to_publish_under_in_the_agent_and_the_schema_alike(
    source: str,
) -> None:
    """docs/config.md: a non-Hub source takes ``revision`` only as the 40-hex commit an
    ``hfRepo`` is published under (as ``pull --hf-revision``); the agent and the chart's schema
    agree on what they accept."""
    import jsonschema
    import yaml

    from prefetch.agent.config import parse_config
    from prefetch.support.errors import ConfigError

    schema = json.loads((REPO / "charts/model-prefetch/values.schema.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    commit = "ab" * 20
    good = {"name": "m", "source": source, "hfRepo": "org/llama", "revision": commit}
    assert parse_config(yaml.safe_dump({"models": [good]})).models[0].hf_revision == commit
    assert not list(validator.iter_errors({"config": {"models": [good]}}))
    bad_ones = [
        {"name": "m", "source": source, "revision": "main"},
        {"name": "m", "source": source, "revision": commit},
        {"name": "m", "source": source, "hfRepo": "org/llama", "revision": "main"},
    ]
    for bad in bad_ones:
        with pytest.raises(ConfigError, match="revision"):
            parse_config(yaml.safe_dump({"models": [bad]}))
        assert list(validator.iter_errors({"config": {"models": [bad]}})), bad


def test_pull_help_says_hf_repo_takes_these_sources() -> None:
    proc = run_cli("pull", "--help", env=clean_env(Path("/nonexistent")))
    text = " ".join(proc.stdout.split())
    assert "gs, az and file sources: publish in the Hugging Face layout" in text


@pytest.mark.slow
def test_the_agent_reads_a_sas_on_the_uri_and_never_shows_its_signature(
    azurite: Azurite, tmp_path: Path
) -> None:
    import datetime

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    served = serve_az(azurite, tmp_path)
    sas = generate_container_sas(
        ACCOUNT, "models", account_key=KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1),
    )  # fmt: skip
    signature = dict(p.split("=", 1) for p in sas.split("&"))["sig"]
    cache = tmp_path / "cache"
    config = tmp_path / "models.yaml"
    config.write_text(config_text(cache, [{"name": "sas", "source": f"{served.uri}?{sas}"}]))
    env = {k: v for k, v in served.env.items() if k != "AZURE_STORAGE_KEY"}
    agent = AgentProcess(config, dict(env, PREFETCH_LOG_LEVEL="debug"), tmp_path / "agent.log")
    try:
        body = agent.ready_then_terminated(timeout=60)
        logged = agent.stderr()
    finally:
        agent.stop()
    assert body["models"][0]["state"] == "ready"
    assert tree(cache / "models" / "sas") == served.files
    seen = (
        json.dumps(body)
        + logged
        + "".join(p.read_text(errors="replace") for p in cache.rglob("*.json"))
    )
    assert "sas" in logged  # the agent did log about the model
    assert signature not in seen and signature.replace("%2B", "+") not in seen
