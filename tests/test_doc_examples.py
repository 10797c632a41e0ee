"""Every YAML example in README.md and docs/ that is an agent config or the chart's values is
read as it would be used: an agent config by the agent's parser, chart values rendered by the
real Helm engine (helm-python-sdk, as tests/test_helm_chart.py) and the agent config it renders
parsed. A block that is partly an agent config and partly something else is an error: split
it, so that the config part is checked."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from prefetch.agent.config import parse_config
from prefetch.agent.config_tables import TOP

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "model-prefetch"
PAGES = [REPO / "README.md", CHART / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^( *)```ya?ml\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
AGENT_KEYS = frozenset(TOP.keys)
VALUES_KEYS = frozenset(
    json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))["properties"]
)


def blocks() -> list[tuple[str, str]]:
    """Each YAML block of the pages, dedented, named ``page:line``."""
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{page.relative_to(REPO)}:{line}", textwrap.dedent(m.group(2))))
    return out


def kind(text: str) -> str | None:
    """``agent`` (an agent config), ``values`` (the chart's), ``mixed``, ``not YAML``, or None
    (neither)."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        return "not YAML"
    if not isinstance(doc, dict):
        return None
    keys = set(doc)
    if keys <= AGENT_KEYS:
        return "agent"
    if keys <= VALUES_KEYS:
        return "values"
    return "mixed" if keys & (AGENT_KEYS | {"config"}) else None


BLOCKS = [(name, text, kind(text)) for name, text in blocks()]
CHECKED = [pytest.param(text, k, id=name) for name, text, k in BLOCKS if k is not None]


def test_the_examples_are_found() -> None:
    """The extraction is not vacuous: the agent page's config examples are among them."""
    agent = [name for name, _, k in BLOCKS if k == "agent"]
    assert len(agent) >= 3, agent
    assert any(name.startswith("docs/agent.md") for name in agent), agent
    assert any(name.startswith("docs/deploy.md") for name in agent), agent


@pytest.mark.parametrize(("text", "what"), CHECKED)
def test_example_is_read_as_it_would_be_used(
    text: str, what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NODE_IP", "10.0.0.7")  # README's ${NODE_IP}: the downward API's
    assert what != "mixed", "an agent config mixed with other YAML: split the block"
    assert what != "not YAML", "the block does not parse as YAML"
    if what == "agent":
        assert parse_config(text) is not None
        return
    helm: Any = pytest.importorskip("helm_python")
    values = helm.values_from_yaml(text)
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name="model-prefetch", namespace="model-prefetch")
    yamls = [t for path, t in manifests.items() if path.endswith(".yaml")]
    docs = [d for t in yamls for d in yaml.safe_load_all(t) if d]
    [cm] = [d for d in docs if d["kind"] == "ConfigMap" and "models.yaml" in d.get("data", {})]
    parse_config(cm["data"]["models.yaml"])
