"""The agent's config file: defaults, the full schema, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefetch.agent.config import load_config, parse_config, spec_digest
from prefetch.agent.config_checks import parse_listen
from prefetch.agent.config_values import AgentConfig, Backoff
from prefetch.support.constants import (
    DEFAULT_LABEL_PREFIX,
    DEFAULT_LISTEN,
    DEFAULT_STARTUP_TAINT_KEY,
)
from prefetch.support.errors import ConfigError

from .tls import TestCA

FULL = """
cacheDir: /var/cache/model-prefetch
labelPrefix: model-prefetch.io
startupTaint: model-prefetch.io/warming
listen: 0.0.0.0:8090
concurrency: 16
chunkSize: 64MiB
parallelModels: 3
verifyInterval: 24h
verifyReadRate: 200MB
resolveInterval: 10m
supersededGrace: 1h
retryBackoff: {initial: 10s, max: 10m}
minFreeSpace: 1GiB
s3: {endpointUrl: null}
models:
  - name: llama-3-70b-awq
    source: hf://org/name
    revision: main
    include: ["*.safetensors", "*.json"]
    exclude: []
    required: true
    pin: false
  - name: mirror
    source: s3://bucket/prefix
    hfRepo: org/mirror
    revision: 0123456789abcdef0123456789abcdef01234567
    required: false
    pin: true
"""


def test_full_example_parses() -> None:
    cfg = parse_config(FULL)
    assert cfg.cache_dir == Path("/var/cache/model-prefetch")
    assert cfg.label_prefix == "model-prefetch.io"
    assert cfg.startup_taint == "model-prefetch.io/warming"
    assert cfg.concurrency == 16
    assert cfg.chunk_size == 64 * 1024 * 1024
    assert cfg.parallel_models == 3
    assert cfg.verify_interval == 24 * 3600
    assert cfg.verify_read_rate == 200_000_000
    assert cfg.resolve_interval == 600
    assert cfg.superseded_grace == 3600
    assert cfg.retry_backoff == Backoff(initial=10, max=600)
    assert cfg.min_free_space == 1024**3
    assert cfg.s3_endpoint_url is None
    hub, mirror = cfg.models
    assert (hub.name, hub.source.scheme, hub.source.location, hub.revision) == (
        "llama-3-70b-awq",
        "hf",
        "org/name",
        "main",
    )
    assert hub.include == ("*.safetensors", "*.json") and hub.required and not hub.pin
    assert mirror.repo_id == "org/mirror"
    assert mirror.hf_revision == "0123456789abcdef0123456789abcdef01234567"
    assert mirror.revision is None and not mirror.required and mirror.pin
    assert cfg.model("mirror") is mirror and cfg.model("nope") is None
    assert cfg.transfer_config().chunk_size == cfg.chunk_size


def test_defaults() -> None:
    cfg = parse_config("models: []")
    assert cfg.label_prefix == DEFAULT_LABEL_PREFIX
    assert cfg.startup_taint == DEFAULT_STARTUP_TAINT_KEY
    assert cfg.listen == DEFAULT_LISTEN
    assert cfg.verify_interval is None  # off by default
    assert cfg.resolve_interval == 600
    assert cfg.min_free_space == 1024**3
    assert cfg.models == ()
    assert parse_config("").models == ()
    assert parse_config("verifyInterval: 0").verify_interval is None
    assert parse_config("verifyReadRate: 0").verify_read_rate is None
    assert cfg.superseded_grace == 600
    assert parse_config("supersededGrace: 0").superseded_grace == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "models:\n  - {name: a, source: s3://bkt/p}\n  - {name: b, source: 'ftp://x'}",
            "models[1].source: unsupported source URI",
        ),
        (
            "models:\n  - {name: a, source: s3://bkt/p}\n  - {name: a, source: s3://bkt/q}",
            "models[1].name: duplicate model name 'a'",
        ),
        ("models:\n  - {name: Bad_Name, source: s3://bkt/p}", "models[0].name: 'Bad_Name'"),
        ("models:\n  - {source: s3://bkt/p}", "models[0].name: missing"),
        ("models:\n  - {name: a}", "models[0].source: missing"),
        (
            "models:\n  - {name: a, source: s3://bkt/p, colour: red}",
            "models[0].colour: unknown key",
        ),
        (
            "models:\n  - {name: a, source: s3://bkt/p, required: 'yes'}",
            "models[0].required: expected true or false",
        ),
        (
            "models:\n  - {name: a, source: s3://bkt/p, include: [1]}",
            "models[0].include[0]: expected a non-empty glob",
        ),
        (
            "models:\n  - {name: a, source: s3://bkt/p, revision: main}",
            "models[0].revision: S3 sources have no revisions",
        ),
        (
            "models:\n  - {name: a, source: hf://o/n, hfRepo: o/m}",
            "models[0].hfRepo: only for s3:// sources",
        ),
        ("models:\n  - {name: a, source: 's3://bkt/p', hfRepo: nope}", "models[0].hfRepo: 'nope'"),
        (
            "models:\n  - {name: a, source: 'hf://o/n@v1', revision: v2}",
            "models[0].revision: 'v2' conflicts with @v1",
        ),
        ("models: {name: a}", "models: expected a list of models"),
        ("models:\n  - just-a-string", "models[0]: expected a mapping"),
        ("cacheDirectory: /x", "cacheDirectory: unknown key"),
        ("supersededGrace: soon", "supersededGrace"),
        ("concurrency: 0", "concurrency: must be between 1 and 512"),
        ("concurrency: '16'", "concurrency: expected a whole number"),
        ("chunkSize: 1KiB", "chunkSize: must be at least 64KiB"),
        ("chunkSize: lots", "chunkSize: not a size"),
        ("minFreeSpace: -1", "minFreeSpace: must not be negative"),
        ("verifyInterval: soon", "verifyInterval: not a duration"),
        ("retryBackoff: {initial: 10s, max: 1s}", "retryBackoff.max: must not be shorter"),
        ("retryBackoff: {initial: 0}", "retryBackoff.initial: must be a positive duration"),
        ("retryBackoff: {start: 1s}", "retryBackoff.start: unknown key"),
        ("listen: 8090", "listen: expected a non-empty string"),
        ("listen: localhost", "listen: 'localhost' is not HOST:PORT"),
        ("labelPrefix: Model_Prefetch", "labelPrefix: 'Model_Prefetch' is not a DNS subdomain"),
        ("startupTaint: 'a b'", "startupTaint: 'a b' is not a taint key"),
        ("s3: {endpointUrl: 'ftp://x'}", "s3.endpointUrl: 'ftp://x' is not an http(s) URL"),
        ("s3: {region: x}", "s3.region: unknown key"),
        ("- a\n- b", "the file: expected a mapping, got a list"),
        ("syncDeadline: soon", "syncDeadline: not a duration"),
        ("syncDeadline: [1h]", "syncDeadline: expected a duration like 10m"),
        (
            "models:\n  - {name: a, source: s3://bkt/p, syncDeadline: -5}",
            "models[0].syncDeadline: must not be negative",
        ),
    ],
)
def test_errors_name_the_field(text: str, expected: str, tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert expected in message, message


def test_yaml_syntax_error_names_the_line() -> None:
    with pytest.raises(ConfigError, match=r"not valid YAML at line 3"):
        parse_config("models:\n  - name: a\n  source: [unclosed\n")


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_listen_and_overrides() -> None:
    assert parse_listen("0.0.0.0:8090") == ("0.0.0.0", 8090)
    assert parse_listen("[::]:9000") == ("::", 9000)
    assert parse_listen(":8080") == ("0.0.0.0", 8080)
    cfg = AgentConfig().with_overrides(cache_dir=Path("/c"), listen="127.0.0.1:1")
    assert (cfg.cache_dir, cfg.listen) == (Path("/c"), "127.0.0.1:1")
    with pytest.raises(ConfigError, match="--listen"):
        AgentConfig().with_overrides(listen="nope")


def test_digest_tracks_content_not_flags() -> None:
    a = parse_config("models: [{name: a, source: s3://bkt/p}]").models[0]
    pinned = parse_config("models: [{name: a, source: s3://bkt/p, pin: true, required: false}]")
    narrowed = parse_config("models: [{name: a, source: s3://bkt/p, include: ['*.json']}]")
    assert spec_digest(a) == spec_digest(pinned.models[0])
    assert spec_digest(a) != spec_digest(narrowed.models[0])
    assert parse_config("x: 1".replace("x", "concurrency")).digest != parse_config("").digest


def test_sync_deadline_scales_with_the_model_or_is_set_globally_or_per_model() -> None:
    GB = 10**9
    auto = parse_config("models: []").deadline_for("any")
    assert auto.for_bytes(0) == auto.for_bytes(GB) == 600  # the minimum: 10 minutes
    # 140 GB at the 4 MiB/s floor: 9.3 hours, where a healthy 100 MB/s link needs 23 minutes
    assert 9 * 3600 < auto.for_bytes(140 * GB) < 10 * 3600
    config = parse_config(
        "syncDeadline: 2h\nmodels:\n"
        "  - {name: a, source: s3://bkt/a, syncDeadline: 90s}\n"
        "  - {name: b, source: s3://bkt/b, syncDeadline: 'off'}\n"
        "  - {name: c, source: s3://bkt/c, syncDeadline: auto}\n"
        "  - {name: d, source: s3://bkt/d}\n"
    )
    assert [config.deadline_for(n).for_bytes(140 * GB) for n in "abd"] == [90, None, 7200]
    assert config.deadline_for("c").for_bytes(140 * GB) == auto.for_bytes(140 * GB)
    assert parse_config("syncDeadline: 0\nmodels: []").sync_deadline.for_bytes(GB) is None


def test_backoff_doubles_up_to_max() -> None:
    b = Backoff(initial=10, max=60)
    assert [b.delay(n) for n in (1, 2, 3, 4, 5)] == [10, 20, 40, 60, 60]


def test_a_spec_rule_reads_the_same_from_the_cli_and_the_config_file() -> None:
    from prefetch.cli.pull import pull_spec

    with pytest.raises(ConfigError) as from_cli:
        pull_spec("hf://o/n@v1", name="", include=(), exclude=(), revision="v2", hf_repo=None,
                  hf_revision=None, layout_name=None)  # fmt: skip
    with pytest.raises(ConfigError) as from_file:
        parse_config("models:\n  - {name: a, source: 'hf://o/n@v1', revision: v2}")
    reason = "'v2' conflicts with @v1 in the source (two revisions given)"
    assert str(from_cli.value) == f"--revision: {reason}"
    assert str(from_file.value) == f"models[0].revision: {reason}"


def test_ca_bundle_top_level_and_per_model_which_wins(test_ca: TestCA, tmp_path: Path) -> None:
    own = tmp_path / "a.pem"
    own.write_bytes(test_ca.ca_file.read_bytes())
    cfg = parse_config(
        f"caBundle: {test_ca.ca_file}\n"
        "models:\n"
        f"  - {{name: a, source: s3://bkt/a/, caBundle: {own}}}\n"
        "  - {name: b, source: s3://bkt/b/}\n"
    )
    assert cfg.ca_bundle_for("a") == str(own)
    assert cfg.ca_bundle_for("b") == str(test_ca.ca_file)
    assert parse_config("models: []").ca_bundle_for("a") is None
    with pytest.raises(ConfigError, match=r"^models\[0\]\.caBundle: expected a non-empty string"):
        parse_config("models:\n  - {name: a, source: s3://bkt/a/, caBundle: 3}")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # "$" of a Python regex also matches before a final newline: a name that is not a label
        ('models:\n  - {name: "abc\\n", source: s3://bkt/p}', "models[0].name: 'abc\\n'"),
        # Python's \d takes any digit, float() reads them: not what the chart's schema reads
        ('chunkSize: "\u0661\u0662\u0668MiB"', "chunkSize: not a size"),
        ('stallTimeout: "\u0663\u0660s"', "stallTimeout: not a duration"),
        ('labelPrefix: "example.com\\n"', "labelPrefix: 'example.com\\n' is not a DNS subdomain"),
    ],
)
def test_spellings_the_charts_schema_refuses_the_agent_refuses(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert str(caught.value).startswith(expected), str(caught.value)


def test_whole_numbers_written_as_floats_are_whole_numbers() -> None:
    """JSON Schema's ``integer`` (the chart's) takes 16.0: so does the agent."""
    cfg = parse_config("concurrency: 16.0\nchunkSize: 1048576.0")
    assert (cfg.concurrency, cfg.chunk_size) == (16, 1048576)
    assert isinstance(cfg.concurrency, int)
    with pytest.raises(ConfigError, match="concurrency: expected a whole number"):
        parse_config("concurrency: 16.5")
