"""The listing without botocore (prefetch/sources/s3/direct.py) and the lazy client: signed as
botocore signs, the same keys as botocore lists, the region redirect, the fallbacks, and a no-op
pull of an S3 model that never imports botocore."""

from __future__ import annotations

import datetime
import http.server
import io
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.sources.s3 import direct as s3_direct
from prefetch.sources.s3.direct import (
    S3Bucket,
    StaticCredentials,
    canonical_query,
    direct_settings,
    parse_list_page,
    sends_as_signed,
    sign_v4,
)
from prefetch.sources.s3.sdk import BotocoreObjects
from prefetch.sources.s3.source import LazyS3Client, S3Source, lazy_s3_client
from prefetch.support.errors import AccessDeniedError, BucketNotFoundError

from .support import pull_s3, put

REPO = Path(__file__).resolve().parent.parent
WHEN = datetime.datetime(2026, 12, 3, 19, 4, 5, tzinfo=datetime.UTC)
KEYS = StaticCredentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")


def _local_client(server: Any, **extra: Any) -> LazyS3Client:
    return lazy_s3_client(
        endpoint_url=server.endpoint, access_key=server.access_key,
        secret_key=server.secret_key, region="us-east-1", **extra,
    )  # fmt: skip


# -- signing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "FQoGZXIvYXdzEXAMPLETOKEN"])
@pytest.mark.parametrize(
    "url",
    [
        "https://bkt.s3.eu-west-1.amazonaws.com/",
        "http://127.0.0.1:8333/bkt",
        "https://minio.example:443/bkt",
    ],
)
def test_the_signature_is_the_one_botocore_computes(monkeypatch, url, token):
    import botocore.auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    query = canonical_query(
        {"list-type": "2", "prefix": "models/a b+c/ü~", "max-keys": "1000",
         "continuation-token": "1/2+3=", "encoding-type": "url"}
    )  # fmt: skip
    full = f"{url}?{query}"
    mine = sign_v4("GET", full, StaticCredentials(KEYS.access_key, KEYS.secret_key, token),
                   "eu-west-1", now=WHEN)  # fmt: skip
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: WHEN.replace(tzinfo=None))
    request = AWSRequest("GET", full)
    request.context["payload_signing_enabled"] = True  # S3 over http(s) with no body: e3b0...
    creds = Credentials(KEYS.access_key, KEYS.secret_key, token)
    botocore.auth.S3SigV4Auth(creds, "s3", "eu-west-1").add_auth(request)
    assert mine["authorization"] == request.headers["Authorization"]
    assert mine["x-amz-date"] == request.headers["X-Amz-Date"]


@pytest.mark.parametrize("token", [None, "FQoGZXIvYXdzEXAMPLETOKEN"])
def test_an_object_requests_headers_are_signed_as_botocore_signs_them(monkeypatch, token):
    """A ranged, pinned GET with the checksum header (what a download sends) and a part HEAD:
    every header is signed, and the signature is botocore's for the same request."""
    import botocore.auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: WHEN.replace(tzinfo=None))
    creds = StaticCredentials(KEYS.access_key, KEYS.secret_key, token)
    cases = [
        ("GET", "http://127.0.0.1:8333/bkt/m/a%20b%2Bc/%C3%BC~.bin",
         {"Range": "bytes=0-1048575", "If-Match": '"0123abc"', "x-amz-checksum-mode": "ENABLED"}),
        ("HEAD", "https://bkt.s3.eu-west-1.amazonaws.com/m/w.safetensors?partNumber=1", {}),
    ]  # fmt: skip
    for method, url, headers in cases:
        mine = sign_v4(method, url, creds, "eu-west-1", now=WHEN, headers=headers)
        request = AWSRequest(method, url, headers=dict(headers))
        request.context["payload_signing_enabled"] = True
        botocore.auth.S3SigV4Auth(
            Credentials(KEYS.access_key, KEYS.secret_key, token), "s3", "eu-west-1"
        ).add_auth(request)
        assert mine["authorization"] == request.headers["Authorization"], (method, url)
        assert {k: mine[k.lower()] for k in headers} == headers  # sent as signed


# -- listing against the local server --------------------------------------------------------


ODD_KEYS = [
    "m/a b.txt", "m/plus+sign", "m/percent%20kept", "m/ü/ñ.json", "m/q?x=1&y=2#frag",
    "m/tilde~and'quote", "m/semi;colon,comma", "m/dir/", "m/trailing space ",
]  # fmt: skip


def _botocore_keys(s3_client: Any, bucket: str, prefix: str) -> list[tuple[str, int, str]]:
    out = []
    for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [(o["Key"], o["Size"], o["ETag"]) for o in page.get("Contents", [])]
    return out


def _direct_keys(lister: S3Bucket, bucket: str, prefix: str) -> tuple[list[Any], int]:
    out, token, pages = [], None, 0
    while True:
        page = lister.list_objects_v2(Bucket=bucket, Prefix=prefix, ContinuationToken=token)
        pages += 1
        out += [(o["Key"], o["Size"], o["ETag"]) for o in page["Contents"]]
        if not page["IsTruncated"]:
            return out, pages
        token = page["NextContinuationToken"]


@pytest.mark.slow
def test_the_direct_listing_lists_what_botocore_lists_odd_keys_and_continuations(
    s3_server, s3_client, bucket
):
    """Keys that need URL-encoding arrive decoded; 1000+ keys take continuation tokens."""
    for key in ODD_KEYS:
        put(s3_client, bucket, key, key.encode())
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: put(s3_client, bucket, f"m/many/{n:05d}", b"x"), range(1003)))
    lister = _local_client(s3_server).direct_bucket(bucket)
    assert lister is not None
    mine, pages = _direct_keys(lister, bucket, "m/")
    assert pages >= 2
    assert mine == _botocore_keys(s3_client, bucket, "m/")
    assert {k for k, _, _ in mine} >= set(ODD_KEYS)


def test_a_pull_with_static_keys_never_creates_a_botocore_client(
    s3_server, s3_client, bucket, tmp_path
):
    """Listing, describing (whole-object GET of a small file, HEAD and the part layout's HEAD
    of a multipart one) and the ranged GETs are all signed without botocore; so is the no-op
    pull after it. The bytes arrive verified."""
    from boto3.s3.transfer import TransferConfig

    big = bytes(range(256)) * (3 * 1024 * 1024 // 256 + 7)  # > SMALL_OBJECT, 2 parts
    put(s3_client, bucket, "m/config.json", b"{}")
    put(s3_client, bucket, "m/w.bin", b"w" * 70_000)
    s3_client.upload_fileobj(
        io.BytesIO(big),
        bucket,
        "m/big.bin",
        Config=TransferConfig(
            multipart_threshold=2 * 1024 * 1024, multipart_chunksize=2 * 1024 * 1024
        ),
    )  # fmt: skip  (no additional checksum: the multipart ETag needs the part layout)
    first = _local_client(s3_server)
    result = pull_s3(first, f"s3://{bucket}/m", tmp_path / "d")
    assert result.files_downloaded == 3 and result.files_verified == 3
    assert (tmp_path / "d" / "big.bin").read_bytes() == big
    assert not first.created
    again = _local_client(s3_server)
    result = pull_s3(again, f"s3://{bucket}/m", tmp_path / "d")
    assert result.up_to_date and result.files == 3
    assert not again.created


def test_a_key_with_a_dot_segment_is_read_through_botocore(s3_server, s3_client, bucket, tmp_path):
    """URL parsing would drop a "." segment from the path the direct request signed: such a
    key stays on botocore, which sends it as it is."""
    assert not sends_as_signed("m/./w.bin") and not sends_as_signed("m/../w.bin")
    assert sends_as_signed("m/.hidden/w..bin") and sends_as_signed("m//w.bin")
    client = _local_client(s3_server)
    spec = ModelSpec(source=parse_source_uri(f"s3://{bucket}/m"))
    source = S3Source(client, spec.source)
    put(s3_client, bucket, "m/w.bin", b"w" * 70_000)
    source.resolve(spec)  # sets up the direct object path
    dotted = source._objects_for("m/./w.bin")
    assert isinstance(dotted, BotocoreObjects)
    assert isinstance(source._objects_for("m/w.bin"), S3Bucket)


def test_a_pull_after_a_direct_listing_reads_objects_on_the_seam(
    s3_server, s3_client, bucket, tmp_path
):
    """The listing says where the objects are: describe and the GETs sign there themselves."""
    put(s3_client, bucket, "m/w.bin", b"w" * 70_000)
    client = _local_client(s3_server)
    spec = ModelSpec(source=parse_source_uri(f"s3://{bucket}/m"))
    source = S3Source(client, spec.source)
    snapshot = source.resolve(spec)
    seen: list[str] = []
    client.client().meta.events.register("before-send.s3", lambda **kw: seen.append("botocore"))
    described = source.describe(snapshot.files[0])
    assert described.described and seen == []


def test_a_missing_bucket_and_a_wrong_secret_are_the_errors_botocore_gives(s3_server, tmp_path):
    spec = ModelSpec(source=parse_source_uri("s3://no-such-bucket-here/m"))
    with pytest.raises(BucketNotFoundError):
        S3Source(_local_client(s3_server), spec.source).resolve(spec)
    wrong = lazy_s3_client(
        endpoint_url=s3_server.endpoint, access_key=s3_server.access_key, secret_key="wrong",
        region="us-east-1",
    )  # fmt: skip
    spec = ModelSpec(source=parse_source_uri("s3://any-bucket/m"))
    with pytest.raises(AccessDeniedError):
        S3Source(wrong, spec.source).resolve(spec)
    assert not wrong.created


def test_a_no_op_s3_pull_on_the_command_line_imports_no_botocore(
    s3_client, bucket, s3_env, tmp_path
):
    put(s3_client, bucket, "m/config.json", b"{}")
    put(s3_client, bucket, "m/w.bin", b"w" * 70_000)
    args = ["pull", f"s3://{bucket}/m", str(tmp_path / "d"), "--json"]
    run = [sys.executable, "-c", _RUN_AND_LIST_BOTOCORE, *args]
    first = subprocess.run(run, env=s3_env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert first.returncode == 0, first.stderr
    again = subprocess.run(run, env=s3_env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert again.returncode == 0, again.stderr
    assert '"bytes_downloaded": 0' in again.stdout
    assert again.stderr.strip().splitlines()[-1] == "heavy modules: []"


_RUN_AND_LIST_BOTOCORE = """
import sys
from prefetch.cli import main
try:
    main(sys.argv[1:], prog_name="prefetch")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
heavy = ("boto3", "botocore", "awscrt")
print(f"heavy modules: {sorted(m for m in heavy if m in sys.modules)}", file=sys.stderr)
sys.exit(code)
"""


# -- the region redirect ---------------------------------------------------------------------

_EMPTY_LISTING = (
    b'<?xml version="1.0" encoding="UTF-8"?>'
    b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
    b"<Name>bkt</Name><EncodingType>url</EncodingType><IsTruncated>false</IsTruncated>"
    b"<Contents><Key>m/a%20b</Key><Size>3</Size><ETag>&quot;abc&quot;</ETag></Contents>"
    b"</ListBucketResult>"
)


class _RegionalBucket(http.server.BaseHTTPRequestHandler):
    """A bucket in eu-west-1: a request signed for any other region is answered as S3 does."""

    scopes: list[str] = []
    status = 301

    def do_GET(self) -> None:
        scope = re.search(r"Credential=[^/]+/\d{8}/([^/]+)/", self.headers["Authorization"] or "")
        region = scope.group(1) if scope else ""
        type(self).scopes.append(region)
        if region != "eu-west-1":
            body = b"<Error><Code>PermanentRedirect</Code><Message>moved</Message></Error>"
            self.send_response(self.status)
            self.send_header("x-amz-bucket-region", "eu-west-1")
        else:
            body = _EMPTY_LISTING
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def regional_bucket() -> Iterator[tuple[str, type[_RegionalBucket]]]:
    handler = type("Handler", (_RegionalBucket,), {"scopes": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("status", [301, 400])
def test_a_bucket_in_another_region_is_listed_again_signed_for_its_region(regional_bucket, status):
    endpoint, handler = regional_bucket
    handler.status = status
    client = lazy_s3_client(
        endpoint_url=endpoint, access_key="a", secret_key="b", region="us-east-1"
    )
    lister = client.direct_bucket("bkt")
    assert lister is not None
    page = lister.list_objects_v2(Bucket="bkt", Prefix="m/")
    assert [o["Key"] for o in page["Contents"]] == ["m/a b"]
    assert page["Contents"][0]["ETag"] == '"abc"'
    lister.list_objects_v2(Bucket="bkt", Prefix="m/")  # the region is remembered
    assert handler.scopes == ["us-east-1", "eu-west-1", "eu-west-1"]
    assert not client.created


def test_a_truncated_page_without_a_continuation_token_is_refused_not_listed_forever():
    page = _EMPTY_LISTING.replace(b"<IsTruncated>false", b"<IsTruncated>true")
    with pytest.raises(ValueError, match="continuation token"):
        parse_list_page(page)
    assert parse_list_page(_EMPTY_LISTING)["Contents"][0]["Key"] == "m/a b"


# -- when botocore must list -----------------------------------------------------------------

_ENV = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b", "AWS_CONFIG_FILE": "/nonexistent"}


@pytest.mark.parametrize(
    ("bucket", "endpoint", "extra"),
    [
        ("arn:aws:s3:us-east-1:123456789012:accesspoint/ap", None, {}),
        ("bucket--use1-az4--x-s3", None, {}),
        ("bkt", None, {"AWS_USE_FIPS_ENDPOINT": "true"}),
        ("bkt", None, {"AWS_PROFILE": "not-in-the-config-file"}),
        ("bkt", None, {"AWS_ACCESS_KEY_ID": ""}),
    ],
)
def test_settings_the_direct_listing_cannot_reproduce_leave_it_to_botocore(bucket, endpoint, extra):
    env = {**_ENV, **extra}
    assert direct_settings(bucket, endpoint_url=endpoint, region=None, environ=env) is None


def test_the_region_comes_from_the_config_files_profile_as_botocore_reads_it(tmp_path):
    config = tmp_path / "config"
    config.write_text("[default]\nregion = us-west-2\n[profile other]\nregion = ap-south-1\n")
    env = {**_ENV, "AWS_CONFIG_FILE": str(config)}
    found = direct_settings("bkt", endpoint_url=None, region=None, environ=env)
    assert found is not None and found.region == "us-west-2"
    env["AWS_PROFILE"] = "other"
    found = direct_settings("bkt", endpoint_url=None, region=None, environ=env)
    assert found is not None and found.region == "ap-south-1"
    env["AWS_DEFAULT_REGION"] = "eu-central-1"
    found = direct_settings("bkt", endpoint_url=None, region=None, environ=env)
    assert found is not None and found.region == "eu-central-1"
    config.write_text("[default]\ns3 =\n    addressing_style = virtual\n")
    env = {**_ENV, "AWS_CONFIG_FILE": str(config)}
    assert direct_settings("bkt", endpoint_url=None, region=None, environ=env) is None


def test_a_client_with_a_profile_lists_through_botocore(s3_server, s3_client, bucket, monkeypatch):
    put(s3_client, bucket, "m/config.json", b"{}")
    client = _local_client(s3_server)
    client.settings["profile"] = "p"
    assert client.direct_bucket(bucket) is None


# -- the mirror source's blob reads ----------------------------------------------------------


@pytest.mark.parametrize("client_kind", ["botocore", "static keys"])
def test_a_pull_through_a_mirror_reads_everything_but_a_listing_on_the_seam(
    s3_server, s3_client, bucket, tmp_path, client_kind, test_ca
):
    """The mirror source lists nothing of the model, yet its ref, commit metadata, blob HEADs
    and GETs skip botocore: with a botocore client only a listing goes through it (to learn
    where and how to sign), and with the static keys no botocore client is even created."""
    import urllib3

    from prefetch.pipeline.layout.hf import HfCacheLayout
    from prefetch.pipeline.sync import sync
    from prefetch.sources import SourceSettings, open_source
    from prefetch.sources.hf.source import HubOptions

    from .fakes.hubserver import HubServer
    from .support import FAST, HUB_REPO, write_mirror

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes(b'{"a": 1}')
    (model / "w.safetensors").write_bytes(b"w" * 200_000)
    with HubServer(test_ca) as hub:
        hub.add_commit(HUB_REPO, model)
        write_mirror(s3_client, bucket, "hf/acme/tiny/", hub)
        through_botocore: list[str] = []
        s3_client.meta.events.register(
            "before-send.s3", lambda request, **_: through_botocore.append(request.url)
        )
        client = s3_client if client_kind == "botocore" else _local_client(s3_server)
        spec = ModelSpec(
            source=parse_source_uri(f"hf://{HUB_REPO}"),
            mirrors=(parse_source_uri(f"s3://{bucket}/hf/acme/tiny/"),),
        )
        pool = urllib3.PoolManager(maxsize=4, retries=False)
        options = HubOptions(endpoint=hub.endpoint, token=False, http=pool, retry=FAST.retry)
        source = open_source(spec, SourceSettings(s3_client=client, hub=options))
        result = sync(spec, source, HfCacheLayout(tmp_path / "cache", HUB_REPO), FAST)
    assert result.files_downloaded == 2 and result.served_by.startswith("s3://")
    if client_kind == "botocore":
        assert through_botocore and all("list-type=2" in u for u in through_botocore)
    else:
        assert not through_botocore and not client.created


@pytest.mark.parametrize("token", [None, "FQoGZXIvYXdzEXAMPLETOKEN"])
def test_the_two_signers_sign_an_object_request_alike(monkeypatch, token):
    """One signer interface, two implementations: static keys (signed here) and botocore's
    credential chain (its request signer's frozen credentials, botocore's S3SigV4Auth) give the
    same headers for the same request."""
    import botocore.auth
    from botocore.credentials import Credentials

    from prefetch.sources.s3.direct import StaticKeySigner
    from prefetch.sources.s3.sdk import BotocoreSigner

    class _RequestSigner:  # botocore's RequestSigner.get_auth_instance, as the client's gives it
        def get_auth_instance(self, signing_name, region_name, signature_version=None, **_):
            assert signature_version == "s3v4"
            creds = Credentials(KEYS.access_key, KEYS.secret_key, token)
            return botocore.auth.S3SigV4Auth(creds, signing_name, region_name)

    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: WHEN.replace(tzinfo=None))
    url = "http://127.0.0.1:8333/bkt/m/sub%20dir/w%2Bv2.bin?partNumber=2"
    headers = {"Range": "bytes=0-1048575", "If-Match": "0123abcd", "x-amz-checksum-mode": "ENABLED"}
    static = StaticKeySigner(
        StaticCredentials(KEYS.access_key, KEYS.secret_key, token), clock=lambda: WHEN
    ).sign("GET", url, "eu-west-1", headers)
    chained = BotocoreSigner(_RequestSigner()).sign("GET", url, "eu-west-1", headers)
    chained.pop("host", None)  # http.client sends it; the static signer does not return it
    assert static == chained


def test_the_static_signer_derives_its_signing_key_once_a_day_and_signs_as_without_it() -> None:
    """Issue 33: the SigV4 signing key (four HMACs) is derived once per day and region, not per
    request; every signature equals the uncached one's, also across a day change, and only
    the current day's key is kept."""
    from prefetch.sources.s3.direct import StaticKeySigner

    creds = StaticCredentials(KEYS.access_key, KEYS.secret_key, None)
    when = [WHEN]
    signer = StaticKeySigner(creds, clock=lambda: when[0])
    url = "http://127.0.0.1:8333/bkt/m/a.bin"
    headers = {"Range": "bytes=0-9"}
    derived: list[tuple[str, str]] = []
    real = s3_direct.signing_key

    def counting(secret: str, day: str, region: str) -> bytes:
        derived.append((day, region))
        return real(secret, day, region)

    day2 = WHEN + datetime.timedelta(days=1)
    expected = [
        sign_v4("GET", url, creds, "eu-west-1", now=t, headers=headers) for t in (WHEN, day2)
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(s3_direct, "signing_key", counting)
        got = [signer.sign("GET", url, "eu-west-1", headers) for _ in range(3)]
        when[0] = day2
        got.append(signer.sign("GET", url, "eu-west-1", headers))
    assert got == [expected[0]] * 3 + [expected[1]]
    assert [d for d, _ in derived] == [WHEN.strftime("%Y%m%d"), day2.strftime("%Y%m%d")]
    assert list(signer.keys) == [(KEYS.secret_key, when[0].strftime("%Y%m%d"), "eu-west-1")]
