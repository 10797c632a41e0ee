"""Every environment variable model-prefetch reads itself, read here and nowhere else.

Each function reads its variable when called (never at import), from ``environ`` when given and
from ``os.environ`` otherwise, so a test or a long-running agent sees the environment as it is
now. A value that cannot be meant raises :class:`~prefetch.errors.ConfigError` naming the variable.

Not here: the variables the CLI's options read through click (``envvar=`` beside each option:
``PREFETCH_CONCURRENCY``, ``PREFETCH_CHUNK_SIZE``, ``PREFETCH_CONFIG``, ``NODE_NAME``...), which
click parses and reports with the option, and those huggingface_hub, boto3 and the Kubernetes
client read for themselves (``HF_TOKEN``, ``HF_HOME``, ``AWS_PROFILE``...).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from prefetch.errors import ConfigError

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _flag(name: str, environ: Mapping[str, str] | None) -> bool:
    value = _environ(environ).get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}: {value!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _http_url(name: str, environ: Mapping[str, str] | None) -> str | None:
    value = _environ(environ).get(name, "").strip()
    if not value:
        return None
    parts = urlsplit(value)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{name}: {value!r} is not an http(s) URL")
    return value


def debug(environ: Mapping[str, str] | None = None) -> bool:
    """``PREFETCH_DEBUG``: show tracebacks instead of one ``Error:`` line (default off)."""
    return _flag("PREFETCH_DEBUG", environ)


def hf_endpoint(environ: Mapping[str, str] | None = None) -> str | None:
    """``HF_ENDPOINT``: the Hub or a mirror (None: the caller's default, https://huggingface.co)."""
    return _http_url("HF_ENDPOINT", environ)


def aws_endpoint_url(environ: Mapping[str, str] | None = None) -> str | None:
    """``AWS_ENDPOINT_URL``: an S3-compatible endpoint (None: AWS itself)."""
    return _http_url("AWS_ENDPOINT_URL", environ)


def in_kubernetes(environ: Mapping[str, str] | None = None) -> bool:
    """``KUBERNETES_SERVICE_HOST`` is set: the process runs in a pod (the node gate may work)."""
    return bool(_environ(environ).get("KUBERNETES_SERVICE_HOST"))


@dataclass(frozen=True)
class Proxies:
    """``HTTP_PROXY``/``HTTPS_PROXY``/``NO_PROXY`` (lower case first, as curl and urllib do).

    ``by_scheme`` maps "http"/"https" to the proxy URL; ``no_proxy`` is the raw bypass list,
    matched by :func:`urllib.request.proxy_bypass_environment`.
    """

    by_scheme: Mapping[str, str]
    no_proxy: str | None = None


def proxies(environ: Mapping[str, str] | None = None) -> Proxies:
    """The proxies the environment names for HTTP and HTTPS, and the hosts that bypass them."""
    env = _environ(environ)
    found: dict[str, str] = {}
    for scheme in ("http", "https"):
        name = f"{scheme}_proxy"
        # as urllib: under CGI, HTTP_PROXY may be a request header (httpoxy), so it is ignored
        upper = None if scheme == "http" and "REQUEST_METHOD" in env else env.get(name.upper())
        value = (env.get(name) or upper or "").strip()
        if not value:
            continue
        parts = urlsplit(value if "://" in value else f"http://{value}")
        if not parts.hostname:
            raise ConfigError(f"{name.upper()}: {value!r} is not a proxy URL")
        found[scheme] = value
    no_proxy = (env.get("no_proxy") or env.get("NO_PROXY") or "").strip() or None
    return Proxies(by_scheme=found, no_proxy=no_proxy)


__all__ = [
    "Proxies",
    "aws_endpoint_url",
    "debug",
    "hf_endpoint",
    "in_kubernetes",
    "proxies",
]
