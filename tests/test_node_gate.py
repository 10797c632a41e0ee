"""NodeGate against the in-memory API server stub, through the real kubernetes client."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from prefetch.agent.node import GateResult, NodeGate, in_cluster_gate, label_key
from prefetch.support.constants import DEFAULT_LABEL_PREFIX, DEFAULT_STARTUP_TAINT_KEY
from prefetch.support.errors import ConfigError, NodeGateError
from tests.fakes.k8s_stub import KubeStub, apply_json_patch, running_stub, validate_node

NODE = "ip-10-0-1-23.ec2.internal"
PREFIX = DEFAULT_LABEL_PREFIX
STARTUP = {"key": DEFAULT_STARTUP_TAINT_KEY, "value": "true", "effect": "NoSchedule"}
GPU = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
FOREIGN_LABELS = {
    "karpenter.sh/nodepool": "gpu",
    "node.kubernetes.io/instance-type": "p5.48xlarge",
    "example.com/team": "ready",  # value "ready", but outside our prefix
}
LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


@pytest.fixture
def stub() -> Iterator[KubeStub]:
    yield from running_stub()


@pytest.fixture
def node(stub: KubeStub) -> str:
    stub.add_node(NODE, labels=dict(FOREIGN_LABELS), taints=[GPU, STARTUP])
    return NODE


class RecordingSleep:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def make_gate(stub: KubeStub, name: str = NODE, **options: Any) -> NodeGate:
    options.setdefault("backoff", 0.001)
    options.setdefault("max_backoff", 0.01)
    return NodeGate(stub.client(), name, **options)


def key(model: str) -> str:
    return label_key(PREFIX, model)


def patches(stub: KubeStub) -> list[Any]:
    return stub.requests_of("PATCH")


# -- labels ----------------------------------------------------------------------------------


def test_labels_appear_for_ready_models(stub: KubeStub, node: str) -> None:
    result = make_gate(stub).apply(["llama-3-8b", "qwen2-7b"], all_required_ready=False)

    assert result == GateResult(
        labels_added=(key("llama-3-8b"), key("qwen2-7b")), patched=True, attempts=1
    )
    labels = stub.labels(node)
    assert labels[f"{PREFIX}/llama-3-8b"] == "ready"
    assert labels[f"{PREFIX}/qwen2-7b"] == "ready"
    (patch,) = patches(stub)
    assert patch.content_type == "application/json-patch+json"
    assert patch.query == "fieldManager=model-prefetch"
    assert patch.body[0]["op"] == "test"
    assert patch.body[0]["path"] == "/metadata/resourceVersion"
    assert {
        "op": "add",
        "path": "/metadata/labels/model-prefetch.io~1llama-3-8b",
        "value": "ready",
    } in patch.body


def test_node_without_labels_gets_a_label_map(stub: KubeStub) -> None:
    stub.add_node("bare")
    make_gate(stub, "bare").apply(["llama"], all_required_ready=False)
    assert stub.labels("bare") == {f"{PREFIX}/llama": "ready"}


def test_label_of_model_no_longer_ready_is_removed(stub: KubeStub, node: str) -> None:
    stub.write(node, lambda n: n["metadata"]["labels"].update({f"{PREFIX}/notes": "keep-me"}))
    gate = make_gate(stub)
    gate.apply(["a", "b", "c"], all_required_ready=False)

    result = gate.apply(["b"], all_required_ready=False)

    assert result.labels_removed == (key("a"), key("c"))
    assert result.labels_added == ()
    labels = stub.labels(node)
    assert labels == {**FOREIGN_LABELS, f"{PREFIX}/notes": "keep-me", key("b"): "ready"}


def test_stale_label_left_by_an_earlier_run_is_removed(stub: KubeStub) -> None:
    stub.add_node(NODE, labels={f"{PREFIX}/old-model": "ready", "karpenter.sh/nodepool": "gpu"})
    result = make_gate(stub).apply([], all_required_ready=False)
    assert result.labels_removed == (f"{PREFIX}/old-model",)
    assert stub.labels(NODE) == {"karpenter.sh/nodepool": "gpu"}


def test_other_labels_and_taints_are_untouched(stub: KubeStub, node: str) -> None:
    gate = make_gate(stub)
    gate.apply(["llama"], all_required_ready=False)
    gate.apply(["qwen"], all_required_ready=True)
    gate.apply([], all_required_ready=True)

    assert stub.labels(node) == FOREIGN_LABELS
    assert stub.taints(node) == [GPU]


def test_second_apply_with_same_state_sends_no_patch(stub: KubeStub, node: str) -> None:
    gate = make_gate(stub)
    gate.apply(["llama"], all_required_ready=True)
    rv = stub.resource_version(node)
    before = len(patches(stub))

    result = gate.apply(["llama"], all_required_ready=True)

    assert result == GateResult(patched=False, attempts=1)
    assert len(patches(stub)) == before
    assert stub.resource_version(node) == rv


# -- the startup taint -----------------------------------------------------------------------


def test_taint_removed_exactly_when_all_required_ready(stub: KubeStub, node: str) -> None:
    gate = make_gate(stub)

    first = gate.apply(["llama"], all_required_ready=False)
    assert not first.taint_removed
    assert STARTUP in stub.taints(node)

    second = gate.apply(["llama", "qwen"], all_required_ready=True)
    assert second.taint_removed
    assert stub.taints(node) == [GPU]


def test_taint_matches_key_and_effect(stub: KubeStub) -> None:
    same_key_other_effect = {**STARTUP, "effect": "NoExecute"}
    stub.add_node(NODE, taints=[same_key_other_effect, STARTUP, GPU])
    result = make_gate(stub).apply([], all_required_ready=True)
    assert result.taint_removed
    assert stub.taints(NODE) == [same_key_other_effect, GPU]


def test_taint_is_never_added_back(stub: KubeStub, node: str) -> None:
    gate = make_gate(stub)
    gate.apply(["llama"], all_required_ready=True)
    before = len(patches(stub))

    result = gate.apply([], all_required_ready=False)  # model evicted: label goes, taint stays off

    assert result.labels_removed == (key("llama"),)
    assert not result.taint_removed
    assert stub.taints(node) == [GPU]
    assert len(patches(stub)) == before + 1
    assert all(op["op"] != "add" or "taints" not in op["path"] for op in patches(stub)[-1].body)


def test_custom_taint_and_prefix(stub: KubeStub) -> None:
    taint = {"key": "example.com/cache-warming", "effect": "NoExecute"}
    stub.add_node(NODE, labels={"example.com/x": "ready"}, taints=[taint])
    gate = make_gate(
        stub,
        label_prefix="example.com",
        startup_taint_key="example.com/cache-warming",
        startup_taint_effect="NoExecute",
    )
    result = gate.apply(["llama"], all_required_ready=True)
    assert result.labels_removed == ("example.com/x",)
    assert stub.labels(NODE) == {"example.com/llama": "ready"}
    assert stub.taints(NODE) == []


# -- concurrency -----------------------------------------------------------------------------


def test_concurrent_write_is_retried_without_clobbering_it(stub: KubeStub, node: str) -> None:
    def other_controller(n: dict[str, Any]) -> None:
        n["metadata"]["labels"]["karpenter.sh/initialized"] = "true"

    stub.before_next_patch(other_controller)

    result = make_gate(stub).apply(["llama"], all_required_ready=True)

    assert result.patched and result.attempts == 2 and result.taint_removed
    assert [p.status for p in patches(stub)] == [422, 200]
    first, second = (p.body[0]["value"] for p in patches(stub))
    assert int(second) > int(first)  # the retry tested the fresh resourceVersion
    labels = stub.labels(node)
    assert labels["karpenter.sh/initialized"] == "true"
    assert labels[key("llama")] == "ready"
    assert stub.taints(node) == [GPU]


def test_concurrent_taint_removal_does_not_make_us_remove_another_taint(stub: KubeStub) -> None:
    # The stale patch would remove /spec/taints/0: after the concurrent removal of the startup
    # taint that index is the GPU taint. The resourceVersion test stops it.
    stub.add_node(NODE, taints=[STARTUP, GPU])
    stub.before_next_patch(lambda n: n["spec"]["taints"].remove(STARTUP))

    result = make_gate(stub).apply([], all_required_ready=True)

    assert result == GateResult(patched=False, attempts=2)
    assert stub.taints(NODE) == [GPU]


def test_concurrent_writer_that_did_our_work_leaves_nothing_to_do(stub: KubeStub) -> None:
    stub.add_node(NODE)
    stub.before_next_patch(lambda n: n["metadata"].update(labels={f"{PREFIX}/llama": "ready"}))
    result = make_gate(stub).apply(["llama"], all_required_ready=False)
    assert result == GateResult(patched=False, attempts=2)
    assert len(patches(stub)) == 1


def test_conflict_409_is_retried(stub: KubeStub, node: str) -> None:
    stub.fail_next(1, 409, method="PATCH")
    result = make_gate(stub).apply(["llama"], all_required_ready=False)
    assert result.attempts == 2
    assert stub.labels(node)[key("llama")] == "ready"


# -- transient and permanent failures --------------------------------------------------------


@pytest.mark.parametrize("status", [500, 502, 503, 429])
def test_transient_errors_are_retried(stub: KubeStub, node: str, status: int) -> None:
    stub.fail_next(2, status)
    result = make_gate(stub).apply(["llama"], all_required_ready=True)
    assert result.patched and result.attempts == 3
    assert stub.taints(node) == [GPU]


def test_errors_on_patch_are_retried(stub: KubeStub, node: str) -> None:
    stub.fail_next(2, 500, method="PATCH")
    result = make_gate(stub).apply(["llama"], all_required_ready=False)
    assert result.attempts == 3
    assert [p.status for p in patches(stub)] == [500, 500, 200]


def test_dropped_connection_is_retried(stub: KubeStub, node: str) -> None:
    stub.fail_next(1, 0, method="PATCH")
    result = make_gate(stub).apply(["llama"], all_required_ready=False)
    assert result.attempts == 2
    assert stub.labels(node)[key("llama")] == "ready"


def test_unreachable_api_server_raises_after_attempts() -> None:
    with KubeStub() as stub:
        api = stub.client()
    gate = NodeGate(api, NODE, max_attempts=2, backoff=0.001, request_timeout=2.0)
    with pytest.raises(NodeGateError, match="in 2 attempts"):
        gate.apply(["llama"], all_required_ready=False)


def test_persistent_500_raises_node_gate_error(stub: KubeStub, node: str) -> None:
    stub.fail_next(1000, 500)
    sleep = RecordingSleep()
    gate = make_gate(stub, max_attempts=4, backoff=0.01, max_backoff=1.0, sleep=sleep)

    with pytest.raises(NodeGateError) as info:
        gate.apply(["llama"], all_required_ready=True)

    assert NODE in str(info.value) and "4 attempts" in str(info.value)
    assert "500" in str(info.value)
    assert len(stub.requests_of("GET")) == 4
    assert patches(stub) == []
    # exponential backoff with full jitter: in [0, 0.01], [0, 0.02], [0, 0.04]
    assert len(sleep.calls) == 3
    for i, slept in enumerate(sleep.calls):
        assert 0 <= slept <= 0.01 * 2**i


def test_the_gate_waits_as_the_one_retry_policy_says(
    stub: KubeStub, node: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the jitter drawn at its low end: full jitter (RetryPolicy) goes down to 0; a formula of
    # its own (the old [0.5, 1) of the backoff) would not
    monkeypatch.setattr("prefetch.pipeline.retry.random.uniform", lambda low, high: low)
    stub.fail_next(2, 500)
    sleep = RecordingSleep()
    make_gate(stub, max_attempts=4, backoff=0.01, max_backoff=1.0, sleep=sleep).apply([], True)
    assert sleep.calls == [0.0, 0.0]
    monkeypatch.setattr("prefetch.pipeline.retry.random.uniform", lambda low, high: high)
    stub.fail_next(2, 500)
    make_gate(stub, max_attempts=4, backoff=0.01, max_backoff=1.0, sleep=sleep).apply([], True)
    assert sleep.calls[2:] == [0.01, 0.02]


def test_retry_after_is_honoured_up_to_max_backoff(stub: KubeStub, node: str) -> None:
    # On PATCH: urllib3 itself already sleeps for Retry-After and retries idempotent GETs.
    stub.fail_next(1, 429, method="PATCH", retry_after=30)
    sleep = RecordingSleep()
    make_gate(stub, backoff=0.001, max_backoff=0.2, sleep=sleep).apply([], True)
    assert sleep.calls == [0.2]  # Retry-After wins over the backoff, capped at max_backoff


def test_node_not_found_names_the_node_without_retrying(stub: KubeStub) -> None:
    with pytest.raises(NodeGateError, match="'missing-node' not found") as info:
        make_gate(stub, "missing-node").apply(["llama"], all_required_ready=True)
    assert info.value.hint and "NODE_NAME" in info.value.hint
    assert len(stub.requests) == 1


@pytest.mark.parametrize("method, verb", [("GET", "get"), ("PATCH", "patch")])
def test_forbidden_names_the_missing_rbac_verb(
    stub: KubeStub, node: str, method: str, verb: str
) -> None:
    stub.fail_next(1, 403, method=method)
    with pytest.raises(NodeGateError, match=f"RBAC forbids '{verb}'") as info:
        make_gate(stub).apply(["llama"], all_required_ready=False)
    assert info.value.hint and f"'{verb}' verb on nodes" in info.value.hint
    assert len(stub.requests) == (1 if method == "GET" else 2)


def test_patch_rejected_for_itself_is_not_retried_forever(stub: KubeStub, node: str) -> None:
    # A 422 while the resourceVersion did not move: not our guard, the patch itself is refused.
    stub.fail_next(1, 422, method="PATCH")
    with pytest.raises(NodeGateError, match="rejected the label/taint patch"):
        make_gate(stub, max_attempts=5).apply(["llama"], all_required_ready=False)
    assert len(patches(stub)) == 1
    assert len(stub.requests_of("GET")) == 2


# -- label keys ------------------------------------------------------------------------------


def test_shortening_matches_the_documented_examples() -> None:
    long = "meta-llama-3.1-405b-instruct-fp8-dynamic-with-a-very-long-suffix-v2"
    assert label_key(PREFIX, long) == (
        f"{PREFIX}/meta-llama-3.1-405b-instruct-fp8-dynamic-with-a-very-af6031ebd8"
    )
    assert label_key(PREFIX, "meta-llama/Llama-3.1-8B-Instruct") == (
        f"{PREFIX}/meta-llama-Llama-3.1-8B-Instruct-08a20b291e"
    )


def test_valid_short_names_are_used_unchanged() -> None:
    assert label_key(PREFIX, "llama-3.1-8b-instruct") == f"{PREFIX}/llama-3.1-8b-instruct"
    assert label_key(PREFIX, "a" * 63) == f"{PREFIX}/{'a' * 63}"


@pytest.mark.parametrize(
    "name",
    [
        "a" * 64,
        "meta-llama-3.1-405b-instruct-fp8-dynamic-with-a-very-long-suffix-v2",
        "meta-llama/Llama-3.1-8B-Instruct",
        "-starts-with-dash",
        "ends.with.dot.",
        "x" * 52 + "....." + "y" * 20,
        "模型",
        "___",
    ],
)
def test_other_names_are_shortened_predictably(name: str) -> None:
    shortened = label_key(PREFIX, name)
    prefix, _, label_name = shortened.partition("/")
    assert prefix == PREFIX
    assert len(label_name) <= 63
    assert LABEL_NAME.match(label_name), label_name
    assert re.search(r"(^|-)[0-9a-f]{10}$", label_name)
    assert label_key(PREFIX, name) == shortened  # stable
    assert validate_node({"metadata": {"labels": {shortened: "ready"}}}) == []


def test_shortened_keys_keep_a_readable_head_and_differ_for_different_names() -> None:
    base = "mistralai-mixtral-8x22b-instruct-v0.1-awq-4bit-gptq-calibrated-"
    one, two = label_key(PREFIX, base + "one"), label_key(PREFIX, base + "two")
    assert one != two
    assert one.split("/", 1)[1].startswith("mistralai-mixtral-8x22b-instruct")
    assert (
        one
        == f"{PREFIX}/mistralai-mixtral-8x22b-instruct-v0.1-awq-4bit-gptq-"
        + (hashlib.sha256((base + "one").encode()).hexdigest()[:10])
    )


def test_long_model_names_label_the_node(stub: KubeStub, node: str) -> None:
    long_names = [f"org-{'very-long-model-name-' * 3}{i}" for i in range(3)]
    gate = make_gate(stub)
    gate.apply(long_names, all_required_ready=True)
    keys = {gate.label_key(n) for n in long_names}
    assert len(keys) == 3
    assert {k for k in stub.labels(node) if k.startswith(PREFIX + "/")} == keys
    assert make_gate(stub).apply(long_names, all_required_ready=True).patched is False


def test_empty_model_name_is_refused(stub: KubeStub, node: str) -> None:
    with pytest.raises(ValueError):
        make_gate(stub).apply([""], all_required_ready=False)


@pytest.mark.parametrize(
    "options",
    [
        {"label_prefix": "Not_A/Prefix"},
        {"startup_taint_effect": "NoWay"},
        {"max_attempts": 0},
        {"startup_taint_key": ""},
    ],
)
def test_bad_gate_options_are_config_errors(stub: KubeStub, options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        make_gate(stub, **options)


# -- in_cluster_gate -------------------------------------------------------------------------


def test_in_cluster_gate_is_off_outside_a_cluster(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with caplog.at_level(logging.DEBUG, logger="prefetch.agent.node"):
        assert in_cluster_gate(NODE) is None
    records = [r for r in caplog.records if r.name == "prefetch.agent.node"]
    assert len(records) == 1
    assert records[0].levelno == logging.INFO
    assert "node gate off" in records[0].getMessage()
    assert "KUBERNETES_SERVICE_HOST" in records[0].getMessage()


def test_in_cluster_gate_is_off_without_a_node_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    with caplog.at_level(logging.DEBUG, logger="prefetch.agent.node"):
        assert in_cluster_gate(None) is None
    records = [r for r in caplog.records if r.name == "prefetch.agent.node"]
    assert len(records) == 1 and "NODE_NAME" in records[0].getMessage()


def test_in_cluster_gate_reports_a_broken_in_cluster_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(NodeGateError, match="in-cluster Kubernetes config"):
        in_cluster_gate(NODE)


# -- the stub itself (so the tests above mean what they say) ---------------------------------


def test_stub_failed_test_op_is_422_status(stub: KubeStub, node: str) -> None:
    api = stub.client()
    body = [{"op": "test", "path": "/metadata/resourceVersion", "value": "1"}]
    with pytest.raises(ApiException) as info:
        api.patch_node(node, body, _content_type="application/json-patch+json")
    assert info.value.status == 422
    status = json.loads(info.value.body)
    assert status["kind"] == "Status" and status["reason"] == "Invalid"
    assert status["message"] == "the server rejected our request due to an error in our request"


def test_stub_merge_and_strategic_merge_patches(stub: KubeStub, node: str) -> None:
    api = stub.client()
    rv = int(stub.resource_version(node))
    api.patch_node(
        node,
        {"metadata": {"labels": {"karpenter.sh/nodepool": None, "a": "b"}}},
        _content_type="application/merge-patch+json",
    )
    api.patch_node(node, {"spec": {"taints": [GPU]}})  # the client sends strategic merge
    assert patches(stub)[-1].content_type == "application/strategic-merge-patch+json"
    labels = stub.labels(node)
    assert "karpenter.sh/nodepool" not in labels and labels["a"] == "b"
    assert stub.taints(node) == [GPU]
    assert int(stub.resource_version(node)) == rv + 2


def test_stub_resource_version_precondition_and_errors(stub: KubeStub, node: str) -> None:
    api = stub.client()
    with pytest.raises(ApiException) as conflict:
        api.patch_node(node, {"metadata": {"resourceVersion": "1", "labels": {"x": "y"}}})
    assert conflict.value.status == 409
    with pytest.raises(ApiException) as missing:
        api.read_node("nope")
    assert missing.value.status == 404 and '"reason": "NotFound"' in missing.value.body
    with pytest.raises(ApiException) as invalid:
        api.patch_node(node, {"metadata": {"labels": {"bad key!": "x"}}})
    assert invalid.value.status == 422
    stub.fail_next(1, 500)
    with pytest.raises(ApiException) as server:
        api.list_node()
    assert server.value.status == 500
    assert [n.metadata.name for n in api.list_node().items] == [node]


def test_stub_json_patch_pointer_escapes() -> None:
    doc = {"a/b": {"c~d": 1}, "list": [1, 2]}
    ops = [
        {"op": "test", "path": "/a~1b/c~0d", "value": 1},
        {"op": "replace", "path": "/a~1b/c~0d", "value": 2},
        {"op": "add", "path": "/list/-", "value": 3},
        {"op": "remove", "path": "/list/0"},
    ]
    assert apply_json_patch(doc, ops) == {"a/b": {"c~d": 2}, "list": [2, 3]}
    assert doc == {"a/b": {"c~d": 1}, "list": [1, 2]}  # the input is not modified


def test_public_api() -> None:
    import prefetch.agent.node as node_module

    assert sorted(node_module.__all__) == [
        "FIELD_MANAGER",
        "GateResult",
        "LABEL_NAME_MAX",
        "NodeGate",
        "READY_VALUE",
        "in_cluster_gate",
        "label_key",
        "parse_timestamp",
    ]


def test_many_patches_share_one_pooled_connection() -> None:
    """Each PATCH's answer is read to its end, so the next request can reuse the connection:
    an unread body there is either taken for the next status line or makes urllib3 drop it."""
    with KubeStub(keep_alive=True) as stub:
        stub.add_node(NODE, labels=dict(FOREIGN_LABELS), taints=[GPU])
        gate = make_gate(stub)
        for i in range(40):
            models = [f"model-{i % 2}"]
            result = gate.apply(models, all_required_ready=False)
            assert result.patched and result.attempts == 1, (i, result)
        assert len(patches(stub)) == 40
        assert len(stub.requests_of("GET")) == 40, "a request was retried"
        assert stub.connections == 1, f"{stub.connections} connections for 80 requests"
