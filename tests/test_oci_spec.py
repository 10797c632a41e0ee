"""oci:// URIs and the rules of an oci:// model (the CLI and the agent's config)."""

from __future__ import annotations

import pytest

from prefetch.agent.config import parse_config
from prefetch.pipeline.spec import ModelSpec, SpecError, parse_source_uri
from prefetch.support.errors import ConfigError

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("uri", "location", "repo", "ref"),
    [
        ("oci://ghcr.io/org/model:v1", "ghcr.io", "org/model", "v1"),
        (f"oci://127.0.0.1:5000/a/b/c@{DIGEST}", "127.0.0.1:5000", "a/b/c", DIGEST),
        ("oci://registry.local/m", "registry.local", "m", None),
        ("oci://localhost:30020", "localhost:30020", "", None),  # a mirror: the host alone
    ],
)  # fmt: skip
def test_oci_uris(uri, location, repo, ref):
    parsed = parse_source_uri(uri)
    assert (parsed.scheme, parsed.location, parsed.path, parsed.revision) == (
        "oci", location, repo, ref,
    )  # fmt: skip
    assert parse_source_uri(str(parsed)) == parsed


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("oci://reg/Upper", "not a repository name"),
        ("oci://reg/m@sha256:abc", "not a sha256:<64 hex> digest"),
        ("oci://reg/m@md5:" + "a" * 32, "not a sha256"),
        ("oci://reg/m:bad tag", "not a valid tag"),
        ("oci:///m", "not a registry host"),
        ("oci://reg/../m", "not a repository name"),
    ],
)  # fmt: skip
def test_malformed_oci_uris_are_refused_naming_why(uri, message):
    with pytest.raises(ConfigError, match=message):
        parse_source_uri(uri)


def test_a_tag_defaults_to_latest_and_is_the_revision():
    spec = ModelSpec(source=parse_source_uri("oci://reg/org/llama"))
    assert spec.revision == "latest" and str(spec.source) == "oci://reg/org/llama:latest"
    assert spec.name == "llama" and spec.repo_id is None
    pinned = ModelSpec(source=parse_source_uri("oci://reg/org/llama"), revision=DIGEST)
    assert str(pinned.source) == f"oci://reg/org/llama@{DIGEST}"
    with pytest.raises(SpecError, match="conflicts"):
        ModelSpec(source=parse_source_uri("oci://reg/org/llama:v1"), revision="v2")
    with pytest.raises(SpecError, match="names no repository"):
        ModelSpec(source=parse_source_uri("oci://reg:5000"))


def test_mirrors_of_an_oci_model_are_registries():
    mirror = parse_source_uri("oci://127.0.0.1:30020")
    spec = ModelSpec(source=parse_source_uri("oci://ghcr.io/org/m:v1"), mirrors=(mirror,))
    assert spec.source_kind("oci://127.0.0.1:30020/org/m@" + DIGEST) == "mirror"
    assert spec.source_kind("oci://ghcr.io/org/m@" + DIGEST) == "oci"
    with pytest.raises(SpecError, match="not an oci:// URI"):
        ModelSpec(source=spec.source, mirrors=(parse_source_uri("s3://bucket/p/"),))
    with pytest.raises(SpecError, match="names no tag or digest"):
        ModelSpec(source=spec.source, mirrors=(parse_source_uri("oci://m:1/org/m:v1"),))


def test_the_agent_config_takes_an_oci_model_with_mirrors(tmp_path):
    config = parse_config(
        f"cacheDir: {tmp_path}\n"
        "models:\n"
        "  - name: llama\n"
        "    source: oci://ghcr.io/org/llama:v1\n"
        "    hfRepo: org/llama\n"
        "    mirrors: [oci://127.0.0.1:30020]\n"
    )
    (model,) = config.models
    assert model.source.scheme == "oci" and model.repo_id == "org/llama"
    assert [str(m) for m in model.mirrors] == ["oci://127.0.0.1:30020"]


def test_a_registry_host_may_name_an_env_var(monkeypatch):
    monkeypatch.setenv("NODE_IP", "10.0.3.7")
    assert parse_source_uri("oci://${NODE_IP}:30020").location == "10.0.3.7:30020"
    monkeypatch.delenv("NODE_IP")
    with pytest.raises(ConfigError, match=r"\$\{NODE_IP\} is not set"):
        parse_source_uri("oci://${NODE_IP}:30020")


def test_a_hostile_manifest_document_is_one_error():
    from prefetch.sources.oci.manifest import parse_document
    from prefetch.support.errors import InvalidListingError

    with pytest.raises(InvalidListingError, match="nested"):
        parse_document(b"[" * 10_000, "reg/m@sha256:x")
    with pytest.raises(InvalidListingError, match="more than"):
        parse_document(b" " * (5 << 20), "reg/m@sha256:x")
    with pytest.raises(InvalidListingError, match="not a JSON object"):
        parse_document(b"[1]", "reg/m@sha256:x")


def test_registry_addresses(monkeypatch):
    from prefetch.sources.oci.source import registry_base

    monkeypatch.delenv("PREFETCH_OCI_PLAIN_HTTP", raising=False)
    assert registry_base("ghcr.io") == "https://ghcr.io"
    assert registry_base("127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert registry_base("localhost:5000") == "http://localhost:5000"
    assert registry_base("[::1]:5000") == "http://[::1]:5000"
    assert registry_base("docker.io") == "https://registry-1.docker.io"
    assert registry_base("10.0.3.7:30020") == "https://10.0.3.7:30020"
    monkeypatch.setenv("PREFETCH_OCI_PLAIN_HTTP", "10.0.3.7:30020, mirror.local")
    assert registry_base("10.0.3.7:30020") == "http://10.0.3.7:30020"
    assert registry_base("mirror.local:5000") == "http://mirror.local:5000"


def test_an_ipv6_node_ip_is_a_registry_host_in_brackets(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/mirrors.md's Spegel recipe on an IPv6 cluster (status.hostIP is a bare IPv6
    address). Before: 'fd00::1:30020' is not a registry host, and every agent exited 1; and
    the mirror was spoken to over TLS, PREFETCH_OCI_PLAIN_HTTP=$(NODE_IP):30020 not matching."""
    from prefetch.sources.oci.source import registry_base

    monkeypatch.setenv("NODE_IP", "fd00::1")
    mirror = parse_source_uri("oci://${NODE_IP}:30020")
    assert mirror.location == "[fd00::1]:30020"
    monkeypatch.setenv("PREFETCH_OCI_PLAIN_HTTP", "fd00::1:30020, registry.internal:5000")
    assert registry_base(mirror.location) == "http://[fd00::1]:30020"
    assert registry_base("registry.internal:5000") == "http://registry.internal:5000"
    assert registry_base("[fd00::2]:30020") == "https://[fd00::2]:30020"
    monkeypatch.setenv("NODE_IP", "10.0.3.7")  # IPv4 as before
    assert parse_source_uri("oci://${NODE_IP}:30020").location == "10.0.3.7:30020"
