"""deploy/mirror/: the Job and CronJob that run ``prefetch mirror``, their service account and the
IAM policy beside them. Schema validation and ``kubectl kustomize`` are tests/test_manifests.py's
(they cover every folder under deploy/); this module checks what a schema cannot: the pods run
the agent's image with arguments the CLI accepts, the CronJob never overlaps itself, and the
policy grants exactly the actions the mirror uses, on the bucket and prefix it writes only."""

from __future__ import annotations

import json
from typing import Any

import click
import pytest

from prefetch.cli import main as cli_main
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from tests import manifests_util as mu

FOLDER = mu.REPO / "deploy" / "mirror"
POLICY = FOLDER / "iam-policy.json"
#: What ``prefetch mirror`` calls on S3, as IAM actions (see deploy/mirror/README.md).
MIRROR_ACTIONS = {
    "s3:GetObject",
    "s3:PutObject",
    "s3:ListBucket",
    "s3:AbortMultipartUpload",
    "s3:ListMultipartUploadParts",
    "s3:ListBucketMultipartUploads",
}
BUCKET_LEVEL = {"s3:ListBucket", "s3:ListBucketMultipartUploads"}


def _job() -> dict[str, Any]:
    return mu.one("Job", under="deploy/mirror")


def _cronjob() -> dict[str, Any]:
    return mu.one("CronJob", under="deploy/mirror")


def _pod_specs() -> list[dict[str, Any]]:
    return [
        _job()["spec"]["template"]["spec"],
        _cronjob()["spec"]["jobTemplate"]["spec"]["template"]["spec"],
    ]


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["containers"]
    return container


def _policy() -> dict[str, Any]:
    doc = json.loads(POLICY.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def _actions(statement: dict[str, Any]) -> set[str]:
    action = statement["Action"]
    return {action} if isinstance(action, str) else set(action)


def _resources(statement: dict[str, Any]) -> list[str]:
    resource = statement["Resource"]
    return [resource] if isinstance(resource, str) else list(resource)


def _destination() -> tuple[str, str]:
    """(bucket, key prefix) the Job mirrors into."""
    uri = parse_source_uri(_container(_job()["spec"]["template"]["spec"])["args"][2])
    return uri.location, uri.path


# -- the pods ------------------------------------------------------------------------------------


def test_the_mirror_pods_run_the_agents_image() -> None:
    image = mu.container(mu.one("DaemonSet", under="daemonset"))["image"]
    assert [_container(pod)["image"] for pod in _pod_specs()] == [image, image]


@pytest.mark.parametrize("which", ["job", "cronjob"])
def test_the_mirror_args_are_accepted_by_the_cli(which: str) -> None:
    pod = _pod_specs()[0 if which == "job" else 1]
    args = _container(pod)["args"]
    assert args[0] == "mirror"
    command = cli_main.get_command(click.Context(cli_main), "mirror")
    ctx = command.make_context("mirror", list(args[1:]), resilient_parsing=False)
    ctx.close()
    source, dest = parse_source_uri(args[1]), parse_source_uri(args[2])
    ModelSpec(source=source)  # the revision is a valid ref name
    assert source.scheme == "hf" and dest.scheme == "s3"
    assert dest.path.endswith(f"{source.location}/"), "one Hub repo per prefix, named by its id"


def test_the_job_pins_a_commit_and_the_cronjob_follows_a_branch() -> None:
    job_source = parse_source_uri(_container(_pod_specs()[0])["args"][1])
    cron_source = parse_source_uri(_container(_pod_specs()[1])["args"][1])
    assert job_source.revision is not None and len(job_source.revision) == 40
    assert cron_source.revision == "main"
    assert job_source.location == cron_source.location
    assert _container(_pod_specs()[0])["args"][2] == _container(_pod_specs()[1])["args"][2]


def test_the_cronjob_never_runs_two_mirrors_at_once() -> None:
    spec = _cronjob()["spec"]
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["jobTemplate"]["spec"]["activeDeadlineSeconds"] > 0


def test_the_pods_use_the_irsa_service_account_and_the_hub_token_secret() -> None:
    account = mu.one("ServiceAccount", under="deploy/mirror")
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith(
        "arn:aws:iam::"
    )
    for pod in _pod_specs():
        assert pod["serviceAccountName"] == mu.name(account)
        assert pod["automountServiceAccountToken"] is False
        token = next(e for e in _container(pod)["env"] if e["name"] == "HF_TOKEN")
        assert set(token["valueFrom"]["secretKeyRef"]) == {"name", "key", "optional"}


def test_the_pods_meet_pod_security_restricted() -> None:
    namespace = mu.one("Namespace", under="deploy/mirror")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for pod in _pod_specs():
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        ctx = _container(pod)["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"]
        assert ctx["readOnlyRootFilesystem"] is True
        assert not any("hostPath" in v for v in pod.get("volumes", []))


def test_kustomize_puts_everything_in_the_mirror_namespace() -> None:
    if mu.kubectl() is None:
        pytest.skip("kubectl is not installed")
    docs = mu.kustomize_build(FOLDER)
    assert {d["kind"] for d in docs} == {"Namespace", "ServiceAccount", "Job", "CronJob"}
    assert all(
        d["metadata"].get("namespace") == "model-mirror" for d in docs if d["kind"] != "Namespace"
    )


# -- the IAM policy ------------------------------------------------------------------------------


def test_the_policy_is_an_iam_policy_document_of_allow_statements() -> None:
    policy = _policy()
    assert set(policy) == {"Version", "Statement"} and policy["Version"] == "2012-10-17"
    for statement in policy["Statement"]:
        assert set(statement) <= {"Sid", "Effect", "Action", "Resource", "Condition"}
        assert statement["Effect"] == "Allow" and statement["Sid"].isalnum()
        assert _actions(statement) and _resources(statement)


def test_the_policy_grants_exactly_the_actions_the_mirror_uses() -> None:
    granted = set().union(*(_actions(s) for s in _policy()["Statement"]))
    assert granted == MIRROR_ACTIONS
    assert not any("*" in action for action in granted)


def test_the_policy_covers_only_the_jobs_bucket_and_prefix() -> None:
    bucket, prefix = _destination()
    for statement in _policy()["Statement"]:
        for resource in _resources(statement):
            if _actions(statement) <= BUCKET_LEVEL:
                assert resource == f"arn:aws:s3:::{bucket}"
            else:
                assert not _actions(statement) & BUCKET_LEVEL, "bucket and object actions mixed"
                assert resource.startswith(f"arn:aws:s3:::{bucket}/") and resource.endswith("/*")
                object_prefix = resource.removeprefix(f"arn:aws:s3:::{bucket}/").removesuffix("*")
                assert object_prefix and prefix.startswith(object_prefix)


def test_listing_is_limited_to_the_mirror_prefix() -> None:
    _, prefix = _destination()
    (listing,) = [s for s in _policy()["Statement"] if "s3:ListBucket" in _actions(s)]
    allowed = listing["Condition"]["StringLike"]["s3:prefix"]
    assert allowed and all(
        p.endswith("*") and p[:-1] and prefix.startswith(p[:-1]) for p in allowed
    )


def test_the_readme_explains_every_granted_action() -> None:
    text = (FOLDER / "README.md").read_text(encoding="utf-8")
    for action in MIRROR_ACTIONS:
        assert f"| `{action}` |" in text, f"{action} has no row saying why it is needed"


def test_the_files_named_here_exist() -> None:
    kustomization = mu.load_all(FOLDER / "kustomization.yaml")[0]
    for resource in kustomization["resources"]:
        assert (FOLDER / resource).is_file(), resource
