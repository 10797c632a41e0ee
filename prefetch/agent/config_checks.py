"""The config file's value checks: each turns one key's YAML value into its Python value or
raises a :class:`~prefetch.support.errors.ConfigError` naming the key's path (``models[1].source:
...``). The field table (:mod:`prefetch.agent.config_fields`) pairs each with the JSON Schema of
what it accepts; the patterns both use are here."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from prefetch.pipeline.spec import parse_source_uri, validate_name
from prefetch.support.errors import ConfigError
from prefetch.support.units import parse_duration, parse_size

__all__ = [
    "DNS_SUBDOMAIN",
    "LABEL_NAME",
    "LISTEN_PATTERN",
    "Parse",
    "parse_listen",
]

#: A key's check: (the value, the key's path) -> the value parsed.
Parse = Callable[[Any, str], Any]

DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LISTEN_PATTERN = r"\[([0-9A-Fa-f:.]+)\]:([0-9]+)|([^:\[\]]*):([0-9]+)"


def kind_of(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }.get(type(value), type(value).__name__)


def mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where or 'the file'}: expected a mapping, got {kind_of(value)}")
    return value


def check_keys(value: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in value:
        if key not in known:
            path = f"{where}.{key}" if where else str(key)
            raise ConfigError(f"{path}: unknown key (known keys: {', '.join(known)})")


def get(value: Mapping[str, Any], key: str, where: str, convert: Parse, default: Any) -> Any:
    """``convert(value[key])``, its errors prefixed with the field's path; else ``default``."""
    path = f"{where}.{key}" if where else key
    if key not in value:
        return default
    try:
        return convert(value[key], path)
    except ConfigError as exc:
        msg = str(exc)
        if not msg.startswith(path):
            msg = f"{path}: {msg}"
        raise ConfigError(msg, hint=exc.hint) from exc


def text(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{path}: expected a non-empty string, got {kind_of(value)}")
    return value.strip()


def opt_text(value: Any, path: str) -> str | None:
    return None if value is None else text(value, path)


def boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {kind_of(value)} {value!r}")
    return value


def _whole(value: Any) -> int | None:
    """``value`` as a whole number (a float with no fraction counts, as JSON Schema's
    ``integer`` does); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) else None


def int_range(lo: int, hi: int) -> Parse:
    def convert(value: Any, path: str) -> int:
        number = _whole(value)
        if number is None:
            raise ConfigError(f"{path}: expected a whole number, got {kind_of(value)} {value!r}")
        if not lo <= number <= hi:
            raise ConfigError(f"{path}: must be between {lo} and {hi}, got {value}")
        return number

    return convert


def size(value: Any, path: str) -> int:
    number = _whole(value)
    if number is not None:
        return parse_size(number, field=path)
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected a size like 1GiB, got {kind_of(value)}")
    return parse_size(value, field=path)


def min_size(least: int, shown: str) -> Parse:
    def convert(value: Any, path: str) -> int:
        found = size(value, path)
        if found < least:
            raise ConfigError(f"{path}: must be at least {shown}, got {value!r}")
        return found

    return convert


def duration(value: Any, path: str) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str | None):
        raise ConfigError(f"{path}: expected a duration like 10m, got {kind_of(value)}")
    return parse_duration(value, field=path)


def positive_duration(value: Any, path: str) -> float:
    seconds = duration(value, path)
    if seconds is None or seconds <= 0:
        raise ConfigError(f"{path}: must be a positive duration like 10s, got {value!r}")
    return seconds


def share(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(f"{path}: expected a number in (0, 1], got {value!r}")
    return float(value)


def patterns(value: Any, path: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of glob patterns, got {kind_of(value)}")
    for i, p in enumerate(value):
        if not isinstance(p, str) or not p:
            raise ConfigError(f"{path}[{i}]: expected a non-empty glob pattern, got {kind_of(p)}")
    return tuple(value)


def _exact(regex: str, what: str) -> Parse:
    """A string matching ``regex`` as a whole (not stripped: the schema sees it as written)."""

    def convert(value: Any, path: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{path}: expected a non-empty string, got {kind_of(value)}")
        if not re.fullmatch(regex, value):
            raise ConfigError(f"{path}: {value!r} is not {what}")
        return value

    return convert


def label_prefix(value: Any, path: str) -> str:
    found: str = _exact(DNS_SUBDOMAIN, "a DNS subdomain (lowercase a-z, 0-9, '-' and '.')")(
        value, path
    )
    if len(found) > 253:
        raise ConfigError(f"{path}: {found!r} is not a DNS subdomain (at most 253 characters)")
    return found


taint_key = _exact(f"(({DNS_SUBDOMAIN})?/)?{LABEL_NAME}", "a taint key like example.com/warming")


def listen(value: Any, path: str) -> str:
    found = text(value, path)
    parse_listen(found, field_name=path)
    return found


def parse_listen(value: str, *, field_name: str = "listen") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port)."""
    m = re.fullmatch(LISTEN_PATTERN, value.strip())
    if m is None:
        raise ConfigError(f"{field_name}: {value!r} is not HOST:PORT (e.g. 0.0.0.0:8090)")
    host = m.group(1) if m.group(1) is not None else m.group(3)
    port = int(m.group(2) or m.group(4))
    if not 0 <= port <= 65535:
        raise ConfigError(f"{field_name}: port {port} is out of range")
    return host or "0.0.0.0", port


def dns_label(value: Any, path: str) -> str:
    """A model's or compile cache's ``name``: a DNS label, as written."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{path}: expected a non-empty string, got {kind_of(value)}")
    return validate_name(value, field_name=path)


def uri(schemes: tuple[str, ...]) -> Parse:
    def convert(value: Any, path: str) -> Any:
        try:
            found = parse_source_uri(text(value, path))
        except ConfigError as exc:
            message = str(exc)
            raise ConfigError(
                message if message.startswith(path) else f"{path}: {message}"
            ) from exc
        if found.scheme not in schemes:
            listed = ", ".join(f"{s}://" for s in schemes)
            raise ConfigError(f"{path}: {str(found)!r} is not one of {listed}")
        return found

    return convert


def uri_list(schemes: tuple[str, ...]) -> Parse:
    """A list of URIs (one string: a list of one; null: none)."""
    one = uri(schemes)

    def convert(value: Any, path: str) -> tuple[Any, ...]:
        if isinstance(value, str):
            value = [value]
        if value is None:
            return ()
        if not isinstance(value, list):
            listed = " or ".join(f"{s}://" for s in schemes)
            raise ConfigError(f"{path}: expected a list of {listed} URIs, got {kind_of(value)}")
        return tuple(one(v, f"{path}[{i}]") for i, v in enumerate(value))

    return convert


def names_from(known: tuple[str, ...]) -> Parse:
    """A list of names from ``known``, each once (``extraDirs``)."""

    def convert(value: Any, path: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            raise ConfigError(
                f"{path}: expected a list like [{', '.join(known)}], got {kind_of(value)}"
            )
        for i, name in enumerate(value):
            if name not in known:
                raise ConfigError(f"{path}[{i}]: {name!r} is not one of {', '.join(sorted(known))}")
        if len(set(value)) != len(value):
            raise ConfigError(f"{path}: a directory is named twice")
        return tuple(value)

    return convert


def endpoint_url(value: Any, path: str) -> str | None:
    url = opt_text(value, path)
    if url is not None and not re.match(r"^https?://[^/\s]", url):
        raise ConfigError(f"{path}: {url!r} is not an http(s) URL")
    return url


def proxy(value: Any, path: str) -> str | None:
    """A model's ``proxy``: a URL, or ``none``/"" for direct; null: the environment's
    (ModelSpec reads the URL: :func:`prefetch.support.settings.parse_proxy`)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected a proxy URL or none, got {kind_of(value)}")
    return value


def not_parsed_here(value: Any, path: str) -> Any:
    """The parse of a mapping or list of mappings, which prefetch.agent.config does itself
    (its rules span several fields)."""
    raise AssertionError(f"{path}: parsed by prefetch.agent.config")
