"""The NodeGate: node labels and the startup taint that gate scheduling on ready models.

The agent owns three things on its node, and nothing else:

* labels ``<prefix>/<model-label-name>=ready``, one per verified model (see :func:`label_key` for
  how a model name becomes a label name). Every label under ``<prefix>/`` whose value is ``ready``
  counts as the agent's own: one that is not in the current ready set (model evicted, failed
  re-verification, removed from the config) is removed. Labels outside the prefix, and labels
  under it with any other value, are never touched.
* the Karpenter startup taint (``startup_taint_key`` with ``startup_taint_effect``, any value),
  removed once every required model is ready. It is never added back: Karpenter owns adding it.
* the progress annotation (:meth:`NodeGate.annotate`, written by
  :mod:`prefetch.agent.progress_note`), one merge patch of that one key.

Each :meth:`NodeGate.apply` reads the node, computes the smallest change, and sends nothing when
the node is already right. A change goes out as one JSON Patch whose first operation tests
``/metadata/resourceVersion``, so a write that landed between our GET and our PATCH makes the
API server refuse the patch (422) instead of us overwriting it; the gate then reads the node again
and recomputes. Conflicts, throttling, server errors and connection failures are retried with
exponential backoff and jitter; what persists becomes a
:class:`~prefetch.support.errors.NodeGateError`.

The Kubernetes client is synchronous; the agent's asyncio loop calls :meth:`NodeGate.apply`
through ``asyncio.to_thread``. RBAC needed: ``nodes`` ``get`` and ``patch``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NotRequired, TypedDict, Unpack, cast

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from prefetch.pipeline.retry import RetryPolicy
from prefetch.support import settings
from prefetch.support.constants import (
    DEFAULT_LABEL_PREFIX,
    DEFAULT_STARTUP_TAINT_EFFECT,
    DEFAULT_STARTUP_TAINT_KEY,
)
from prefetch.support.errors import ConfigError, NodeGateError

__all__ = [
    "FIELD_MANAGER",
    "LABEL_NAME_MAX",
    "READY_VALUE",
    "GateResult",
    "NodeGate",
    "in_cluster_gate",
    "label_key",
    "parse_timestamp",
]

logger = logging.getLogger(__name__)

#: The value of every label the agent owns.
READY_VALUE = "ready"
#: Field manager name on every PATCH (``kubectl get node -o yaml --show-managed-fields``).
FIELD_MANAGER = "model-prefetch"
#: Longest name part of a label key (the part after ``<prefix>/``).
LABEL_NAME_MAX = 63
_PREFIX_MAX = 253
_HASH_CHARS = 10
_LABEL_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_NOT_LABEL_CHAR_RE = re.compile(r"[^-A-Za-z0-9_.]+")
_JSON_PATCH = "application/json-patch+json"
_MERGE_PATCH = "application/merge-patch+json"
_TAINT_EFFECTS = frozenset({"NoSchedule", "PreferNoSchedule", "NoExecute"})
# 409: conflict; 422: our resourceVersion test failed (checked, see apply); 429: throttled.
_RETRY_STATUSES = frozenset({409, 422, 429})


def label_key(prefix: str, model_name: str) -> str:
    """The node label key for *model_name*: ``<prefix>/<name>``.

    A name that already is a valid label name (at most 63 characters of ``[A-Za-z0-9_.-]``,
    starting and ending alphanumeric; every DNS-label model name is one) is used unchanged.
    Any other name is shortened predictably: characters outside ``[A-Za-z0-9_.-]`` become ``-``,
    the result is cut to its first 52 characters and trimmed to end alphanumeric, then ``-`` and
    the first 10 hex digits of the SHA-256 of the full original name (UTF-8) are appended:

    * ``meta-llama-3.1-405b-instruct-fp8-dynamic-with-a-very-long-suffix-v2`` (67 characters)
      -> ``meta-llama-3.1-405b-instruct-fp8-dynamic-with-a-very-af6031ebd8``
    * ``meta-llama/Llama-3.1-8B-Instruct`` -> ``meta-llama-Llama-3.1-8B-Instruct-08a20b291e``

    The result is at most 63 characters, readable, the same on every host and every run (a pod's
    node affinity can name it), and distinct for distinct names (barring a 40-bit hash collision,
    or a model literally named like another's shortened form). A name with no usable characters
    becomes just the 10 hex digits. An empty name is a ``ValueError``.
    """
    _check_prefix(prefix)
    return f"{prefix}/{_label_name(model_name)}"


def _label_name(model_name: str) -> str:
    if not model_name:
        raise ValueError("model name is empty")
    if len(model_name) <= LABEL_NAME_MAX and _LABEL_NAME_RE.match(model_name):
        return model_name
    digest = hashlib.sha256(model_name.encode("utf-8")).hexdigest()[:_HASH_CHARS]
    head = _NOT_LABEL_CHAR_RE.sub("-", model_name)[: LABEL_NAME_MAX - 1 - _HASH_CHARS]
    head = head.lstrip("-_.")
    head = head.rstrip("-_.")
    return f"{head}-{digest}" if head else digest


def _check_prefix(prefix: str) -> None:
    parts = prefix.split(".")
    if len(prefix) > _PREFIX_MAX or not all(_DNS_LABEL_RE.match(p) for p in parts):
        raise ConfigError(
            f"label prefix {prefix!r} is not a DNS subdomain (lowercase a-z, 0-9, '-' and '.', "
            f"at most {_PREFIX_MAX} characters)"
        )


def _pointer(*tokens: str) -> str:
    """An RFC 6901 JSON Pointer: ``~`` becomes ``~0`` and ``/`` becomes ``~1`` in each token."""
    return "".join("/" + t.replace("~", "~0").replace("/", "~1") for t in tokens)


@dataclass(frozen=True)
class GateResult:
    """What one :meth:`NodeGate.apply` changed on the node.

    ``labels_added`` and ``labels_removed`` are sorted label keys; ``patched`` is False when the
    node was already right and no PATCH was sent; ``attempts`` counts GET(+PATCH) rounds (1 when
    nothing had to be retried).
    """

    labels_added: tuple[str, ...] = ()
    labels_removed: tuple[str, ...] = ()
    taint_removed: bool = False
    patched: bool = False
    attempts: int = 1


class Taint(TypedDict, total=False):
    key: str
    value: str
    effect: str


class NodeMetadata(TypedDict, total=False):
    name: str
    resourceVersion: str
    labels: dict[str, str]
    annotations: dict[str, str]


class NodeSpec(TypedDict, total=False):
    taints: list[Taint]


class NodeObject(TypedDict, total=False):
    """The parts of a Kubernetes Node (as the API server's JSON) the gate reads."""

    metadata: NodeMetadata
    spec: NodeSpec


class PatchOp(TypedDict):
    """One JSON Patch (RFC 6902) operation."""

    op: str
    path: str
    value: NotRequired[str | dict[str, str]]


class GateOptions(TypedDict, total=False):
    """:class:`NodeGate`'s keyword arguments."""

    label_prefix: str
    startup_taint_key: str
    startup_taint_effect: str
    max_attempts: int
    backoff: float
    max_backoff: float
    request_timeout: float
    sleep: Callable[[float], None]


@dataclass(frozen=True)
class _Plan:
    resource_version: str
    add: tuple[str, ...]
    remove: tuple[str, ...]
    taint_indexes: tuple[int, ...]
    labels_missing: bool

    @property
    def empty(self) -> bool:
        return not (self.add or self.remove or self.taint_indexes)

    def patch(self) -> list[PatchOp]:
        ops: list[PatchOp] = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": self.resource_version}
        ]
        if self.labels_missing and self.add:
            ops.append({"op": "add", "path": "/metadata/labels", "value": {}})
        ops += [
            {"op": "add", "path": _pointer("metadata", "labels", k), "value": READY_VALUE}
            for k in self.add
        ]
        ops += [{"op": "remove", "path": _pointer("metadata", "labels", k)} for k in self.remove]
        # Highest index first, so earlier removals do not shift later ones.
        ops += [
            {"op": "remove", "path": _pointer("spec", "taints", str(i))}
            for i in sorted(self.taint_indexes, reverse=True)
        ]
        return ops


class NodeGate:
    """Keeps one node's ready labels and startup taint in line with the agent's models.

    *api* is a ``CoreV1Api`` the caller built (in a cluster: :func:`in_cluster_gate`; in tests: a
    client pointed at a local stub). ``max_attempts`` bounds the GET/PATCH rounds of one
    :meth:`apply`; between rounds the gate sleeps as :class:`prefetch.pipeline.retry.RetryPolicy`
    says: a random time up to ``backoff * 2**(n-1)`` seconds capped at ``max_backoff`` (full
    jitter), or the server's ``Retry-After`` (same cap). ``request_timeout`` bounds each HTTP
    request.
    """

    def __init__(
        self,
        api: k8s_client.CoreV1Api,
        node_name: str,
        *,
        label_prefix: str = DEFAULT_LABEL_PREFIX,
        startup_taint_key: str = DEFAULT_STARTUP_TAINT_KEY,
        startup_taint_effect: str = DEFAULT_STARTUP_TAINT_EFFECT,
        max_attempts: int = 5,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        request_timeout: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not node_name:
            raise ConfigError("node name is empty (set NODE_NAME from the downward API)")
        _check_prefix(label_prefix)
        if not startup_taint_key:
            raise ConfigError("startup taint key is empty")
        if startup_taint_effect not in _TAINT_EFFECTS:
            raise ConfigError(
                f"startup taint effect {startup_taint_effect!r} is not one of "
                f"{', '.join(sorted(_TAINT_EFFECTS))}"
            )
        if max_attempts < 1:
            raise ConfigError(f"max_attempts must be at least 1, got {max_attempts}")
        if backoff < 0 or max_backoff < 0 or request_timeout <= 0:
            raise ConfigError("backoff and max_backoff must be >= 0, request_timeout > 0")
        self._api = api
        self.node_name = node_name
        self.label_prefix = label_prefix
        self.startup_taint_key = startup_taint_key
        self.startup_taint_effect = startup_taint_effect
        self._max_attempts = max_attempts
        self._retry = RetryPolicy(
            attempts=max_attempts,
            base_delay=backoff,
            max_delay=max_backoff,
            max_retry_after=max_backoff,
            retryable=_retryable,
        )
        self._timeout = request_timeout
        self._sleep = sleep

    def label_key(self, model_name: str) -> str:
        """The label key this gate uses for *model_name* (see :func:`label_key`)."""
        return f"{self.label_prefix}/{_label_name(model_name)}"

    def apply(self, ready_models: Iterable[str], all_required_ready: bool) -> GateResult:
        """Make the node show exactly *ready_models* as ready; lift the taint if all are ready.

        Sends no PATCH when the node already matches. Raises :class:`NodeGateError` when the
        node does not exist (404), RBAC forbids a verb (403), the API rejects the patch itself,
        or transient failures persist for ``max_attempts`` rounds.
        """
        wanted = frozenset(self.label_key(m) for m in ready_models)
        failure = ""
        retry_after = 0.0
        refused_rv: str | None = None  # resourceVersion our last patch was refused (422) at
        for attempt in range(1, self._max_attempts + 1):
            if attempt > 1:
                self._sleep(self._retry.delay(attempt - 1, retry_after))
            verb = "get"
            try:
                plan = self._plan(self._get(), wanted, all_required_ready)
                if refused_rv is not None and plan.resource_version == refused_rv:
                    # Nothing changed since, so the resourceVersion test held and the API
                    # server refused the patch itself: sending it again cannot help.
                    raise NodeGateError(
                        f"the API server rejected the label/taint patch for node "
                        f"{self.node_name!r}: {failure}"
                    )
                if plan.empty:
                    return GateResult(attempts=attempt)
                verb = "patch"
                self._patch(plan)
            except ApiException as exc:
                failure = _describe(exc)
                if not self._retry.retryable(exc):
                    raise self._fatal(exc, verb, failure) from exc
                refused_rv = (
                    plan.resource_version if verb == "patch" and exc.status == 422 else None
                )
                retry_after = _retry_after(exc)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                failure = f"{type(exc).__name__}: {exc}"
                refused_rv = None
                retry_after = 0.0
            else:
                return self._patched(plan, attempt)
            logger.warning(
                "node gate: %s node %s failed (attempt %d/%d): %s",
                verb,
                self.node_name,
                attempt,
                self._max_attempts,
                failure,
            )
        raise NodeGateError(
            f"could not update labels/taints on node {self.node_name!r} in "
            f"{self._max_attempts} attempts; last error: {failure}",
            hint="check that the API server is reachable and healthy from the agent pod",
        )

    def _patched(self, plan: _Plan, attempt: int) -> GateResult:
        """What :meth:`apply` returns (and logs) once ``plan`` was patched in."""
        logger.info(
            "node gate: node %s: labelled %s, unlabelled %s%s",
            self.node_name,
            list(plan.add),
            list(plan.remove),
            f", removed taint {self.startup_taint_key}" if plan.taint_indexes else "",
        )
        return GateResult(
            labels_added=plan.add,
            labels_removed=plan.remove,
            taint_removed=bool(plan.taint_indexes),
            patched=True,
            attempts=attempt,
        )

    def annotate(self, key: str, value: str) -> None:
        """Set one annotation on the node: one merge patch, no GET, no retry.

        The agent's progress note is the one user; it is rewritten at the next interval anyway,
        so a failure is not retried here (a struggling API server gets one request per interval,
        not a burst). A merge patch creates ``metadata.annotations`` when the node has none and
        touches no other key; no resourceVersion guard is needed, as no one else writes *key*.
        Raises :class:`NodeGateError` on any failure.
        """
        body: NodeObject = {"metadata": {"annotations": {key: value}}}
        try:
            self._send_patch(body, _MERGE_PATCH)
        except ApiException as exc:
            raise self._fatal(exc, "patch", _describe(exc)) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise NodeGateError(
                f"could not annotate node {self.node_name!r}: {type(exc).__name__}: {exc}"
            ) from exc

    def creation_time(self) -> float | None:
        """The node's ``metadata.creationTimestamp`` as Unix time (None when it has none or it
        does not parse). One GET; raises :class:`NodeGateError` when the node cannot be read."""
        node = self._read()
        return parse_timestamp((node.get("metadata") or {}).get("creationTimestamp"))

    def label(self, key: str) -> str | None:
        """The node's label ``key`` (None when it has none), e.g. ``nvidia.com/gpu.product``.
        One GET; raises :class:`NodeGateError` when the node cannot be read."""
        node = self._read()
        value = ((node.get("metadata") or {}).get("labels") or {}).get(key)
        return value if isinstance(value, str) else None

    def _read(self) -> NodeObject:
        """The Node, one GET; its failures as :class:`NodeGateError`."""
        try:
            node = self._get()
        except ApiException as exc:
            raise self._fatal(exc, "get", _describe(exc)) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise NodeGateError(
                f"could not read node {self.node_name!r}: {type(exc).__name__}: {exc}"
            ) from exc
        return node

    # -- one round -------------------------------------------------------------------------

    def _get(self) -> NodeObject:
        resp = self._api.read_node(
            self.node_name, _preload_content=False, _request_timeout=self._timeout
        )
        try:
            node = json.loads(resp.data)
        except ValueError as exc:
            raise NodeGateError(f"GET node {self.node_name!r} returned no JSON: {exc}") from exc
        finally:
            resp.release_conn()
        if not isinstance(node, dict):
            raise NodeGateError(f"GET node {self.node_name!r} returned no object")
        return cast("NodeObject", node)  # the API server's Node: the fields read are optional

    def _patch(self, plan: _Plan) -> None:
        self._send_patch(plan.patch(), _JSON_PATCH)

    def _send_patch(self, body: list[PatchOp] | NodeObject, content_type: str) -> None:
        """PATCH the node; the answer is read and the connection goes back to the pool."""
        resp = self._api.patch_node(
            self.node_name,
            body,
            field_manager=FIELD_MANAGER,
            _content_type=content_type,
            _preload_content=False,
            _request_timeout=self._timeout,
        )
        try:
            # Read the answer to its end before the connection goes back to the pool: an unread
            # body would be taken for the status line of the next request on that connection.
            resp.drain_conn()
        finally:
            resp.release_conn()

    def _plan(self, node: NodeObject, wanted: frozenset[str], lift: bool) -> _Plan:
        metadata = node.get("metadata") or {}
        rv = metadata.get("resourceVersion")
        if not rv:
            raise NodeGateError(f"node {self.node_name!r} came back without a resourceVersion")
        raw_labels = metadata.get("labels")
        labels: Mapping[str, str] = raw_labels or {}
        owned = {
            k
            for k, v in labels.items()
            if v == READY_VALUE and k.startswith(self.label_prefix + "/")
        }
        taint_indexes: list[int] = []
        if lift:
            taints = (node.get("spec") or {}).get("taints") or []
            taint_indexes = [
                i
                for i, t in enumerate(taints)
                if t.get("key") == self.startup_taint_key
                and t.get("effect") == self.startup_taint_effect
            ]
        return _Plan(
            resource_version=str(rv),
            add=tuple(sorted(k for k in wanted if labels.get(k) != READY_VALUE)),
            remove=tuple(sorted(owned - wanted)),
            taint_indexes=tuple(taint_indexes),
            labels_missing=raw_labels is None,
        )

    def _fatal(self, exc: ApiException, verb: str, detail: str) -> NodeGateError:
        if exc.status == 404:
            return NodeGateError(
                f"node {self.node_name!r} not found ({detail})",
                hint="NODE_NAME must be the pod's spec.nodeName, set from the downward API",
            )
        if exc.status == 403:
            return NodeGateError(
                f"RBAC forbids {verb!r} on node {self.node_name!r} ({detail})",
                hint=f"grant the agent's service account the {verb!r} verb on nodes "
                "(its ClusterRole needs nodes: get, patch)",
            )
        if exc.status == 401:
            return NodeGateError(
                f"the API server did not accept the agent's credentials ({detail})",
                hint="check the service account token mounted into the agent pod",
            )
        return NodeGateError(f"the API server refused to {verb} node {self.node_name!r} ({detail})")


def parse_timestamp(value: object) -> float | None:
    """A Kubernetes timestamp (RFC 3339 in UTC, ``2026-12-03T18:00:00Z``) as Unix time; None
    for anything else."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return parsed.timestamp()


def _retryable(exc: BaseException) -> bool:
    """A failed GET/PATCH worth another round: a throttle, a conflict, a 5xx, no answer."""
    if not isinstance(exc, ApiException):
        return isinstance(exc, urllib3.exceptions.HTTPError | OSError)
    status = exc.status or 0
    return status in _RETRY_STATUSES or status >= 500 or status == 0


def _retry_after(exc: ApiException) -> float:
    """The server's ``Retry-After`` in seconds (0 when absent or not a number)."""
    value = (exc.headers or {}).get("Retry-After")
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0


def _describe(exc: ApiException) -> str:
    """``HTTP <status> <reason>: <Status message>`` for an API error, for logs and errors."""
    text = f"HTTP {exc.status or 0} {exc.reason or ''}".rstrip()
    message = ""
    if exc.body:
        try:
            decoded = json.loads(exc.body)
            message = decoded.get("message", "") if isinstance(decoded, dict) else ""
        except ValueError:
            message = str(exc.body)[:200]
    return f"{text}: {message}" if message else text


def in_cluster_gate(node_name: str | None, **gate_options: Unpack[GateOptions]) -> NodeGate | None:
    """A :class:`NodeGate` for *node_name* using the pod's service account, or None when off.

    The gate is on only inside a cluster (``KUBERNETES_SERVICE_HOST`` is set, read at call time)
    and with a node name (the caller passes ``NODE_NAME``, set from the downward API
    ``spec.nodeName``). Otherwise this logs one info line saying why the gate is off and returns
    None. The client configuration is built privately; the process-wide default is not touched.
    ``gate_options`` are passed to :class:`NodeGate`.
    """
    if not settings.in_kubernetes():
        logger.info("node gate off: not in a Kubernetes cluster (KUBERNETES_SERVICE_HOST unset)")
        return None
    if not node_name:
        logger.info(
            "node gate off: no node name (set NODE_NAME from the downward API spec.nodeName)"
        )
        return None
    configuration = k8s_client.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except k8s_config.ConfigException as exc:
        raise NodeGateError(
            f"in a cluster, but the in-cluster Kubernetes config cannot be loaded: {exc}",
            hint="mount the agent's service account token (automountServiceAccountToken: true)",
        ) from exc
    api = k8s_client.CoreV1Api(k8s_client.ApiClient(configuration))
    return NodeGate(api, node_name, **gate_options)
