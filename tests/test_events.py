"""The node's story: Kubernetes Events (events.k8s.io/v1) on the Node and the same story in the
agent's JSON log lines, against the Kubernetes API stub with the real kubernetes client and the
real local S3 server (SeaweedFS)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from kubernetes.config import incluster_config
from prometheus_client import CollectorRegistry

from prefetch.agent import events as ev
from prefetch.agent import kube_events
from prefetch.agent.event_recorder import EventRecorder
from prefetch.agent.kube_events import KubeEventSink
from prefetch.agent.loop import Agent
from prefetch.agent.metrics import AgentMetrics
from prefetch.agent.node import NodeGate
from prefetch.agent.space import SpaceManager
from prefetch.agent.warming import WarmingStory
from prefetch.demo.locals3 import SeaweedS3
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.sources.s3.factory import make_s3_client
from prefetch.support.constants import DEFAULT_STARTUP_TAINT_KEY, PROGRESS_ANNOTATION
from prefetch.support.logjson import JsonFormatter, current_sync_id, sync_context
from prefetch.support.units import format_bytes
from tests import manifests_util as mu
from tests.fakes.k8s_events import describe_events
from tests.fakes.k8s_stub import KubeStub, running_stub
from tests.fakes.s3proxy import S3FaultProxy
from tests.support import AgentThread, config_text, upload, wait_for
from tests.tls import TestCA

MiB = 1024 * 1024
NODE = "gpu-node-1"
STARTUP = {"key": DEFAULT_STARTUP_TAINT_KEY, "value": "true", "effect": "NoSchedule"}
EVENTS_PATH = "/apis/events.k8s.io/v1/namespaces/default/events"


@pytest.fixture
def stub() -> Iterator[KubeStub]:
    yield from running_stub()


def stub_gate(stub: KubeStub) -> Callable[[Any], NodeGate]:
    def make(cfg: Any) -> NodeGate:
        return NodeGate(
            stub.client(),
            NODE,
            label_prefix=cfg.label_prefix,
            startup_taint_key=cfg.startup_taint,
            backoff=0.01,
            max_backoff=0.05,
        )

    return make


def stub_agent(stub: KubeStub, config: Path, s3_client: Any) -> Agent:
    """An agent that gates and tells its story on the stub's node."""
    sink = KubeEventSink(stub.events_client(), stub.client(), NODE)
    return Agent(
        config,
        s3_client=s3_client,
        gate_factory=stub_gate(stub),
        event_sink=sink,
        serve=False,
        tick=0.2,
    )


def reasons(events: list[dict[str, Any]]) -> list[str]:
    return [e["reason"] for e in events]


def sample(agent: Agent, name: str, **labels: str) -> float:
    return agent.registry.get_sample_value(name, labels) or 0.0


class JsonLines:
    """Captures the JSON log lines every logger writes while in use (the agent's format)."""

    def __init__(self) -> None:
        self.stream = io.StringIO()
        self.handler = logging.StreamHandler(self.stream)
        self.handler.setFormatter(JsonFormatter())

    def __enter__(self) -> JsonLines:
        root = logging.getLogger()
        self._level = root.level
        root.addHandler(self.handler)
        root.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger()
        root.removeHandler(self.handler)
        root.setLevel(self._level)

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stream.getvalue().splitlines() if line]


# -- the story of a cold start ---------------------------------------------------------------------


def test_a_cold_start_tells_warming_started_each_model_ready_and_the_gate_opened_in_order(
    s3_client: Any, bucket: str, stub: KubeStub, tmp_path: Path
) -> None:
    stub.add_node(NODE, taints=[STARTUP])
    sizes = {}
    for i, name in enumerate(("r1", "r2")):
        files = upload(s3_client, bucket, name, tmp_path, 2 * MiB, seed=i)
        sizes[name] = sum(len(b) for b in files.values())
    config = tmp_path / "models.yaml"
    models = [{"name": n, "source": f"s3://{bucket}/{n}"} for n in sizes]
    config.write_text(config_text(tmp_path / "cache", models))
    agent = stub_agent(stub, config, s3_client)
    with AgentThread(agent):
        wait_for(lambda: STARTUP not in stub.taints(NODE), "the taint to go", dump=agent.status)
        assert agent.events.flush()
    events = stub.events("default")
    print(stub.describe_events(NODE))  # the closing note's `kubectl describe node` excerpt

    assert reasons(events)[0] == "WarmingStarted"
    assert sorted(reasons(events)[1:3]) == ["ModelReady", "ModelReady"]
    assert reasons(events)[3:] == ["NodeGateOpened"]
    for e in events:
        assert e["regarding"] == {
            "apiVersion": "v1",
            "kind": "Node",
            "name": NODE,
            "uid": f"uid-{NODE}",
        }
        assert e["reportingController"] == "model-prefetch.io/agent"
        assert e["reportingInstance"] == NODE
        assert e["type"] == "Normal" and "series" not in e
    warming, *ready, opened = events
    total = sum(sizes.values())
    assert warming["action"] == "Warm" and "Warming 2 model(s): r1, r2;" in warming["note"]
    assert f"({total} bytes) in total, " in warming["note"]
    assert f"({total} bytes) to download" in warming["note"]
    for e in ready:
        name = e["note"].split()[1]
        assert e["action"] == "Sync"
        assert f"({sizes[name]} bytes)" in e["note"]
        assert f"from s3://{bucket}/{name}/" in e["note"]
    assert opened["action"] == "OpenGate"
    assert f"removed the startup taint {DEFAULT_STARTUP_TAINT_KEY}" in opened["note"]
    assert "r1, r2" in opened["note"]


def test_a_repeated_failure_updates_one_events_count_instead_of_creating_many(
    s3_client: Any, bucket: str, stub: KubeStub, tmp_path: Path
) -> None:
    stub.add_node(NODE, taints=[STARTUP])
    config = tmp_path / "models.yaml"
    missing = f"s3://{bucket}-gone/m"
    config.write_text(config_text(tmp_path / "cache", [{"name": "m", "source": missing}]))
    agent = stub_agent(stub, config, s3_client)
    with AgentThread(agent):
        state = agent.scheduler.get("m")
        assert state is not None
        wait_for(lambda: state.failures >= 3, "three failed syncs", dump=agent.status)
    failed = [e for e in stub.events() if e["reason"] == "SyncFailed"]
    assert len(failed) == 1, reasons(stub.events())
    assert failed[0]["series"]["count"] == state.failures
    assert failed[0]["type"] == "Warning" and "(not_found)" in failed[0]["note"]
    patches = [r for r in stub.requests_of("PATCH") if r.path.startswith(EVENTS_PATH + "/")]
    assert patches and all(r.content_type == "application/merge-patch+json" for r in patches)
    assert all(set(r.body) == {"series"} for r in patches)


def test_an_occurrence_after_the_series_window_is_a_new_event(stub: KubeStub) -> None:
    stub.add_node(NODE)
    now = [1000.0]
    metrics = AgentMetrics(CollectorRegistry())
    sink = KubeEventSink(stub.events_client(), stub.client(), NODE)
    recorder = EventRecorder(metrics, sink, series_window=60.0, clock=lambda: now[0])
    failure = ev.sync_failed("m", "transient", "HTTP 503", source="s3://b/m/")
    recorder.emit(failure)
    assert recorder.flush()
    now[0] += 59
    recorder.emit(failure)  # within the window: the first Event's count
    assert recorder.flush()
    now[0] += 61
    recorder.emit(failure)  # a minute of quiet later: a new Event
    assert recorder.flush()
    recorder.close()
    counts = [e.get("series", {}).get("count", 1) for e in stub.events()]
    assert counts == [2, 1]


def test_a_repeat_whose_event_expired_creates_it_again_with_the_whole_count(
    stub: KubeStub,
) -> None:
    stub.add_node(NODE)
    sink = KubeEventSink(stub.events_client(), stub.client(), NODE)
    recorder = EventRecorder(AgentMetrics(CollectorRegistry()), sink)
    failure = ev.sync_failed("m", "transient", "HTTP 503", source="s3://b/m/")
    recorder.emit(failure)
    assert recorder.flush()
    stub.event_store.expire()
    recorder.emit(failure)  # its PATCH finds no Event (404): created anew, with the series
    assert recorder.flush()
    recorder.close()
    (event,) = stub.events()
    assert event["series"]["count"] == 2 and event["reason"] == "SyncFailed"
    statuses = [(r.method, r.status) for r in stub.requests if r.path.startswith(EVENTS_PATH)]
    assert statuses == [("POST", 201), ("PATCH", 404), ("POST", 201)]


def test_the_rate_limit_drops_the_excess_and_counts_it(stub: KubeStub) -> None:
    stub.add_node(NODE)
    now = [0.0]
    metrics = AgentMetrics(CollectorRegistry())
    sink = KubeEventSink(stub.events_client(), stub.client(), NODE)
    recorder = EventRecorder(metrics, sink, burst=3, refill_seconds=300, clock=lambda: now[0])
    for i in range(5):
        recorder.emit(ev.evicted(f"old-{i}", 10, for_model="new"))
    assert recorder.flush()
    assert len(stub.events()) == 3
    dropped = metrics.registry.get_sample_value(
        "model_prefetch_events_dropped_total", {"reason": "rate_limited"}
    )
    assert dropped == 2
    now[0] += 300  # one token back
    recorder.emit(ev.evicted("old-5", 10, for_model="new"))
    recorder.emit(ev.evicted("old-6", 10, for_model="new"))
    assert recorder.flush()
    recorder.close()
    assert [e["note"].split()[1] for e in stub.events()] == ["old-0", "old-1", "old-2", "old-5"]


@pytest.mark.parametrize("status", [500, 403, 0], ids=["server-error", "forbidden", "dropped"])
def test_an_events_api_error_does_not_stop_the_model_becoming_ready(
    s3_client: Any, bucket: str, stub: KubeStub, tmp_path: Path, status: int
) -> None:
    stub.add_node(NODE, taints=[STARTUP])
    stub.fail_next(10**6, status, path="/apis/events.k8s.io/")
    upload(s3_client, bucket, "r1", tmp_path, 2 * MiB)
    config = tmp_path / "models.yaml"
    config.write_text(
        config_text(tmp_path / "cache", [{"name": "r1", "source": f"s3://{bucket}/r1"}])
    )
    agent = stub_agent(stub, config, s3_client)
    with AgentThread(agent):
        wait_for(lambda: STARTUP not in stub.taints(NODE), "the taint to go", dump=agent.status)
        assert agent.readiness()[0] == 200
        assert agent.events.flush()
    assert stub.events() == []
    assert sample(agent, "model_prefetch_event_errors_total") >= 3  # warming, ready, gate


def test_a_full_queue_drops_events_without_blocking(stub: KubeStub) -> None:
    stub.add_node(NODE)
    metrics = AgentMetrics(CollectorRegistry())

    class Stuck:
        """A sink whose API server never answers (until released)."""

        node_name = NODE

        def __init__(self) -> None:
            self.release = threading.Event()

        def node_uid(self) -> str | None:
            return None

        def create(self, namespace: str, body: dict[str, Any]) -> None:
            self.release.wait(10)

        def patch(self, namespace: str, name: str, body: dict[str, Any]) -> bool:
            return True

    sink = Stuck()
    recorder = EventRecorder(metrics, sink, queue_size=2)
    for i in range(6):
        recorder.emit(ev.evicted(f"old-{i}", 10, for_model="new"))  # returns at once
    dropped = metrics.registry.get_sample_value(
        "model_prefetch_events_dropped_total", {"reason": "queue_full"}
    )
    assert dropped is not None and dropped >= 3
    sink.release.set()
    recorder.close()


def test_a_checksum_failure_that_fails_the_sync_is_told_as_checksum_failed(
    test_ca: TestCA,
    s3_server: SeaweedS3,
    s3_client: Any,
    bucket: str,
    stub: KubeStub,
    tmp_path: Path,
) -> None:
    stub.add_node(NODE, taints=[STARTUP])
    files = upload(s3_client, bucket, "m", tmp_path, 2 * MiB)
    shard = max(files, key=lambda p: len(files[p]))
    config = tmp_path / "models.yaml"
    config.write_text(
        config_text(tmp_path / "cache", [{"name": "m", "source": f"s3://{bucket}/m"}])
    )
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        proxy.faults.flip_key, proxy.faults.flip_offset = f"m/{shard}", 100  # every answer
        client = make_s3_client(
            endpoint_url=proxy.endpoint,
            access_key=s3_server.access_key,
            secret_key=s3_server.secret_key,
        )
        agent = stub_agent(stub, config, client)
        with AgentThread(agent):
            state = agent.scheduler.get("m")
            assert state is not None
            wait_for(lambda: state.failures >= 2, "two failed syncs", dump=agent.status)
    assert reasons(stub.events()) == ["WarmingStarted", "ChecksumFailed"]
    told = stub.events()[1]
    assert told["type"] == "Warning" and told["action"] == "Verify"
    assert told["series"]["count"] == state.failures
    assert shard in told["note"] and told["note"].endswith("; the sync failed")


def test_bit_rot_found_at_rest_is_told_and_the_model_ready_again_counts_in_its_event(
    s3_client: Any, bucket: str, stub: KubeStub, tmp_path: Path
) -> None:
    stub.add_node(NODE, taints=[STARTUP])
    files = upload(s3_client, bucket, "m", tmp_path, 2 * MiB)
    shard = max(files, key=lambda p: len(files[p]))
    cache = tmp_path / "cache"
    config = tmp_path / "models.yaml"
    model = [{"name": "m", "source": f"s3://{bucket}/m"}]
    config.write_text(config_text(cache, model, verifyInterval="1s"))
    agent = stub_agent(stub, config, s3_client)
    local = cache / "models" / "m" / shard
    with AgentThread(agent):
        state = agent.scheduler.get("m")
        assert state is not None
        wait_for(lambda: STARTUP not in stub.taints(NODE), "the taint to go", dump=agent.status)
        data = bytearray(local.read_bytes())
        data[len(data) // 2] ^= 0x01
        local.write_bytes(bytes(data))
        wait_for(
            lambda: "ReverifyFailed" in reasons(stub.events()) and state.ready,
            "the damage found and the model ready again",
            dump=agent.status,
        )
        assert agent.events.flush()
    story = {e["reason"]: e for e in stub.events()}
    rot = story["ReverifyFailed"]
    assert rot["type"] == "Warning" and f"checksum mismatch for {shard}" in rot["note"]
    # the same revision ready again: a repeat of the first ModelReady, not a new Event
    assert reasons(stub.events()).count("ModelReady") == 1
    assert story["ModelReady"]["series"]["count"] == 2


def test_an_eviction_is_told_with_the_bytes_it_freed() -> None:
    old = SimpleNamespace(key="models/old", name="old", size=100 * MiB, last_used=0.0)
    free = [1 * MiB]

    class Disk:
        """Just enough of a Store: one unwanted model, and the free space it frees."""

        def free_bytes(self) -> int:
            return free[0]

        def eviction_candidates(self, wanted: Any, busy: Any) -> list[Any]:
            return [old]

        def evict(self, entry: Any, *, lock_timeout: float) -> int:
            free[0] += entry.size
            return int(entry.size)

    sink = Recording()
    metrics = AgentMetrics(CollectorRegistry())
    recorder = EventRecorder(metrics, sink)
    space = SpaceManager(Disk(), metrics, recorder)  # type: ignore[arg-type]
    spec = ModelSpec(name="new", source=parse_source_uri("s3://bucket/new"))
    space.make_room(spec, 4 * MiB, wanted=[spec], min_free=0, sink=metrics.sink("new", "s3"))
    assert recorder.flush()
    recorder.close()
    assert [e["note"] for e in sink.created] == [
        f"Evicted old from the cache (100.0 MiB ({100 * MiB} bytes) freed) to make room for new"
    ]


class Recording:
    """A sink that keeps the Event bodies it is given, in order."""

    node_name = NODE

    def __init__(self) -> None:
        self.created: list[dict[str, Any]] = []

    def node_uid(self) -> str | None:
        return None

    def create(self, namespace: str, body: dict[str, Any]) -> None:
        self.created.append(body)

    def patch(self, namespace: str, name: str, body: dict[str, Any]) -> bool:
        return True


def test_warming_started_waits_for_the_starting_syncs_plans_and_tells_their_sizes() -> None:
    sink = Recording()
    recorder = EventRecorder(AgentMetrics(CollectorRegistry()), sink)
    story = WarmingStory(recorder)
    story.begin(["a", "b", "c"], starting=["a", "b"], known={})
    story.planned("a", 1000, 600)
    assert recorder.flush() and sink.created == []  # b has not resolved yet
    story.planned("b", 24, 24)
    assert recorder.flush()
    recorder.close()
    assert [e["note"] for e in sink.created] == [
        "Warming 3 model(s): a, b, c; 1.0 KiB (1024 bytes) in total, 624 B (624 bytes) to "
        "download; sizes not resolved yet: c"
    ]


def test_warming_started_is_told_before_a_sync_of_its_episode_ends() -> None:
    """However slow one sync is to resolve, no model is ready before warming started (here
    the ended sync waits no time at all for the other to resolve)."""
    sink = Recording()
    recorder = EventRecorder(AgentMetrics(CollectorRegistry()), sink)
    story = WarmingStory(recorder, resolve_wait=0.0)
    story.begin(["a", "b"], starting=["a", "b"], known={})
    story.planned("a", 10, 10)
    story.settled("a")  # a is done (ModelReady next) while b is still resolving
    recorder.emit(
        ev.model_ready(
            "a", bytes_total=10, downloaded=10, seconds=1, source="s3://x/a/", revision="r"
        )
    )
    story.planned("b", 20, 20)  # too late for the story: told once
    assert recorder.flush()
    recorder.close()
    assert [e["reason"] for e in sink.created] == ["WarmingStarted", "ModelReady"]
    assert sink.created[0]["note"].endswith("to download; sizes not resolved yet: b")


# -- the same story in the log ---------------------------------------------------------------------


def test_event_log_lines_carry_the_events_fields_and_a_syncs_lines_share_one_sync_id(
    test_ca: TestCA,
    s3_server: SeaweedS3,
    s3_client: Any,
    bucket: str,
    stub: KubeStub,
    tmp_path: Path,
) -> None:
    stub.add_node(NODE, taints=[STARTUP])
    r1 = upload(s3_client, bucket, "r1", tmp_path, 2 * MiB, seed=1)
    upload(s3_client, bucket, "r2", tmp_path, 2 * MiB, seed=2)
    shard, other = sorted(r1, key=lambda p: len(r1[p]))[-2:]
    config = tmp_path / "models.yaml"
    models = [{"name": n, "source": f"s3://{bucket}/{n}"} for n in ("r1", "r2")]
    config.write_text(config_text(tmp_path / "cache", models))
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy, JsonLines() as logs:
        # one corrupted answer (the engine fetches the file again) and one connection cut
        # mid-body (an I/O worker thread logs its retry)
        faults = proxy.faults
        faults.flip_key, faults.flip_offset, faults.flip_times = f"r1/{shard}", 100, 1
        faults.cut_key, faults.cut_after, faults.cut_times = f"r1/{other}", 64 * 1024, 1
        client = make_s3_client(
            endpoint_url=proxy.endpoint,
            access_key=s3_server.access_key,
            secret_key=s3_server.secret_key,
        )
        agent = stub_agent(stub, config, client)
        with AgentThread(agent):
            wait_for(lambda: STARTUP not in stub.taints(NODE), "the taint to go")
            assert agent.events.flush()
    lines = logs.lines()
    told = {(x["event"], x.get("model")): x for x in lines if "event" in x}
    assert {k[0] for k in told} == {
        "WarmingStarted",
        "ChecksumFailed",
        "ModelReady",
        "NodeGateOpened",
    }
    for model in ("r1", "r2"):
        line = told[("ModelReady", model)]
        event = next(e for e in stub.events() if e["reason"] == "ModelReady" and model in e["note"])
        assert line["msg"] == f"ModelReady: {event['note']}"
        assert line["node"] == NODE and line["level"] == "info"
        assert line["source"] == f"s3://{bucket}/{model}/"
        assert f"({line['bytes']} bytes)" in event["note"]
        assert f"in {line['seconds']:.1f}s" in event["note"]
    assert told[("ChecksumFailed", "r1")]["level"] == "warning"

    r1_sync = told[("ModelReady", "r1")]["sync_id"]
    r2_sync = told[("ModelReady", "r2")]["sync_id"]
    assert r1_sync and r2_sync and r1_sync != r2_sync
    assert told[("ChecksumFailed", "r1")]["sync_id"] == r1_sync
    # the engine's lines about r1's file carry r1's id, also from its I/O worker threads
    refetch = [x for x in lines if "downloading the file once more" in x["msg"]]
    assert refetch and all(x.get("sync_id") == r1_sync for x in refetch)
    retried = [x for x in lines if x["msg"].startswith("retrying") and other in x["msg"]]
    assert retried and all(x.get("sync_id") == r1_sync for x in retried)
    # and every line about one model from its sync carries that sync's id
    for model, sync_id in (("r1", r1_sync), ("r2", r2_sync)):
        synced = [x for x in lines if x.get("model") == model and x.get("phase") == "sync"]
        assert synced and {x.get("sync_id") for x in synced} == {sync_id}
    assert "sync_id" not in told[("NodeGateOpened", None)]


def test_a_sync_context_reaches_the_threads_started_in_it() -> None:
    async def in_a_sync() -> str | None:
        with sync_context("abc12345"):
            return await asyncio.to_thread(current_sync_id)

    assert asyncio.run(in_a_sync()) == "abc12345"
    assert current_sync_id() is None


# -- RBAC --------------------------------------------------------------------------------------


def _granted() -> set[tuple[str | None, str, str, str]]:
    """(namespace or None for cluster-wide, API group, resource, verb) the manifests grant."""
    granted: set[tuple[str | None, str, str, str]] = set()
    for kind, scoped in (("ClusterRole", False), ("Role", True)):
        for role in mu.find(kind, under="daemonset"):
            namespace = role["metadata"]["namespace"] if scoped else None
            for rule in role["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            granted.add((namespace, group, resource, verb))
    return granted


def _used(stub: KubeStub) -> set[tuple[str | None, str, str, str]]:
    """What the stub's recorded requests needed, as RBAC rules."""
    verbs = {"GET": "get", "PATCH": "patch", "POST": "create", "PUT": "update", "DELETE": "delete"}
    used: set[tuple[str | None, str, str, str]] = set()
    for r in stub.requests:
        parts = r.path.strip("/").split("/")
        if parts[:2] == ["api", "v1"]:
            group, rest = "", parts[2:]
        else:
            group, rest = parts[1], parts[3:]
        namespace = None
        if rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        verb = verbs[r.method]
        if r.method == "GET" and len(rest) == 1:
            verb = "list"
        used.add((namespace, group, rest[0], verb))
    return used


def test_rbac_grants_exactly_what_the_agent_uses(
    s3_client: Any, bucket: str, stub: KubeStub, tmp_path: Path
) -> None:
    """Nodes get/patch (the gate), Events create/patch in "default" (a new Event, a repeat's
    count): the run uses every grant and nothing else."""
    stub.add_node(NODE, taints=[STARTUP])
    upload(s3_client, bucket, "r1", tmp_path, 2 * MiB)
    config = tmp_path / "models.yaml"
    models = [
        {"name": "r1", "source": f"s3://{bucket}/r1"},
        {"name": "bad", "source": f"s3://{bucket}-gone/m", "required": False},
    ]
    config.write_text(config_text(tmp_path / "cache", models))
    agent = stub_agent(stub, config, s3_client)
    with AgentThread(agent):
        state = agent.scheduler.get("bad")
        assert state is not None
        wait_for(lambda: STARTUP not in stub.taints(NODE), "the taint to go", dump=agent.status)
        wait_for(lambda: state.failures >= 3, "a repeated failure", dump=agent.status)
    assert _used(stub) == _granted()
    role = yaml.safe_dump(mu.find("Role", under="daemonset"))
    assert "default" in role  # where Events about a Node must live


def test_the_operations_page_lists_every_event_reason_and_no_other() -> None:
    page = (mu.REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    table = page.split("| reason | type | when |", 1)[1].split("\n\n", 1)[0]
    listed = [row.split("`")[1] for row in table.splitlines()[2:]]
    assert listed == [r.value for r in ev.Reason]


def test_the_describe_rendering_shows_a_series_as_kubectl_does() -> None:
    base = {"reportingController": "model-prefetch.io/agent", "reportingInstance": NODE}
    events = [
        {**base, "type": "Warning", "reason": "SyncFailed", "note": "Sync of model m failed",
         "eventTime": "2026-12-03T10:00:00.000000Z",
         "series": {"count": 5, "lastObservedTime": "2026-12-03T10:17:00.000000Z"}},
        {**base, "type": "Normal", "reason": "WarmingStarted", "note": "Warming 1 model(s): m",
         "eventTime": "2026-12-03T09:59:58.000000Z"},
    ]  # fmt: skip
    text = describe_events(events, now=datetime(2026, 12, 3, 10, 20, tzinfo=UTC))
    assert text.splitlines() == [
        "Events:",
        "  Type     Reason          Age               From                                 Message",
        "  ----     ------          ----              ----                                 -------",
        "  Normal   WarmingStarted  20m               model-prefetch.io/agent, gpu-node-1  "
        "Warming 1 model(s): m",
        "  Warning  SyncFailed      3m (x5 over 20m)  model-prefetch.io/agent, gpu-node-1  "
        "Sync of model m failed",
    ]


def test_outside_a_cluster_or_without_its_config_events_are_only_logged(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "no-token"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert kube_events.in_cluster_events(NODE) is None
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "1")
    assert kube_events.in_cluster_events(None) is None
    # in a cluster but without a service account token: no Events, and no crash either
    assert kube_events.in_cluster_events(NODE) is None
    with JsonLines() as logs:
        EventRecorder(AgentMetrics(CollectorRegistry())).emit(ev.evicted("old", 5, for_model="new"))
    (line,) = logs.lines()
    assert line["event"] == "Evicted" and line["bytes"] == 5 and "node" not in line


# -- time to serve: the warm-up and the compile cache ----------------------------------------------


def test_the_warm_up_and_the_compile_cache_are_told_as_events_in_the_note_and_in_status(
    s3_client: Any, bucket: str, stub: KubeStub, tmp_path: Path
) -> None:
    """A warmPageCache model tells WarmUpStarted and WarmUpFinished (bytes, seconds); a compile
    cache tells CompileCacheNotPublished (once, not at every resolve), then CompileCachePulled
    for its key once another node published it; the progress note and `prefetch status` show
    the warm-up's and the compile cache's state."""
    from prefetch.publish.compile_cache import CacheKey, push

    from .test_compile_cache import vllm_cache
    from .test_status_cmd import kubeconfig, status

    stub.add_node(NODE, taints=[STARTUP])
    files = upload(s3_client, bucket, "w", tmp_path, 2 * MiB, seed=3)
    size = sum(len(b) for b in files.values())
    key = CacheKey(vllm="v0.18.0", model="org/w", revision="r1", gpu_product="NVIDIA-A10G")
    entry = {"name": "w-compile", "source": f"s3://{bucket}/compile-cache/", "vllm": "v0.18.0",
             "model": "org/w", "revision": "r1", "gpuProduct": "NVIDIA-A10G"}  # fmt: skip
    config = tmp_path / "models.yaml"
    models = [{"name": "w", "source": f"s3://{bucket}/w", "warmPageCache": True}]
    config.write_text(
        config_text(tmp_path / "cache", models, compileCaches=[entry], resolveInterval="1s")
    )
    agent = stub_agent(stub, config, s3_client)
    agent.progress.limiter.interval = 0.0  # every change written at once
    with AgentThread(agent):
        w = agent.scheduler.get("w")
        assert w is not None
        wait_for(lambda: w.warm is not None, "the warm-up", dump=agent.status)
        passes = agent.passes
        wait_for(lambda: agent.passes > passes + 15, "a few resolves of the compile cache")
        node_a = tmp_path / "node-a"
        vllm_cache(node_a)
        uri = f"s3://{bucket}/compile-cache/{key.key}/"
        assert push(s3_client, node_a, uri, key=key, settle=0).uploaded
        cc = agent.scheduler.get("w-compile")
        assert cc is not None
        wait_for(lambda: cc.ready and not cc.nothing_published, "the pull", dump=agent.status)

        def noted() -> dict[str, Any]:
            raw = stub.node(NODE)["metadata"].get("annotations", {}).get(PROGRESS_ANNOTATION)
            return {m["name"]: m for m in json.loads(raw or '{"models": []}')["models"]}

        wait_for(lambda: noted().get("w-compile", {}).get("cache") == "pulled", "the note")
        assert agent.events.flush()
    note = noted()
    assert note["w"]["warm"] == "warm" and "cache" not in note["w"]
    assert "warm" not in note["w-compile"]
    told = {e["reason"]: e for e in stub.events("default")}
    assert reasons(stub.events("default")).count("CompileCacheNotPublished") == 1
    assert "series" not in told["CompileCacheNotPublished"]  # once, not at every resolve
    started, finished = told["WarmUpStarted"], told["WarmUpFinished"]
    assert f"({size} bytes)" in started["note"] and started["action"] == "Warm"
    assert f"read {format_bytes(size)} ({size} bytes) in " in finished["note"]
    assert key.key in told["CompileCacheNotPublished"]["note"]
    pulled = told["CompileCachePulled"]
    assert key.key in pulled["note"] and pulled["type"] == "Normal"
    names = reasons(stub.events("default"))
    assert names.index("WarmUpStarted") < names.index("WarmUpFinished")

    result = status("--kubeconfig", str(kubeconfig(tmp_path / "kc", stub.url)), "-o", "json")
    assert result.exit_code == 0, result.output
    rows = {m["name"]: m for m in json.loads(result.stdout)["nodes"][0]["models"]}
    assert rows["w"]["warm"] == "warm" and rows["w-compile"]["cache"] == "pulled"
    table = status("--kubeconfig", str(tmp_path / "kc")).stdout
    assert "warm:warm" in table and "cache:pulled" in table


def test_a_warm_up_that_does_not_fit_is_told_as_skipped_with_why(
    s3_client: Any, bucket: str, stub: KubeStub, tmp_path: Path
) -> None:
    stub.add_node(NODE, taints=[STARTUP])
    upload(s3_client, bucket, "big", tmp_path, 2 * MiB, seed=4)
    config = tmp_path / "models.yaml"
    models = [{"name": "big", "source": f"s3://{bucket}/big", "warmPageCache": True}]
    config.write_text(config_text(tmp_path / "cache", models, warmMemoryShare=1e-12))
    agent = stub_agent(stub, config, s3_client)
    with AgentThread(agent):
        ms = agent.scheduler.get("big")
        assert ms is not None
        wait_for(lambda: ms.warm is not None, "the warm-up", dump=agent.status)
        assert agent.events.flush()
    told = {e["reason"]: e for e in stub.events("default")}
    assert "WarmUpStarted" not in told and "WarmUpFinished" not in told
    skipped = told["WarmUpSkipped"]
    assert skipped["type"] == "Normal"
    assert "Page-cache warm-up of model big skipped: " in skipped["note"]
    assert "does not fit" in skipped["note"]


def test_a_failed_warm_up_is_a_warning() -> None:
    event = ev.warm_up_finished(
        "m", "failed", bytes_read=5, seconds=1.0, reason="m/x: Input/output error", revision="r"
    )
    assert event.reason is ev.Reason.WARM_UP_SKIPPED and event.type == "Warning"
    assert event.error == "m/x: Input/output error" and "failed: m/x" in event.note


def test_a_sync_that_ends_first_waits_for_the_others_sizes() -> None:
    """A small model synced before the large one resolved: WarmingStarted still has both."""
    sink = Recording()
    recorder = EventRecorder(AgentMetrics(CollectorRegistry()), sink)
    story = WarmingStory(recorder)
    story.begin(["small", "large"], starting=["small", "large"], known={})
    story.planned("small", 10, 10)
    threading.Timer(0.3, story.planned, ("large", 2048, 2048)).start()
    story.settled("small")  # returns once large resolved, then small's ModelReady is told
    assert recorder.flush()
    recorder.close()
    assert [e["note"] for e in sink.created] == [
        "Warming 2 model(s): small, large; 2.0 KiB (2058 bytes) in total, 2.0 KiB (2058 bytes) "
        "to download"
    ]


def test_a_required_model_that_fails_fast_is_named_not_counted_as_0_bytes() -> None:
    sink = Recording()
    recorder = EventRecorder(AgentMetrics(CollectorRegistry()), sink)
    story = WarmingStory(recorder)
    story.begin(["broken", "llama"], starting=["broken", "llama"], known={})
    threading.Timer(0.3, story.planned, ("llama", 1024, 1024)).start()
    story.settled("broken")  # its listing was refused: no size, ever
    assert recorder.flush()
    recorder.close()
    (note,) = [e["note"] for e in sink.created]
    assert note == (
        "Warming 2 model(s): broken, llama; 1.0 KiB (1024 bytes) in total, 1.0 KiB (1024 bytes) "
        "to download; failed before resolving: broken"
    )


def test_with_no_size_resolved_warming_started_gives_none() -> None:
    sink = Recording()
    recorder = EventRecorder(AgentMetrics(CollectorRegistry()), sink)
    story = WarmingStory(recorder, resolve_wait=0.2)
    story.begin(["a", "b"], starting=["a"], known={})
    story.settled("a")
    assert recorder.flush()
    recorder.close()
    (event,) = sink.created
    assert event["note"] == (
        "Warming 2 model(s): a, b; sizes not resolved yet: b; failed before resolving: a"
    )
    assert "0 B" not in event["note"]


def test_a_model_that_starts_later_in_the_episode_is_counted_not_failed() -> None:
    """parallelModels: 1 and the first model stalls while resolving: the second gets the slot
    it gave up, resolves and is ready. Before: its plan was ignored (it was not starting at
    the episode's begin), and WarmingStarted said it had "failed before resolving"."""
    sink = Recording()
    recorder = EventRecorder(AgentMetrics(CollectorRegistry()), sink)
    story = WarmingStory(recorder, resolve_wait=0.2)
    story.begin(["stalled", "healthy"], starting=["stalled"], known={})
    story.planned("healthy", 1024, 1024)  # it got the stalled sync's slot
    story.settled("healthy")  # ready (ModelReady next); stalled still resolving
    assert recorder.flush()
    recorder.close()
    (event,) = sink.created
    assert event["note"] == (
        "Warming 2 model(s): stalled, healthy; 1.0 KiB (1024 bytes) in total, 1.0 KiB "
        "(1024 bytes) to download; sizes not resolved yet: stalled"
    )


def test_a_stalled_sync_is_not_waited_for() -> None:
    """A sync found stalled (no progress for stallTimeout) gives up its slot; before, the
    model that got the slot, once ready, still waited up to resolve_wait for the stalled
    one's size before its ModelReady (and its readiness): 10 s more to a node's ready."""
    sink = Recording()
    recorder = EventRecorder(AgentMetrics(CollectorRegistry()), sink)
    story = WarmingStory(recorder, resolve_wait=60.0)
    story.begin(["stalled", "healthy"], starting=["stalled"], known={})
    story.stalled("stalled")  # its size is not known, and may never be
    story.planned("healthy", 1024, 1024)
    settled = threading.Thread(target=story.settled, args=("healthy",))
    settled.start()
    settled.join(timeout=10)  # generous: waiting would take resolve_wait, 60 s
    assert not settled.is_alive(), "healthy's ModelReady waits for the stalled model"
    assert recorder.flush()
    recorder.close()
    (event,) = sink.created
    assert event["note"] == (
        "Warming 2 model(s): stalled, healthy; 1.0 KiB (1024 bytes) in total, 1.0 KiB "
        "(1024 bytes) to download; sizes not resolved yet: stalled"
    )
