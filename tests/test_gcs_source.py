"""The gs:// source against a scripted Cloud Storage over TLS (tests/fakes/scripted_gcs.py):
credentials (a token given, a service-account JSON through google-auth, a token refreshed after
a 401), paging, a redirect, a generation that is not the listed one, and what -vv prints."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import sync
from prefetch.sources import SourceSettings, open_source
from prefetch.support.errors import SourceChangedError

from .fakes.scripted_gcs import ScriptedGcs
from .support import clean_env, run_cli
from .tls import TestCA

TOKEN = "ya29.HostileGcsAccessToken0123456789abcdefXYZ"
FILES = {f"m/part-{i}.bin": bytes([i]) * (100_000 + i) for i in range(5)}
CONFIG = TransferConfig(
    concurrency=2,
    chunk_size=64 * 1024,
    buffer_size=16 * 1024,
    retry=RetryPolicy(attempts=2, base_delay=0.01),
)


@pytest.fixture
def gcs(test_ca: TestCA) -> Iterator[ScriptedGcs]:
    with ScriptedGcs(test_ca) as server:
        for name, data in FILES.items():
            server.put("bkt", name, data)
        yield server


def env_for(gcs: ScriptedGcs, work: Path, **extra: str) -> dict[str, str]:
    env = clean_env(work / "hf-home", STORAGE_EMULATOR_HOST=gcs.endpoint,
                    CLOUDSDK_CONFIG=str(work / "no-gcloud"), **extra)  # fmt: skip
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_OAUTH_ACCESS_TOKEN",
                 "CLOUDSDK_AUTH_ACCESS_TOKEN"):  # fmt: skip
        if name not in extra:
            env.pop(name, None)
    return env


def pulled(dest: Path) -> dict[str, bytes]:
    return {f"m/{p.name}": p.read_bytes() for p in dest.glob("*.bin")}


def pull_in_process(
    gcs: ScriptedGcs, dest: Path, monkeypatch: pytest.MonkeyPatch, token: str = TOKEN
) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    monkeypatch.setenv("GOOGLE_OAUTH_ACCESS_TOKEN", token)
    spec = ModelSpec(source=parse_source_uri("gs://bkt/m"))
    source = open_source(spec, SourceSettings(concurrency=2, retry=CONFIG.retry))
    sync(spec, source, PlainLayout(dest), CONFIG)


def test_the_listing_is_read_page_by_page_with_the_token(gcs: ScriptedGcs, tmp_path: Path) -> None:
    gcs.script.token, gcs.script.page_size = TOKEN, 2
    proc = run_cli("pull", "gs://bkt/m", str(tmp_path / "d"), "--json",
                   env=env_for(gcs, tmp_path, GOOGLE_OAUTH_ACCESS_TOKEN=TOKEN))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert pulled(tmp_path / "d") == FILES
    listings = [r.path for r in gcs.requests if "alt=media" not in r.path]
    assert len(listings) == 3 and "pageToken=2" in listings[1] and "pageToken=4" in listings[2]
    assert all("fields=items" in p and "prefix=m%2F" in p for p in listings)
    assert all(r.headers.get("Authorization") == f"Bearer {TOKEN}" for r in gcs.requests)
    media = [r for r in gcs.requests if "alt=media" in r.path]
    # stored gzip-encoded bytes are fetched as stored (no decompressive transcoding)
    assert media and all(r.headers.get("Accept-Encoding") == "gzip" for r in media)
    assert json.loads(proc.stdout)["checksum_algorithms"] == {"crc32c": len(FILES)}


def test_a_refused_token_is_one_line_and_never_printed_at_vv(
    gcs: ScriptedGcs, tmp_path: Path
) -> None:
    gcs.script.token = "the-right-one"
    proc = run_cli("-vv", "pull", "gs://bkt/m", str(tmp_path / "d"),
                   env=env_for(gcs, tmp_path, GOOGLE_OAUTH_ACCESS_TOKEN=TOKEN))  # fmt: skip
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [
        "Error: listing gs://bkt/m/: access denied to the access token of "
        "GOOGLE_OAUTH_ACCESS_TOKEN (HTTP 401 (Invalid Credentials))"
    ]
    assert "Hint: check the Google credentials" in proc.stderr
    assert TOKEN[:12] not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_service_account_json_gets_its_token_through_google_auth_and_refreshes_it(
    gcs: ScriptedGcs, tmp_path: Path
) -> None:
    """GOOGLE_APPLICATION_CREDENTIALS: google-auth signs a JWT with the key and exchanges it at
    the file's token_uri (the scripted server); a 401 mid-pull (the token expired) fetches a
    new one once. Neither token nor the key is printed at -vv."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()  # fmt: skip
    sa = tmp_path / "sa.json"
    sa.write_text(json.dumps({
        "type": "service_account", "project_id": "p", "private_key_id": "k1",
        "private_key": pem, "client_email": "puller@p.iam.gserviceaccount.com",
        "client_id": "1", "token_uri": f"{gcs.endpoint}/token",
    }))  # fmt: skip
    first, second = "ya29.first-issued-token-abcdef", "ya29.second-issued-token-uvwxyz"
    gcs.script.issued = [first, second]
    gcs.script.token = "nothing-issued-yet"
    gcs.script.expire_after = 2  # the listing and one read, then a 401
    proc = run_cli("-vv", "pull", "gs://bkt/m", str(tmp_path / "d"),
                   env=env_for(gcs, tmp_path, GOOGLE_APPLICATION_CREDENTIALS=str(sa)))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert pulled(tmp_path / "d") == FILES
    assert [r.path for r in gcs.requests].count("/token") == 2
    sent = {r.headers.get("Authorization") for r in gcs.requests if r.path != "/token"}
    assert sent == {f"Bearer {first}", f"Bearer {second}"}
    out = proc.stdout + proc.stderr
    assert first not in out and second not in out and pem.splitlines()[1] not in out


def test_a_redirect_to_another_host_is_refused_and_the_token_never_reaches_it(
    gcs: ScriptedGcs, test_ca: TestCA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ScriptedGcs(test_ca, role="cdn") as other:
        gcs.script.redirect_to = other.endpoint
        with pytest.raises(Exception, match="302") as err:
            pull_in_process(gcs, tmp_path / "d", monkeypatch)
        assert "m/part-" in str(err.value)
        assert other.requests == []  # never asked, so never given the token
        assert TOKEN not in str(err.value)


def test_an_answer_of_another_generation_is_a_changed_object(
    gcs: ScriptedGcs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gcs.script.served_generation = "999999"
    with pytest.raises(SourceChangedError, match="generation 999999"):
        pull_in_process(gcs, tmp_path / "d", monkeypatch)
    assert pulled(tmp_path / "d") == {}


def test_a_generation_gone_mid_pull_is_a_changed_object(
    gcs: ScriptedGcs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every range names the listed generation: Cloud Storage answers 404 once it is gone."""
    spec = ModelSpec(source=parse_source_uri("gs://bkt/m"))
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    monkeypatch.setenv("GOOGLE_OAUTH_ACCESS_TOKEN", TOKEN)
    source = open_source(spec, SourceSettings(retry=CONFIG.retry))
    snapshot = source.resolve(spec)
    gcs.put("bkt", "m/part-3.bin", b"new content")
    file = snapshot.file("part-3.bin")
    with pytest.raises(SourceChangedError, match=r"generation .* is gone"):
        source.open_range(file, 0, 10)
    assert "generation=" in gcs.requests[-1].path


def test_two_objects_of_one_generation_and_size_are_two_blobs_in_the_hub_layout(
    gcs: ScriptedGcs, tmp_path: Path
) -> None:
    """A generation is unique per object, not per bucket: equal-sized shards uploaded in the
    same microsecond may share one, and must not share a blob."""
    gcs.put("bkt", "same/a.bin", b"A" * 5000, generation=77)
    gcs.put("bkt", "same/b.bin", b"B" * 5000, generation=77)
    home = tmp_path / "home"
    proc = run_cli("pull", "gs://bkt/same", str(home), "--hf-repo", "acme/same", "--json",
                   env=env_for(gcs, tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    snapshot = Path(json.loads(proc.stdout)["path"])
    assert (snapshot / "a.bin").read_bytes() == b"A" * 5000
    assert (snapshot / "b.bin").read_bytes() == b"B" * 5000


def test_without_google_auth_application_default_credentials_name_the_extra(
    gcs: ScriptedGcs, tmp_path: Path
) -> None:
    """No token and no emulator: Application Default Credentials, which need google-auth
    (a package named ``google`` shadowing the namespace stands for its absence)."""
    shadow = tmp_path / "shadow" / "google"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    env = env_for(gcs, tmp_path)
    del env["STORAGE_EMULATOR_HOST"]
    env["PYTHONPATH"] = f"{shadow.parent}:{env['PYTHONPATH']}"
    proc = run_cli("pull", "gs://bkt/m", str(tmp_path / "d"), env=env)
    assert proc.returncode != 0
    assert proc.stderr.splitlines()[:2] == [
        "Error: reading gs:// with Application Default Credentials needs google-auth",
        "Hint: pip install 'model-prefetch[gcs]' (google-auth)",
    ]


def test_with_no_credentials_anywhere_requests_go_anonymous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A public bucket needs none: google-auth finding nothing is not an error."""
    from prefetch.sources.gcs.auth import ApplicationDefault
    from prefetch.sources.http.transport import make_http_pool

    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_OAUTH_ACCESS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # google-auth's switch: no metadata server here
    auth = ApplicationDefault(make_http_pool(2))
    assert auth.header() is None
    assert auth.origin.startswith("no credentials")


def test_parallel_reads_meeting_one_expiry_refresh_the_token_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Several ranged reads answered 401 for the same expired token report it one after the
    other: the first drops it and the next header() fetches one new token; the others, whose
    401 answered the old token, retry with the new one instead of dropping it again."""
    import google.auth

    from prefetch.sources.gcs.auth import ApplicationDefault

    class Credentials:
        def __init__(self) -> None:
            self.token: str | None = "t0"
            self.refreshes = 0

        @property
        def valid(self) -> bool:
            return self.token is not None

        def refresh(self, request: object) -> None:
            self.refreshes += 1
            self.token = f"t{self.refreshes}"

    creds = Credentials()
    monkeypatch.setattr(google.auth, "default", lambda scopes=None: (creds, "p"))
    auth = ApplicationDefault(http=None)  # type: ignore[arg-type]  # refresh() ignores it here
    sent = [auth.header() for _ in range(4)]  # four reads sent with the same token
    assert set(sent) == {"Bearer t0"}
    for header in sent:  # each is answered 401, and reports it
        assert auth.expired(header) is True
        assert auth.header() == "Bearer t1"
    assert creds.refreshes == 1
