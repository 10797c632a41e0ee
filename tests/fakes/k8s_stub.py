"""A small in-memory Kubernetes API server for Node objects, on 127.0.0.1.

Enough of ``/api/v1/nodes`` for the NodeGate tests, answered the way kube-apiserver answers:

* ``GET /api/v1/nodes`` (a ``NodeList``; ``labelSelector`` with equality and existence terms)
  and ``GET /api/v1/nodes/{name}``; nodes carry a ``metadata.creationTimestamp``;
* ``PATCH /api/v1/nodes/{name}`` with ``application/json-patch+json`` (RFC 6902 ``add``,
  ``remove``, ``replace``, ``test``, ``move``, ``copy`` on RFC 6901 pointers),
  ``application/merge-patch+json`` (RFC 7386) and ``application/strategic-merge-patch+json``
  (treated as a merge patch plus the ``$patch: replace|delete`` map directives; that is exact for
  ``metadata.labels`` and for ``spec.taints``, an atomic list);
* every write bumps ``metadata.resourceVersion``; a patch whose result carries a different
  ``resourceVersion`` than the stored one is a 409 Conflict (the API server's precondition);
* a patch that cannot be applied (a failed ``test``, a missing path) is a 422 ``Invalid`` Status
  with the message kube-apiserver gives (``NewGenericServerResponse(422, ...)`` in its patch
  handler); a malformed patch body is a 400; labels and taints are validated like the API server
  does (422 ``Invalid`` with causes);
* errors are ``Status`` objects (``kind: Status``, ``reason``, ``details``, ``code``).

And events.k8s.io/v1 Events (create, list, get, patch; validated as kube-apiserver does, see
:mod:`tests.fakes.k8s_events`): :meth:`KubeStub.events` returns them,
:meth:`KubeStub.describe_events` renders them as ``kubectl describe node`` does, and
:meth:`KubeStub.events_client` is an ``EventsV1Api`` pointed at the stub.

Test hooks: :meth:`KubeStub.fail_next` makes the next N matching requests fail with a status (or
drop the connection); :meth:`KubeStub.before_next_patch` runs a function on the stored node just
before the next PATCH is applied (a concurrent writer landing between a client's GET and PATCH).
Every request is recorded in :attr:`KubeStub.requests`. :meth:`KubeStub.client` builds a real
``kubernetes.client.CoreV1Api`` pointed at the stub, with no auth.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubernetes import client as k8s_client

from tests.fakes.k8s_events import EventStore, describe_events

Json = Any
NodeHook = Callable[[dict[str, Any]], None]

_NODE_PATH = re.compile(r"^/api/v1/nodes/([^/]+)$")
_LIST_PATH = "/api/v1/nodes"
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_PATCH_TYPES = (
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
)


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    query: str
    content_type: str | None
    body: Json  # parsed JSON, the raw text when it is not JSON, None when empty
    status: int  # what the stub answered; 0 for a dropped connection


@dataclass
class _Fault:
    remaining: int
    status: int
    method: str | None
    retry_after: int | None
    path: str | None = None  # a path prefix the fault is limited to


class StubError(Exception):
    """An API error to answer with: HTTP status and a Status object."""

    def __init__(self, status: Json, headers: dict[str, str] | None = None) -> None:
        super().__init__(status["message"])
        self.status = status
        self.headers = headers or {}


def status_object(
    code: int,
    reason: str,
    message: str,
    *,
    name: str | None = None,
    kind: str | None = None,
    causes: list[dict[str, str]] | None = None,
    retry_after: int | None = None,
) -> Json:
    """A ``metav1.Status`` failure body, as kube-apiserver serializes it."""
    details: dict[str, Any] = {}
    if name is not None:
        details["name"] = name
    if kind is not None:
        details["kind"] = kind
    if causes:
        details["causes"] = causes
    if retry_after:
        details["retryAfterSeconds"] = retry_after
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details or reason == "Invalid":
        body["details"] = details
    return body


def _injected(code: int, name: str | None, method: str, retry_after: int | None) -> Json:
    if code == 404:
        return status_object(404, "NotFound", f'nodes "{name}" not found', name=name, kind="nodes")
    if code == 409:
        return _conflict(name or "")
    if code == 403:
        verb = method.lower() if method != "GET" or name else "list"
        return status_object(
            403,
            "Forbidden",
            f'nodes "{name}" is forbidden: User "system:serviceaccount:model-prefetch:agent" '
            f'cannot {verb} resource "nodes" in API group "" at the cluster scope',
            name=name,
            kind="nodes",
        )
    if code == 429:
        return status_object(
            429,
            "TooManyRequests",
            "Too many requests, please try again later.",
            retry_after=retry_after,
        )
    if code == 422:
        return status_object(
            422, "Invalid", "the server rejected our request due to an error in our request"
        )
    if code == 503:
        return status_object(503, "ServiceUnavailable", "the server is currently unable to handle")
    if code >= 500:
        return status_object(
            code,
            "InternalError",
            "Internal error occurred: injected by the test stub",
            causes=[{"message": "injected by the test stub"}],
        )
    return status_object(code, "BadRequest", f"injected {code}")


def _conflict(name: str) -> Json:
    return status_object(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on nodes "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
        name=name,
        kind="nodes",
    )


def _patch_failed(detail: str) -> StubError:
    # kube-apiserver answers a JSON Patch that does not apply (a failed test, a missing path)
    # with errors.NewGenericServerResponse(422, "", schema.GroupResource{}, "", err.Error(), 0,
    # false): reason Invalid, a fixed message, empty details; the jsonpatch error text is not in
    # the body. The stub adds it as a header, for debugging only.
    return StubError(
        status_object(
            422, "Invalid", "the server rejected our request due to an error in our request"
        ),
        {"X-Stub-Detail": detail},
    )


def _bad_request(message: str) -> StubError:
    return StubError(status_object(400, "BadRequest", message))


# -- RFC 6901 / 6902 --------------------------------------------------------------------------


def _tokens(pointer: Any) -> list[str]:
    if not isinstance(pointer, str) or (pointer and not pointer.startswith("/")):
        raise _patch_failed(f"invalid JSON pointer {pointer!r}")
    if pointer == "":
        return []
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]


def _index(container: list[Any], token: str, *, for_add: bool) -> int:
    if for_add and token == "-":
        return len(container)
    if not re.fullmatch(r"0|[1-9][0-9]*", token):
        raise _patch_failed(f"invalid array index {token!r}")
    index = int(token)
    limit = len(container) if for_add else len(container) - 1
    if index > limit:
        raise _patch_failed(f"array index {index} out of bounds")
    return index


def _parent(doc: Json, tokens: list[str]) -> tuple[Json, str]:
    if not tokens:
        raise _patch_failed("the operation cannot target the whole document")
    target = doc
    for token in tokens[:-1]:
        if isinstance(target, dict) and token in target:
            target = target[token]
        elif isinstance(target, list):
            target = target[_index(target, token, for_add=False)]
        else:
            raise _patch_failed(f"path component {token!r} does not exist")
    if not isinstance(target, dict | list):
        raise _patch_failed("the parent of the target is not a container")
    return target, tokens[-1]


def _get(doc: Json, tokens: list[str]) -> Json:
    if not tokens:
        return doc
    parent, last = _parent(doc, tokens)
    if isinstance(parent, list):
        return parent[_index(parent, last, for_add=False)]
    if last not in parent:
        raise _patch_failed(f"path {last!r} does not exist")
    return parent[last]


def _add(doc: Json, tokens: list[str], value: Json) -> Json:
    if not tokens:
        return copy.deepcopy(value)
    parent, last = _parent(doc, tokens)
    if isinstance(parent, list):
        parent.insert(_index(parent, last, for_add=True), copy.deepcopy(value))
    else:
        parent[last] = copy.deepcopy(value)
    return doc


def _remove(doc: Json, tokens: list[str]) -> Json:
    parent, last = _parent(doc, tokens)
    if isinstance(parent, list):
        del parent[_index(parent, last, for_add=False)]
    elif last in parent:
        del parent[last]
    else:
        raise _patch_failed(f"cannot remove {last!r}: it does not exist")
    return doc


def _json_equal(a: Json, b: Json) -> bool:
    """JSON equality: no ``True == 1``, numbers compare by value, objects ignore key order."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def apply_json_patch(doc: Json, ops: Json) -> Json:
    """Apply an RFC 6902 patch to a copy of *doc*; StubError (400/422) when it cannot be."""
    if not isinstance(ops, list) or not all(isinstance(op, dict) for op in ops):
        raise _bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    doc = copy.deepcopy(doc)
    for op in ops:
        kind = op.get("op")
        tokens = _tokens(op.get("path"))
        if kind in ("add", "replace", "test") and "value" not in op:
            raise _patch_failed(f"{kind} operation has no value")
        if kind == "add":
            doc = _add(doc, tokens, op["value"])
        elif kind == "remove":
            doc = _remove(doc, tokens)
        elif kind == "replace":
            _get(doc, tokens)  # must exist
            doc = _add(_remove(doc, tokens), tokens, op["value"]) if tokens else op["value"]
        elif kind == "test":
            if not _json_equal(_get(doc, tokens), op["value"]):
                raise _patch_failed("testing value failed")
        elif kind in ("move", "copy"):
            source = _tokens(op.get("from"))
            value = copy.deepcopy(_get(doc, source))
            if kind == "move":
                doc = _remove(doc, source)
            doc = _add(doc, tokens, value)
        else:
            raise _patch_failed(f"unexpected kind {kind!r}")
    return doc


def apply_merge_patch(doc: Json, patch: Json, *, strategic: bool = False) -> Json:
    """RFC 7386 merge patch (with ``$patch`` map directives when *strategic*)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if strategic:
        directive = patch.get("$patch")
        if directive == "delete":
            return None
        if directive == "replace":
            return {k: v for k, v in copy.deepcopy(patch).items() if k != "$patch"}
        if directive is not None:
            raise _bad_request(f"unknown patch type {directive!r}")
    result = copy.deepcopy(doc) if isinstance(doc, dict) else {}
    for key, value in patch.items():
        if strategic and key.startswith("$"):
            continue  # $setElementOrder/..., $retainKeys: ordering hints, no effect here
        if value is None:
            result.pop(key, None)
            continue
        merged = apply_merge_patch(result.get(key), value, strategic=strategic)
        if merged is None:
            result.pop(key, None)
        else:
            result[key] = merged
    return result


# -- validation ---------------------------------------------------------------------------------


def _qualified_name_errors(key: Any) -> list[str]:
    if not isinstance(key, str):
        return ["must be a string"]
    prefix, _, name = key.rpartition("/")
    errors = []
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        errors.append("prefix part must be a lowercase RFC 1123 subdomain")
    if not name or len(name) > 63 or not _QUALIFIED_NAME.match(name):
        errors.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', must start "
            "and end with an alphanumeric character, and be at most 63 characters"
        )
    return errors


def validate_node(node: Json) -> list[dict[str, str]]:
    """Field errors the API server would report for labels and taints (StatusCause dicts)."""
    causes = []
    labels = node.get("metadata", {}).get("labels") or {}
    if not isinstance(labels, dict):
        return [{"reason": "FieldValueInvalid", "message": "must be an object", "field": "labels"}]
    for key, value in labels.items():
        for err in _qualified_name_errors(key):
            causes.append(
                {
                    "reason": "FieldValueInvalid",
                    "message": f"Invalid value: {key!r}: {err}",
                    "field": "metadata.labels",
                }
            )
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            causes.append(
                {
                    "reason": "FieldValueInvalid",
                    "message": f"Invalid value: {value!r}: a valid label value",
                    "field": "metadata.labels",
                }
            )
    seen = set()
    taints = node.get("spec", {}).get("taints") or []
    for i, taint in enumerate(taints if isinstance(taints, list) else [None]):
        where = f"spec.taints[{i}]"
        if not isinstance(taint, dict):
            causes.append(
                {"reason": "FieldValueInvalid", "message": "not an object", "field": where}
            )
            continue
        for err in _qualified_name_errors(taint.get("key")):
            causes.append({"reason": "FieldValueInvalid", "message": err, "field": where + ".key"})
        if taint.get("effect") not in _TAINT_EFFECTS:
            causes.append(
                {
                    "reason": "FieldValueNotSupported",
                    "message": f"Unsupported value: {taint.get('effect')!r}",
                    "field": where + ".effect",
                }
            )
        pair = (taint.get("key"), taint.get("effect"))
        if pair in seen:
            causes.append(
                {
                    "reason": "FieldValueDuplicate",
                    "message": f"Duplicate value: {taint.get('key')}:{taint.get('effect')}",
                    "field": where,
                }
            )
        seen.add(pair)
    return causes


# -- label selectors ---------------------------------------------------------------------------


def selects(selector: str, labels: dict[str, str]) -> bool:
    """Whether *labels* match a label selector's equality and existence terms (``k=v``,
    ``k==v``, ``k!=v``, ``k``, ``!k``, comma-separated: all must hold); a set-based term
    (``k in (a,b)``) is a 400, as the stub does not know it."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if " in " in term or " notin " in term or "(" in term:
            raise _bad_request(f"unable to parse requirement: {term!r} (not in the stub)")
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


# -- the server ---------------------------------------------------------------------------------


class KubeStub:
    """The stub server. Use as a context manager, or call :meth:`start` and :meth:`stop`."""

    def __init__(self, host: str = "127.0.0.1", *, keep_alive: bool = False) -> None:
        self.host = host
        #: Answer HTTP/1.1 and keep connections open between requests, as a real API server does.
        self.keep_alive = keep_alive
        #: TCP connections accepted so far.
        self.connections = 0
        #: Every request received, in order (also the ones answered by an injected fault).
        self.requests: list[RecordedRequest] = []
        self._lock = threading.RLock()
        self._nodes: dict[str, dict[str, Any]] = {}
        self._rv = 100
        self._faults: list[_Fault] = []
        self._before_patch: list[NodeHook] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._clients: list[k8s_client.ApiClient] = []
        #: events.k8s.io/v1 Events (see tests.fakes.k8s_events).
        self.event_store = EventStore(_event_error)

    # lifecycle

    def start(self) -> KubeStub:
        stub = self

        class Handler(_Handler):
            pass

        Handler.stub = stub
        Handler.protocol_version = "HTTP/1.1" if self.keep_alive else "HTTP/1.0"
        self._server = ThreadingHTTPServer((self.host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.02},
            name="k8s-stub",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        for api_client in self._clients:
            api_client.close()
        self._clients.clear()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> KubeStub:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "stub not started"
        return f"http://{self.host}:{self._server.server_address[1]}"

    def client(self) -> k8s_client.CoreV1Api:
        """A real ``CoreV1Api`` talking to this stub over HTTP, without auth."""
        configuration = k8s_client.Configuration(host=self.url)
        configuration.verify_ssl = False
        api_client = k8s_client.ApiClient(configuration)
        self._clients.append(api_client)
        return k8s_client.CoreV1Api(api_client)

    def events_client(self) -> k8s_client.EventsV1Api:
        """A real ``EventsV1Api`` talking to this stub over HTTP, without auth."""
        configuration = k8s_client.Configuration(host=self.url)
        configuration.verify_ssl = False
        api_client = k8s_client.ApiClient(configuration)
        self._clients.append(api_client)
        return k8s_client.EventsV1Api(api_client)

    def events(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Copies of the stored Events (of *namespace*, if given), oldest first."""
        return self.event_store.all(namespace)

    def describe_events(self, node: str) -> str:
        """The ``Events:`` section ``kubectl describe node <node>`` would print."""
        about = [e for e in self.events() if (e.get("regarding") or {}).get("name") == node]
        return describe_events(about)

    # state

    def add_node(
        self,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        taints: list[dict[str, Any]] | None = None,
        annotations: dict[str, str] | None = None,
        created: str | None = None,
    ) -> dict[str, Any]:
        """Store a node; ``created`` is its ``metadata.creationTimestamp`` (RFC 3339, as the
        API server sets it; default: now)."""
        stamp = created or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        node: dict[str, Any] = {
            "kind": "Node",
            "apiVersion": "v1",
            "metadata": {"name": name, "uid": f"uid-{name}", "creationTimestamp": stamp},
            "spec": {},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
        if labels is not None:
            node["metadata"]["labels"] = dict(labels)
        if annotations is not None:
            node["metadata"]["annotations"] = dict(annotations)
        if taints is not None:
            node["spec"]["taints"] = copy.deepcopy(taints)
        with self._lock:
            self._store(name, node)
            return copy.deepcopy(node)

    def node(self, name: str) -> dict[str, Any]:
        """A copy of the stored node."""
        with self._lock:
            return copy.deepcopy(self._nodes[name])

    def labels(self, name: str) -> dict[str, str]:
        return dict(self.node(name)["metadata"].get("labels") or {})

    def taints(self, name: str) -> list[dict[str, Any]]:
        return list(self.node(name)["spec"].get("taints") or [])

    def resource_version(self, name: str) -> str:
        return str(self.node(name)["metadata"]["resourceVersion"])

    def write(self, name: str, change: NodeHook) -> None:
        """Change a stored node as another client would (bumps its resourceVersion)."""
        with self._lock:
            node = copy.deepcopy(self._nodes[name])
            change(node)
            self._store(name, node)

    def _store(self, name: str, node: dict[str, Any]) -> None:
        self._rv += 1
        node["metadata"]["resourceVersion"] = str(self._rv)
        self._nodes[name] = node

    # hooks

    def fail_next(
        self,
        count: int,
        status: int,
        *,
        method: str | None = None,
        retry_after: int | None = None,
        path: str | None = None,
    ) -> None:
        """Answer the next *count* requests (of *method*, and under the *path* prefix, when
        given) with *status*.

        ``status=0`` drops the connection without an answer. Faults queue up in call order.
        """
        with self._lock:
            self._faults.append(_Fault(count, status, method, retry_after, path))

    def before_next_patch(self, change: NodeHook) -> None:
        """Run *change* on the stored node right before the next PATCH is applied (once)."""
        with self._lock:
            self._before_patch.append(change)

    def requests_of(self, method: str) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if r.method == method]

    def _record(self, request: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def _take_fault(self, method: str, path: str = "") -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.method in (None, method) and path.startswith(fault.path or ""):
                    fault.remaining -= 1
                    if fault.remaining <= 0:
                        self._faults.remove(fault)
                    return fault
        return None

    # request handling (called from handler threads)

    def _handle(
        self, method: str, path: str, content_type: str | None, body: Json, query: str = ""
    ) -> Json:
        if self.event_store.handles(path):
            return self.event_store.handle(method, path, body, _patched, content_type)
        if method == "GET" and path == _LIST_PATH:
            selector = parse_qs(query).get("labelSelector", [""])[0]
            with self._lock:
                return {
                    "kind": "NodeList",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self._rv)},
                    "items": [
                        copy.deepcopy(n)
                        for _, n in sorted(self._nodes.items())
                        if selects(selector, n["metadata"].get("labels") or {})
                    ],
                }
        match = _NODE_PATH.match(path)
        if match is None:
            raise StubError(
                status_object(404, "NotFound", "the server could not find the requested resource")
            )
        name = match.group(1)
        with self._lock:
            if name not in self._nodes:
                raise StubError(
                    status_object(
                        404, "NotFound", f'nodes "{name}" not found', name=name, kind="nodes"
                    )
                )
            if method == "GET":
                return copy.deepcopy(self._nodes[name])
            if method != "PATCH":
                raise StubError(
                    status_object(
                        405,
                        "MethodNotAllowed",
                        "the server does not allow this method on the requested resource",
                    )
                )
            while self._before_patch:
                self.write(name, self._before_patch.pop(0))
            return self._patch(name, content_type, body)

    def _patch(self, name: str, content_type: str | None, body: Json) -> Json:
        current = self._nodes[name]
        patched = _patched(current, content_type, body)
        meta = patched.setdefault("metadata", {})
        if meta.get("name") != name:
            raise StubError(
                status_object(
                    400, "BadRequest", "the name of the object does not match the name on the URL"
                )
            )
        rv = meta.get("resourceVersion")
        if rv is not None and str(rv) != current["metadata"]["resourceVersion"]:
            raise StubError(_conflict(name))
        causes = validate_node(patched)
        if causes:
            raise StubError(
                status_object(
                    422,
                    "Invalid",
                    f'Node "{name}" is invalid: '
                    + "; ".join(f"{c['field']}: {c['message']}" for c in causes),
                    name=name,
                    kind="Node",
                    causes=causes,
                )
            )
        if patched != current:  # a no-op patch does not write (no resourceVersion bump)
            self._store(name, patched)
        return copy.deepcopy(self._nodes[name])


def _patched(current: Json, content_type: str | None, body: Json) -> Json:
    """*current* with the patch *body* applied as its media type says (415/400/422 otherwise)."""
    media = (content_type or "").split(";")[0].strip()
    if media not in _PATCH_TYPES:
        raise StubError(
            status_object(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types "
                f"include: {', '.join(_PATCH_TYPES)}, application/apply-patch+yaml",
            )
        )
    if isinstance(body, str) or body is None:
        raise _bad_request("the body of the request could not be decoded as JSON")
    if media == "application/json-patch+json":
        patched = apply_json_patch(current, body)
    else:
        if not isinstance(body, dict):
            raise _bad_request("json: cannot unmarshal array into Go value of type map")
        strategic = media == "application/strategic-merge-patch+json"
        patched = apply_merge_patch(current, body, strategic=strategic)
    if not isinstance(patched, dict):
        raise _bad_request("the patch did not result in an object")
    return patched


def _event_error(
    code: int, reason: str, message: str, causes: list[dict[str, str]] | None = None
) -> StubError:
    return StubError(status_object(code, reason, message, kind="events", causes=causes))


class _Handler(BaseHTTPRequestHandler):
    stub: KubeStub
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep pytest output clean

    def setup(self) -> None:
        super().setup()
        with self.stub._lock:
            self.stub.connections += 1

    def do_GET(self) -> None:
        self._serve("GET")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        text = raw.decode("utf-8", errors="replace")
        body: Json
        try:
            body = json.loads(text) if text else None
        except ValueError:
            body = text
        content_type = self.headers.get("Content-Type")
        stub = self.stub
        name_match = _NODE_PATH.match(parts.path)
        name = name_match.group(1) if name_match else None
        fault = stub._take_fault(method, parts.path)
        headers: dict[str, str] = {}
        if fault is not None and fault.status == 0:
            stub._record(RecordedRequest(method, parts.path, parts.query, content_type, body, 0))
            self.close_connection = True
            self.connection.close()
            return
        if fault is not None:
            code = fault.status
            payload = _injected(code, name, method, fault.retry_after)
            if fault.retry_after is not None:
                headers["Retry-After"] = str(fault.retry_after)
        else:
            try:
                payload = stub._handle(method, parts.path, content_type, body, parts.query)
                code = 201 if method == "POST" else 200  # POST only creates (Events)
            except StubError as exc:
                payload = exc.status
                code = exc.status["code"]
                headers.update(exc.headers)
        stub._record(RecordedRequest(method, parts.path, parts.query, content_type, body, code))
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)


def running_stub() -> Iterator[KubeStub]:
    """Generator for a pytest fixture: ``yield from running_stub()``."""
    with KubeStub() as stub:
        yield stub
