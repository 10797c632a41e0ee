"""The chart's ``config`` schema and docs/config.md are generated from the agent's field table,
and, key by key (a property test on values drawn at random and from the key's own patterns),
what the schema accepts the agent accepts; for all but the keys of STRICTER, what the agent
accepts the schema accepts too.

Patterns are checked as Helm checks them (Go's regexp, like ECMA-262: ``$`` is the end of the
text); Python's ``re.search`` would also let ``$`` match before a final newline, a quirk no
Helm user meets, so the validator below reads ``$`` as ``\\Z``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from prefetch.agent import config_fields, config_schema
from prefetch.agent.config import parse_config
from prefetch.agent.config_fields import MIRRORS_BY_SOURCE, SOURCE_SCHEMES, Table
from prefetch.agent.config_tables import BACKOFF, COMPILE_CACHE, MODEL, S3, TOP
from prefetch.support.errors import ConfigError


def _pattern(
    validator: Any, pattern: str, instance: Any, schema: dict[str, Any]
) -> Iterator[jsonschema.ValidationError]:
    if isinstance(instance, str) and not re.search(
        re.sub(r"\$(?=\||$)", r"\\Z", pattern), instance
    ):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


GoValidator = jsonschema.validators.extend(jsonschema.Draft7Validator, {"pattern": _pattern})
SCHEMA = config_schema.config_schema()
VALIDATOR = GoValidator(SCHEMA)


def schema_accepts(doc: dict[str, Any]) -> bool:
    return bool(VALIDATOR.is_valid(doc))


def agent_accepts(doc: dict[str, Any]) -> bool:
    try:
        parse_config(yaml.safe_dump(doc))
    except ConfigError:
        return False
    return True


# -- generated files -----------------------------------------------------------------------------


def test_committed_schema_and_reference_are_the_generated_ones() -> None:
    for path, text in config_schema.outputs().items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.name} is not what the field table gives: run "
            "python -m prefetch.agent.config_schema"
        )


def test_generator_check_says_which_file_differs(tmp_path: Any, monkeypatch: Any) -> None:
    docs = tmp_path / "config.md"
    docs.write_text("stale\n")
    monkeypatch.setattr(config_schema, "REFERENCE", docs)
    monkeypatch.setattr(config_schema, "REPO", tmp_path.parent)
    assert config_schema.main(["--check"]) == 1
    assert docs.read_text() == "stale\n"
    assert config_schema.main([]) == 0
    assert docs.read_text() == config_schema.reference()


def test_every_key_is_in_the_reference_and_the_schema() -> None:
    reference = config_schema.reference()
    tables = [(TOP, ""), (BACKOFF, "retryBackoff."), (S3, "s3."), (MODEL, "models[]."),
              (COMPILE_CACHE, "compileCaches[].")]  # fmt: skip
    for table, prefix in tables:
        for key in table.keys:
            assert f"`{prefix}{key}`" in reference
    model = SCHEMA["properties"]["models"]["items"]
    assert set(model["properties"]) == set(MODEL.keys)
    assert set(SCHEMA["properties"]) == set(TOP.keys)


def test_source_schemes_come_from_the_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheme a backend declares (prefetch.pipeline.backends) reaches the schema with no other
    edit."""
    examples = {"hf": "hf://org/name", "s3": "s3://bkt/p/", "oci": "oci://reg.io/repo:v1",
                "gs": "gs://bkt/p/", "az": "az://acct1/models/m",
                "file": "file:///mnt/models/m/"}  # fmt: skip
    for scheme in SOURCE_SCHEMES:
        doc = {"models": [{"name": "a", "source": examples.get(scheme, f"{scheme}://x")}]}
        assert schema_accepts(doc), scheme
    for source, mirror in MIRRORS_BY_SOURCE.items():
        doc = {"models": [{"name": "a", "source": examples[source], "mirrors": f"{mirror}://mm"}]}
        assert schema_accepts(doc), mirror
    assert not schema_accepts({"models": [{"name": "a", "source": "ftp://x/y"}]})
    portal = "https://acct1.blob.core.windows.net/models/m/"
    assert schema_accepts({"models": [{"name": "a", "source": portal}]})
    assert not schema_accepts({"models": [{"name": "a", "source": "https://example.com/m"}]})
    assert not schema_accepts({"models": [{"name": "a", "source": "hf://o/n",
                                           "mirrors": ["hf://o/m"]}]})  # fmt: skip
    new = {"models": [{"name": "a", "source": "xyz://bucket/prefix/"}]}
    assert not schema_accepts(new)
    monkeypatch.setattr(config_fields, "SOURCE_SCHEMES", (*SOURCE_SCHEMES, "xyz"))
    assert GoValidator(config_schema.config_schema()).is_valid(new)


# -- the property: per key, the schema and the agent agree -----------------------------------

_ALPHABET = "0123456789.-+ \t\nmsdhkKMGTibBx:/[]@_aZ"
_INTERESTING = [
    "auto", "off", "never", "0", "", " ", "64MiB", "64KiB", "1 gib", "30s", "1h30m", "0s",
    "0.0m", "0.5", "10m30s", "1.5ms", "2d", "-5m", "12 GB", "hf://org/name", "s3://bucket/p/",
    "oci://registry.example.com/repo:v1", "oci://127.0.0.1:30020", "0.0.0.0:8090", "[::1]:80",
    ":8090", "host:65536", "model-prefetch.io", "example.com/warming", "/warming", "a/b/c",
    "Model_Prefetch", "vllm", "sglang", "flashinfer", "deepgemm", "none", "direct",
    "http://proxy:3128", "https://minio:9000", "minio:9000", "/etc/ssl/ca.pem", "main",
    "llama-3", "-bad-", "a" * 64, "S3://bucket/p", "hf://org/name@main", "hf://org--x/y",
    "hf://org/name@a..b", "oci://reg.io/repo", "oci://reg.io", "oci://reg.io/repo@sha256:00",
    "s3://bkt/m/", "s3://bkt/m", "http://u:p@proxy:3128/", "HTTPS://p:0", "NONE", "socks5://p:1",
    "http://p:99999", "http://:80", "http://[::1]:3128", "org/name", "org/na--me", "Org_1/a.b-c",
    "org/", "/name", "a/b/c", "v1.0", "refs/pr/1", "a..b", "x.lock", ".hidden", "a@{1}",
    "0123456789abcdef0123456789abcdef01234567",
]  # fmt: skip
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**6), max_value=10**12),
    st.floats(min_value=-1e6, max_value=1e12, allow_nan=False),
    st.text(alphabet=_ALPHABET, max_size=12),
    st.sampled_from(_INTERESTING),
)
VALUES = st.one_of(
    _SCALARS,
    st.lists(_SCALARS, max_size=3),
    st.dictionaries(st.sampled_from(["initial", "max", "endpointUrl", "x"]), _SCALARS, max_size=2),
)

_MODEL_BASE = {"name": "m", "source": "hf://org/name"}
_CACHE_BASE = {"name": "c", "source": "s3://bkt/p/", "vllm": "v", "model": "o/m", "revision": "r"}
#: Where a key's value goes, with the other keys its rules need to be met.
_CONTEXT: dict[str, Callable[[Any], dict[str, Any]]] = {
    "retryBackoff.initial": lambda v: {"retryBackoff": {"initial": v, "max": float("inf")}},
    "retryBackoff.max": lambda v: {"retryBackoff": {"initial": 5e-324, "max": v}},
    "models[].hfRepo": lambda v: {
        "models": [{**_MODEL_BASE, "source": "s3://bkt/p/", "hfRepo": v}]
    },
    "models[].hubFallback": lambda v: {
        "models": [{**_MODEL_BASE, "mirrors": ["s3://bkt/m/"], "hubFallback": v}]
    },
    # a key's rules by another key's value: each case its own entry ("key@case")
    "models[].revision@oci": lambda v: {
        "models": [{**_MODEL_BASE, "source": "oci://reg.io/repo", "revision": v}]
    },
    "models[].revision@s3": lambda v: {
        "models": [{**_MODEL_BASE, "source": "s3://bkt/p/", "hfRepo": "o/n", "revision": v}]
    },
    "models[].mirrors@oci": lambda v: {
        "models": [{**_MODEL_BASE, "source": "oci://reg.io/repo:v1", "mirrors": v}]
    },
    "models[].mirrors@nohub": lambda v: {
        "models": [{**_MODEL_BASE, "mirrors": v, "hubFallback": False}]
    },
    "compileCaches[].push": lambda v: {
        "compileCaches": [{**_CACHE_BASE, "push": v, "pushFrom": "/host/cache"}]
    },
}
#: Keys the schema states more strictly than the agent reads them: what the schema accepts,
#: the agent accepts (the chart never lets through a config the agent refuses), but spellings
#: the agent also takes (``S3://``, a blank inside a URI, ``${NAME}`` in a registry host, which
#: only the agent's environment can resolve) are refused by the chart.
STRICTER: dict[str, str] = {
    "chunkSize": "a string's whole part alone must reach 64KiB (0.5MiB is refused)",
    "models[].source": "each scheme's shape (prefetch.agent.config_fields._SOURCE_SHAPES)",
    "compileCaches[].source": "an s3:// URI's shape",
    "models[].revision": "by the source's scheme; once (not also in the source, even if equal)",
    "models[].hfRepo": "a Hub repo id of ASCII letters, digits, _ and single . or - between",
    "models[].proxy": "none, direct, or an http(s) URL with a DNS name or IPv4 host",
    "models[].mirrors": "each scheme's shape, and by the source's scheme; not two spellings of "
    "one S3 mirror (s3://b/p and s3://b/p/), which the agent refuses as listed twice",
}
STRICTER |= {
    f"{key}@{case}": STRICTER[key]
    for key, case in [("models[].revision", "oci"), ("models[].revision", "s3"),
                      ("models[].mirrors", "oci"), ("models[].mirrors", "nohub")]
}  # fmt: skip


#: Keys the agent also checks against the node, which no schema can: a ``caBundle`` must be a
#: PEM file there. What the agent accepts, the schema accepts.
NODE_CHECKED: dict[str, str] = {
    "caBundle": "the file must exist on the node and hold PEM certificates",
    "models[].caBundle": "the file must exist on the node and hold PEM certificates",
}


def _paths(table: Table, prefix: str) -> list[str]:
    return [f"{prefix}{f.key}" for f in table.fields if f.kind.parse.__name__ != "not_parsed_here"]


KEYS = [
    *_paths(TOP, ""),
    *_paths(BACKOFF, "retryBackoff."),
    *_paths(S3, "s3."),
    *_paths(MODEL, "models[]."),
    *_paths(COMPILE_CACHE, "compileCaches[]."),
]
CASES = [key for key in _CONTEXT if "@" in key]


def placed(key: str, value: Any) -> dict[str, Any]:
    """A config with ``value`` at ``key`` (and what the key's rules need beside it)."""
    if key in _CONTEXT:
        return _CONTEXT[key](value)
    head, _, rest = key.partition(".")
    if head == "models[]":
        return {"models": [{**_MODEL_BASE, rest: value}]}
    if head == "compileCaches[]":
        return {"compileCaches": [{**_CACHE_BASE, rest: value}]}
    return {head: {rest: value}} if rest else {head: value}


def test_every_key_is_generated() -> None:
    assert {"chunkSize", "stallTimeout", "models[].name", "compileCaches[].extraDirs"} <= set(KEYS)
    assert set(STRICTER) <= set(KEYS + CASES)
    assert len(KEYS) == sum(len(t.fields) for t in (TOP, BACKOFF, S3, MODEL, COMPILE_CACHE)) - 4


def key_schema(key: str) -> dict[str, Any]:
    node: dict[str, Any] = SCHEMA
    for part in key.partition("@")[0].split("."):
        node = node["properties"]
        node = node[part[:-2]]["items"] if part.endswith("[]") else node[part]
    return node


def patterns(node: Any) -> list[str]:
    """Every ``pattern`` in a schema, its items' included."""
    if isinstance(node, dict):
        own = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        return own + [p for k, v in node.items() if k != "pattern" for p in patterns(v)]
    if isinstance(node, list):
        return [p for v in node for p in patterns(v)]
    return []


def values_for(key: str) -> st.SearchStrategy[Any]:
    """Anything (VALUES), and strings drawn from the key's own patterns: values the schema was
    written to accept, which the agent must then accept."""
    drawn = [st.from_regex(re.sub(r"\$(?=\||$)", r"\\Z", p)) for p in patterns(key_schema(key))]
    return st.one_of(VALUES, *drawn, st.lists(st.one_of(*drawn), max_size=2)) if drawn else VALUES


@pytest.mark.parametrize("key", KEYS + CASES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_schema_accepts_what_the_agent_accepts_and_refuses_what_it_refuses(
    key: str, data: st.DataObject
) -> None:
    value = data.draw(values_for(key))
    if key in STRICTER:
        # ${NAME} in a registry host: the agent's environment decides (the schema takes any)
        assume("${" not in str(value))
    if key.startswith("models[].mirrors") and isinstance(value, list):
        # one S3 mirror with and without its last "/": the agent's duplicate, not the schema's
        spelled = [v.rstrip("/") if isinstance(v, str) else v for v in value]
        assume(len({repr(v) for v in spelled}) == len(spelled))
    doc = placed(key, value)
    agent, schema = agent_accepts(doc), schema_accepts(doc)
    if key in STRICTER:
        assert agent or not schema, f"{key}: {value!r}: the schema takes it, the agent refuses"
    elif key in NODE_CHECKED:
        assert schema or not agent, f"{key}: {value!r}: the agent takes it, the schema refuses"
    else:
        assert schema == agent, f"{key}: {value!r}: agent {agent}, schema {schema}"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("models[].source", "ftp://host/x"),
        ("compileCaches[].source", "hf://org/name"),
        ("models[].mirrors", ["hf://org/other"]),
        ("chunkSize", 1024),
    ],
)
def test_the_schema_refuses_by_example_what_the_agent_refuses(key: str, value: Any) -> None:
    doc = placed(key, value)
    assert not agent_accepts(doc)
    assert not schema_accepts(doc)


@pytest.mark.parametrize(
    "model",
    [
        {"name": "a", "source": "oci://[::1]:5000/models/a:v1"},
        {"name": "a", "source": "oci://[fd00::1]/models/a@sha256:" + "a" * 64},
        {"name": "a", "source": "oci://reg.io/a:v1", "mirrors": ["oci://[fd00::1]:30020"]},
    ],
)
def test_a_registry_by_its_ipv6_address_is_taken_by_both(model: dict[str, Any]) -> None:
    """Before: the agent took an IPv6 registry host ([fd00::1]:30020, a node-local mirror on an
    IPv6 cluster) and the chart refused it."""
    doc = {"models": [model]}
    assert agent_accepts(doc)
    assert schema_accepts(doc)
