"""The backend registry (prefetch.pipeline.backends): every scheme's knowledge in its backend, the
registry cheap to load, and no scheme compared outside a backend."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prefetch.pipeline.backends import backend, backends, mirror_schemes, mirrors_by_source
from prefetch.pipeline.spec import parse_source_uri
from prefetch.support.errors import ConfigError

PACKAGE = Path(__file__).resolve().parents[1] / "prefetch"


def test_every_backend_parses_what_it_prints() -> None:
    for b in backends():
        uri = parse_source_uri(b.usage)
        assert uri.scheme == b.scheme and backend(uri.scheme) is b
        assert parse_source_uri(str(uri)) == uri, b.scheme


def test_an_unknown_scheme_names_every_backends_uris_in_one_order() -> None:
    with pytest.raises(ConfigError) as e:
        parse_source_uri("gs://bucket/x")
    assert str(e.value) == (
        "unsupported source URI 'gs://bucket/x': expected s3://bucket/prefix, hf://org/name or "
        "oci://registry/repo:tag"
    )
    with pytest.raises(ValueError, match="no backend for scheme 'gs'"):
        backend("gs")


def test_mirrors_are_declared_by_the_backends() -> None:
    assert mirror_schemes() == ("s3", "oci")
    assert mirrors_by_source() == {"hf": "s3", "oci": "oci"}


def test_loading_the_registry_imports_no_backends_code_that_reads_the_network() -> None:
    """A spec is checked (and the CLI starts) without botocore, urllib3's pools or any
    source's code: a backend imports its source when it opens one."""
    probe = (
        "import json, sys\n"
        "from prefetch.pipeline.spec import ModelSpec, parse_source_uri\n"
        "for u in ('s3://b-k/m/', 'hf://org/name@main', 'oci://reg.io/org/m:v1'):\n"
        "    str(ModelSpec(source=parse_source_uri(u)))\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    loaded = json.loads(out)
    heavy = [m for m in loaded if m.split(".")[0] in ("botocore", "boto3", "urllib3")]
    sources = [m for m in loaded if m.startswith("prefetch.sources.")]
    assert heavy == []
    assert sorted(sources) == [
        "prefetch.sources.base",
        "prefetch.sources.hf",  # the backends' packages: a docstring each
        "prefetch.sources.hf.backend",
        "prefetch.sources.oci",
        "prefetch.sources.oci.backend",
        "prefetch.sources.s3",
        "prefetch.sources.s3.backend",
    ]


#: A scheme compared as a literal: ``.scheme == "s3"``, ``scheme != "hf"``, ``scheme in ("hf",
#: "oci")`` (http and https are URL schemes, not backends').
_COMPARISON = re.compile(r"""scheme\s*(==|!=|not in|in)\s*\(?["'](s3|hf|oci)["']""")


#: The folders of prefetch.sources that belong to no backend: the HTTP plumbing. The package's
#: own modules (the front door, the protocol, the fallback over several sources) are shared too;
#: every other folder is a backend's.
_SHARED = ("http",)


def _outside_backends(path: Path) -> bool:
    sources = PACKAGE / "sources"
    if not path.is_relative_to(sources):
        return True
    parts = path.relative_to(sources).parts
    return len(parts) == 1 or parts[0] in _SHARED


def test_no_scheme_is_compared_outside_its_backend() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if _outside_backends(path)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _COMPARISON.search(line)
    ]
    assert found == []
