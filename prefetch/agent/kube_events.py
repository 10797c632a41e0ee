"""The Kubernetes API end of the node's Events: :class:`KubeEventSink` writes them with the
kubernetes client, :func:`in_cluster_events` makes one with the pod's service account. RBAC
needed: ``events`` in API group ``events.k8s.io``, verbs ``create`` and ``patch``, in namespace
``default`` only (a Role there); the node GET for its uid is covered by the gate's
``nodes: get``."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from prefetch.support import settings

if TYPE_CHECKING:
    from kubernetes import client as k8s_client

# Its lines keep the logger name they have always had, so log queries keep matching.
log = logging.getLogger("prefetch.agent.events")

__all__ = ["KubeEventSink", "in_cluster_events"]


class KubeEventSink:
    """Writes Events through the kubernetes client: ``EventsV1Api`` for the Events and
    ``CoreV1Api`` for one GET of the node (its uid). Requests are bounded by
    ``request_timeout``; answers are read to their end and not deserialized."""

    def __init__(
        self,
        events_api: k8s_client.EventsV1Api,
        core_api: k8s_client.CoreV1Api,
        node_name: str,
        *,
        request_timeout: float = 10.0,
    ) -> None:
        self._events = events_api
        self._core = core_api
        self._node_name = node_name
        self._timeout = request_timeout

    @property
    def node_name(self) -> str:
        return self._node_name

    def node_uid(self) -> str | None:
        try:
            resp = self._core.read_node(
                self._node_name, _preload_content=False, _request_timeout=self._timeout
            )
            try:
                node = json.loads(resp.data)
            finally:
                resp.release_conn()
            uid = node.get("metadata", {}).get("uid") if isinstance(node, dict) else None
            return str(uid) if uid else None
        except Exception as exc:
            log.info("events: cannot read node %s for its uid: %s", self._node_name, exc)
            return None

    def create(self, namespace: str, body: Mapping[str, object]) -> None:
        resp = self._events.create_namespaced_event(
            namespace, body, _preload_content=False, _request_timeout=self._timeout
        )
        _finish(resp)

    def patch(self, namespace: str, name: str, body: Mapping[str, object]) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = self._events.patch_namespaced_event(
                name,
                namespace,
                body,
                _content_type="application/merge-patch+json",
                _preload_content=False,
                _request_timeout=self._timeout,
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        _finish(resp)
        return True


class _PooledResponse(Protocol):
    """What the Kubernetes client returns with ``_preload_content=False`` (urllib3's response)."""

    def drain_conn(self) -> None: ...

    def release_conn(self) -> None: ...


def _finish(resp: _PooledResponse) -> None:
    """Read the answer to its end before its connection goes back to the pool."""
    try:
        resp.drain_conn()
    finally:
        resp.release_conn()


def in_cluster_events(node_name: str | None) -> KubeEventSink | None:
    """A :class:`KubeEventSink` with the pod's service account; None outside a cluster or
    without a node name (then events are only logged). Never raises: an agent that cannot
    send Events still syncs models."""
    if not settings.in_kubernetes() or not node_name:
        return None
    from kubernetes import client as k8s_client
    from kubernetes import config as k8s_config

    configuration = k8s_client.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except k8s_config.ConfigException as exc:
        log.warning("events off: the in-cluster Kubernetes config cannot be loaded: %s", exc)
        return None
    api_client = k8s_client.ApiClient(configuration)
    return KubeEventSink(
        k8s_client.EventsV1Api(api_client), k8s_client.CoreV1Api(api_client), node_name
    )
