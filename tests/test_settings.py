"""Environment variables: each read in prefetch.support.settings only, at call time, bad values
named."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from click.testing import CliRunner

import prefetch
from prefetch.cli import main
from prefetch.support import settings
from prefetch.support.errors import ConfigError


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, False), ("", False), ("0", False), ("off", False), ("1", True), ("TRUE", True)],
)
def test_prefetch_debug_is_a_boolean_defaulting_to_off(value: str | None, expected: bool) -> None:
    environ = {} if value is None else {"PREFETCH_DEBUG": value}
    assert settings.debug(environ) is expected


def test_a_prefetch_debug_that_is_no_boolean_is_named() -> None:
    with pytest.raises(ConfigError, match="PREFETCH_DEBUG: 'maybe' is not a boolean"):
        settings.debug({"PREFETCH_DEBUG": "maybe"})


@pytest.mark.parametrize(
    ("name", "read"),
    [("HF_ENDPOINT", settings.hf_endpoint), ("AWS_ENDPOINT_URL", settings.aws_endpoint_url)],
)
def test_endpoints_default_to_none_and_must_be_http_urls(name: str, read: object) -> None:
    assert callable(read)
    assert read({}) is None and read({name: "  "}) is None
    assert read({name: "http://127.0.0.1:9000"}) == "http://127.0.0.1:9000"
    with pytest.raises(ConfigError, match=f"{name}: 'ftp://mirror' is not an http"):
        read({name: "ftp://mirror"})


def test_in_kubernetes_follows_kubernetes_service_host() -> None:
    assert settings.in_kubernetes({"KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert not settings.in_kubernetes({}) and not settings.in_kubernetes(
        {"KUBERNETES_SERVICE_HOST": ""}
    )


def test_proxies_prefer_lower_case_and_ignore_http_proxy_under_cgi() -> None:
    found = settings.proxies(
        {"https_proxy": "http://lower:1", "HTTPS_PROXY": "http://upper:2", "HTTP_PROXY": "p:3"}
    )
    assert dict(found.by_scheme) == {"https": "http://lower:1", "http": "p:3"}
    assert found.no_proxy is None
    cgi = settings.proxies({"HTTP_PROXY": "http://header:1", "REQUEST_METHOD": "GET"})
    assert dict(cgi.by_scheme) == {}
    assert settings.proxies({"NO_PROXY": "a,b", "no_proxy": "c"}).no_proxy == "c"
    with pytest.raises(ConfigError, match="HTTPS_PROXY: 'http://' is not a proxy URL"):
        settings.proxies({"HTTPS_PROXY": "http://"})


def test_the_environment_is_read_when_asked_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")
    assert settings.hf_endpoint() == "http://127.0.0.1:1"
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:2")
    assert settings.hf_endpoint() == "http://127.0.0.1:2"
    monkeypatch.delenv("HF_ENDPOINT")
    assert settings.hf_endpoint() is None


def test_a_bad_prefetch_debug_is_one_error_line_from_the_cli(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["verify", str(tmp_path)], env={"PREFETCH_DEBUG": "loud"})
    assert result.exit_code == 1
    assert "Error: PREFETCH_DEBUG: 'loud' is not a boolean" in result.output


def test_no_module_but_settings_reads_the_environment() -> None:
    package = Path(prefetch.__file__).parent
    readers = []
    for path in sorted(package.rglob("*.py")):
        if path == package / "support" / "settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                readers.append(f"{path.relative_to(package)}:{node.lineno}")
    assert readers == []
