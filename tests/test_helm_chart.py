"""The Helm chart (charts/model-prefetch/), linted and rendered by the real Helm engine.

No helm binary is needed: the PyPI package ``helm-python-sdk`` (import ``helm_python``) bundles
Helm's Go SDK as a shared library and calls it through ctypes, offline. It is alpha, so
pyproject.toml pins it; the whole module skips where it is not importable (``pip install -e
'.[test]'`` installs it, so CI runs every test here).

What is checked:

* ``helm lint`` finds nothing above "info", with the default values and with every example;
* every rendered document validates against the Kubernetes schemas (kubernetes-validate) and, for
  custom resources, against the CRDs in ``<repo>/../shared/crds``, as tests/test_manifests.py
  checks the kustomize manifests (same helpers, tests/manifests_util.py);
* equivalence: the release "model-prefetch" with default values renders exactly the objects of
  ``kubectl kustomize daemonset/`` once the labels Helm adds are dropped, and the mirror and the
  alert rules those of deploy/mirror/ and deploy/monitoring/ with values that ask for them; a
  change to either side without the other fails;
* values.schema.json rejects unknown keys and wrong types with Helm's own message, and lists
  exactly the keys the agent's config reader accepts.
"""

from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import manifests_util as mu

helm = pytest.importorskip(
    "helm_python",
    reason="helm-python-sdk is not installed (it is in the test extra: pip install -e '.[test]')",
)

REPO = mu.REPO
CHART = REPO / "charts" / "model-prefetch"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
RELEASE = "model-prefetch"
NAMESPACE = "model-prefetch"
#: Labels Helm's conventions add, dropped before the chart is compared with kustomize.
HELM_LABELS = (
    "helm.sh/chart",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
)
Doc = mu.Doc

#: Values that switch on everything the defaults leave off, and change what can be changed.
EVERYTHING: dict[str, Any] = {
    "image": {"digest": "sha256:" + "ab" * 32, "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "registry"}],
    "serviceAccount": {
        "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::111122223333:role/agent"}
    },
    "credentials": {"secretName": "hub-and-s3"},
    "priorityClassName": "gpu-critical",
    "nodeSelector": {"karpenter.sh/nodepool": "gpu"},
    "podAnnotations": {"example.com/owner": "ml-platform"},
    "podLabels": {"team": "ml"},
    "commonLabels": {"cost-center": "ml"},
    "extraEnv": [{"name": "PREFETCH_LOG_LEVEL", "value": "debug"}],
    "extraVolumes": [
        {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    ],
    "extraVolumeMounts": [{"name": "models", "mountPath": "/mnt/models", "readOnly": True}],
    "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
    "warmPageCache": {"memoryLimit": "17Gi"},
    "config": {
        "listen": "0.0.0.0:9090",
        "minRate": "64KiB",
        "stallTimeout": "30s",
        "retryBackoff": {"initial": "10s", "max": "10m"},
        "s3": {"endpointUrl": "https://minio.example.internal:9000"},
        "models": [
            {
                "name": "llama-3-1-8b-instruct",
                "source": "s3://my-model-mirror/meta-llama/Llama-3.1-8B-Instruct/",
                "hfRepo": "meta-llama/Llama-3.1-8B-Instruct",
                "required": False,
                "pin": True,
                "exclude": "*.pth",
                "proxy": "none",
            }
        ],
    },
    "namespace": {"create": True},
    "monitoring": {
        "podMonitor": {"interval": "15s", "labels": {"release": "kube-prometheus-stack"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "dashboard": {"enabled": True},
    },
    "mirror": {
        "enabled": True,
        "awsRegion": "eu-west-1",
        "extraEnv": [{"name": "NO_PROXY", "value": ".amazonaws.com"}],
        "jobs": [
            {
                "name": "mirror-llama-8b",
                "source": "hf://meta-llama/Llama-3.1-8B-Instruct@main",
                "destination": "s3://my-model-mirror/meta-llama/Llama-3.1-8B-Instruct",
                "schedule": "0 * * * *",
            }
        ],
    },
    "extraObjects": [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": "{{ .Release.Name }}-extra",
                "namespace": "{{ .Release.Namespace }}",
            },
            "stringData": {"HF_TOKEN": "hf_example"},
        },
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-notes\n"
        "data:\n  owner: ml-platform\n",
    ],
}


# -- the Helm engine ---------------------------------------------------------------------------


def render(
    values: dict[str, Any] | None = None, *, release: str = RELEASE, namespace: str = NAMESPACE
) -> list[Doc]:
    """The chart's objects, as `helm template RELEASE charts/model-prefetch -n NAMESPACE`."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=release, namespace=namespace)
    docs: list[Doc] = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d is not None]
    return docs


def example_values(path: Path) -> dict[str, Any]:
    values = helm.values_from_yaml(path.read_text(encoding="utf-8"))
    assert isinstance(values, dict)
    return values


def value_sets() -> list[Any]:
    """Default values, EVERYTHING and each example values file."""
    return [
        pytest.param(None, id="defaults"),
        pytest.param(EVERYTHING, id="everything"),
        *(pytest.param(example_values(p), id=f"examples/{p.name}") for p in EXAMPLES),
    ]


def key(doc: Doc) -> tuple[str, str, str]:
    return (doc["kind"], doc["metadata"].get("namespace", ""), mu.name(doc))


def by_key(docs: list[Doc]) -> dict[tuple[str, str, str], Doc]:
    out = {key(d): d for d in docs}
    assert len(out) == len(docs), "two objects with one kind, namespace and name"
    return out


# -- lint ----------------------------------------------------------------------------------------


def _findings(report: dict[str, Any]) -> list[str]:
    """Lint messages above "info" (severity 1), as `helm lint` prints them."""
    levels = {2: "WARNING", 3: "ERROR"}
    return [
        f"[{levels.get(m['severity'], m['severity'])}] {m['path']}: {m['error']}"
        for m in report["messages"]
        if m["severity"] > 1
    ]


@pytest.mark.parametrize("values", value_sets())
def test_helm_lint_finds_nothing_above_info(values: dict[str, Any] | None) -> None:
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version="v1.32.0")
    assert report["total_charts_linted"] == 1
    assert not _findings(report) and not report["errors"], "\n".join(_findings(report))


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("values", value_sets())
def test_rendered_builtin_kinds_validate(values: dict[str, Any] | None) -> None:
    docs = render(values)
    assert docs
    for doc in docs:
        if mu.is_builtin(doc):
            for version in mu.KUBERNETES_VERSIONS:
                mu.validate_builtin(doc, version)


#: Custom resources without a CRD in ../shared/crds, and the test that checks their content.
VALIDATED_WITHOUT_A_CRD = {
    ("monitoring.coreos.com/v1", "PrometheusRule"): (
        "test_monitoring_renders_what_kustomize_renders_for_deploy_monitoring (the same rules as "
        "deploy/monitoring/, which tests/test_monitoring.py checks with promtool)"
    ),
}


@pytest.mark.parametrize("values", value_sets())
def test_rendered_custom_resources_validate_against_upstream_crds(
    values: dict[str, Any] | None,
) -> None:
    if not mu.crds_available():
        pytest.skip(f"no CRD schemas at {mu.SHARED_CRDS} (outside the repository)")
    custom = [d for d in render(values) if not mu.is_builtin(d)]
    for doc in custom:
        if mu.has_crd(doc):
            mu.validate_custom(doc)
        else:
            assert (doc["apiVersion"], doc["kind"]) in VALIDATED_WITHOUT_A_CRD, (
                f"no CRD for {doc['apiVersion']} {doc['kind']} in {mu.SHARED_CRDS}"
            )
        mu.validate_metadata(doc, mu.KUBERNETES_VERSIONS[-1])


@pytest.mark.parametrize("values", value_sets())
def test_rendered_config_is_a_valid_agent_config(values: dict[str, Any] | None) -> None:
    from prefetch.agent.config import parse_config

    [cm] = [d for d in render(values) if d["kind"] == "ConfigMap" and "models.yaml" in d["data"]]
    config = parse_config(cm["data"]["models.yaml"].encode(), path=Path("models.yaml"))
    assert config.models


# -- equivalence with the kustomize manifests ----------------------------------------------------


def normalised(doc: Doc) -> Doc:
    """``doc`` without the labels Helm adds, and the agent's models.yaml parsed.

    The labels go from metadata, selectors and pod templates alike (Helm's selectors carry the
    release as app.kubernetes.io/instance); models.yaml is compared as data because kustomize
    carries the file's comments and Helm writes the values out without them.
    """
    out = copy.deepcopy(doc)

    def drop(node: Any) -> None:
        if isinstance(node, dict):
            for field in ("labels", "matchLabels"):
                if isinstance(node.get(field), dict):
                    for label in HELM_LABELS:
                        node[field].pop(label, None)
            for value in node.values():
                drop(value)
        elif isinstance(node, list):
            for value in node:
                drop(value)

    drop(out)
    if out["kind"] == "Service":
        for label in HELM_LABELS:
            out["spec"].get("selector", {}).pop(label, None)
    if out["kind"] == "ConfigMap" and "models.yaml" in out.get("data", {}):
        out["data"]["models.yaml"] = yaml.safe_load(out["data"]["models.yaml"])
    if out["kind"] == "PrometheusRule":
        # kustomize writes a folded (>-) scalar back with a blank line before a more-indented
        # line, which changes its value by a newline; PromQL ignores whitespace.
        for group in out["spec"]["groups"]:
            for rule in group["rules"]:
                rule["expr"] = " ".join(str(rule["expr"]).split())
    return out


def assert_same_objects(chart: list[Doc], kustomize: list[Doc], what: str) -> None:
    ours = {k: normalised(d) for k, d in by_key(chart).items()}
    theirs = {k: normalised(d) for k, d in by_key(kustomize).items()}
    assert sorted(ours) == sorted(theirs), f"{what}: the chart and kustomize render other objects"
    for k in sorted(ours):
        if ours[k] != theirs[k]:
            diff = difflib.unified_diff(
                yaml.safe_dump(theirs[k], sort_keys=True).splitlines(),
                yaml.safe_dump(ours[k], sort_keys=True).splitlines(),
                f"kubectl kustomize ({what})",
                "helm template (charts/model-prefetch)",
                lineterm="",
            )
            pytest.fail(f"{k[0]} {k[1]}/{k[2]} differs:\n" + "\n".join(diff))


def _kustomize(directory: str) -> list[Doc]:
    if mu.kubectl() is None:
        pytest.skip("kubectl is not installed")
    return mu.kustomize_build(REPO / directory)


def test_defaults_render_what_kustomize_renders_for_daemonset() -> None:
    """Every object of `kubectl kustomize daemonset/`, field for field, but the Namespace.

    The Namespace is the one designed difference: Helm users create it with `--create-namespace`
    (a chart that also rendered it would fail that install), so the chart renders it only with
    namespace.create, and then the same as kustomize's.
    """
    kustomize = _kustomize("daemonset")
    namespaces = [d for d in kustomize if d["kind"] == "Namespace"]
    rest = [d for d in kustomize if d["kind"] != "Namespace"]
    assert_same_objects(render(), rest, "daemonset/")
    created = [d for d in render({"namespace": {"create": True}}) if d["kind"] == "Namespace"]
    assert_same_objects(created, namespaces, "daemonset/ Namespace")


def test_mirror_renders_what_kustomize_renders_for_deploy_mirror() -> None:
    kustomize = [d for d in _kustomize("deploy/mirror") if d["kind"] != "Namespace"]
    job = mu.one("Job", under="deploy/mirror")
    cronjob = mu.one("CronJob", under="deploy/mirror")
    service_account = mu.one("ServiceAccount", under="deploy/mirror")
    job_args = mu.container(job)["args"]
    cron_args = mu.container(cronjob["spec"]["jobTemplate"])["args"]
    values = {
        "monitoring": {"podMonitor": {"enabled": False}},
        "mirror": {
            "enabled": True,
            "serviceAccount": {
                "name": mu.name(service_account),
                "annotations": service_account["metadata"]["annotations"],
            },
            "awsRegion": mu.env_value(mu.container(job), "AWS_REGION"),
            "jobs": [
                {"name": mu.name(job), "source": job_args[1], "destination": job_args[2]},
                {
                    "name": mu.name(cronjob),
                    "source": cron_args[1],
                    "destination": cron_args[2],
                    "schedule": cronjob["spec"]["schedule"],
                },
            ],
        },
    }
    namespace = job["metadata"]["namespace"]
    mirror = [
        d
        for d in render(values, namespace=namespace)
        if (d["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "mirror"
    ]
    assert_same_objects(mirror, kustomize, "deploy/mirror/")


@pytest.mark.parametrize("name", ["prometheusrule.yaml", "dashboard.json"])
def test_chart_files_are_deploy_monitorings(name: str) -> None:
    """The chart carries deploy/monitoring's files as they are (Helm reads only its own folder)."""
    source = REPO / "deploy" / "monitoring" / name
    copied = CHART / "files" / name
    assert copied.read_bytes() == source.read_bytes(), (
        f"{copied.relative_to(REPO)} is not {source.relative_to(REPO)}: copy it again"
    )


def test_monitoring_renders_what_kustomize_renders_for_deploy_monitoring() -> None:
    values = {"monitoring": {"prometheusRule": {"enabled": True}, "dashboard": {"enabled": True}}}
    monitoring = [
        d
        for d in render(values)
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "monitoring"
    ]
    [rule] = [d for d in monitoring if d["kind"] == "PrometheusRule"]
    assert rule["spec"] == mu.one("PrometheusRule", under="deploy/monitoring")["spec"]
    assert_same_objects(monitoring, _kustomize("deploy/monitoring"), "deploy/monitoring/")


def test_prometheus_rule_names_this_releases_job_and_service_account() -> None:
    values = {"monitoring": {"prometheusRule": {"enabled": True}}}
    [rule] = [
        d for d in render(values, release="gpu", namespace="ml") if d["kind"] == "PrometheusRule"
    ]
    text = json.dumps(rule["spec"])
    assert 'up{job=\\"ml/gpu-model-prefetch-agent\\"}' in text
    assert "model-prefetch/model-prefetch-agent" not in text
    assert "serviceaccount:{{ $labels.namespace }}:gpu-model-prefetch-agent" in text
    # the alerts' own templates reach Prometheus untouched
    assert "{{ $labels.node }}" in text


# -- values --------------------------------------------------------------------------------------


SCHEMA_ERROR = "values don't meet the specifications of the schema(s) in the following chart(s):"


@pytest.mark.parametrize(
    ("values_file", "message"),
    [
        (
            "config:\n  concurency: 16\n",
            "- at '/config': additional properties 'concurency' not allowed",
        ),
        ('config:\n  concurrency: "16"\n', "- at '/config/concurrency': got string, want integer"),
        ("imag:\n  tag: 0.2.0\n", "- at '': additional properties 'imag' not allowed"),
        (
            'monitoring:\n  podMonitor:\n    enabled: "no"\n',
            "- at '/monitoring/podMonitor/enabled': got string, want boolean",
        ),
        (
            "config:\n  models:\n    - name: Llama_70B\n      source: hf://org/name\n",
            "- at '/config/models/0/name': 'Llama_70B' does not match pattern",
        ),
    ],
    ids=["unknown-config-key", "config-type", "unknown-top-key", "bool-type", "model-name"],
)
def test_schema_rejects_a_bad_values_file_with_helms_message(
    values_file: str, message: str
) -> None:
    values = helm.values_from_yaml(values_file)
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    text = str(caught.value)
    assert text.startswith(SCHEMA_ERROR) and f"\nmodel-prefetch:\n{message}" in text, text
    report = helm.lint(CHART, values)
    assert any(message.removeprefix("- ") in e for e in report["errors"]), report


def schema_refusal(values: dict[str, Any]) -> str:
    """Helm's message refusing ``values`` (the test fails if they render)."""
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return str(caught.value)


#: Every scheme a model's source takes, a registry mirror, and a mirror Job pushing to one.
EVERY_SCHEME: dict[str, Any] = {
    "config": {
        "models": [
            {
                "name": "llama",
                "source": "oci://registry.example.com/models/llama:v1",
                "hfRepo": "org/llama",
                "mirrors": ["oci://127.0.0.1:30020"],
            },
            {
                "name": "qwen",
                "source": "hf://Qwen/Qwen2.5-0.5B",
                "mirrors": "s3://mirror/hf/Qwen/Qwen2.5-0.5B/",
            },
            {"name": "plain", "source": "s3://bucket/models/plain/"},
            {"name": "local", "source": "file:///mnt/models/local/", "hfRepo": "org/local"},
        ]
    },
    "mirror": {
        "enabled": True,
        "jobs": [
            {
                "name": "push-qwen",
                "source": "hf://Qwen/Qwen2.5-0.5B@main",
                "destination": "oci://registry.example.com/models/qwen:main",
            },
            {
                "name": "copy-llama",
                "source": "oci://registry.example.com/models/llama:v1",
                "destination": "s3://mirror/llama/",
            },
        ],
    },
}


def test_every_source_scheme_and_registry_mirror_renders_and_is_read_by_the_agent() -> None:
    """Before: the schema allowed only hf:// and s3:// sources and s3:// mirrors."""
    from prefetch.agent.config import parse_config

    [cm] = [
        d for d in render(EVERY_SCHEME) if d["kind"] == "ConfigMap" and "models.yaml" in d["data"]
    ]
    config = parse_config(cm["data"]["models.yaml"])
    assert [m.source.scheme for m in config.models] == ["oci", "hf", "s3", "file"]
    assert [str(m) for m in config.models[0].mirrors] == ["oci://127.0.0.1:30020"]


#: Values the agent refuses at start (every node would crash-loop): the chart must refuse them.
REFUSED_BY_THE_AGENT = [
    *[
        (key, value)
        for key in ("chunkSize", "minRate", "verifyReadRate", "minFreeSpace", "warmReadRate")
        for value in (-1, "50 gigs", "1.5 GB/s", "")
    ],
    *[
        (key, value)
        for key in (
            "stallTimeout",
            "syncDeadline",
            "verifyInterval",
            "resolveInterval",
            "supersededGrace",
            "retryBackoff.initial",
            "retryBackoff.max",
        )
        for value in (-30, "30 secs", "-5m", "10m 30s")
    ],
    *[(key, value) for key in ("stallTimeout", "retryBackoff.initial") for value in (0, "0s")],
    ("chunkSize", 1024),
    ("labelPrefix", "Model_Prefetch"),
    ("startupTaint", "a/b/c"),
    ("listen", "0.0.0.0:99999"),
    ("concurrency", 0),
    ("warmMemoryShare", 0),
    ("s3", {"endpointUrl": "minio:9000"}),
    ("models", [{"name": "a", "source": "ftp://host/model"}]),
    ("models", [{"name": "a", "source": "file://host/model"}]),
    ("models", [{"name": "a", "source": "file:///"}]),
    ("models", [{"name": "a", "source": "hf://org/name", "mirrors": ["hf://org/other"]}]),
    ("models", [{"name": "a", "source": "hf://org/name", "include": [""]}]),
    ("models", [{"name": "a", "source": "hf://org/name", "mirrors": ["oci://registry.io"]}]),
    ("models", [{"name": "a", "source": "oci://registry.io/a:v1", "mirrors": ["s3://bkt/a/"]}]),
    ("models", [{"name": "a", "source": "s3://bkt/a/", "mirrors": ["s3://bkt/b/"]}]),
    ("models", [{"name": "a", "source": "hf://org/name", "hubFallback": False}]),
    ("models", [{"name": "a", "source": "hf://org/name", "hfRepo": "org/other"}]),
    ("models", [{"name": "a", "source": "s3://bkt/a/", "proxy": "socks5://proxy:1080"}]),
    ("models", [{"name": "a", "source": "oci://registry.io/a:v1", "mirrors": ["oci://m.io/a:v1"]}]),
]


def _nested(key: str, value: Any) -> dict[str, Any]:
    head, _, rest = key.partition(".")
    return {head: _nested(rest, value) if rest else value}


@pytest.mark.parametrize(("key", "value"), REFUSED_BY_THE_AGENT)
def test_the_chart_refuses_what_the_agent_refuses(key: str, value: Any) -> None:
    """Before: eleven keys took any string or number, and the agent exited 1 on every node."""
    from prefetch.agent.config import parse_config
    from prefetch.support.errors import ConfigError

    config = _nested(key, value)
    with pytest.raises(ConfigError):
        parse_config(yaml.safe_dump(config))
    text = schema_refusal({"config": config})
    assert text.startswith(SCHEMA_ERROR) and f"at '/config/{key.split('.')[0]}" in text, text


_CACHE = {"name": "cc", "source": "s3://bkt/cc/", "vllm": "0.6.3", "model": "org/m"}
_CACHE["revision"] = "a" * 40

#: Configs every key of which the schema accepts alone, that the agent refuses for a rule about
#: several keys at once (templates/_checks.tpl): the chart must refuse them, naming the key.
REFUSED_ACROSS_KEYS = [
    ({"retryBackoff": {"initial": "10m", "max": "1m"}}, "config.retryBackoff.max: must not be"),
    ({"retryBackoff": {"initial": "1h"}}, "config.retryBackoff.max: must not be"),  # max 10m
    ({"retryBackoff": {"max": "5s"}}, "config.retryBackoff.max: must not be"),  # initial 10s
    ({"retryBackoff": {"initial": "1m1h", "max": 3600}}, "config.retryBackoff.max: must not"),
    (
        {"models": [{"name": "a", "source": "hf://o/x"}, {"name": "a", "source": "hf://o/y"}]},
        "config.models[1].name: duplicate model name",
    ),
    (
        {"models": [{"name": "a", "source": "hf://o/x"}, {"name": "b", "source": "hf://O/X@v2"}]},
        "config.models[1] (b): same Hub repo as config.models[0]",
    ),
    (
        {
            "models": [
                {"name": "a", "source": "oci://r.io/x:v1", "hfRepo": "o/x"},
                {"name": "b", "source": "s3://bkt/x/", "hfRepo": "o/x"},
            ]
        },
        "config.models[1] (b): same Hub repo as config.models[0]",
    ),
    (
        {"models": [{"name": "cc", "source": "hf://o/x"}], "compileCaches": [_CACHE]},
        'config.compileCaches[0].name: "cc" is also a model\'s name',
    ),
    ({"compileCaches": [{**_CACHE, "push": True}]}, "config.compileCaches[0].pushFrom: push"),
    (
        {"compileCaches": [_CACHE, {**_CACHE, "source": "s3://bkt/other/"}]},
        "config.compileCaches[1].name: duplicate compile cache name",
    ),
    (
        {"compileCaches": [{**_CACHE, "push": True, "pushFrom": "cache/vllm"}]},
        "config.compileCaches[0].pushFrom: push",
    ),
]


@pytest.mark.parametrize(("config", "message"), REFUSED_ACROSS_KEYS)
def test_the_chart_refuses_what_the_agent_refuses_across_keys(
    config: dict[str, Any], message: str
) -> None:
    """Before: each key passed the schema alone, the chart rendered, and every agent exited 1
    at start (a duplicate model name, a backoff whose max is below its initial, ...)."""
    from prefetch.agent.config import parse_config
    from prefetch.support.errors import ConfigError

    with pytest.raises(ConfigError):
        parse_config(yaml.safe_dump(config))
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError) as caught:
        chart.render({"config": config}, name=RELEASE, namespace=NAMESPACE)
    assert message in str(caught.value), str(caught.value)
    # (`helm lint` only logs a template's `fail`, in its lint mode: install and template refuse.)


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:00"])
def test_listen_on_port_0_is_refused_by_the_chart(listen: str) -> None:
    """The agent takes port 0 (any free port; outside a cluster), but the chart makes it the
    container port the probes use. Before: rendered, and only the API server refused it."""
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError) as caught:
        chart.render({"config": {"listen": listen}}, name=RELEASE, namespace=NAMESPACE)
    assert "config.listen: port 0" in str(caught.value)


def test_two_mirror_jobs_of_one_name_are_refused() -> None:
    """Before: two Jobs of one name rendered, and the install failed at the API server."""
    job = {"name": "copy", "source": "hf://o/x", "destination": "s3://b/x/"}
    values = {"mirror": {"enabled": True, "jobs": [job, {**job, "source": "hf://o/y"}]}}
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert 'mirror.jobs[1].name: duplicate job name "copy"' in str(caught.value)


#: What those rules let through: the chart renders it and the agent reads it.
ACCEPTED_ACROSS_KEYS = [
    {"retryBackoff": {"initial": "10m"}},  # = the default max
    {"retryBackoff": {"max": "10s"}},  # = the default initial
    {"retryBackoff": {"initial": "1h", "max": "1h0m"}},
    {"retryBackoff": {"initial": 0.5, "max": "500ms"}},
    {"retryBackoff": {"initial": "1h30m", "max": "1.5h"}},
    {"models": [{"name": "a", "source": "hf://o/x"}, {"name": "b", "source": "hf://o/xy"}]},
    {"models": [{"name": "cc", "source": "hf://o/x"}], "compileCaches": [{**_CACHE, "name": "d"}]},
    {"compileCaches": [{**_CACHE, "push": True, "pushFrom": "/var/cache/vllm"}]},
    {"compileCaches": [{**_CACHE, "push": False, "pushFrom": "relative"}]},
]


@pytest.mark.parametrize("config", ACCEPTED_ACROSS_KEYS)
def test_the_chart_renders_what_the_agent_accepts_across_keys(config: dict[str, Any]) -> None:
    from prefetch.agent.config import parse_config

    [cm] = [
        d
        for d in render({"config": config})
        if d["kind"] == "ConfigMap" and "models.yaml" in d["data"]
    ]
    parse_config(cm["data"]["models.yaml"])


@pytest.mark.parametrize(
    ("values", "at"),
    [
        ({"resources": {"limits": {"memory": "768 MB"}}}, "/resources/limits/memory"),
        ({"warmPageCache": {"memoryLimit": "768 MB"}}, "/warmPageCache/memoryLimit"),
        ({"resources": {"requests": {"cpu": "0.5 cores"}}}, "/resources/requests/cpu"),
        ({"mirror": {"resources": {"limits": {"memory": "2GB"}}}}, "/mirror/resources/limits"),
        ({"tolerations": [{"key": "gpu", "operator": "Exist"}]}, "/tolerations/0/operator"),
        ({"tolerations": [{"key": "gpu", "efect": "NoSchedule"}]}, "/tolerations/0"),
        ({"image": {"repository": "ghcr.io/x/y", "tag": "v1 latest"}}, "/image/tag"),
        ({"imagePullSecrets": ["registry"]}, "/imagePullSecrets/0"),
        ({"monitoring": {"podMonitor": {"interval": "15 s"}}}, "/monitoring/podMonitor/interval"),
        ({"podLabels": {"team": "ml platform"}}, "/podLabels/team"),
        ({"commonLabels": {"cost-center": "x" * 64}}, "/commonLabels/cost-center"),
        ({"commonLabels": {"cost center": "ml"}}, "invalid propertyName 'cost center'"),
        (
            {"monitoring": {"podMonitor": {"labels": {"release": "kube prometheus"}}}},
            "/monitoring/podMonitor/labels/release",
        ),
        ({"podAnnotations": {"example.com/a b": "x"}}, "invalid propertyName 'example.com/a b'"),
        ({"serviceAccount": {"name": "Agent_SA"}}, "/serviceAccount/name"),
        ({"credentials": {"secretName": "hub and s3"}}, "/credentials/secretName"),
        ({"fullnameOverride": "Prefetch"}, "/fullnameOverride"),
        (
            {
                "mirror": {
                    "jobs": [
                        {
                            "name": "j",
                            "source": "hf://o/x",
                            "destination": "s3://b/x/",
                            "schedule": "every hour",
                        }
                    ]
                }
            },
            "/mirror/jobs/0/schedule",
        ),
    ],
    ids=[
        "memory",
        "warm-memory",
        "cpu",
        "mirror-memory",
        "operator",
        "toleration-key",
        "tag",
        "secret",
        "interval",
        "pod-label-value",
        "label-value-length",
        "label-key",
        "monitoring-label",
        "annotation-key",
        "service-account-name",
        "secret-name",
        "fullname",
        "cron",
    ],
)
def test_the_charts_own_values_are_checked(values: dict[str, Any], at: str) -> None:
    """Before: a memory of "768 MB" rendered, and only the API server would have refused it."""
    text = schema_refusal(values)
    # a bad key is named in the message, at '' (Helm's validator gives no path for it)
    assert f"at '{at}" in text if at.startswith("/") else at in text, text


def test_kubernetes_names_labels_and_schedules_render() -> None:
    job = {"name": "j", "source": "hf://o/x", "destination": "s3://b/x/"}
    render(
        {
            "fullnameOverride": "prefetch",
            "commonLabels": {"example.com/cost-center": "ml_1.a", "empty": ""},
            "podAnnotations": {"example.com/owner": "ML platform (team 1)"},
            "serviceAccount": {"name": "agent.sa"},
            "credentials": {"secretName": "hub-and-s3"},
            "mirror": {
                "enabled": True,
                "jobs": [
                    {**job, "schedule": "*/15 * * * *"},
                    {**job, "name": "k", "schedule": "@hourly"},
                    {**job, "name": "l", "schedule": "0 3 * * MON-FRI"},
                ],
            },
        }
    )


def test_kubernetes_quantities_render() -> None:
    quantities = ["768Mi", "1Gi", "500m", "0.5", 2, 1.5, "1e3", "+1k", ".5Gi", "129M"]
    for quantity in quantities:
        render({"resources": {"requests": {"cpu": quantity, "memory": quantity}}})
        [agent] = [
            d
            for d in render({"warmPageCache": {"memoryLimit": quantity}})
            if mu.is_builtin(d) and d["kind"] == "DaemonSet"
        ]
        assert mu.pod_spec(agent)["containers"][0]["resources"]["limits"]["memory"] == quantity


def test_schema_lists_exactly_the_agents_config_keys() -> None:
    """A key the agent gains or loses must be added to or removed from values.schema.json."""
    from prefetch.agent import config_tables

    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    config = schema["properties"]["config"]
    assert set(config["properties"]) == set(config_tables.TOP.keys)
    assert set(config["properties"]["models"]["items"]["properties"]) == set(
        config_tables.MODEL.keys
    )
    assert set(config["properties"]["retryBackoff"]["properties"]) == set(
        config_tables.BACKOFF.keys
    )
    assert set(config["properties"]["s3"]["properties"]) == set(config_tables.S3.keys)


def test_default_config_is_daemonsets_models_yaml() -> None:
    """The chart's default model list is the kustomize one (without kubectl too)."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    models_yaml = yaml.safe_load((REPO / "daemonset" / "models.yaml").read_text(encoding="utf-8"))
    assert defaults["config"] == models_yaml


def test_other_release_and_namespace_keep_the_events_role_in_default() -> None:
    docs = by_key(render(release="gpu", namespace="ml"))
    agent = "gpu-model-prefetch-agent"
    shared = f"{agent}-ml"  # outside the release's namespace: the namespace is in the name
    daemonset = docs[("DaemonSet", "ml", agent)]
    assert mu.pod_spec(daemonset)["serviceAccountName"] == agent
    subject = {"kind": "ServiceAccount", "name": agent, "namespace": "ml"}
    binding = docs[("RoleBinding", "default", f"{shared}-events")]
    assert binding["subjects"] == [subject]
    assert binding["roleRef"]["name"] == f"{shared}-events"
    cluster_binding = docs[("ClusterRoleBinding", "", shared)]
    assert cluster_binding["subjects"] == [subject]
    assert cluster_binding["roleRef"]["name"] == shared
    assert ("ClusterRole", "", shared) in docs
    assert docs[("Role", "default", f"{shared}-events")]["rules"] == [
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]}
    ]
    selector = daemonset["spec"]["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/instance"] == "gpu", "two releases must not share pods"


def test_two_releases_of_one_name_in_two_namespaces_share_no_object() -> None:
    """The events Role and RoleBinding in ``default`` and the cluster-scoped ClusterRole and its
    binding: one release would take the other's (Helm refuses the second install)."""
    values = {"namespace": {"create": True}, "mirror": EVERYTHING["mirror"]}
    first = {key(d) for d in render(values, release="gpu", namespace="ml")}
    second = {key(d) for d in render(values, release="gpu", namespace="ml-2")}
    assert not first & second, sorted(first & second)


def test_everything_values_reach_the_objects() -> None:
    docs = render(EVERYTHING)
    [ds] = [d for d in docs if d["kind"] == "DaemonSet"]
    c = mu.container(ds)
    assert c["image"] == f"ghcr.io/model-prefetch/model-prefetch@{EVERYTHING['image']['digest']}"
    assert mu.named_port(c, "http") == 9090, "config.listen sets the container port"
    [service] = [d for d in docs if d["kind"] == "Service"]
    assert service["spec"]["ports"][0]["port"] == 9090
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for e in c["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert refs == {"hub-and-s3"}
    assert mu.env_value(c, "PREFETCH_LOG_LEVEL") == "debug"
    spec = mu.pod_spec(ds)
    assert spec["volumes"][-1] == EVERYTHING["extraVolumes"][0]  # a file:// source's volume
    assert c["volumeMounts"][-1] == EVERYTHING["extraVolumeMounts"][0]
    assert spec["priorityClassName"] == "gpu-critical"
    assert spec["nodeSelector"] == {"karpenter.sh/nodepool": "gpu"}
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "PrometheusRule", "CronJob", "Secret"} <= kinds
    extras = {"model-prefetch-extra", "model-prefetch-notes"}
    assert extras <= {mu.name(d) for d in docs}, "extraObjects, through tpl"
    for doc in docs:
        if mu.name(doc) not in extras:
            assert doc["metadata"]["labels"]["cost-center"] == "ml", key(doc)


def test_service_account_can_be_brought_along() -> None:
    values = {"serviceAccount": {"create": False, "name": "existing"}}
    docs = render(values)
    assert not [d for d in docs if d["kind"] == "ServiceAccount"]
    [ds] = [d for d in docs if d["kind"] == "DaemonSet"]
    assert mu.pod_spec(ds)["serviceAccountName"] == "existing"
    with (
        helm.Chart.load(CHART) as chart,
        pytest.raises(helm.HelmRenderError, match=r"serviceAccount\.name"),
    ):
        chart.render({"serviceAccount": {"create": False}}, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_mirrors_are_where_the_agent_pulls_from(path: Path) -> None:
    """What an example's mirror Job writes is a mirror of one of its models, at its revision."""
    values = example_values(path)
    models = values["config"]["models"]
    for job in values.get("mirror", {}).get("jobs", []):
        repo, _, revision = job["source"].partition("@")
        model = next((m for m in models if m["source"] == repo), None)
        assert model is not None, f"{job['name']}: no model has the source {repo}"
        mirrors = [m.rstrip("/") for m in model.get("mirrors", [])]
        assert job["destination"].rstrip("/") in mirrors, f"{job['name']}: not in the mirrors"
        if "schedule" not in job:
            assert revision == model.get("revision"), f"{job['name']}: mirrors another revision"


def test_there_is_an_example_with_a_mirror() -> None:
    assert any(example_values(p).get("mirror", {}).get("jobs") for p in EXAMPLES)


def test_chart_readme_documents_every_value() -> None:
    """Each value (to the second level) is in the README's table: `a.b`, or `a.b` then `.c`."""
    readme = (CHART / "README.md").read_text(encoding="utf-8")
    defaults = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    free_form = {"config", "affinity", "resources", "nodeSelector", "podAnnotations", "podLabels"}
    for top, value in defaults.items():
        subs = list(value) if isinstance(value, dict) and top not in free_form else []
        for path in [f"{top}.{sub}" for sub in subs] or [top]:
            sub = path.rpartition(".")[2] if "." in path else None
            shown = (f"`{path}`", f"`{path}.", f"`{top}.*`") + ((f"`.{sub}`",) if sub else ())
            assert any(s in readme for s in shown), f"charts/model-prefetch/README.md: {path}"


def test_warm_page_cache_memory_limit_is_the_agent_s_memory_limit() -> None:
    """The page cache a warm-up reads is charged to the agent's memory cgroup: the chart lets
    a user give the agent the memory its warmed models need (and the kustomize overlay
    deploy/warm-page-cache/ does the same), and says so when models warm without it."""
    warm_model = {"name": "a", "source": "s3://bkt/a", "warmPageCache": True}
    values = {"warmPageCache": {"memoryLimit": "33280Mi"}, "config": {"models": [warm_model]}}
    [ds] = [d for d in render(values) if d["kind"] == "DaemonSet"]
    resources = mu.container(ds)["resources"]
    assert resources["limits"] == {"cpu": "4", "memory": "33280Mi"}
    assert resources["requests"] == {"cpu": "250m", "memory": "256Mi"}
    [default] = [d for d in render() if d["kind"] == "DaemonSet"]
    assert mu.container(default)["resources"]["limits"]["memory"] == "512Mi"
    with helm.Chart.load(CHART) as chart:
        unsized = chart.render({"config": {"models": [warm_model]}}, name=RELEASE,
                               namespace=NAMESPACE)  # fmt: skip
        sized = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    notes = next(text for path, text in unsized.items() if path.endswith("NOTES.txt"))
    assert "warmPageCache.memoryLimit" in notes and "(512Mi)" in notes
    assert "warmPageCache.memoryLimit" not in next(
        text for path, text in sized.items() if path.endswith("NOTES.txt")
    )
    if mu.kubectl() is None:
        pytest.skip("kubectl is not installed")
    [overlay] = [d for d in mu.kustomize_build(REPO / "deploy" / "warm-page-cache")
                 if d["kind"] == "DaemonSet"]  # fmt: skip
    assert mu.container(overlay)["resources"]["limits"]["memory"] == "33280Mi"
