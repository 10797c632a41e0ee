"""Publishing a compile cache from the agent (``compileCaches`` entries with ``push: true``).

The vLLM pod writes its compile cache into a host directory (the entry's ``pushFrom``, its
``VLLM_CACHE_ROOT``). :class:`CachePusher` looks at that directory every ``poll`` seconds from the
agent's loop (in a worker thread) and, once vLLM has finished (its ``.cache_ready`` marker is
there and no file changes for the settle period), publishes it with
:func:`prefetch.publish.compile_cache.push` under the entry's key: first writer wins by
``If-None-Match: *``, nothing is overwritten, a cache still being written is left for the next
look. Each key is published (or found published by another writer) once per agent process. A
key another writer's live claim holds is looked at again (that push may die; its lease then
runs out). A directory refused for good (a symlink, a file swapped after its check) is told
once as a Warning Event and looked at again with a growing interval.

Why a poll and not ``watchdog`` (inotify): the decision needs a settle period anyway (no file
changed for a while), which an event stream does not give; the directory may not exist until the
vLLM pod first starts (a watch needs it to exist); and one stat walk of a cache of a few hundred
files every ``poll`` seconds costs nothing next to a thread and a dependency.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefetch.agent.config_values import AgentConfig, PushTarget
from prefetch.agent.event_recorder import EventRecorder
from prefetch.agent.events import (
    compile_cache_already_published,
    compile_cache_push_refused,
    compile_cache_pushed,
)
from prefetch.agent.scheduler import Scheduler
from prefetch.publish.compile_cache import CACHE_READY, push
from prefetch.support import settings
from prefetch.support.errors import CompileCacheError, CompileCacheRefused, PrefetchError
from prefetch.support.logjson import scrub

log = logging.getLogger(__name__)

#: How often the agent looks at a ``pushFrom`` directory.
PUSH_POLL = 30.0
#: How long no file may change, after the marker appeared, before the agent uploads: longer than
#: ``prefetch cache push``'s 2 s, because the agent cannot know that every tensor-parallel rank
#: has written its part (each rank writes its own directory, and its own marker).
PUSH_SETTLE = 30.0
#: A push refused for good (a symlink or a swapped file in ``pushFrom``: the directory must
#: change first) is looked at again after this long, doubling at each refusal up to
#: :data:`REFUSED_MAX`; the first refusal of a run is a Warning Event, the rest debug lines.
REFUSED_FIRST = 5 * 60.0
REFUSED_MAX = 60 * 60.0

__all__ = ["PUSH_POLL", "PUSH_SETTLE", "REFUSED_FIRST", "REFUSED_MAX", "CachePusher", "PushClient"]


class PushClient:
    """The S3 client compile caches are published with (the tests' own, else one made on first
    use, for the config's endpoint)."""

    def __init__(self, s3_client: object | None) -> None:
        self._given = s3_client
        self._made: object | None = None

    def __call__(self, config: AgentConfig) -> object:
        if self._given is not None:
            return self._given
        if self._made is None:
            from prefetch.sources.s3.factory import make_s3_client

            self._made = make_s3_client(
                endpoint_url=config.s3_endpoint_url or settings.aws_endpoint_url(),
                ca_bundle=config.ca_bundle,
            )
        return self._made


class _Stopped(Exception):
    """The agent stops: a push waiting for its settle period gives up before any write."""


class CachePusher:
    """Publishes each ``push: true`` compile cache once per key (see the module docstring).

    ``client()`` gives the S3 client (made on first use); ``settle`` is how long the files must
    stay unchanged before the upload; ``poll`` how often the agent's loop looks (:meth:`due`)."""

    def __init__(
        self,
        events: EventRecorder,
        client: Callable[[AgentConfig], Any],
        *,
        settle: float = PUSH_SETTLE,
        poll: float = PUSH_POLL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._events = events
        self._client = client
        self._settle = settle
        self._poll = poll
        self._next_look = 0.0
        self._clock = clock
        self._done: set[tuple[str, str]] = set()  # (entry, key) published or found published
        # (entry, key) refused for good -> (when to look again, the interval that gave it)
        self._refused: dict[tuple[str, str], tuple[float, float]] = {}

    def due(self, now: float, config: AgentConfig) -> bool:
        """Whether the loop should start a look now (``config`` has push targets and ``poll``
        seconds passed since the last); the next one is counted from ``now``."""
        if now < self._next_look or not config.push_targets():
            return False
        self._next_look = now + self._poll
        return True

    def run(self, config: AgentConfig, scheduler: Scheduler, stop: threading.Event) -> None:
        """One look at every ``pushFrom`` directory whose key is not done (a worker thread)."""
        for target in config.push_targets():
            name, root, key = target.name, target.root, target.key
            if stop.is_set():
                return
            if (name, key.key) in self._done or self._backing_off((name, key.key)):
                continue
            ms = scheduler.get(name)
            if ms is not None and ms.ready and not ms.nothing_published and not ms.syncing:
                self._done.add((name, key.key))  # pulled: the key is published already
                continue
            if not _has_marker(root):
                continue  # vLLM has not finished compiling (or not started) here yet
            try:
                outcome = self._push(config, target, stop)
            except _Stopped:
                return
            if outcome is not None and ms is not None and scheduler.current(ms):
                ms.cache_push = outcome

    def _push(self, config: AgentConfig, target: PushTarget, stop: threading.Event) -> str | None:
        name, root, uri, key = target.name, target.root, target.uri, target.key

        def sleep(seconds: float) -> None:
            if stop.wait(seconds):
                raise _Stopped

        try:
            result = push(self._client(config), root, uri, key=key, settle=self._settle,
                          sleep=sleep, extra_dirs=target.extra_dirs)  # fmt: skip
        except CompileCacheRefused as exc:  # the directory must change first: back off
            self._refuse((name, key.key), str(exc))
            return None
        except CompileCacheError as exc:  # still being written: the next look tries again
            log.info("%s: compile cache not pushed yet: %s", name, exc,
                     extra={"model": name, "phase": "push"})  # fmt: skip
            return None
        except PrefetchError as exc:
            log.warning("%s: compile cache push failed (tried again later): %s", name,
                        scrub(str(exc)), extra={"model": name, "phase": "push",
                                                "error": scrub(str(exc))})  # fmt: skip
            return None
        self._refused.pop((name, key.key), None)
        if result.pending:  # another writer's live claim: its push may still die
            log.info("%s: compile cache not pushed yet: %s", name, result.reason,
                     extra={"model": name, "phase": "push"})  # fmt: skip
            return None
        self._done.add((name, key.key))
        where = scrub(uri)
        if result.uploaded:
            self._events.emit(compile_cache_pushed(
                name, key.key, files=result.files, bytes_total=result.bytes, uri=where
            ))  # fmt: skip
            return "pushed"
        self._events.emit(compile_cache_already_published(name, key.key, uri=where))
        return "published-elsewhere"

    def _backing_off(self, target: tuple[str, str]) -> bool:
        """Whether ``target`` was refused for good and its next look is not due yet."""
        due = self._refused.get(target)
        return due is not None and self._clock() < due[0]

    def _refuse(self, target: tuple[str, str], detail: str) -> None:
        """A push refused for good: a Warning Event the first time in a run, then a longer wait
        before each next look (:data:`REFUSED_FIRST` doubling to :data:`REFUSED_MAX`)."""
        name, key = target
        previous = self._refused.get(target)
        interval = REFUSED_FIRST if previous is None else min(previous[1] * 2, REFUSED_MAX)
        self._refused[target] = (self._clock() + interval, interval)
        if previous is None:
            self._events.emit(compile_cache_push_refused(name, key, detail=scrub(detail)))
        else:
            log.debug("%s: compile cache push still refused (next look in %.0fs): %s", name,
                      interval, detail, extra={"model": name, "phase": "push"})  # fmt: skip


def _has_marker(root: Path) -> bool:
    """Whether vLLM's ``.cache_ready`` is anywhere under ``root`` (cheap: no settle wait)."""
    try:
        return any(p.is_file() for p in root.rglob(CACHE_READY))
    except OSError:
        return False
