"""Unit tests: sizes, URIs and specs, chunk plans, paths, deadlines (checksum math is in
test_verify.py, the resume journal in test_journal.py)."""

from __future__ import annotations

import itertools

import pytest

from prefetch.pipeline.engine.plan import plan_chunks
from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout import safe_join
from prefetch.pipeline.snapshot import listing_digest
from prefetch.pipeline.spec import ModelSpec, default_model_name, parse_source_uri
from prefetch.support.errors import (
    ConfigError,
    LayoutError,
)
from prefetch.support.units import format_bytes, parse_duration, parse_size

MiB = 1024 * 1024


def test_sizes_and_durations():
    assert parse_size("16MiB") == 16 * MiB
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size(4096) == 4096
    with pytest.raises(ConfigError, match="not a size"):
        parse_size("lots")
    assert parse_duration("1h30m") == 5400
    assert parse_duration("0") is None and parse_duration("off") is None
    with pytest.raises(ConfigError, match="not a duration"):
        parse_duration("soon")
    assert format_bytes(3 * MiB) == "3.0 MiB"


@pytest.mark.parametrize(
    ("uri", "scheme", "location", "path", "revision"),
    [
        ("s3://bucket/some/prefix", "s3", "bucket", "some/prefix/", None),
        ("s3://bucket", "s3", "bucket", "", None),
        ("hf://org/name", "hf", "org/name", "", None),
        ("hf://org/name@v1.0", "hf", "org/name", "", "v1.0"),
        ("hf://gpt2", "hf", "gpt2", "", None),
    ],
)
def test_parse_source_uri(uri, scheme, location, path, revision):
    parsed = parse_source_uri(uri)
    assert (parsed.scheme, parsed.location, parsed.path, parsed.revision) == (
        scheme, location, path, revision,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3:/x", "no bucket"),
        ("s3://UPPER/x", "not a valid bucket name"),
        ("ftp://b/x", "unsupported source URI"),
        ("hf://", "malformed Hub URI"),
        ("hf://org/name@", "empty revision"),
        ("/just/a/path", "unsupported source URI"),
    ],
)
def test_bad_uris_are_named(uri, message):
    with pytest.raises(ConfigError, match=message):
        parse_source_uri(uri)


def test_model_spec_names_and_patterns():
    spec = ModelSpec(source=parse_source_uri("hf://Org/Llama_3.1-70B@main"))
    assert (
        spec.name == "llama-3-1-70b"
        and spec.revision == "main"
        and spec.repo_id == "Org/Llama_3.1-70B"
    )
    assert default_model_name(parse_source_uri("s3://bkt/models/Qwen2/")) == "qwen2"
    with pytest.raises(ConfigError, match="not a DNS label"):
        ModelSpec(source=parse_source_uri("s3://bkt/x"), name="Bad_Name")
    with pytest.raises(ConfigError, match="hf_repo"):
        ModelSpec(source=parse_source_uri("s3://bkt/x"), hf_repo="no-slash")
    spec = ModelSpec(source=parse_source_uri("s3://bkt/x"), include=("*.json", "sub/*.bin"),
                     exclude=("secret*",))  # fmt: skip
    assert spec.wants("config.json") and spec.wants("deep/config.json")
    assert spec.wants("sub/a.bin") and not spec.wants("other/a.bin")
    assert not spec.wants("secret.json")


def test_listing_digest_is_order_independent_and_content_sensitive():
    a = [("a", 1, "e1"), ("b", 2, "e2")]
    assert listing_digest(a) == listing_digest(list(reversed(a)))
    assert listing_digest(a) != listing_digest([("a", 1, "e1"), ("b", 2, "e3")])


def test_plan_chunks_covers_the_file_exactly():
    for size in (0, 1, MiB - 1, MiB, MiB + 1, 10 * MiB + 3):
        chunks = plan_chunks(size, MiB, None)
        assert sum(e - s for s, e in chunks) == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))


def test_transfer_config_is_validated():
    with pytest.raises(ConfigError, match="concurrency"):
        TransferConfig(concurrency=0)
    with pytest.raises(ConfigError, match="chunk size"):
        TransferConfig(chunk_size=10)


@pytest.mark.parametrize("bad", ["../etc/passwd", "/abs", "a/../../b", "a//b", "", "./a"])
def test_layout_refuses_paths_that_escape(tmp_path, bad):
    with pytest.raises(LayoutError, match="unsafe"):
        safe_join(tmp_path, bad)
    assert safe_join(tmp_path, "a/b.json") == tmp_path / "a" / "b.json"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("stallTimeout: .nan", "stallTimeout"),
        ("syncDeadline: .nan", "syncDeadline"),
        ("verifyInterval: .NaN", "verifyInterval"),
        ("retryBackoff: {initial: .nan}", "retryBackoff.initial"),
        ("models: [{name: a, source: 'hf://o/x', syncDeadline: .nan}]", "models[0].syncDeadline"),
    ],
)
def test_a_nan_duration_is_refused_naming_its_key(text: str, key: str) -> None:
    """Before: YAML's .nan passed the "must not be negative" check (every comparison with NaN
    is false) and the agent ran with a stall window or deadline of NaN seconds."""
    from prefetch.agent.config import parse_config

    with pytest.raises(ConfigError, match=r"not a duration: nan") as caught:
        parse_config(text + "\n")
    assert str(caught.value).startswith(f"{key}: "), str(caught.value)
