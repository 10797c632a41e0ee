"""``prefetch status``: read the Nodes with the user's kubeconfig and say how each is warming.

Per node it combines the agent's progress note (the annotation
:data:`~prefetch.support.constants.PROGRESS_ANNOTATION`, see :mod:`prefetch.agent.progress_note`)
with what is on the Node now: each model's ready label and the startup taint. A node without the
annotation is still listed, as ``no agent report``: a GPU node whose agent never reported (the
DaemonSet does not select it, its pod cannot start, RBAC forbids the patch) is what an operator
needs to see; narrow the list to the GPU nodes with ``-l``. A note older than three write
intervals while bytes were still moving is marked stale: the agent has stopped reporting.

One LIST of nodes (paged, 500 a page); nothing is written.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from prefetch.agent.node import READY_VALUE, label_key, parse_timestamp
from prefetch.agent.progress_note import NOTE_VERSION
from prefetch.support import settings
from prefetch.support.constants import (
    DEFAULT_LABEL_PREFIX,
    DEFAULT_STARTUP_TAINT_KEY,
    PROGRESS_ANNOTATION,
    PROGRESS_INTERVAL,
)
from prefetch.support.errors import ClusterReadError, PrefetchError
from prefetch.support.redact import printable
from prefetch.support.safejson import load_json
from prefetch.support.units import format_bytes

__all__ = [
    "ModelRow",
    "NodeReport",
    "cluster_api",
    "list_nodes",
    "node_report",
    "table",
]

#: A note this much older than the write interval, while bytes were moving, is stale.
STALE_AFTER = 3 * PROGRESS_INTERVAL
_PAGE = 500
_DEFAULT_KUBECONFIG = "~/.kube/config"
_TIMEOUT = 15.0
_MOVING = frozenset({"syncing", "updating"})
#: Kubernetes caps a Node's annotations at 256 KiB together: a note can be no larger.
MAX_NOTE_BYTES = 256 * 1024
_MAX_COUNT = 2**63
_MAX_TEXT = 253  # a model name is a label value (63) in a key; reasons are short sentences
T = TypeVar("T")


@dataclass(frozen=True)
class ModelRow:
    """One model as the node's note reports it, and whether the node carries its ready label."""

    name: str
    phase: str
    done: int | None
    total: int | None
    rate: int | None
    eta: int | None
    labelled: bool
    reason: str | None = None
    warm: str | None = None  # the page-cache warm-up's state, when the model has one
    cache: str | None = None  # a compile cache entry's state (pulled, none, pushed, ...)

    @property
    def percent(self) -> float | None:
        if not self.total or self.done is None:
            return None
        return round(100.0 * min(self.done, self.total) / self.total, 1)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "name": self.name,
            "phase": self.phase,
            "bytes_done": self.done,
            "bytes_total": self.total,
            "percent": self.percent,
            "rate_bytes_per_second": self.rate,
            "eta_seconds": self.eta,
            "labelled": self.labelled,
            "reason": self.reason,
        }
        extra = (("warm", self.warm), ("cache", self.cache))
        return out | {k: v for k, v in extra if v is not None}


@dataclass(frozen=True)
class NodeReport:
    """One node: its note (``problem`` says why there is none usable) and its gate state."""

    node: str
    taint: bool
    ready: bool | None = None
    written_at: str | None = None
    age: float | None = None
    stale: bool = False
    models: list[ModelRow] = field(default_factory=list)
    problem: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "node": self.node,
            "report": self.problem is None,
            "problem": self.problem,
            "all_required_ready": self.ready,
            "startup_taint": self.taint,
            "written_at": self.written_at,
            "age_seconds": None if self.age is None else round(self.age, 1),
            "stale": self.stale,
            "models": [m.to_json() for m in self.models],
        }


# -- reading the cluster -----------------------------------------------------------------------


def cluster_api(kubeconfig: str | None, context: str | None) -> k8s_client.CoreV1Api:
    """A CoreV1Api from the user's kubeconfig (``--kubeconfig``, else ``KUBECONFIG``, else
    ``~/.kube/config``) and context; the process-wide default configuration is not touched."""
    configuration = k8s_client.Configuration()
    path = kubeconfig or settings.kubeconfig() or _DEFAULT_KUBECONFIG
    try:
        k8s_config.load_kube_config(
            config_file=path, context=context, client_configuration=configuration
        )
    except (k8s_config.ConfigException, OSError, ValueError) as exc:
        where = kubeconfig or path
        raise ClusterReadError(
            f"cannot load the kubeconfig ({where}): {exc}",
            hint="pass --kubeconfig FILE (and --context NAME), or set KUBECONFIG",
        ) from exc
    configuration.retries = 1
    return k8s_client.CoreV1Api(k8s_client.ApiClient(configuration))


def list_nodes(api: k8s_client.CoreV1Api, selector: str | None) -> list[dict[str, object]]:
    """Every node matching the label ``selector``, as plain JSON, in pages."""
    return list(_pages(api, selector))


def _pages(api: k8s_client.CoreV1Api, selector: str | None) -> Iterator[dict[str, object]]:
    host = api.api_client.configuration.host
    cont: str | None = None
    while True:
        try:
            resp = api.list_node(
                label_selector=selector or "",
                limit=_PAGE,
                _continue=cont or "",
                _preload_content=False,
                _request_timeout=_TIMEOUT,
            )
            try:
                page = json.loads(resp.data)
            finally:
                resp.release_conn()
        except ApiException as exc:
            raise _refused(exc, host) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ClusterReadError(
                f"cannot reach the Kubernetes API server at {host}: {type(exc).__name__}",
                hint="check the kubeconfig's server address and your network (VPN, proxy)",
            ) from exc
        except ValueError as exc:
            raise ClusterReadError(f"the API server at {host} answered with no JSON") from exc
        yield from page.get("items") or []
        cont = (page.get("metadata") or {}).get("continue")
        if not cont:
            return


def _refused(exc: ApiException, host: str) -> ClusterReadError:
    detail = f"HTTP {exc.status} {exc.reason or ''}".rstrip()
    if exc.status == 401:
        return ClusterReadError(
            f"the API server at {host} did not accept your credentials ({detail})",
            hint="log in again (your kubeconfig's token or certificate may have expired)",
        )
    if exc.status == 403:
        return ClusterReadError(
            f"you may not list nodes on {host} ({detail})",
            hint="prefetch status needs the 'list' verb on nodes: kubectl auth can-i list nodes",
        )
    if exc.status == 400:
        return ClusterReadError(f"the API server refused the request ({detail}): {exc.body}")
    return ClusterReadError(f"the API server at {host} could not list nodes ({detail})")


# -- one node ----------------------------------------------------------------------------------


def node_report(node: Mapping[str, object], now: float) -> NodeReport:
    """What ``prefetch status`` says about ``node`` (``now``: Unix time, for the note's age).
    The note is written by whatever can patch the Node: one that is not JSON, too large, too
    deep, or holds a value of the wrong type or range is this node's ``problem``, never an
    exception that would hide every other node."""
    metadata = _mapping(node.get("metadata"))
    name = _text(metadata.get("name", "?"))
    labels = _mapping(metadata.get("labels"))
    listed = _mapping(node.get("spec")).get("taints")
    taints: list[object] = listed if isinstance(listed, list) else []
    raw = _mapping(metadata.get("annotations")).get(PROGRESS_ANNOTATION)
    if raw is None:
        return NodeReport(
            name, _has_taint(taints, DEFAULT_STARTUP_TAINT_KEY), problem="no agent report"
        )
    try:
        return _from_note(name, _parse_note(raw), labels, taints, now)
    except _BadNote as exc:
        return NodeReport(
            name,
            _has_taint(taints, DEFAULT_STARTUP_TAINT_KEY),
            problem=f"unreadable agent report: {exc}",
        )


def _mapping(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}


class _BadNote(PrefetchError):
    """Why a node's note cannot be shown."""


def _from_note(
    name: str,
    note: dict[str, object],
    labels: Mapping[str, object],
    taints: list[object],
    now: float,
) -> NodeReport:
    prefix = _field(note, "prefix", str) or DEFAULT_LABEL_PREFIX
    models = _field(note, "models", list) or []
    rows = [_model_row(i, m, labels, prefix) for i, m in enumerate(models)]
    at = _field(note, "at", str)
    written = parse_timestamp(at)
    age = max(now - written, 0.0) if written is not None else None
    moving = any(r.phase in _MOVING for r in rows)
    ready = _field(note, "ready", bool)
    return NodeReport(
        node=name,
        taint=_has_taint(taints, _field(note, "taint", str) or DEFAULT_STARTUP_TAINT_KEY),
        ready=bool(ready),
        written_at=None if at is None else _text(at),
        age=age,
        stale=moving and age is not None and age > STALE_AFTER,
        models=rows,
    )


def _parse_note(raw: object) -> dict[str, object]:
    if not isinstance(raw, str):
        raise _BadNote(f"a {type(raw).__name__}, not a string")
    note = load_json(raw, where="the note", max_bytes=MAX_NOTE_BYTES, error=_BadNote)
    if not isinstance(note, dict):
        raise _BadNote("not a JSON object")
    if note.get("v") != NOTE_VERSION:
        raise _BadNote(f"not version {NOTE_VERSION}")
    return note


def _field(entry: Mapping[str, object], key: str, kind: type[T]) -> T | None:
    """``entry[key]`` when it is a ``kind`` (None when absent or null); _BadNote otherwise."""
    value = entry.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise _BadNote(f"{key} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def _model_row(index: int, entry: object, labels: Mapping[str, object], prefix: str) -> ModelRow:
    if not isinstance(entry, dict):
        raise _BadNote(f"models[{index}] is a {type(entry).__name__}, not an object")
    try:
        name = _field(entry, "name", str) or "?"
        try:
            labelled = labels.get(label_key(prefix, name)) == READY_VALUE
        except ValueError:  # an empty name, or a prefix that is not one
            labelled = False
        return ModelRow(
            name=_text(name),
            phase=_text(_field(entry, "phase", str) or "?"),
            done=_count(entry, "done"),
            total=_count(entry, "total"),
            rate=_count(entry, "rate"),
            eta=_count(entry, "eta"),
            labelled=labelled,
            reason=None if entry.get("reason") is None else _text(_field(entry, "reason", str)),
            warm=None if entry.get("warm") is None else _text(_field(entry, "warm", str)),
            cache=None if entry.get("cache") is None else _text(_field(entry, "cache", str)),
        )
    except _BadNote as exc:
        raise _BadNote(f"models[{index}].{exc}") from None


def _count(entry: Mapping[str, object], key: str) -> int | None:
    """A byte count, rate or number of seconds: a whole number from 0 to 2**63."""
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _MAX_COUNT:
        raise _BadNote(f"{key} is {_text(repr(value))[:40]}, not a count")
    return value


def _text(value: object) -> str:
    """A name, phase or reason from the note, bounded and safe for a terminal (control
    characters, escapes and bidi overrides escaped: nothing forges a row or moves the cursor)."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > _MAX_TEXT:
        text = text[:_MAX_TEXT] + "..."
    return printable(text)


def _has_taint(taints: list[object], key: str) -> bool:
    return any(isinstance(t, dict) and t.get("key") == key for t in taints)


# -- output ------------------------------------------------------------------------------------

_HEADER = ("NODE", "READY", "TAINT", "MODEL", "PHASE", "PROGRESS", "RATE", "ETA", "AGE", "LABEL")


def table(reports: list[NodeReport]) -> list[str]:
    """The table's lines: one row per node and model (columns repeat, so rows grep well)."""
    rows: list[tuple[str, ...]] = [_HEADER]
    for report in reports:
        head = (report.node, _yes_no(report.ready), "on" if report.taint else "off")
        if report.problem is not None:
            rows.append((*head, f"({printable(report.problem)})", "", "", "", "", "", ""))
            continue
        age = _duration(report.age) + (" stale" if report.stale else "")
        for m in report.models:
            rows.append(
                (
                    *head,
                    m.name,
                    m.phase + (f" ({m.reason})" if m.reason else "") + _states(m),
                    _progress(m),
                    f"{format_bytes(m.rate)}/s" if m.rate else "-",
                    _duration(m.eta),
                    age,
                    "ready" if m.labelled else "-",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _states(m: ModelRow) -> str:
    """`` warm:<state>`` and `` cache:<state>`` after the phase, when the note has them."""
    return "".join(f" {k}:{v}" for k, v in (("warm", m.warm), ("cache", m.cache)) if v)


def _progress(m: ModelRow) -> str:
    if m.total is None:
        return "-" if m.done is None else format_bytes(m.done)
    return f"{format_bytes(m.done or 0)}/{format_bytes(m.total)} {m.percent:.0f}%"


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def _duration(seconds: float | None) -> str:
    """``42s``, ``4m46s``, ``2h03m``; ``-`` for None."""
    if seconds is None:
        return "-"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
