"""The Kubernetes manifests (daemonset/, deploy/), the agent image (Dockerfile) and how they fit
together with the agent, its config and the node bootstrap.

Validation: built-in kinds against the Kubernetes OpenAPI schemas (kubernetes-validate, strict),
custom resources against the upstream CRDs in <repo>/../shared/crds (skipped when absent), and
the output of ``kubectl kustomize`` the same way. Consistency: every value that two places must
agree on is read from both places (the agent's models.yaml, prefetch.support.constants, the
bootstrap script, the NodePool, the Dockerfile, pyproject.toml), never restated here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from prefetch.support import constants
from tests import manifests_util as mu

REPO = mu.REPO
MODELS_FILE = REPO / "daemonset" / "models.yaml"
BOOTSTRAP_SCRIPT = REPO / "bootstrap" / "setup-local-nvme.sh"
USER_DATA = REPO / "bootstrap" / "user-data.mime"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
PYPROJECT = REPO / "pyproject.toml"

MANIFESTS = mu.manifests()
BUILTIN = [m for m in MANIFESTS if mu.is_builtin(m.doc)]
CUSTOM = [m for m in MANIFESTS if not mu.is_builtin(m.doc)]


def _ids(items: list[mu.Manifest]) -> list[str]:
    return [m.id for m in items]


# -- parsing and schema validation ---------------------------------------------------------------


def test_there_are_manifests() -> None:
    kinds = {m.doc["kind"] for m in MANIFESTS}
    expected = {
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
        "Service",
        "PodMonitor",
        "Deployment",
        "ScaledObject",
        "NodePool",
        "EC2NodeClass",
        "Job",
        "CronJob",
    }
    assert expected <= kinds, f"missing kinds: {expected - kinds}"


@pytest.mark.parametrize("path", mu.yaml_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_yaml_file_parses(path: Path) -> None:
    docs = mu.load_all(path)
    assert docs, f"{path} has no YAML document"
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: a document is not a mapping"


@pytest.mark.parametrize("version", mu.KUBERNETES_VERSIONS)
@pytest.mark.parametrize("manifest", BUILTIN, ids=_ids(BUILTIN))
def test_builtin_kinds_validate(manifest: mu.Manifest, version: str) -> None:
    mu.validate_builtin(manifest.doc, version)


#: Custom resources whose CRD is not in ../shared/crds, and the test that checks their content.
VALIDATED_WITHOUT_A_CRD = {
    ("monitoring.coreos.com/v1", "PrometheusRule"): "tests/test_monitoring.py: promtool check "
    "rules and promtool test rules on its groups",
}


@pytest.mark.parametrize("manifest", CUSTOM, ids=_ids(CUSTOM))
def test_custom_resources_validate_against_upstream_crds(manifest: mu.Manifest) -> None:
    if not mu.crds_available():
        pytest.skip(f"no CRD schemas at {mu.SHARED_CRDS} (outside the repository)")
    key = (manifest.doc["apiVersion"], manifest.doc["kind"])
    if not mu.has_crd(manifest.doc):
        # ../shared/crds lists only some CRDs; a kind without one must be checked another way
        assert key in VALIDATED_WITHOUT_A_CRD, f"no CRD for {key} in {mu.SHARED_CRDS}"
        mu.validate_metadata(manifest.doc, mu.KUBERNETES_VERSIONS[-1])
        return
    mu.validate_custom(manifest.doc)
    mu.validate_metadata(manifest.doc, mu.KUBERNETES_VERSIONS[-1])


def test_nodepool_cel_rules_checked_by_hand() -> None:
    """NodePool CEL rules a schema check cannot see: Gt/Lt values, restricted label domains."""
    if not mu.crds_available():
        pytest.skip(f"no CRD schemas at {mu.SHARED_CRDS} (outside the repository)")
    allowed: dict[str, set[str]] = {}
    for domain in ("karpenter.sh", "karpenter.k8s.aws"):
        rules = mu.cel_rules("NodePool", f'label domain "{domain}" is restricted')
        assert rules, f"the NodePool CRD no longer restricts the label domain {domain}"
        allowed[domain] = set(re.findall(rf'"({re.escape(domain)}/[^"]+)"', rules[0]))
    requirements = mu.one("NodePool")["spec"]["template"]["spec"]["requirements"]
    for req in requirements:
        key, operator, values = req["key"], req["operator"], req.get("values", [])
        domain = key.split("/", 1)[0] if "/" in key else ""
        for restricted, keys in allowed.items():
            if domain.endswith(restricted):
                assert key in keys, f"{key}: Karpenter does not let a NodePool select on it"
        if operator in ("Gt", "Lt", "Gte", "Lte"):
            assert len(values) == 1 and values[0].isdigit(), f"{key} {operator}: one integer"
        if operator == "In":
            assert values, f"{key} In: needs values"


@pytest.mark.parametrize("directory", mu.kustomize_dirs(), ids=lambda p: str(p.relative_to(REPO)))
def test_kustomize_builds_and_its_output_validates(directory: Path) -> None:
    if mu.kubectl() is None:
        pytest.skip("kubectl is not installed")
    docs = mu.kustomize_build(directory)
    assert docs, f"kubectl kustomize {directory} produced nothing"
    for doc in docs:
        if mu.is_builtin(doc):
            for version in mu.KUBERNETES_VERSIONS:
                mu.validate_builtin(doc, version)
        elif mu.crds_available() and mu.has_crd(doc):
            mu.validate_custom(doc)


def test_kustomize_daemonset_carries_models_yaml_unchanged() -> None:
    """The agent's ConfigMap is generated from daemonset/models.yaml, byte for byte."""
    if mu.kubectl() is None:
        pytest.skip("kubectl is not installed")
    docs = mu.kustomize_build(REPO / "daemonset")
    configmaps = mu.find("ConfigMap", docs=docs)
    daemonset = mu.one("DaemonSet", under="daemonset")
    volume = next(v for v in mu.pod_spec(daemonset)["volumes"] if "configMap" in v)
    cm = next(c for c in configmaps if mu.name(c) == volume["configMap"]["name"])
    assert cm["data"]["models.yaml"] == MODELS_FILE.read_text(encoding="utf-8")
    # every namespaced object in the agent's namespace, but the events Role and its binding,
    # which kustomize must leave in "default" (where Events about a Node live)
    namespaces = {
        (d["kind"], d["metadata"].get("namespace"))
        for d in docs
        if d["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding")
    }
    assert {ns for kind, ns in namespaces if kind not in ("Role", "RoleBinding")} == {
        "model-prefetch"
    }
    assert {ns for kind, ns in namespaces if kind in ("Role", "RoleBinding")} == {"default"}


# -- the agent's config, as the agent reads it ---------------------------------------------------


def _agent_config() -> dict[str, Any]:
    doc = yaml.safe_load(MODELS_FILE.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def _label_prefix() -> str:
    return _agent_config().get("labelPrefix", constants.DEFAULT_LABEL_PREFIX)


def _startup_taint_key() -> str:
    return _agent_config().get("startupTaint", constants.DEFAULT_STARTUP_TAINT_KEY)


def _label_key(model_name: str) -> str:
    try:
        from prefetch.agent.node import label_key
    except ImportError:  # the NodeGate module is optional here; this is its documented rule
        return f"{_label_prefix()}/{model_name}"
    return label_key(_label_prefix(), model_name)


def _ready_value() -> str:
    try:
        from prefetch.agent.node import READY_VALUE
    except ImportError:
        return "ready"
    return READY_VALUE


def test_models_yaml_is_a_valid_agent_config() -> None:
    from prefetch.agent.config import parse_config

    config = parse_config(MODELS_FILE.read_bytes(), path=MODELS_FILE)
    assert config.models, "the example config has no model"
    assert any(m.required for m in config.models)


# -- the gate: labels, taints, affinity ----------------------------------------------------------


def _nodepool_spec() -> dict[str, Any]:
    return mu.one("NodePool")["spec"]["template"]["spec"]


def test_startup_taint_agrees_across_config_nodepool_and_daemonset() -> None:
    key = _startup_taint_key()
    taint = {"key": key, "effect": constants.DEFAULT_STARTUP_TAINT_EFFECT}
    startup = _nodepool_spec().get("startupTaints", [])
    assert [(t["key"], t["effect"]) for t in startup] == [(key, taint["effect"])], (
        f"the NodePool's startupTaints must be exactly the agent's taint {key}:{taint['effect']}"
    )
    daemonset = mu.one("DaemonSet")
    assert mu.tolerates(mu.pod_spec(daemonset).get("tolerations", []), startup[0]), (
        "the agent must tolerate the startup taint it removes"
    )
    vllm = mu.one("Deployment", under="deploy/vllm")
    assert not mu.tolerates(mu.pod_spec(vllm).get("tolerations", []), startup[0]), (
        "vLLM must not tolerate the startup taint: it is what keeps it off a warming node"
    )


def test_daemonset_and_vllm_tolerate_the_nodepool_taints() -> None:
    taints = _nodepool_spec().get("taints", [])
    assert taints, "the GPU NodePool should taint its nodes"
    for workload in (mu.one("DaemonSet"), mu.one("Deployment", under="deploy/vllm")):
        for taint in taints:
            assert mu.tolerates(mu.pod_spec(workload).get("tolerations", []), taint), (
                f"{mu.name(workload)} does not tolerate {taint}"
            )


def _vllm_gate() -> tuple[str, str]:
    """(label key, model name) of vLLM's required ready-label affinity."""
    vllm = mu.one("Deployment", under="deploy/vllm")
    terms = mu.required_node_terms(vllm)
    assert len(terms) == 1, "vLLM should have one required nodeSelectorTerm (terms are ORed)"
    prefix = _label_prefix() + "/"
    gates = [e for e in terms[0] if e["key"].startswith(prefix)]
    assert len(gates) == 1, f"vLLM should require exactly one {prefix}<model> label"
    gate = gates[0]
    assert gate["operator"] == "In" and gate["values"] == [_ready_value()], gate
    return gate["key"], gate["key"][len(prefix) :]


def test_vllm_affinity_names_a_required_model_of_the_config() -> None:
    key, model_name = _vllm_gate()
    models = {m["name"]: m for m in _agent_config().get("models", [])}
    assert model_name in models, f"vLLM waits for {model_name!r}, which models.yaml does not list"
    assert key == _label_key(model_name), f"the agent labels this model {_label_key(model_name)}"
    # A model a workload depends on must gate the startup taint: Karpenter treats the node as
    # initialized (and compares real node labels) only once the taint is gone.
    assert models[model_name].get("required", True), f"{model_name} should be required: true"


def test_vllm_loads_the_model_the_agent_warms() -> None:
    _, model_name = _vllm_gate()
    model = next(m for m in _agent_config()["models"] if m["name"] == model_name)
    source = model["source"]
    repo_id = model.get("hfRepo") or source.removeprefix("hf://").split("@", 1)[0]
    c = mu.container(mu.one("Deployment", under="deploy/vllm"))
    assert c.get("command") == ["vllm", "serve"], "the model id is `vllm serve`'s argument"
    positional = c["args"][0]
    assert positional == repo_id, f"vLLM serves {positional!r}, the agent warms {repo_id!r}"


def test_nodepool_declares_the_ready_labels_workloads_select() -> None:
    """Karpenter only launches nodes for pods whose node-affinity labels the NodePool knows."""
    key, _ = _vllm_gate()
    reqs = {r["key"]: r for r in _nodepool_spec()["requirements"]}
    assert key in reqs, f"add `{{key: {key}, operator: Exists}}` to the NodePool requirements"
    req = reqs[key]
    assert req["operator"] == "Exists" or (
        req["operator"] == "In" and _ready_value() in req.get("values", [])
    ), req


def test_daemonset_runs_on_the_nodepool_nodes() -> None:
    labels = mu.one("NodePool")["spec"]["template"].get("metadata", {}).get("labels", {})
    terms = mu.required_node_terms(mu.one("DaemonSet"))
    assert terms, "the agent should only run on nodes with the cache volume"

    def matches(expr: dict[str, Any]) -> bool:
        op, key = expr["operator"], expr["key"]
        if op == "In":
            return labels.get(key) in expr["values"]
        if op == "Exists":
            return key in labels
        return False

    assert any(all(matches(e) for e in term) for term in terms), (
        f"no DaemonSet nodeSelectorTerm matches the NodePool's node labels {labels}"
    )


# -- the cache path, from the bootstrap to the containers ----------------------------------------


def _bootstrap_defaults() -> dict[str, str]:
    assert BOOTSTRAP_SCRIPT.is_file(), f"{BOOTSTRAP_SCRIPT.relative_to(REPO)} is missing"
    return mu.shell_defaults(BOOTSTRAP_SCRIPT)


def test_cache_host_path_agrees_across_bootstrap_daemonset_and_vllm() -> None:
    defaults = _bootstrap_defaults()
    mount = defaults.get("LOCAL_NVME_MOUNT_POINT")
    cache = defaults.get("LOCAL_NVME_CACHE_DIR")
    assert mount and cache, "setup-local-nvme.sh: no LOCAL_NVME_MOUNT_POINT/CACHE_DIR defaults"
    bootstrap_path = cache if cache.startswith("/") else f"{mount.rstrip('/')}/{cache}"
    assert bootstrap_path == constants.HOST_CACHE_DIR
    for workload in (mu.one("DaemonSet"), mu.one("Deployment", under="deploy/vllm")):
        paths = {path for path, _, _ in mu.host_path_mounts(workload)}
        assert paths == {bootstrap_path}, f"{mu.name(workload)} mounts {paths}"


def _config_cache_dir() -> str:
    configured = _agent_config().get("cacheDir")
    if configured:
        return str(configured)
    from prefetch.agent.config_values import DEFAULT_CACHE_DIR

    return str(DEFAULT_CACHE_DIR)


def test_agent_mount_is_the_config_cache_dir() -> None:
    cache_dir = _config_cache_dir()
    daemonset = mu.one("DaemonSet")
    [(_, volume, mount)] = list(mu.host_path_mounts(daemonset))
    assert mount["mountPath"] == cache_dir
    assert not mount.get("readOnly"), "the agent writes the cache"
    c = mu.container(daemonset)
    override = mu.env_value(c, "PREFETCH_CACHE_DIR")
    assert override in (None, cache_dir), "PREFETCH_CACHE_DIR would override cacheDir"
    assert "--cache-dir" not in " ".join(c.get("args", [])), "--cache-dir would override cacheDir"
    assert volume["hostPath"].get("type") in ("Directory", "DirectoryOrCreate")


def test_vllm_reads_the_cache_offline_and_read_only() -> None:
    """The node's cache is HF_HOME, read-only. The one other mount of it (issue 24: the agent
    publishes what vLLM compiles, so VLLM_CACHE_ROOT must be on the node, where the agent sees
    it) is VLLM_CACHE_ROOT, writable, and only a subPath under vllm-cache/: vLLM never writes
    where the agent keeps models (hub/, models/)."""
    vllm = mu.one("Deployment", under="deploy/vllm")
    mounts = [m for _, _, m in mu.host_path_mounts(vllm)]
    [mount] = [m for m in mounts if "subPath" not in m]
    c = mu.container(vllm)
    assert mu.env_value(c, "HF_HOME") == mount["mountPath"]
    assert mount.get("readOnly") is True
    assert mu.env_value(c, "HF_HUB_OFFLINE") == "1"
    [compile_root] = [m for m in mounts if "subPath" in m]
    assert compile_root["subPath"].startswith("vllm-cache/")
    assert ".." not in compile_root["subPath"].split("/")
    assert mu.env_value(c, "VLLM_CACHE_ROOT") == compile_root["mountPath"]


def test_vllm_keeps_the_extra_jit_caches_where_extra_dirs_publishes_them() -> None:
    """FLASHINFER_WORKSPACE_BASE and DG_JIT_CACHE_DIR are the subdirectories of VLLM_CACHE_ROOT
    that a compileCaches entry's extraDirs names (prefetch.publish.compile_cache.EXTRA_DIRS)."""
    from prefetch.publish.compile_cache import EXTRA_DIRS, extra_env

    c = mu.container(mu.one("Deployment", under="deploy/vllm"))
    root = mu.env_value(c, "VLLM_CACHE_ROOT")
    assert root
    for env, value in extra_env(root, EXTRA_DIRS).items():
        assert mu.env_value(c, env) == value, env


def test_bootstrap_gives_the_cache_dir_to_the_agent_uid() -> None:
    """The agent runs as a fixed non-root uid; the bootstrap must make the cache dir its own."""
    owner = _bootstrap_defaults().get("LOCAL_NVME_CACHE_OWNER")
    if USER_DATA.is_file():  # the user data may set it for the unit (/etc/sysconfig/...)
        found = re.findall(r"LOCAL_NVME_CACHE_OWNER=['\"]?(\d+:\d+)", USER_DATA.read_text())
        owner = found[-1] if found else owner
    assert owner, "setup-local-nvme.sh: no LOCAL_NVME_CACHE_OWNER default"
    uid, _, gid = owner.partition(":")
    ctx = mu.pod_spec(mu.one("DaemonSet"))["securityContext"]
    assert (int(uid), int(gid)) == (ctx["runAsUser"], ctx["runAsGroup"]), (
        f"the node bootstrap makes the cache directory {owner}, but the agent runs as "
        f"{ctx['runAsUser']}:{ctx['runAsGroup']} and cannot write it: make the bootstrap's "
        f"cache owner {ctx['runAsUser']}:{ctx['runAsGroup']} (the Dockerfile's uid)"
    )


# -- the agent's port, probes and flags ----------------------------------------------------------


def _listen_port() -> int:
    """The agent's port: --listen / PREFETCH_LISTEN, else the config's listen, else the default."""
    c = mu.container(mu.one("DaemonSet"))
    args = c.get("args", [])
    listen = (
        _flag(args, "--listen")
        or mu.env_value(c, "PREFETCH_LISTEN")
        or _agent_config().get("listen", constants.DEFAULT_LISTEN)
    )
    return int(listen.rsplit(":", 1)[1])


def test_agent_port_and_probes_match_the_agent() -> None:
    daemonset = mu.one("DaemonSet")
    c = mu.container(daemonset)
    liveness, readiness = c["livenessProbe"], c["readinessProbe"]
    assert liveness["httpGet"]["path"] == constants.HEALTHZ_PATH
    assert readiness["httpGet"]["path"] in (constants.HEALTHZ_PATH, constants.READYZ_PATH)
    for probe in (liveness, readiness, c.get("startupProbe")):
        if probe:
            assert mu.probe_port(c, probe) == _listen_port()
    if readiness["httpGet"]["path"] == constants.READYZ_PATH:
        # /readyz waits for the downloads: a rollout would wait for them on every node.
        assert daemonset["spec"]["updateStrategy"]["rollingUpdate"].get("maxUnavailable")

    service = mu.one("Service", under="daemonset")
    [port] = service["spec"]["ports"]
    target = port["targetPort"]
    assert (mu.named_port(c, target) if isinstance(target, str) else target) == _listen_port()

    monitor = mu.one("PodMonitor", under="daemonset")
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint.get("path", "/metrics") == constants.METRICS_PATH
    assert mu.named_port(c, endpoint["port"]) == _listen_port()
    template_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    for selector in (monitor["spec"]["selector"]["matchLabels"], service["spec"]["selector"]):
        assert selector.items() <= template_labels.items()


def _agent_command() -> click.Command:
    from prefetch import cli

    command = cli.main.get_command(click.Context(cli.main), "agent")
    assert command is not None, "the `agent` command is not registered in prefetch.cli"
    return command


def test_agent_environment_variables_are_agent_options() -> None:
    command = _agent_command()
    envvars: set[str] = set()
    for param in command.params:
        env = getattr(param, "envvar", None)
        envvars.update([env] if isinstance(env, str) else env or [])
    c = mu.container(mu.one("DaemonSet"))
    ours = {e["name"] for e in c.get("env", []) if e["name"].startswith("PREFETCH_")}
    assert ours <= envvars, f"not options of `prefetch agent`: {ours - envvars}"
    assert "NODE_NAME" in envvars
    node_name = next(e for e in c["env"] if e["name"] == "NODE_NAME")
    assert node_name["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    config_path = mu.env_value(c, "PREFETCH_CONFIG")
    option = next(p for p in command.params if "--config" in getattr(p, "opts", []))
    config_path = config_path or option.default
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert str(Path(config_path).parent) in mounts, "the config file's folder is not mounted"


def test_daemonset_args_are_accepted_by_the_agent() -> None:
    command = _agent_command()
    args = mu.container(mu.one("DaemonSet"))["args"]
    assert args[0] == "agent"
    ctx = command.make_context("agent", list(args[1:]), resilient_parsing=False)
    ctx.close()


# -- the agent pod's hardening -------------------------------------------------------------------


def test_daemonset_pod_hardening() -> None:
    daemonset = mu.one("DaemonSet")
    spec = mu.pod_spec(daemonset)
    c = mu.container(daemonset)
    pod_ctx, ctx = spec["securityContext"], c["securityContext"]
    assert pod_ctx["runAsNonRoot"] is True and pod_ctx["runAsUser"] != 0
    assert pod_ctx["seccompProfile"]["type"] == "RuntimeDefault"
    assert ctx.get("privileged") is not True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["capabilities"]["drop"] == ["ALL"] and not ctx["capabilities"].get("add")
    tmp = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
    volume = next(v for v in spec["volumes"] if v["name"] == tmp["name"])
    assert "emptyDir" in volume
    assert not (spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"))
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["terminationGracePeriodSeconds"] >= 35
    strategy = daemonset["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"]
    resources = c["resources"]
    assert {"cpu", "memory"} <= resources["requests"].keys()
    assert "memory" in resources["limits"]


def test_credentials_come_from_an_optional_secret() -> None:
    c = mu.container(mu.one("DaemonSet"))
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in c["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert {"HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= refs.keys()
    assert all(ref.get("optional") is True for ref in refs.values())
    assert all(e.get("value") is None for e in c["env"] if e["name"] in refs)


def test_rbac_is_nodes_get_and_patch_and_events_create_and_patch_in_default_only() -> None:
    """The agent's whole API surface (tests/test_events.py checks a run uses exactly this)."""
    role = mu.one("ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    events_role = mu.one("Role", under="daemonset")
    # Events about a Node must live in "default": the only grant outside the cluster role
    assert events_role["metadata"]["namespace"] == "default"
    assert events_role["rules"] == [
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]}
    ]
    daemonset = mu.one("DaemonSet")
    agent = {
        "kind": "ServiceAccount",
        "name": mu.pod_spec(daemonset)["serviceAccountName"],
        "namespace": daemonset["metadata"]["namespace"],
    }
    binding = mu.one("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == mu.name(role)
    assert binding["subjects"] == [agent]
    events_binding = mu.one("RoleBinding", under="daemonset")
    assert events_binding["metadata"]["namespace"] == "default"
    assert events_binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": mu.name(events_role),
    }
    assert events_binding["subjects"] == [agent]


# -- vLLM ----------------------------------------------------------------------------------------


def _flag(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag:
            return args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def test_vllm_server_flags() -> None:
    vllm = mu.one("Deployment", under="deploy/vllm")
    c = mu.container(vllm)
    args = c["args"]
    assert _flag(args, "--quantization") == "awq_marlin"
    assert _flag(args, "--tensor-parallel-size") == str(c["resources"]["limits"]["nvidia.com/gpu"])
    assert _flag(args, "--enable-chunked-prefill") == "", "a boolean flag takes no value"
    assert int(_flag(args, "--max-model-len") or 0) > 0
    assert 0 < float(_flag(args, "--gpu-memory-utilization") or 0) < 1
    assert "replicas" not in vllm["spec"], "the ScaledObject owns replicas"


def test_vllm_ports_probes_and_shm() -> None:
    vllm = mu.one("Deployment", under="deploy/vllm")
    c = mu.container(vllm)
    ports = c["ports"]
    assert len({p["containerPort"] for p in ports}) == len(ports), "a port declared twice"
    [port] = ports
    assert port["name"] and str(port["containerPort"]) == _flag(c["args"], "--port")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[kind]
        assert probe["httpGet"]["path"] == "/health" and probe["httpGet"]["port"] == port["name"]
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "model load takes time"
    shm_mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    shm = next(v for v in mu.pod_spec(vllm)["volumes"] if v["name"] == shm_mount["name"])
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
    service = mu.one("Service", under="deploy/vllm")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [port["name"]]


def test_scaled_object_fails_loudly() -> None:
    vllm = mu.one("Deployment", under="deploy/vllm")
    scaled = mu.one("ScaledObject")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == mu.name(vllm)
    assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
    assert spec["fallback"]["replicas"] >= 1 and spec["fallback"]["failureThreshold"] >= 1
    args = mu.container(vllm)["args"]
    served = _flag(args, "--served-model-name") or args[0]
    queries = []
    for trigger in spec["triggers"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "prometheus"
        assert "metricName" not in meta, "metricName is gone from the prometheus scaler"
        assert {"serverAddress", "query", "threshold"} <= meta.keys()
        assert meta["ignoreNullValues"] == "false", "an empty result must be an error, not 0"
        # KEDA's fallback only works for AverageValue metrics.
        assert trigger.get("metricType", "AverageValue") == "AverageValue"
        assert f'model_name="{served}"' in meta["query"], "the query must select vLLM's model"
        queries.append(meta["query"])
    text = " ".join(queries)
    assert "vllm:num_requests_waiting" in text and "vllm:kv_cache_usage_perc" in text
    monitor = mu.one("PodMonitor", under="deploy/vllm")
    labels = vllm["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == mu.container(vllm)["ports"][0]["name"]


def test_no_removed_vllm_metric_is_used() -> None:
    """vllm:gpu_cache_usage_perc is gone (vllm:kv_cache_usage_perc replaced it)."""
    for manifest in MANIFESTS:
        assert "gpu_cache_usage_perc" not in json.dumps(manifest.doc), manifest.id


# -- Karpenter -----------------------------------------------------------------------------------


def test_nodepool_and_nodeclass_fit_together() -> None:
    nodepool, nodeclass = mu.one("NodePool"), mu.one("EC2NodeClass")
    ref = nodepool["spec"]["template"]["spec"]["nodeClassRef"]
    assert (ref["group"], ref["kind"], ref["name"]) == (
        nodeclass["apiVersion"].split("/")[0],
        "EC2NodeClass",
        mu.name(nodeclass),
    )
    keys = {r["key"]: r for r in nodepool["spec"]["template"]["spec"]["requirements"]}
    for key in (
        "karpenter.k8s.aws/instance-category",
        "karpenter.k8s.aws/instance-family",
        "karpenter.k8s.aws/instance-local-nvme",
        "karpenter.sh/capacity-type",
        "kubernetes.io/arch",
    ):
        assert key in keys, f"the NodePool should constrain {key}"
    assert keys["karpenter.k8s.aws/instance-local-nvme"]["operator"] == "Gt"
    disruption = nodepool["spec"]["disruption"]
    assert disruption["consolidationPolicy"] == "WhenEmpty" and disruption["consolidateAfter"]
    assert disruption["budgets"]
    spec = nodeclass["spec"]
    assert "instanceStorePolicy" not in spec, "our bootstrap owns the instance-store disks"
    [term] = spec["amiSelectorTerms"]
    assert re.fullmatch(r"al2023@v\d{8}", term["alias"]), "pin the AMI release, not latest"
    assert any(b.get("rootVolume") for b in spec["blockDeviceMappings"])
    for selector in ("subnetSelectorTerms", "securityGroupSelectorTerms"):
        assert "karpenter.sh/discovery" in spec[selector][0]["tags"]


def test_ec2nodeclass_user_data_is_the_generated_bootstrap() -> None:
    assert USER_DATA.is_file(), f"{USER_DATA.relative_to(REPO)}: run bootstrap/render-user-data.sh"
    expected = USER_DATA.read_text(encoding="ascii")
    user_data = mu.one("EC2NodeClass")["spec"].get("userData")
    assert user_data == expected, (
        "the EC2NodeClass's userData is not bootstrap/user-data.mime: "
        "run python deploy/karpenter/sync-user-data.py"
    )
    if mu.kubectl() is not None:  # and kustomize passes it through unchanged
        built = mu.find("EC2NodeClass", docs=mu.kustomize_build(REPO / "deploy" / "karpenter"))
        assert [d["spec"]["userData"] for d in built] == [expected]


# -- the image -----------------------------------------------------------------------------------


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def _final_stage() -> list[tuple[str, str]]:
    instructions = mu.dockerfile_instructions(DOCKERFILE)
    starts = [i for i, (ins, _) in enumerate(instructions) if ins == "FROM"]
    assert starts, "no FROM in the Dockerfile"
    return instructions[starts[-1] :]


def test_dockerfile_entrypoint_is_the_console_script() -> None:
    final = dict(_final_stage())
    entrypoint = _exec_form(final["ENTRYPOINT"])
    cmd = _exec_form(final["CMD"])
    scripts = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["scripts"]
    assert entrypoint[0] in scripts, f"{entrypoint[0]} is not a console script of pyproject.toml"
    assert cmd[0] == "agent" == mu.container(mu.one("DaemonSet"))["args"][0]


def test_agent_help_runs() -> None:
    """`prefetch agent --help`, through the console script's entry point."""
    final = dict(_final_stage())
    script = _exec_form(final["ENTRYPOINT"])[0]
    target = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["scripts"][script]
    module, _, func = target.partition(":")
    code = (
        "import importlib, sys; sys.argv[0] = sys.argv[1]; del sys.argv[1]; "
        f"sys.exit(getattr(importlib.import_module({module!r}), {func!r})())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, script, *_exec_form(final["CMD"]), "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    for option in ("--config", "--listen", "--node-name", "--cache-dir", "--log-format"):
        assert option in result.stdout, f"`{script} agent --help` does not list {option}"


def test_dockerfile_user_matches_the_daemonset() -> None:
    final = _final_stage()
    args = {
        name: value
        for ins, text in final
        if ins == "ARG"
        for name, _, value in [text.partition("=")]
    }
    [user] = [text for ins, text in final if ins == "USER"]
    uid, _, gid = re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], user).partition(":")
    ctx = mu.pod_spec(mu.one("DaemonSet"))["securityContext"]
    assert int(uid) == ctx["runAsUser"] and int(gid or uid) == ctx["runAsGroup"]


def test_docker_build_context_has_what_the_dockerfile_copies() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    copies = [
        text
        for ins, text in mu.dockerfile_instructions(DOCKERFILE)
        if ins == "COPY" and "--from" not in text
    ]
    assert copies
    for text in copies:
        *sources, _ = text.split()
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            assert mu.dockerignore_allows(patterns, source), f"COPY {source}: .dockerignored"
    for leftover in ("tests", ".git", "bench", "prefetch/__pycache__/x.pyc"):
        assert not mu.dockerignore_allows(patterns, leftover), f"{leftover} is in the context"
    # the image installs the package with every backend's extra (gs://, az:// credentials)
    assert "pip install --no-cache-dir '.[gcs,azure]'" in DOCKERFILE.read_text(encoding="utf-8")
