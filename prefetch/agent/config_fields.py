"""The agent's config file, field by field: the :class:`Kind`, :class:`Field` and
:class:`Table` types and the kinds of value a key holds, from which come the parser's per-key
checks (and their messages: :mod:`prefetch.agent.config_checks`), the JSON Schema of the
chart's ``config`` values (:mod:`prefetch.agent.config_schema`) and the field reference in
docs/config.md. (Named tuples, not dataclasses: three frozen dataclasses cost the agent's
start-up a few milliseconds.)

Why a table of our own rather than pydantic or msgspec: the agent imports this at start-up,
and a pydantic model of the file made ``import prefetch.agent.config`` cost 161 ms instead of
94 ms; msgspec cost nothing but reports only the first error, with its path inside the
message. A :class:`Kind` holds a parser and the schema of exactly what it accepts, both
written from the same constants (the unit tables of :mod:`prefetch.support.units`, the URI schemes
of :mod:`prefetch.pipeline.spec`); tests/test_config_schema.py checks, key by key, that they agree.

Adding a key is one :class:`Field` line in its :class:`Table` (and reading it where it is
used). Rules about several fields at once (a duplicate model name, ``hfRepo`` only for S3 and
OCI sources) stay in the section parsers (:mod:`prefetch.agent.config_models`, ...) and
:class:`~prefetch.pipeline.spec.ModelSpec`. The tables themselves are in
:mod:`prefetch.agent.config_tables`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from prefetch.agent.config_checks import (
    DNS_SUBDOMAIN,
    LABEL_NAME,
    Parse,
    boolean,
    check_keys,
    dns_label,
    duration,
    endpoint_url,
    get,
    int_range,
    label_prefix,
    listen,
    mapping,
    min_size,
    names_from,
    not_parsed_here,
    opt_text,
    patterns,
    positive_duration,
    proxy,
    share,
    size,
    taint_key,
    text,
    uri,
    uri_list,
)
from prefetch.pipeline.backends import mirror_schemes, mirrors_by_source, source_schemes
from prefetch.support.errors import ConfigError
from prefetch.support.units import (
    DURATION_PATTERN,
    POSITIVE_DURATION_PATTERN,
    SIZE_PATTERN,
    size_pattern_at_least,
)

#: The schemes of a model's ``source``, of its ``mirrors`` (by its source's), and where a mirror
#: lives: the backends' (see prefetch.pipeline.backends); the chart's schema is generated from them.
SOURCE_SCHEMES = source_schemes()
MIRRORS_BY_SOURCE = mirrors_by_source()
MIRROR_SCHEMES = mirror_schemes()

Schema = dict[str, Any]

#: Placeholders in the patterns below, written out by the generator
#: (:func:`prefetch.agent.config_schema.python_space_class`): a character Python's
#: ``str.strip`` keeps, one it removes, and the inside of a class of the latter.
NONSPACE = "{NONSPACE}"
SPACE = "{SPACE}"
SPACE_CHARS = "{SPACE_CHARS}"
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_PORT = r"0*(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4})"


class Kind(NamedTuple):
    """What a key holds: its parser, the JSON Schema of exactly the values that parser
    accepts (built only when asked for), and how the field reference names it."""

    parse: Parse
    schema: Callable[[], Schema]
    doc: str


class Field(NamedTuple):
    """One key: its ``kind``, its default as the docs show it, and what it does. ``missing``:
    the key is required, and this is said when it is left out."""

    key: str
    kind: Kind
    default: str
    doc: str
    missing: str | None = None


class Table(NamedTuple):
    """The keys of one mapping of the file (the top level, a model, ...)."""

    fields: tuple[Field, ...]
    #: Rules across this mapping's keys the schema can state (JSON Schema ``allOf``).
    rules: Callable[[], list[Schema]] | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(f.key for f in self.fields)

    def field(self, key: str) -> Field:
        return next(f for f in self.fields if f.key == key)

    def check(self, value: Any, where: str) -> Mapping[str, Any]:
        """``value`` as a mapping with none of its keys unknown and every required key there."""
        m = mapping(value, where)
        check_keys(m, self.keys, where)
        for f in self.fields:
            if f.missing is not None and f.key not in m:
                raise ConfigError(f"{where}.{f.key}: missing{f.missing}")
        return m

    def get(self, value: Mapping[str, Any], key: str, where: str, default: Any) -> Any:
        """``value[key]`` parsed by its kind (``default`` when it is not there)."""
        return get(value, key, where, self.field(key).kind.parse, default)

    def schema(self) -> Schema:
        out: Schema = {"type": "object", "additionalProperties": False}
        required = [f.key for f in self.fields if f.missing is not None]
        if required:
            out["required"] = required
        out["properties"] = {f.key: {**f.kind.schema(), "description": f.doc} for f in self.fields}
        if self.rules is not None:
            out["allOf"] = self.rules()
        return out


# -- kinds ---------------------------------------------------------------------------------------

_NONBLANK: Schema = {"type": "string", "pattern": NONSPACE}


def _kind(parse: Parse, schema: Schema | Callable[[], Schema], doc: str) -> Kind:
    return Kind(parse, schema if callable(schema) else (lambda: schema), doc)


def _nullable(schema: Schema) -> Schema:
    """``schema`` or null. Types are listed rather than ``anyOf``-ed throughout: a keyword
    (``pattern``, ``minimum``, ``items``) applies only to its own type, and Helm's message
    then names the one rule broken."""
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return {**schema, "type": [*kinds, "null"]}


#: Each scheme's URIs, as far as a pattern can say it without the environment: a subset of
#: what :func:`prefetch.pipeline.spec.parse_source_uri` and ModelSpec accept (odd spellings they
#: take, like ``S3://`` or a blank inside, are refused). ``${NAME}`` in a registry host is read from
#: the agent's environment, so the agent alone can judge it. A scheme added to
#: SOURCE_SCHEMES without a shape here is checked by its ``scheme://`` only.
_SEGMENT = r"[A-Za-z0-9_]+([.-][A-Za-z0-9_]+)*"
_HF_ORG = r"[A-Za-z0-9][A-Za-z0-9_]*([.-][A-Za-z0-9_]+)*"
_REF_PART = r"[A-Za-z0-9_][A-Za-z0-9_-]*"
_H = "[0-9A-Fa-f]{1,4}"
#: An IPv6 address as urlsplit takes one in brackets (ipaddress), written out by where its
#: "::" stands (no IPv4 tail, no zone: the schema takes a subset of what the agent takes).
_IPV6 = "|".join((
    f"({_H}:){{7}}{_H}", f"({_H}:){{1,7}}:", f"({_H}:){{1,6}}:{_H}",
    *(f"({_H}:){{1,{6 - n}}}(:{_H}){{1,{n + 1}}}" for n in range(1, 5)),
    f"{_H}:(:{_H}){{1,6}}", f":((:{_H}){{1,7}}|:)",
))  # fmt: skip
_OCI_HOST = (
    rf"(\[({_IPV6})\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|\$\{{[A-Za-z_][A-Za-z0-9_]*\}})"
    r"(:[0-9]{1,5})?"
)
_OCI_REPO = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*"
_OCI_REF = r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|@sha256:[0-9a-f]{64})"
_SOURCE_SHAPES = {
    "s3": r"s3://[a-z0-9][a-z0-9._-]{1,254}(/[!-~]*)?",
    "hf": rf"hf://{_HF_ORG}(/{_SEGMENT})?(@{_REF_PART}(/{_REF_PART})*)?",
    "oci": rf"oci://{_OCI_HOST}/{_OCI_REPO}{_OCI_REF}?",
    "gs": r"gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[!-~]*)?",
    "file": rf"file://(localhost)?/[^{SPACE_CHARS}]+",
    "az": r"(az://[a-z0-9]{3,24}|https://[a-z0-9]{3,24}\.blob\.core\.windows\.net)"
    r"/([a-z0-9][a-z0-9-]{2,62}|\$root)(/[!-~]*)?",
}
_PATH_SEGMENT = r"[A-Za-z0-9._~!$&'()*+,;=:@%-]+"
#: Mirrors are written as the agent spells them back but for an S3 prefix's last ``/`` (a
#: registry host in lowercase, no ``//``, no blanks around), so ``uniqueItems`` is the agent's
#: "listed twice" but for ``s3://b/p`` beside ``s3://b/p/``. A registry mirror names no tag or
#: digest (the origin's is read there), maybe no repository.
_MIRROR_SHAPES = {
    **_SOURCE_SHAPES,
    "s3": rf"s3://[a-z0-9][a-z0-9._-]{{1,254}}(/{_PATH_SEGMENT})*/?",
    "oci": rf"oci://(\[({_IPV6.replace('A-Fa-f', 'a-f')})\]|[a-z0-9]([a-z0-9.-]*[a-z0-9])?"
    r"|\$\{[A-Za-z_][A-Za-z0-9_]*\})(:[0-9]{1,5})?"
    rf"(/{_OCI_REPO})?",
}
_BLANKS = r"[\t\n\v\f\r ]*"


def _any_case(word: str) -> str:
    return "".join(f"[{c.lower()}{c.upper()}]" for c in word)


def _uri_schema(
    schemes: tuple[str, ...], shapes: Mapping[str, str] = _SOURCE_SHAPES, blanks: str = _BLANKS
) -> Schema:
    alternatives = "|".join(shapes.get(s, f"{s}://[^{SPACE_CHARS}]+") for s in schemes)
    return {"type": "string", "pattern": f"^{blanks}({alternatives}){blanks}$"}


def mirror_rules() -> list[Schema]:
    """A model's ``mirrors`` by its source's scheme (:data:`MIRRORS_BY_SOURCE`, the backends'),
    ``hfRepo`` not for an hf:// source (it has its own repo id), and ``hubFallback: false``
    only with mirrors."""
    rules: list[Schema] = [
        {
            "if": {"properties": {"source": {"pattern": f"^{_BLANKS}{scheme}://"}}},
            "then": {
                "properties": {
                    "mirrors": mirrors_schema(
                        (MIRRORS_BY_SOURCE[scheme],) if scheme in MIRRORS_BY_SOURCE else ()
                    )
                }
            },
        }
        for scheme in SOURCE_SCHEMES
    ]
    hub = {"properties": {"source": {"pattern": f"^{_BLANKS}hf://"}}}
    rules.append({"if": hub, "then": {"properties": {"hfRepo": {"type": "null"}}}})
    rules += revision_rules()
    no_hub = {"properties": {"hubFallback": {"const": False}}, "required": ["hubFallback"]}
    with_mirrors = {
        "required": ["mirrors"],
        "properties": {"mirrors": {"type": ["string", "array"], "minItems": 1}},
    }
    return [*rules, {"if": no_hub, "then": with_mirrors}]


#: A git ref name as :func:`prefetch.support.paths.ref_name_problem` allows it: no blank, control
#: character or any of ``~^:?*[\\``, and none of the shapes of :data:`_BAD_REF`.
_REF = r"^[^\x00-\x20\x7f-\x9f~^:?*\[\\]+$"
_BAD_REF = r"\.\.|@\{|^@$|^[/-]|[/.]$|//|(^|/)\.|\.lock(/|$)"
_NULL: Schema = {"properties": {"revision": {"type": "null"}}}


def _source_is(pattern: str) -> Schema:
    return {"properties": {"source": {"pattern": f"^{_BLANKS}{pattern}"}}}


def revision_rules() -> list[Schema]:
    """A model's ``revision`` by its source: hf://, a git ref; oci://, a tag or digest; s3://,
    gs://, az:// and file://, none but the 40-hex commit to publish under ``hfRepo``. Given
    twice (in the source's ``@``/``:`` too), the agent wants them equal: the schema wants it
    once."""
    ref = {
        "type": ["string", "null"],
        "pattern": _REF,
        "not": {"type": "string", "pattern": _BAD_REF},
    }
    tag = {"type": ["string", "null"], "pattern": f"^({_OCI_REF[2:-1].replace('|@', '|')})$"}
    commit = {"type": "string", "pattern": "^[0-9a-f]{40}$"}
    mirror = {
        "required": ["hfRepo"],
        "properties": {"hfRepo": {"type": "string"}, "revision": commit},
    }
    return [
        {"if": _source_is("hf://[^@]*$"), "then": {"properties": {"revision": ref}}},
        {"if": _source_is("hf://.*@"), "then": _NULL},
        {"if": _source_is("oci://[^/]*/[^:@]*$"), "then": {"properties": {"revision": tag}}},
        {"if": _source_is("oci://[^/]*/.*[:@]"), "then": _NULL},
        # a listing (s3, gs, az and its portal form, file): none, or the commit to publish
        # an hfRepo under
        {"if": _source_is("(s3|gs|az|file|https)://"), "then": {"anyOf": [_NULL, mirror]}},
    ]


def mirrors_schema(schemes: tuple[str, ...]) -> Schema:
    """``mirrors`` of ``schemes`` (none: empty or null)."""
    if not schemes:
        return {"type": ["array", "null"], "maxItems": 0}
    one = _uri_schema(schemes, _MIRROR_SHAPES, blanks="")
    return {
        "type": ["string", "array", "null"],
        "pattern": one["pattern"],
        "items": one,
        "uniqueItems": True,
    }


_USERINFO = r"[A-Za-z0-9._~%!$&'()*+,;=:-]+@"
#: What :func:`prefetch.support.settings.parse_proxy` takes (but IPv6 hosts, left to the agent).
_PROXY_SHAPE = (
    rf"^{_BLANKS}({_any_case('none')}|{_any_case('direct')}|{_any_case('http')}[sS]?://"
    rf"({_USERINFO})?[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:{_PORT})?(/[!-~]*)?)?{_BLANKS}$"
)


TEXT = _kind(text, _NONBLANK, "string")
HF_REPO = _kind(
    opt_text, {"type": ["string", "null"], "pattern": f"^{_HF_ORG}/{_SEGMENT}$"}, "org/name or null"
)
PROXY = _kind(proxy, {"type": ["string", "null"], "pattern": _PROXY_SHAPE}, "URL, none or null")
OPT_TEXT = _kind(opt_text, _nullable(_NONBLANK), "string or null")
PATH = _kind(opt_text, _nullable(_NONBLANK), "file path or null")
BOOL = _kind(boolean, {"type": "boolean"}, "true or false")
SIZE = _kind(
    size,
    {"type": ["integer", "string"], "minimum": 0, "pattern": SIZE_PATTERN},
    "size: bytes, or like 64KiB, 200MB, 1GiB",
)
DURATION = _kind(
    duration,
    {"type": ["number", "string", "null"], "minimum": 0, "pattern": DURATION_PATTERN},
    "duration: seconds, or like 30s, 10m, 1h30m, 24h; 0, off or null: never",
)
POSITIVE_DURATION = _kind(
    positive_duration,
    {"type": ["number", "string"], "exclusiveMinimum": 0, "pattern": POSITIVE_DURATION_PATTERN},
    "positive duration: seconds, or like 30s, 10m, 24h",
)
SHARE = _kind(share, {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "number in (0, 1]")
PATTERNS = _kind(
    patterns,
    {
        "type": ["string", "array", "null"],
        "minLength": 1,
        "items": {"type": "string", "minLength": 1},
    },
    "glob pattern, or a list of them",
)
DNS_LABEL = _kind(
    dns_label,
    {"type": "string", "pattern": f"^{_DNS_LABEL}$"},
    "DNS label (a-z, 0-9, '-'; at most 63)",
)
LABEL_PREFIX = _kind(
    label_prefix,
    {"type": "string", "pattern": f"^{DNS_SUBDOMAIN}$", "maxLength": 253},
    "DNS subdomain",
)
TAINT_KEY = _kind(
    taint_key,
    {"type": "string", "pattern": f"^(({DNS_SUBDOMAIN})?/)?{LABEL_NAME}$"},
    "taint key (prefix/name)",
)
LISTEN = _kind(
    listen,
    {
        "type": "string",
        "pattern": f"^{SPACE}*(\\[[0-9A-Fa-f:.]+\\]|[^:\\[\\]]*):{_PORT}{SPACE}*$",
    },
    "HOST:PORT ([v6]:PORT)",
)
SOURCE_URI = _kind(
    uri(SOURCE_SCHEMES),
    lambda: _uri_schema(SOURCE_SCHEMES),
    "URI: " + ", ".join(f"{s}://" for s in SOURCE_SCHEMES),
)
S3_URI = _kind(uri(("s3",)), lambda: _uri_schema(("s3",)), "URI: s3://")
#: Parsed as any source (ModelSpec says which scheme a model's mirrors need: its own message).
MIRROR_URIS = _kind(
    uri_list(SOURCE_SCHEMES),
    lambda: mirrors_schema(MIRROR_SCHEMES),
    "URI or list: " + ", ".join(f"{s}://" for s in MIRROR_SCHEMES),
)
ENDPOINT_URL = _kind(
    endpoint_url,
    _nullable({"type": "string", "pattern": f"^{SPACE}*https?://[^/{SPACE_CHARS}]"}),
    "http(s) URL or null",
)


def int_kind(lo: int, hi: int) -> Kind:
    return _kind(
        int_range(lo, hi), {"type": "integer", "minimum": lo, "maximum": hi}, f"{lo} to {hi}"
    )


def size_at_least(least: int, shown: str) -> Kind:
    return _kind(
        min_size(least, shown),
        {"type": ["integer", "string"], "minimum": least, "pattern": size_pattern_at_least(least)},
        f"size, at least {shown}",
    )


def names_kind(known: tuple[str, ...]) -> Kind:
    return _kind(
        names_from(known),
        {"type": "array", "uniqueItems": True, "items": {"enum": list(known)}},
        "list of " + ", ".join(known),
    )


def object_kind(table: Table, doc: str, *, nullable: bool = False) -> Kind:
    return Kind(
        not_parsed_here, lambda: _nullable(table.schema()) if nullable else table.schema(), doc
    )


def list_kind(table: Table, doc: str) -> Kind:
    return Kind(
        not_parsed_here,
        lambda: {"type": ["array", "null"], "items": table.schema()},
        doc,
    )


def sync_deadline_kind(parse: Parse) -> Kind:
    return _kind(
        parse,
        {
            "type": ["number", "string", "null"],
            "minimum": 0,
            "pattern": f"^auto$|{DURATION_PATTERN}",
        },
        "auto, a duration, or off",
    )
