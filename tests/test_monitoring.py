"""The alerts, recording rules and Grafana dashboard in deploy/monitoring/.

The rules are checked with ``promtool check rules`` and every alert is unit-tested with
``promtool test rules`` on a series that must fire it and one that must not. Then a real
Prometheus scrapes a real agent (``prefetch agent`` against the session's SeaweedFS, with a model
that syncs, a model whose bucket does not exist, and a file corrupted at rest): the recording rules
must produce series, the "model failing" alert must fire, and every dashboard query must parse and
return a series. Tests needing ``promtool`` or ``prometheus`` (Debian package ``prometheus``) skip
when they are absent.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
import shutil
import subprocess
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from prefetch.demo.locals3 import SeaweedS3
from tests.support import (
    AgentProcess,
    config_text,
    free_port,
    http_get,
    s3_subprocess_env,
    upload,
    wait_for,
)

REPO = Path(__file__).resolve().parent.parent
MONITORING = REPO / "deploy" / "monitoring"
RULES_MANIFEST = MONITORING / "prometheusrule.yaml"
DASHBOARD = MONITORING / "dashboard.json"
#: The job name the Prometheus Operator gives daemonset/podmonitor.yaml's targets.
AGENT_JOB = "model-prefetch/model-prefetch-agent"
#: Labels the PodMonitor puts on every agent series (node from its relabeling).
AGENT = {
    "job": AGENT_JOB,
    "namespace": "model-prefetch",
    "pod": "model-prefetch-agent-x7k2p",
    "node": "gpu-node-1",
    "instance": "10.0.3.7:8090",
}
#: What Grafana puts in place of the dashboard's variables, for running its queries here.
DASHBOARD_VARIABLES = {"$__rate_interval": "30s", "$node": ".+"}
MiB = 1024 * 1024

Doc = dict[str, Any]


# -- the rules, as Prometheus reads them ---------------------------------------------------------


def rule_groups() -> list[Doc]:
    doc = yaml.safe_load(RULES_MANIFEST.read_text(encoding="utf-8"))
    assert doc["kind"] == "PrometheusRule"
    groups: list[Doc] = doc["spec"]["groups"]
    return groups


def alert_rules() -> dict[str, Doc]:
    return {r["alert"]: r for g in rule_groups() for r in g["rules"] if "alert" in r}


def write_rule_file(path: Path, groups: list[Doc]) -> Path:
    """A Prometheus rule file (what the operator generates from the PrometheusRule's groups)."""
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False), encoding="utf-8")
    return path


def binary(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        pytest.skip(f"{name} is not installed (Debian package prometheus)")
    return exe


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    rules = write_rule_file(tmp_path / "rules.yaml", rule_groups())
    result = promtool("check", "rules", str(rules), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_severity_and_says_what_to_do() -> None:
    for name, rule in alert_rules().items():
        assert rule.get("labels", {}).get("severity") in ("critical", "warning", "info"), name
        annotations = rule.get("annotations", {})
        assert annotations.get("summary"), f"{name}: no summary"
        description = annotations.get("description", "")
        assert len(description.split()) >= 20, f"{name}: the description must say what to do"
        assert "://" not in description, f"{name}: runbook text belongs in the description"


# -- promtool unit tests, one firing and one quiet case per alert at least -----------------------


def series(metric: str, values: str, **labels: str) -> Doc:
    """An input series of an agent scraped through the PodMonitor (``labels`` add or override)."""
    all_labels = {**AGENT, **labels}
    selector = ",".join(f'{k}="{v}"' for k, v in all_labels.items())
    return {"series": f"{metric}{{{selector}}}", "values": values}


def alert_labels(*keys: str, **extra: str) -> dict[str, str]:
    """The labels an alert keeps from the agent's series (``keys``), plus ``extra``."""
    return {**{k: AGENT[k] for k in keys}, **extra}


NODE_KEYS = ("namespace", "pod", "node")


@dataclass(frozen=True)
class AlertCase:
    alert: str
    name: str
    input: list[Doc]
    at: str
    fires: list[dict[str, str]] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.alert}-{self.name}"


CASES = [
    AlertCase(
        "ModelPrefetchModelFailing",
        "fires-after-15m-of-failed-syncs",
        [series("model_prefetch_model_state", "1x30", model="llama", state="failed")],
        "20m",
        [alert_labels(*NODE_KEYS, model="llama")],
    ),
    AlertCase(
        "ModelPrefetchModelFailing",
        "fires-through-retries",
        [series("model_prefetch_model_state", "1 1 1 0 " * 8, model="llama", state="failed")],
        "25m",
        [alert_labels(*NODE_KEYS, model="llama")],
    ),
    AlertCase(
        "ModelPrefetchModelFailing",
        "quiet-when-the-model-recovers",
        [series("model_prefetch_model_state", "1x5 0x30", model="llama", state="failed")],
        "25m",
    ),
    AlertCase(
        "ModelPrefetchNodeWarmingSlow",
        "fires-after-30m-not-ready",
        [series("model_prefetch_all_required_ready", "0x40")],
        "35m",
        [alert_labels(*NODE_KEYS)],
    ),
    AlertCase(
        "ModelPrefetchNodeWarmingSlow",
        "quiet-once-ready-in-time",
        [series("model_prefetch_all_required_ready", "0x20 1x20")],
        "35m",
    ),
    AlertCase(
        "ModelPrefetchTaintNeverLifted",
        "fires-after-2h-not-ready",
        [series("model_prefetch_all_required_ready", "0x150")],
        "130m",
        [alert_labels(*NODE_KEYS)],
    ),
    AlertCase(
        "ModelPrefetchTaintNeverLifted",
        "quiet-when-ready-after-90m",
        [series("model_prefetch_all_required_ready", "0x90 1x60")],
        "130m",
    ),
    AlertCase(
        "ModelPrefetchChecksumFailures",
        "fires-on-an-increase",
        [
            series(
                "model_prefetch_checksum_failures_total",
                "0 0 0 1 1 1",
                model="m",
                reason="download",
            )
        ],
        "5m",
        [alert_labels(*NODE_KEYS, model="m", reason="download")],
    ),
    AlertCase(
        "ModelPrefetchChecksumFailures",
        "fires-on-the-first-failure-of-a-new-series",
        [
            series(
                "model_prefetch_checksum_failures_total",
                "_ _ _ 1 1 1",
                model="m",
                reason="reverify",
            )
        ],
        "5m",
        [alert_labels(*NODE_KEYS, model="m", reason="reverify")],
    ),
    AlertCase(
        "ModelPrefetchChecksumFailures",
        "quiet-without-new-failures",
        [
            series("model_prefetch_checksum_failures_total", "0x30", model="a", reason="download"),
            series("model_prefetch_checksum_failures_total", "2x30", model="b", reason="reverify"),
        ],
        "25m",
    ),
    AlertCase(
        "ModelPrefetchCacheNearlyFull",
        "fires-below-a-tenth-free",
        [
            series("model_prefetch_cache_free_bytes", "5000000000x20"),
            series("model_prefetch_cache_used_bytes", "95000000000x20"),
        ],
        "20m",
        [alert_labels(*NODE_KEYS)],
    ),
    AlertCase(
        "ModelPrefetchCacheNearlyFull",
        "quiet-with-room",
        [
            series("model_prefetch_cache_free_bytes", "50000000000x20"),
            series("model_prefetch_cache_used_bytes", "50000000000x20"),
        ],
        "20m",
    ),
    AlertCase(
        "ModelPrefetchAgentDown",
        "fires-when-scrapes-fail",
        [series("up", "0x10")],
        "6m",
        [alert_labels("job", "instance", *NODE_KEYS)],
    ),
    AlertCase(
        "ModelPrefetchAgentDown",
        "quiet-when-up-or-another-job-is-down",
        [series("up", "1x10"), series("up", "0x10", job="some-other-job")],
        "6m",
    ),
    AlertCase(
        "ModelPrefetchAgentAbsent",
        "fires-without-agent-targets",
        [series("up", "1x40", job="some-other-job")],
        "35m",
        [{"job": AGENT_JOB}],
    ),
    AlertCase(
        "ModelPrefetchAgentAbsent",
        "quiet-with-an-agent-target",
        [series("up", "1x40")],
        "35m",
    ),
    AlertCase(
        "ModelPrefetchConfigRejected",
        "fires-when-the-config-stays-rejected",
        [series("model_prefetch_config_last_reload_successful", "0x15")],
        "11m",
        [alert_labels("job", "instance", *NODE_KEYS)],
    ),
    AlertCase(
        "ModelPrefetchConfigRejected",
        "quiet-with-a-good-config",
        [series("model_prefetch_config_last_reload_successful", "1x15")],
        "11m",
    ),
    AlertCase(
        "ModelPrefetchNodeGateFailing",
        "fires-while-patches-keep-failing",
        [series("model_prefetch_node_gate_errors_total", "0+1x30")],
        "20m",
        [alert_labels("job", "instance", *NODE_KEYS)],
    ),
    AlertCase(
        "ModelPrefetchNodeGateFailing",
        "quiet-after-old-errors",
        [series("model_prefetch_node_gate_errors_total", "5x30")],
        "20m",
    ),
]

_LABEL_REF = re.compile(r"\{\{\s*\$labels\.(\w+)\s*\}\}")


def render(template: str, labels: dict[str, str], alert: str) -> str:
    """An annotation as Prometheus renders it; a label the alert does not carry is an error
    (Prometheus would print ``<no value>`` in the page an operator reads)."""

    def label(match: re.Match[str]) -> str:
        key = match.group(1)
        assert key in labels, f"{alert}: annotation uses $labels.{key}, the alert has {labels}"
        return labels[key]

    rendered = _LABEL_REF.sub(label, template)
    assert "{{" not in rendered, f"{alert}: a template this test cannot render: {template}"
    return rendered


def expected_alert(rule: Doc, labels: dict[str, str]) -> Doc:
    all_labels = {**labels, **rule.get("labels", {})}
    annotations = {k: render(v, all_labels, rule["alert"]) for k, v in rule["annotations"].items()}
    return {"exp_labels": all_labels, "exp_annotations": annotations}


def unit_test_file(case: AlertCase) -> Doc:
    rule = alert_rules()[case.alert]
    return {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "name": case.id,
                "interval": "1m",
                "input_series": case.input,
                "alert_rule_test": [
                    {
                        "eval_time": case.at,
                        "alertname": case.alert,
                        "exp_alerts": [expected_alert(rule, labels) for labels in case.fires],
                    }
                ],
            }
        ],
    }


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_alert_fires_only_when_it_should(case: AlertCase, tmp_path: Path) -> None:
    write_rule_file(tmp_path / "rules.yaml", rule_groups())
    test_file = tmp_path / "alert.test.yaml"
    test_file.write_text(yaml.safe_dump(unit_test_file(case), sort_keys=False), encoding="utf-8")
    result = promtool("test", "rules", test_file.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    firing = {c.alert for c in CASES if c.fires}
    quiet = {c.alert for c in CASES if not c.fires}
    alerts = set(alert_rules())
    assert alerts == firing, f"alerts without a firing case: {alerts - firing}"
    assert alerts == quiet, f"alerts without a quiet case: {alerts - quiet}"


def test_fleet_recording_rules_compute_the_ready_fraction_and_free_share(tmp_path: Path) -> None:
    write_rule_file(tmp_path / "rules.yaml", rule_groups())
    other = {"pod": "model-prefetch-agent-q9w3z", "node": "gpu-node-2"}
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    series("model_prefetch_all_required_ready", "1x5"),
                    series("model_prefetch_all_required_ready", "0x5", **other),
                    series("model_prefetch_cache_free_bytes", "25x5"),
                    series("model_prefetch_cache_used_bytes", "75x5"),
                ],
                "promql_expr_test": [
                    {
                        "expr": "fleet:model_prefetch_all_required_ready:ratio",
                        "eval_time": "2m",
                        "exp_samples": [
                            {
                                "labels": "fleet:model_prefetch_all_required_ready:ratio",
                                "value": 0.5,
                            }
                        ],
                    },
                    {
                        "expr": "node:model_prefetch_cache_free:ratio",
                        "eval_time": "2m",
                        "exp_samples": [
                            {
                                "labels": 'node:model_prefetch_cache_free:ratio{node="gpu-node-1"}',
                                "value": 0.25,
                            }
                        ],
                    },
                ],
            }
        ],
    }
    test_file = tmp_path / "records.test.yaml"
    test_file.write_text(yaml.safe_dump(test, sort_keys=False), encoding="utf-8")
    result = promtool("test", "rules", test_file.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# -- the dashboard -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref: str
    expr: str

    @property
    def id(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", f"{self.panel} {self.ref}".lower()).strip("-")

    def as_grafana_runs_it(self) -> str:
        expr = self.expr
        for variable, value in DASHBOARD_VARIABLES.items():
            expr = expr.replace(variable, value)
        return expr


def dashboard() -> Doc:
    doc: Doc = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return doc


def panel_queries() -> list[PanelQuery]:
    out = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            out.append(PanelQuery(panel["title"], target["refId"], target["expr"]))
    return out


def test_dashboard_uses_a_prometheus_datasource_variable_and_only_agent_metrics() -> None:
    doc = dashboard()
    assert doc["schemaVersion"] >= 39
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    data_panels = [p for p in doc["panels"] if p["type"] != "row"]
    assert data_panels
    for panel in data_panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel.get("targets"), f"{panel['title']}: no query"
    for query in panel_queries():
        metrics = set(re.findall(r"\b([a-z_:]+)\{", query.expr))
        assert metrics, f"{query.id}: selects no metric with a node filter"
        foreign = {m for m in metrics if not m.startswith("model_prefetch_")}
        assert not foreign, f"{query.id}: not the agent's metrics: {foreign}"
        assert set(DASHBOARD_VARIABLES) >= set(re.findall(r"\$\w+", query.expr)), query.id


# -- a real Prometheus scraping a real agent -----------------------------------------------------


_buckets = itertools.count()
#: The alerts the live test makes fire (their expressions as shipped, without waiting).
LIVE_ALERTS = ("ModelPrefetchModelFailing", "ModelPrefetchChecksumFailures")


@dataclass
class Live:
    """A Prometheus server on 127.0.0.1 scraping an agent every second."""

    base: str

    def query(self, expr: str) -> tuple[int, Doc]:
        status, body = http_get(
            f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        )
        return status, json.loads(body)

    def series(self, expr: str) -> list[Doc]:
        status, answer = self.query(expr)
        assert status == 200, f"{expr}: HTTP {status}: {answer.get('error')}"
        result: list[Doc] = answer["data"]["result"]
        return result

    def firing(self, alertname: str) -> list[dict[str, str]]:
        _, body = http_get(f"{self.base}/api/v1/alerts")
        alerts = json.loads(body)["data"]["alerts"]
        return [
            a["labels"]
            for a in alerts
            if a["labels"]["alertname"] == alertname and a["state"] == "firing"
        ]


def live_rule_groups() -> list[Doc]:
    """The recording rules as shipped, and the alerts ``LIVE_ALERTS`` with ``for: 0s``."""
    groups = copy.deepcopy(rule_groups())
    for group in groups:
        group["rules"] = [r for r in group["rules"] if "record" in r or r["alert"] in LIVE_ALERTS]
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = "0s"
    return groups


def prometheus_config(agent_port: int, rules: Path) -> Doc:
    labels = {k: AGENT[k] for k in ("namespace", "pod", "node")}
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {
                "job_name": AGENT_JOB,
                "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"], "labels": labels}],
            }
        ],
    }


@pytest.fixture(scope="module")
def live(s3_server: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """An agent with a model that syncs ("good", required), one whose bucket does not exist
    ("broken") and a cached file corrupted at rest, scraped by Prometheus with the rules."""
    exe = binary("prometheus")
    work = tmp_path_factory.mktemp("monitoring")
    client = s3_server.client()
    bucket = f"monitoring-{next(_buckets)}-{os.getpid()}"
    client.create_bucket(Bucket=bucket)
    files = upload(client, bucket, "good", work, 2 * MiB)
    cache = work / "cache"
    models = [
        {"name": "good", "source": f"s3://{bucket}/good", "required": True},
        {"name": "broken", "source": f"s3://{bucket}-missing/m", "required": False},
    ]
    config = work / "models.yaml"
    config.write_text(config_text(cache, models, verifyInterval="1s"), encoding="utf-8")
    env = s3_subprocess_env(s3_server, work)
    agent = AgentProcess(config, env, work / "agent.log")
    prometheus: subprocess.Popen[bytes] | None = None
    try:
        wait_for(agent.up, "the agent", dump=agent.stderr)
        rules = write_rule_file(work / "rules.yaml", live_rule_groups())
        prom_config = work / "prometheus.yml"
        prom_config.write_text(yaml.safe_dump(prometheus_config(agent.port, rules)))
        port = free_port()
        with (work / "prometheus.log").open("ab") as log:
            prometheus = subprocess.Popen(
                [
                    exe,
                    f"--config.file={prom_config}",
                    f"--storage.tsdb.path={work / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        server = Live(f"http://127.0.0.1:{port}")
        wait_for(
            lambda: _ready(server),
            "Prometheus to be ready",
            dump=lambda: (work / "prometheus.log").read_text(errors="replace"),
        )
        wait_for(lambda: agent.metric("model_prefetch_model_ready", model="good") == 1, "good")
        shard = sorted(p for p in files if p.endswith(".safetensors"))[0]
        corrupt_at_rest(cache / "models" / "good" / shard)
        wait_for(
            lambda: agent.metric(
                "model_prefetch_checksum_failures_total", model="good", reason="reverify"
            ),
            "the corrupted file to be found",
            dump=agent.stderr,
        )
        yield server
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(30)
        agent.stop()


def _ready(server: Live) -> bool:
    try:
        return http_get(server.base + "/-/ready")[0] == 200
    except OSError:
        return False


def corrupt_at_rest(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_recording_rules_produce_series_from_a_real_agent(live: Live) -> None:
    wait_for(
        lambda: [
            s
            for s in live.series("fleet:model_prefetch_all_required_ready:ratio")
            if s["value"][1] == "1"
        ],
        "the fleet ready fraction to reach 1",
        timeout=60,
    )
    for record in (
        "node:model_prefetch_downloaded_bytes:rate1m",
        "node:model_prefetch_model_remaining_bytes:sum",
        "node:model_prefetch_cache_free:ratio",
    ):
        found = wait_for(lambda r=record: live.series(r), record, timeout=60)  # type: ignore[misc]
        assert found[0]["metric"]["node"] == AGENT["node"]


@pytest.mark.slow
def test_model_failing_alert_fires_for_the_missing_bucket_only(live: Live) -> None:
    firing = wait_for(
        lambda: live.firing("ModelPrefetchModelFailing"), "ModelPrefetchModelFailing", timeout=60
    )
    assert {a["model"] for a in firing} == {"broken"}
    assert firing[0]["node"] == AGENT["node"] and firing[0]["severity"] == "warning"


@pytest.mark.slow
def test_checksum_alert_fires_for_the_file_corrupted_at_rest(live: Live) -> None:
    firing = wait_for(
        lambda: live.firing("ModelPrefetchChecksumFailures"),
        "ModelPrefetchChecksumFailures",
        timeout=60,
    )
    assert [(a["model"], a["reason"]) for a in firing] == [("good", "reverify")]


@pytest.mark.slow
@pytest.mark.parametrize("query", panel_queries(), ids=[q.id for q in panel_queries()])
def test_dashboard_query_parses_and_returns_a_series(live: Live, query: PanelQuery) -> None:
    expr = query.as_grafana_runs_it()
    status, answer = live.query(expr)
    assert status == 200, f"{query.id}: {expr}: HTTP {status}: {answer.get('error')}"
    wait_for(lambda: live.series(expr), f"a series for {query.id}: {expr}", timeout=60)


@pytest.mark.slow
def test_dashboard_node_variable_lists_the_scraped_node(live: Live) -> None:
    variable = next(v for v in dashboard()["templating"]["list"] if v["name"] == "node")
    match = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["query"]["query"])
    assert match, variable["query"]
    metric, label = match.groups()
    found = wait_for(lambda: live.series(metric), metric, timeout=60)
    assert found[0]["metric"][label] == AGENT["node"]
