"""events.k8s.io/v1 Events for the Kubernetes API stub (:mod:`tests.fakes.k8s_stub`).

Served under ``/apis/events.k8s.io/v1/namespaces/{namespace}/events``: ``POST`` (create, 201),
``GET`` (an ``EventList``, or one Event by name) and ``PATCH`` (merge, strategic-merge or JSON
patch). Checked the way kube-apiserver checks Events created through events.k8s.io/v1
(``ValidateEventCreate`` / ``ValidateEventUpdate`` in ``pkg/apis/core/validation/events.go``):

* create: a DNS-subdomain name, the URL's namespace, ``eventTime`` set, ``type`` Normal or
  Warning, ``reportingController`` a qualified name, ``reportingInstance``/``action``/``reason``
  present and at most 128 characters, ``note`` at most 1024, no deprecated fields, a
  ``series`` (if any) with ``count`` >= 2 and a ``lastObservedTime``; an Event about a
  cluster-scoped object (``regarding`` without a namespace, such as a Node) must live in
  ``default`` or ``kube-system``; a taken name is a 409 ``AlreadyExists``;
* update: every field but ``series`` (and metadata) is immutable: 422 ``Invalid``.

:func:`describe_events` renders stored Events as the ``Events:`` section of
``kubectl describe node``.
"""

from __future__ import annotations

import copy
import re
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

Json = Any

EVENTS_PREFIX = "/apis/events.k8s.io/v1/"
_COLLECTION = re.compile(r"^/apis/events\.k8s\.io/v1/namespaces/([^/]+)/events$")
_ITEM = re.compile(r"^/apis/events\.k8s\.io/v1/namespaces/([^/]+)/events/([^/]+)$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_IMMUTABLE = (
    "regarding",
    "related",
    "reason",
    "note",
    "type",
    "eventTime",
    "action",
    "reportingController",
    "reportingInstance",
)
_DEPRECATED = (
    "deprecatedSource",
    "deprecatedFirstTimestamp",
    "deprecatedLastTimestamp",
    "deprecatedCount",
)
_LIMITS = {"reportingInstance": 128, "action": 128, "reason": 128, "note": 1024}

# (status, reason, message, causes) -> the stub's StubError; given by k8s_stub to avoid a cycle
ErrorFactory = Callable[[int, str, str, list[dict[str, str]] | None], Exception]


def _qualified_name_ok(value: str) -> bool:
    prefix, _, name = value.rpartition("/")
    if "/" in value and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return False
    return bool(name) and len(name) <= 63 and bool(_QUALIFIED.match(name))


def create_errors(event: Json, namespace: str) -> list[dict[str, str]]:
    """The field errors kube-apiserver reports for creating ``event`` in ``namespace``."""
    errors: list[tuple[str, str]] = []
    meta = event.get("metadata") or {}
    name = meta.get("name") or ""
    if not name or len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        errors.append(("metadata.name", f"Invalid value: {name!r}: a lowercase RFC 1123 subdomain"))
    if meta.get("namespace", namespace) != namespace:
        errors.append(("metadata.namespace", "does not match the namespace of the request"))
    if not event.get("eventTime"):
        errors.append(("eventTime", "Required value"))
    if event.get("type") not in ("Normal", "Warning"):
        errors.append(("type", f"Invalid value: has invalid value: {event.get('type')}"))
    regarding = event.get("regarding") or {}
    if not regarding.get("namespace") and namespace not in ("default", "kube-system"):
        errors.append(("regarding.namespace", "does not match event.namespace"))
    controller = event.get("reportingController") or ""
    if not controller:
        errors.append(("reportingController", "Required value"))
    elif not _qualified_name_ok(controller):
        errors.append(("reportingController", f"Invalid value: {controller!r}"))
    for field in ("reportingInstance", "action", "reason"):
        if not event.get(field):
            errors.append((field, "Required value"))
    for field, limit in _LIMITS.items():
        if len(event.get(field) or "") > limit:
            errors.append((field, f"can have at most {limit} characters"))
    errors += [(field, "needs to be unset") for field in _DEPRECATED if event.get(field)]
    errors += _series_errors(event)
    return [{"reason": "FieldValueInvalid", "field": f, "message": m} for f, m in errors]


def _series_errors(event: Json) -> list[tuple[str, str]]:
    series = event.get("series")
    if series is None:
        return []
    errors = []
    if not isinstance(series.get("count"), int) or series["count"] < 2:
        errors.append(("series.count", "should be at least 2"))
    if not series.get("lastObservedTime"):
        errors.append(("series.lastObservedTime", "Required value"))
    return errors


def update_errors(new: Json, old: Json) -> list[dict[str, str]]:
    errors = [(f, "field is immutable") for f in _IMMUTABLE if new.get(f) != old.get(f)]
    if new.get("series") != old.get("series"):
        errors += _series_errors(new)
    return [{"reason": "FieldValueInvalid", "field": f, "message": m} for f, m in errors]


class EventStore:
    """The stored Events, by (namespace, name); thread-safe."""

    def __init__(self, error: ErrorFactory) -> None:
        self._error = error
        self._lock = threading.Lock()
        self._events: dict[tuple[str, str], Json] = {}
        self._rv = 1000

    def expire(self) -> None:
        """Forget every Event, as the API server does when their TTL (1 h by default) passes."""
        with self._lock:
            self._events.clear()

    def handles(self, path: str) -> bool:
        return path.startswith(EVENTS_PREFIX)

    def all(self, namespace: str | None = None) -> list[Json]:
        """Copies of the stored Events (of ``namespace``, if given), oldest ``eventTime`` first."""
        with self._lock:
            items = [
                copy.deepcopy(e)
                for (ns, _), e in self._events.items()
                if namespace is None or ns == namespace
            ]
        return sorted(items, key=lambda e: (e.get("eventTime", ""), e["metadata"]["name"]))

    def handle(
        self,
        method: str,
        path: str,
        body: Json,
        apply_patch: Callable[[Json, str | None, Json], Json],
        content_type: str | None,
    ) -> Json:
        if match := _COLLECTION.match(path):
            namespace = match.group(1)
            if method == "POST":
                return self._create(namespace, body)
            if method == "GET":
                return {
                    "kind": "EventList",
                    "apiVersion": "events.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self._rv)},
                    "items": self.all(namespace),
                }
        elif match := _ITEM.match(path):
            namespace, name = match.group(1), match.group(2)
            if method == "GET":
                with self._lock:
                    return copy.deepcopy(self._find(namespace, name))
            if method == "PATCH":
                return self._patch(namespace, name, apply_patch, content_type, body)
        else:
            raise self._error(404, "NotFound", "the server could not find the requested resource")
        raise self._error(
            405, "MethodNotAllowed", "the server does not allow this method on the resource"
        )

    def _find(self, namespace: str, name: str) -> Json:
        event = self._events.get((namespace, name))
        if event is None:
            raise self._error(404, "NotFound", f'events.events.k8s.io "{name}" not found')
        return event

    def _create(self, namespace: str, body: Json) -> Json:
        if not isinstance(body, dict):
            raise self._error(400, "BadRequest", "the body of the request was not an object")
        event = copy.deepcopy(body)
        causes = create_errors(event, namespace)
        name = (event.get("metadata") or {}).get("name", "")
        if causes:
            raise self._invalid(name, causes)
        with self._lock:
            if (namespace, name) in self._events:
                raise self._error(
                    409, "AlreadyExists", f'events.events.k8s.io "{name}" already exists'
                )
            self._stamp(event, namespace)
            self._events[(namespace, name)] = event
            return copy.deepcopy(event)

    def _patch(
        self,
        namespace: str,
        name: str,
        apply_patch: Callable[[Json, str | None, Json], Json],
        content_type: str | None,
        body: Json,
    ) -> Json:
        with self._lock:
            old = self._find(namespace, name)
            new = apply_patch(old, content_type, body)
            causes = update_errors(new, old)
            if causes:
                raise self._invalid(name, causes)
            self._stamp(new, namespace)
            self._events[(namespace, name)] = new
            return copy.deepcopy(new)

    def _stamp(self, event: Json, namespace: str) -> None:
        self._rv += 1
        meta = event.setdefault("metadata", {})
        meta["namespace"] = namespace
        meta["resourceVersion"] = str(self._rv)
        meta.setdefault("uid", f"event-uid-{self._rv}")
        meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    def _invalid(self, name: str, causes: list[dict[str, str]]) -> Exception:
        message = f'Event.events.k8s.io "{name}" is invalid: ' + "; ".join(
            f"{c['field']}: {c['message']}" for c in causes
        )
        return self._error(422, "Invalid", message, causes)


# -- kubectl describe ------------------------------------------------------------------------------


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def human_duration(seconds: float) -> str:
    """A duration as kubectl prints ages (apimachinery's ``HumanDuration``, to its hours)."""
    s = int(seconds)
    if s < 0:
        return "<invalid>"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        rest = s % 60
        return f"{minutes}m{rest}s" if rest else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        rest = (s % 3600) // 60
        return f"{hours}h{rest}m" if rest else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    return f"{hours // 24}d"


def describe_events(events: list[Json], *, now: datetime | None = None) -> str:
    """The ``Events:`` section of ``kubectl describe node`` for ``events`` (events.k8s.io/v1
    objects): Type, Reason, Age (``<last> (xN over <first>)`` for a series), From
    (``<reportingController>, <reportingInstance>``), Message; columns padded by two spaces."""
    if not events:
        return "Events:  <none>"
    now = now or datetime.now(UTC)
    rows = [
        ("Type", "Reason", "Age", "From", "Message"),
        ("----", "------", "----", "----", "-------"),
    ]
    for e in sorted(events, key=lambda e: e.get("eventTime", "")):
        first = _parse_time(e["eventTime"])
        age = human_duration((now - first).total_seconds())
        series = e.get("series")
        if series:
            last = _parse_time(series["lastObservedTime"])
            age = f"{human_duration((now - last).total_seconds())} (x{series['count']} over {age})"
        source = ", ".join(
            x for x in (e.get("reportingController"), e.get("reportingInstance")) if x
        )
        rows.append((e["type"], e["reason"], age, source or "<unknown>", e.get("note", "")))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["Events:"]
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row[:4], widths, strict=True)]
        lines.append("  " + "  ".join([*cells, row[4]]).rstrip())
    return "\n".join(lines)
