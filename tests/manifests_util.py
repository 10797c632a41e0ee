"""Loading and validating the Kubernetes manifests under daemonset/ and deploy/.

Built-in kinds are checked against the Kubernetes OpenAPI schemas that the ``kubernetes-validate``
package ships (strict: unknown fields are errors, as ``kubectl apply`` reports them). Custom
resources are checked against the upstream CRDs in ``<repo>/../shared/crds`` (not part of the
repository), with unknown fields made errors the same way; the API server's CEL rules are not
evaluated there, so the tests check the few that matter by hand.
"""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parent.parent
SHARED_CRDS = REPO.parent / "shared" / "crds"
MANIFEST_DIRS = (REPO / "daemonset", REPO / "deploy")
#: Oldest Kubernetes minor the manifests are meant for, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.32", kubernetes_validate.latest_version())
KUSTOMIZE_API = "kustomize.config.k8s.io/"

Doc = dict[str, Any]


@dataclass(frozen=True)
class Manifest:
    path: Path
    index: int
    doc: Doc

    @property
    def id(self) -> str:
        rel = self.path.relative_to(REPO)
        return f"{rel}#{self.index}:{self.doc.get('kind')}/{name(self.doc)}"


def yaml_files() -> list[Path]:
    files: list[Path] = []
    for top in MANIFEST_DIRS:
        files += [p for p in top.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file()]
    return sorted(files)


def load_all(path: Path) -> list[Any]:
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def is_object(doc: Any) -> bool:
    """A Kubernetes object (not a kustomization, not the agent's models.yaml)."""
    return (
        isinstance(doc, dict)
        and isinstance(doc.get("apiVersion"), str)
        and isinstance(doc.get("kind"), str)
        and not doc["apiVersion"].startswith(KUSTOMIZE_API)
    )


def manifests() -> list[Manifest]:
    out = []
    for path in yaml_files():
        for i, doc in enumerate(load_all(path)):
            if is_object(doc):
                out.append(Manifest(path, i, doc))
    return out


def kind_of(doc: Any) -> str | None:
    return doc.get("kind") if isinstance(doc, dict) else None


def name(doc: Mapping[str, Any]) -> str:
    return str((doc.get("metadata") or {}).get("name", ""))


def find(kind: str, *, under: str | None = None, docs: list[Doc] | None = None) -> list[Doc]:
    """Objects of ``kind`` from the source files (or from ``docs``), optionally under a folder."""
    if docs is None:
        base = REPO / under if under else None
        docs = [m.doc for m in manifests() if base is None or base in m.path.parents]
    return [d for d in docs if d.get("kind") == kind]


def one(kind: str, *, under: str | None = None) -> Doc:
    found = find(kind, under=under)
    assert len(found) == 1, f"expected exactly one {kind} under {under or 'the manifests'}"
    return found[0]


# -- built-in kinds ------------------------------------------------------------------------------


def is_builtin(doc: Doc) -> bool:
    """Does kubernetes-validate know this apiVersion/kind (a built-in kind)?"""
    try:
        kubernetes_validate.validate(
            {"apiVersion": doc["apiVersion"], "kind": doc["kind"]}, KUBERNETES_VERSIONS[-1]
        )
    except kubernetes_validate.SchemaNotFoundError:
        return False
    except kubernetes_validate.ValidationError:
        return True
    return True


def validate_builtin(doc: Doc, version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def validate_metadata(doc: Doc, version: str) -> None:
    """A custom resource's metadata, checked as ObjectMeta (labels are strings, and so on)."""
    carrier = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata") or {}}
    kubernetes_validate.validate(carrier, version, strict=True)


# -- custom resources ----------------------------------------------------------------------------


def crds_available() -> bool:
    return SHARED_CRDS.is_dir() and any(SHARED_CRDS.glob("*.yaml"))


@functools.cache
def crd_documents() -> tuple[Doc, ...]:
    docs: list[Doc] = []
    for path in sorted(SHARED_CRDS.glob("*.yaml")):
        docs += [d for d in load_all(path) if kind_of(d) == "CustomResourceDefinition"]
    return tuple(docs)


@functools.cache
def crd_schemas() -> dict[tuple[str, str], Doc]:
    """(apiVersion, kind) -> openAPIV3Schema of every served version of every CRD."""
    out: dict[tuple[str, str], Doc] = {}
    for crd in crd_documents():
        group = crd["spec"]["group"]
        kind = crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served"):
                schema = version["schema"]["openAPIV3Schema"]
                out[(f"{group}/{version['name']}", kind)] = schema
    return out


def strict_schema(schema: Any) -> Any:
    """``schema`` with unknown fields rejected wherever the CRD lists its properties.

    The API server prunes (or, with strict field validation, rejects) fields a structural schema
    does not declare; JSON Schema allows them unless ``additionalProperties`` says otherwise.
    """
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def has_crd(doc: Doc) -> bool:
    """Is there a CRD for this custom resource in the shared folder (which lists only some)?"""
    return (doc["apiVersion"], doc["kind"]) in crd_schemas()


def validate_custom(doc: Doc) -> None:
    key = (doc["apiVersion"], doc["kind"])
    schemas = crd_schemas()
    if key not in schemas:
        known = ", ".join(sorted(f"{k} {v}" for v, k in schemas))
        raise AssertionError(f"no served CRD version for {key} in {SHARED_CRDS} (have: {known})")
    schema = strict_schema(copy.deepcopy(schemas[key]))
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]
        raise AssertionError(f"{key[1]} {name(doc)} does not match its CRD:\n" + "\n".join(lines))


def cel_rules(kind: str, message_contains: str) -> list[str]:
    """The CEL rules of ``kind``'s CRD whose message contains the text (to check by hand)."""
    rules: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for rule in node.get("x-kubernetes-validations", []):
                if message_contains in rule.get("message", ""):
                    rules.append(rule["rule"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for (_, k), schema in crd_schemas().items():
        if k == kind:
            walk(schema)
    return rules


# -- kustomize -----------------------------------------------------------------------------------


def kustomize_dirs() -> list[Path]:
    return sorted(p.parent for top in MANIFEST_DIRS for p in top.rglob("kustomization.yaml"))


def kubectl() -> str | None:
    return shutil.which("kubectl")


def kustomize_build(directory: Path) -> list[Doc]:
    exe = kubectl()
    assert exe is not None
    result = subprocess.run(
        [exe, "kustomize", str(directory)], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d is not None]


# -- pod specs -----------------------------------------------------------------------------------


def pod_spec(workload: Doc) -> Doc:
    return workload["spec"]["template"]["spec"]


def container(workload: Doc, container_name: str | None = None) -> Doc:
    containers = pod_spec(workload)["containers"]
    if container_name is None:
        assert len(containers) == 1, f"{name(workload)}: expected one container"
        return containers[0]
    return next(c for c in containers if c["name"] == container_name)


def env_value(c: Doc, var: str) -> str | None:
    for item in c.get("env", []):
        if item["name"] == var:
            return item.get("value")
    return None


def host_path_mounts(workload: Doc) -> Iterator[tuple[str, Doc, Doc]]:
    """(host path, volume, mount) for every hostPath volume mounted in the workload's containers."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    for c in pod_spec(workload)["containers"]:
        for mount in c.get("volumeMounts", []):
            volume = volumes.get(mount["name"], {})
            if "hostPath" in volume:
                yield volume["hostPath"]["path"], volume, mount


def tolerates(tolerations: list[Doc], taint: Mapping[str, Any]) -> bool:
    """Kubernetes toleration semantics for one taint."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        operator = t.get("operator", "Equal")
        if operator == "Exists":
            if not t.get("key") or t["key"] == taint["key"]:
                return True
        elif t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def required_node_terms(workload: Doc) -> list[list[Doc]]:
    """matchExpressions of each required nodeSelectorTerm (terms are ORed, expressions ANDed)."""
    affinity = pod_spec(workload).get("affinity", {}).get("nodeAffinity", {})
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {})
    return [term.get("matchExpressions", []) for term in required.get("nodeSelectorTerms", [])]


def named_port(c: Doc, port_name: str) -> int:
    for port in c.get("ports", []):
        if port.get("name") == port_name:
            return int(port["containerPort"])
    raise AssertionError(f"container {c['name']} has no port named {port_name!r}")


def probe_port(c: Doc, probe: Doc) -> int:
    port = probe["httpGet"]["port"]
    return named_port(c, port) if isinstance(port, str) else int(port)


# -- other files ---------------------------------------------------------------------------------


_SHELL_DEFAULT = re.compile(r"^(\w+)=\$\{(\w+):-([^}]*)\}\s*$", re.MULTILINE)


def shell_defaults(script: Path) -> dict[str, str]:
    """Environment-twin defaults of a shell script: ``VAR=${ENV:-default}`` -> {ENV: default}."""
    text = script.read_text(encoding="utf-8")
    return {env: value.strip("'\"") for _, env, value in _SHELL_DEFAULT.findall(text)}


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        instruction, _, args = line.partition(" ")
        out.append((instruction.upper(), args.strip()))
    return out


def dockerignore_allows(patterns: list[str], rel: str) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a parent decides."""
    parts = rel.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        regex = _glob_regex(pat.strip("/"))
        if any(regex.fullmatch(c) for c in candidates):
            included = negate
    return included


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out += pattern[i : end + 1]
            i = end + 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)
