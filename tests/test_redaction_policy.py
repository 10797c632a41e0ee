"""Issue 29 item 11: redaction by query-parameter policy, not by a list of vendors: every value
of a URL's query is masked unless its parameter is known to be public, and OAuth2 tokens and a
docker config's ``auth`` are secrets wherever they appear."""

from __future__ import annotations

import logging

import pytest

from prefetch.support.redact import RedactingFilter, redact

AZURE_SAS = (
    "https://acct.blob.core.windows.net/registry/docker/blobs/data?sv=2021-08-06"
    "&se=2026-12-05T00%3A00%3A00Z&sr=b&sp=r&sig=AzUrESiGnAtUrE%2Bsecret%3D"
)
CLOUDFLARE = (
    "https://production.cloudflare.docker.com/registry-v2/docker/registry/v2/blobs/sha256/ab/"
    "abcd/data?verify=1733356800-CfVeRiFySeCrEt"
)


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        (AZURE_SAS, "AzUrESiGnAtUrE"),
        (CLOUDFLARE, "CfVeRiFySeCrEt"),
        ("https://cdn.example/x?X-Goog-Signature=GoOgSiG&other=1", "GoOgSiG"),
        ("grant_type=refresh_token&refresh_token=ReFrEsHtOkEn&service=r", "ReFrEsHtOkEn"),
        ('{"access_token": "AcCeSsToKeN", "expires_in": 300}', "AcCeSsToKeN"),
        ("{'identitytoken': 'IdEnTiTyToKeN'}", "IdEnTiTyToKeN"),
        ('{"auths": {"r.example": {"auth": "dXNlcjpTZUNyRXQ="}}}', "dXNlcjpTZUNyRXQ="),
        ("POST /token?access_token=QuErYToKeN HTTP/1.1", "QuErYToKeN"),
    ],
)
def test_secrets_of_any_vendor_are_masked(text: str, secret: str) -> None:
    clean = redact(text)
    assert secret not in clean
    assert "***" in clean


def test_public_query_parameters_are_kept() -> None:
    kept = [
        "https://mirror.example/v2/models/m/manifests/v1?ns=registry.example",
        "https://hub.example/api/models/o/m/tree/abc?recursive=true&expand=false",
        "https://s3.example/bucket?list-type=2&prefix=models%2Fm%2F&max-keys=1000",
    ]
    assert [redact(url) for url in kept] == kept
    assert redact(AZURE_SAS).startswith(
        "https://acct.blob.core.windows.net/registry/docker/blobs/data?sv=2021-08-06&se=***"
    )


def test_a_urllib3_debug_line_of_a_blob_redirect_is_redacted() -> None:
    """What ``-vv`` prints for an ACR blob redirect followed to Azure storage."""
    record = logging.LogRecord(
        "urllib3.connectionpool", logging.DEBUG, __file__, 1, '%s://%s:%s "%s %s %s" %s %s',
        ("https", "acct.blob.core.windows.net", 443, "GET", AZURE_SAS.split(".net", 1)[1],
         "HTTP/1.1", 206, 1024),
        None,
    )  # fmt: skip
    RedactingFilter().filter(record)
    assert "AzUrESiGnAtUrE" not in record.getMessage()
    assert "sig=***" in record.getMessage()
