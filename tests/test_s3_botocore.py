"""The S3 source's object requests with botocore's credential chain (sources/s3_botocore.py:
botocore's public signer on the transport seam): signed like botocore signs, addressed where
botocore addresses, credentials as fresh as botocore's, errors the same."""

from __future__ import annotations

import datetime
import os
from typing import Any

import boto3
import botocore.session
import pytest
from botocore.awsrequest import AWSResponse
from botocore.config import Config
from botocore.credentials import CredentialProvider, RefreshableCredentials

from prefetch.demo.locals3 import REGION
from prefetch.pipeline.snapshot import RemoteFile
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.sources.s3.sdk import capture_listing_requests, endpoint_of_listing
from prefetch.sources.s3.source import S3Source
from prefetch.support.errors import AccessDeniedError, SourceChangedError

from .support import pull_s3 as pull
from .support import put

MiB = 1024 * 1024


class _CannedBody:
    def stream(self, **_: Any):  # type: ignore[no-untyped-def]
        yield b""


def _answer_without_network(request: Any, **_: Any) -> AWSResponse:
    """botocore ``before-send`` hook: a canned empty answer, so nothing leaves the machine."""
    body = b"<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>"
    resp = AWSResponse(request.url, 200, {"Content-Type": "application/xml"}, _CannedBody())
    resp._content = body  # type: ignore[attr-defined]
    return resp


def _botocore_urls(region: str, key: str, **client_kwargs: Any) -> tuple[Any, str]:
    """The listing request botocore signs for bucket ``bkt`` and the URL botocore itself uses
    for GetObject of ``key``, both prepared by a client built with ``client_kwargs`` and
    answered by :func:`_answer_without_network`."""
    client = boto3.session.Session().client(
        "s3",
        region_name=region,
        aws_access_key_id="AKIDEXAMPLE",
        aws_secret_access_key="secret",
        **client_kwargs,
    )
    sent: list[Any] = []

    def keep(request: Any, **kwargs: Any) -> AWSResponse:
        sent.append(request)
        return _answer_without_network(request, **kwargs)

    client.meta.events.register("before-send.s3.GetObject", keep)
    client.meta.events.register("before-send.s3.ListObjectsV2", _answer_without_network)
    with capture_listing_requests(client) as listings:
        client.list_objects_v2(Bucket="bkt", Prefix="m/")
    client.get_object(Bucket="bkt", Key=key)
    return listings.requests[-1], sent[-1].url


@pytest.mark.parametrize(
    "client_kwargs",
    [
        {},  # AWS, virtual-hosted
        {"config": Config(s3={"addressing_style": "path"})},
        {"endpoint_url": "http://127.0.0.1:9/some/base"},  # a custom endpoint with a path
        {
            "endpoint_url": "https://storage.example.internal",
            "config": Config(s3={"addressing_style": "virtual"}),
        },
    ],
    ids=["aws-virtual", "aws-path", "custom-path", "custom-virtual"],
)
def test_object_urls_are_the_ones_botocore_builds(client_kwargs):
    key = "m/sub dir/weights+v2~(1).safetensors"
    listing, botocore_url = _botocore_urls("eu-west-3", key, **client_kwargs)
    endpoint = endpoint_of_listing(listing)
    assert endpoint is not None
    assert endpoint.region == "eu-west-3"
    assert endpoint.url_of(key) == botocore_url


def test_requests_botocore_does_not_sign_with_sigv4_for_s3_stay_on_botocore():
    listing, _ = _botocore_urls("us-east-1", "k")
    assert endpoint_of_listing(listing) is not None
    for header, value in [
        ("Authorization", None),  # unsigned
        ("Authorization", "AWS AKIDEXAMPLE:c2lnbmF0dXJl"),  # signature version 2
        (
            "Authorization",
            "AWS4-HMAC-SHA256 Credential=AKID/20260101/us-east-1/s3-outposts/"
            "aws4_request, SignedHeaders=host, Signature=00",
        ),
        ("x-amz-s3session-token", "token"),  # S3 Express session auth
    ]:
        listing.headers.pop(header, None)
        if value is not None:
            listing.headers[header] = value
        assert endpoint_of_listing(listing) is None, (header, value)
        listing, _ = _botocore_urls("us-east-1", "k")


def _object_calls_through_botocore(client: Any) -> list[str]:
    """Names of object operations ``client`` runs through botocore from now on."""
    calls: list[str] = []

    def record(model: Any, **_: Any) -> None:
        calls.append(model.name)

    for op in ("GetObject", "HeadObject"):
        client.meta.events.register(f"provide-client-params.s3.{op}", record)
    return calls


def test_a_pull_sends_only_the_listing_through_botocore(s3_client, bucket, tmp_path):
    """Object HEADs and GETs (small, ranged, part layout) go on the lean path, signed for the
    authenticating local server with path-style addressing; the bytes arrive verified."""
    small, large = os.urandom(10_000), os.urandom(3 * MiB + 1)
    put(s3_client, bucket, "m/small.json", small, ChecksumAlgorithm="SHA256")
    put(s3_client, bucket, "m/large.bin", large, ChecksumAlgorithm="CRC32C")
    calls = _object_calls_through_botocore(s3_client)
    result = pull(s3_client, f"s3://{bucket}/m", tmp_path / "d")
    assert result.files_verified == 2
    assert (tmp_path / "d/small.json").read_bytes() == small
    assert (tmp_path / "d/large.bin").read_bytes() == large
    assert calls == []


class _RotatingProvider(CredentialProvider):
    """Refreshable credentials (as IRSA's web identity provider gives) that always need a
    refresh, whose refresh returns whatever ``self.secret`` is at that moment."""

    METHOD = "test-rotating"

    def __init__(self, access_key: str, secret: str) -> None:
        super().__init__()
        self.access_key, self.secret, self.refreshes = access_key, secret, 0

    def _fresh(self) -> dict[str, Any]:
        self.refreshes += 1
        expiry = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=60)
        return {
            "access_key": self.access_key,
            "secret_key": self.secret,
            "token": None,
            "expiry_time": expiry.isoformat(),
        }

    def load(self) -> RefreshableCredentials:
        return RefreshableCredentials.create_from_metadata(self._fresh(), self._fresh, self.METHOD)


def test_signed_requests_use_credentials_as_refreshed_at_each_request(s3_server, s3_client, bucket):
    data = os.urandom(5000)
    put(s3_client, bucket, "m/a.bin", data)
    provider = _RotatingProvider(s3_server.access_key, s3_server.secret_key)
    session = botocore.session.get_session()
    session.get_component("credential_provider").insert_before("env", provider)
    client = boto3.session.Session(botocore_session=session).client(
        "s3", endpoint_url=s3_server.endpoint, region_name=REGION
    )
    calls = _object_calls_through_botocore(client)
    spec = ModelSpec(source=parse_source_uri(f"s3://{bucket}/m"))
    source = S3Source(client, spec.source)
    (listed,) = source.resolve(spec).files
    before = provider.refreshes
    provider.secret = "revoked"  # the role's credentials rotate to ones the server refuses
    with pytest.raises(AccessDeniedError):
        source.describe(listed)
    provider.secret = s3_server.secret_key
    described = source.describe(listed)
    assert described.described and provider.refreshes >= before + 2
    reader = source.open_range(described, 0, len(data))
    buf = bytearray(len(data))
    assert reader.readinto(memoryview(buf)) == len(data) and bytes(buf) == data
    reader.close()
    assert calls == []


def test_describe_before_any_listing_uses_botocore(s3_client, bucket):
    """Without a listing there is nothing to take the addressing from: botocore does it all."""
    put(s3_client, bucket, "m/a.bin", b"abc")
    calls = _object_calls_through_botocore(s3_client)
    source = S3Source(s3_client, parse_source_uri(f"s3://{bucket}/m"))
    described, body = source.describe_whole(RemoteFile("a.bin", 3, locator="m/a.bin"))
    assert described.described and body == b"abc" and calls == ["GetObject"]
    assert source.describe(RemoteFile("a.bin", 3, locator="m/a.bin")).described
    assert calls == ["GetObject", "HeadObject"]


def test_an_object_deleted_after_the_listing_is_a_changed_source(s3_client, bucket):
    """The lean path's own error table says what botocore's did: 404 after listing = changed."""
    put(s3_client, bucket, "m/small.bin", b"x" * 5000)
    put(s3_client, bucket, "m/large.bin", os.urandom(2 * MiB))
    spec = ModelSpec(source=parse_source_uri(f"s3://{bucket}/m"))
    source = S3Source(s3_client, spec.source)
    listed = {f.path: f for f in source.resolve(spec).files}
    calls = _object_calls_through_botocore(s3_client)
    for key in ("m/small.bin", "m/large.bin"):
        s3_client.delete_object(Bucket=bucket, Key=key)
    for path in ("small.bin", "large.bin"):  # a whole-object GET, then a HEAD
        with pytest.raises(SourceChangedError, match=r"disappeared|changed"):
            source.describe_whole(listed[path])
    assert calls == []
