"""``az://`` URIs and the portal's ``https://<account>.blob.core.windows.net`` form: what the
Azure backend claims, how it reads them, and that a SAS on the query is never rendered."""

from __future__ import annotations

import pytest

from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.sources.azure.auth import (
    Anonymous,
    EntraToken,
    Sas,
    SharedKey,
    account_for,
    connection_string,
)
from prefetch.support.errors import ConfigError

SAS = "sv=2021-12-02&sr=c&sp=rl&se=2030-01-01T00%3A00%3A00Z&sig=S3cr3tS1gnature%3D"


@pytest.mark.parametrize(
    ("text", "location", "path"),
    [
        ("az://acct1/models/llama", "acct1", "models/llama/"),
        ("az://acct1/models/llama/", "acct1", "models/llama/"),
        ("az://acct1/models", "acct1", "models/"),
        ("https://acct1.blob.core.windows.net/models/llama", "acct1", "models/llama/"),
        ("https://acct1.blob.core.windows.net/models/a/b/", "acct1", "models/a/b/"),
        ("az://acct1/$root/x", "acct1", "$root/x/"),
    ],
)
def test_both_forms_parse_to_one_uri(text: str, location: str, path: str) -> None:
    uri = parse_source_uri(text)
    assert (uri.scheme, uri.location, uri.path) == ("az", location, path)
    assert parse_source_uri(str(uri)) == uri


@pytest.mark.parametrize(
    "text",
    [
        "https://example.com/models/llama",
        "https://acct1.blob.core.windows.net.evil.example/models/x",
        "https://acct1.dfs.core.windows.net/models/x",
        "https://127.0.0.1:10000/devstoreaccount1/models/x",
    ],
)
def test_other_https_uris_stay_unsupported(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^unsupported source URI .*expected s3://"):
        parse_source_uri(text)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("az://AB/models/x", "not a storage account name"),
        ("az://acct1/", "no container"),
        ("az://acct1/Models/x", "'Models' is not a container name"),
        ("az://acct1/a--b/x", "'a--b' is not a container name"),
        ("https://acct1.blob.core.windows.net:8443/models/x", "malformed Azure Blob URL"),
    ],
)
def test_malformed_uris_say_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        parse_source_uri(text)


def test_a_sas_on_the_query_is_kept_but_never_rendered_or_repr_d() -> None:
    uri = parse_source_uri(f"https://acct1.blob.core.windows.net/models/x?{SAS}")
    assert uri.secret == SAS
    spec = ModelSpec(source=uri)
    for shown in (str(uri), repr(uri), repr(spec), spec.name):
        assert "S3cr3t" not in shown
    with pytest.raises(ConfigError) as err:
        parse_source_uri(f"az://acct1/Bad/x?{SAS}")
    assert "S3cr3t" not in str(err.value)


def test_credentials_are_chosen_in_order() -> None:
    key = "a2V5"
    env = {"AZURE_STORAGE_KEY": key, "AZURE_STORAGE_SAS_TOKEN": "sv=1&sig=x"}
    assert isinstance(account_for("acct1", SAS, env).credential, Sas)  # the URI's first
    assert isinstance(account_for("acct1", "", env).credential, Sas)
    assert isinstance(account_for("acct1", "", {"AZURE_STORAGE_KEY": key}).credential, SharedKey)
    assert isinstance(account_for("acct1", "", {"entra": "1"}).credential, EntraToken)
    login = {"AZURE_STORAGE_KEY": key, "AZURE_STORAGE_AUTH_MODE": "login"}
    assert isinstance(account_for("acct1", "", login).credential, EntraToken)
    assert isinstance(account_for("acct1", "", {}).credential, Anonymous)
    conn = "AccountName=other;AccountKey=a2V5;BlobEndpoint=https://x.test/other"
    other = account_for("acct1", "", {"AZURE_STORAGE_CONNECTION_STRING": conn})
    assert isinstance(other.credential, Anonymous)  # another account's string is not used
    assert other.endpoint == "https://acct1.blob.core.windows.net"


def test_the_endpoint_override_takes_the_account_name() -> None:
    env = {"AZURE_STORAGE_BLOB_ENDPOINT": "https://127.0.0.1:10000/{account}/"}
    assert account_for("acct1", "", env).endpoint == "https://127.0.0.1:10000/acct1"
    sovereign = {"AZURE_STORAGE_BLOB_ENDPOINT": "https://acct1.blob.core.chinacloudapi.cn"}
    assert account_for("acct1", "", sovereign).endpoint == sovereign["AZURE_STORAGE_BLOB_ENDPOINT"]


def test_a_connection_string_keeps_the_base64_padding() -> None:
    assert (
        connection_string("AccountName=a;AccountKey=ab==; BlobEndpoint=https://h/a")["AccountKey"]
        == "ab=="
    )


def test_entra_without_azure_identity_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "azure.identity", None)  # as if it were not installed
    token = EntraToken()
    with pytest.raises(ConfigError) as err:
        token.authorize("GET", "https://acct1.blob.core.windows.net/c", {})
    assert "azure-identity" in str(err.value) and "model-prefetch[azure]" in str(err.value.hint)
