"""Ordered sources: a Hub model's mirrors first, the Hub after; the one place the fallback lives.

The Hub backend (:mod:`prefetch.sources.hf.backend`) opens an :class:`OrderedSource` for a
model with ``mirrors``, so ``prefetch pull --mirror`` and the agent fall back by the same rule:

* resolving tries each source in order and keeps the first that has the revision (a pinned
  commit: the first source that has that commit);
* it moves on when a source lacks it (:class:`~prefetch.support.errors.NotFoundError`: no ref, no
  commit, no bucket), refuses access, or stays unreachable or throttled after its retries
  (:class:`~prefetch.support.errors.TransientSourceError`);
* it never moves on from anything else: a mirror of another repo (ConfigError), malformed
  metadata (InvalidListingError). And once a source has resolved, the sync reads from it alone,
  so bytes that differ from the recorded ids fail the sync as a checksum failure, never a
  silent fallback to the Hub.

The snapshot's ``source`` names the source that served it (``SyncResult.served_by``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from prefetch.pipeline.snapshot import RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec
from prefetch.sources.base import DescribesWhole, RangeReader, Source
from prefetch.support.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    NoMatchingFilesError,
    NotFoundError,
    PrefetchError,
    RepoNotFoundError,
    RevisionNotFoundError,
    SourceError,
    TransientSourceError,
)
from prefetch.support.redact import redact

log = logging.getLogger(__name__)

#: The failures that make the next source worth trying: this one lacks the revision, or cannot
#: be reached or used right now. Anything else is a problem to fix, raised as it is.
FALLBACK_ERRORS: tuple[type[SourceError], ...] = (
    NotFoundError,
    AccessDeniedError,
    TransientSourceError,
)


class OrderedSource:
    """Sources tried in order (``(uri, source)`` pairs); reads go to the one that resolved.

    Each resolved file's locator remembers its source, so ``describe`` and ``open_range`` of a
    snapshot reach the source that listed it, whatever resolves came after."""

    def __init__(self, candidates: Sequence[tuple[str, Source]]) -> None:
        if not candidates:
            raise ValueError("an ordered source needs at least one source")
        self._candidates = tuple(candidates)
        self._owners: dict[str, Source] = {}
        self._lock = threading.Lock()

    def resolve(self, spec: ModelSpec) -> Snapshot:
        failures: list[tuple[str, SourceError]] = []
        for position, (uri, source) in enumerate(self._candidates):
            try:
                snapshot = source.resolve(spec)
            except FALLBACK_ERRORS as exc:
                failures.append((uri, exc))
                following = self._candidates[position + 1 :]
                if following:
                    log.warning(
                        "%s: %s cannot serve it (%s); trying %s",
                        spec.name, uri, redact(str(exc)), following[0][0],
                        extra={"phase": "resolve"},
                    )  # fmt: skip
                continue
            self._remember(snapshot, source)
            if failures:
                log.info("%s: served by %s", spec.name, uri, extra={"phase": "resolve"})
            return snapshot
        raise _none_served(spec, failures)

    def _remember(self, snapshot: Snapshot, source: Source) -> None:
        with self._lock:
            for f in snapshot.files:
                self._owners[f.locator] = source

    def _owner(self, file: RemoteFile) -> Source:
        with self._lock:
            owner = self._owners.get(file.locator)
        if owner is None:
            raise SourceError(f"{file.path}: not listed by any source of this model")
        return owner

    def describe(self, file: RemoteFile) -> RemoteFile:
        return self._owner(file).describe(file)

    def describe_whole(
        self, file: RemoteFile, *, within: float | None = None
    ) -> tuple[RemoteFile, bytes | None]:
        """The owner's :class:`~prefetch.sources.base.DescribesWhole` when it has it, else
        its describe (no bytes)."""
        owner = self._owner(file)
        if isinstance(owner, DescribesWhole):
            return owner.describe_whole(file, within=within)
        return owner.describe(file), None

    def open_range(self, file: RemoteFile, start: int, end: int) -> RangeReader:
        return self._owner(file).open_range(file, start, end)


class NoSourceServedError(SourceError):
    """Every source of a model failed: ``failures`` holds each one's ``(uri, error)`` in order
    and the last is the ``__cause__``. Raised as one of the subclasses below, which is also of
    the last failure's kind, so a caller still tells "not found" from "unreachable"."""

    def __init__(self, message: str, failures: Sequence[tuple[str, SourceError]]) -> None:
        last = failures[-1][1]
        PrefetchError.__init__(self, message, hint=last.hint)
        self.failures = tuple(failures)
        self.__cause__ = last
        if isinstance(last, TransientSourceError):
            self.retry_after = last.retry_after


class NoSourceHasFilesError(NoSourceServedError, NoMatchingFilesError):
    """The last source had the revision, but no file the patterns keep."""


class NoSourceHasRevisionError(NoSourceServedError, RevisionNotFoundError):
    """The last source lacked the revision."""


class NoSourceHasRepoError(NoSourceServedError, RepoNotFoundError):
    """The last source lacked the repo."""


class NoSourceHasBucketError(NoSourceServedError, BucketNotFoundError):
    """The last source's bucket does not exist."""


class NoSourceHasItError(NoSourceServedError, NotFoundError):
    """The last source lacked what was asked for."""


class NoSourceAllowedError(NoSourceServedError, AccessDeniedError):
    """The last source refused access."""


class NoSourceAnsweredError(NoSourceServedError, TransientSourceError):
    """The last source stayed unreachable or throttled after its retries."""


#: The error for each kind of last failure (its class in prefetch.support.errors), subclasses first.
_BY_KIND: tuple[tuple[type[SourceError], type[NoSourceServedError]], ...] = (
    (NoMatchingFilesError, NoSourceHasFilesError),
    (RevisionNotFoundError, NoSourceHasRevisionError),
    (RepoNotFoundError, NoSourceHasRepoError),
    (BucketNotFoundError, NoSourceHasBucketError),
    (NotFoundError, NoSourceHasItError),
    (AccessDeniedError, NoSourceAllowedError),
    (TransientSourceError, NoSourceAnsweredError),
    (SourceError, NoSourceServedError),
)


def _none_served(spec: ModelSpec, failures: list[tuple[str, SourceError]]) -> SourceError:
    """The error when every source failed, naming why each one could not serve (one source
    alone: its own error)."""
    last = failures[-1][1]
    if len(failures) == 1:
        return last
    reasons = "; ".join(f"{uri}: {exc}" for uri, exc in failures)
    message = f"no source could serve {spec.source}: {reasons}"
    kind = next(error for cls, error in _BY_KIND if isinstance(last, cls))
    return kind(message, failures)
