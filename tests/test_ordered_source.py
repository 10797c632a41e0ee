"""OrderedSource's error when no source could serve (prefetch/sources/ordered.py): of the last
failure's kind, so callers still match it by type, with every failure named and the last one
kept as its cause."""

from __future__ import annotations

import pytest

from prefetch.pipeline.snapshot import RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.sources.base import DescribesWhole, RangeReader
from prefetch.sources.ordered import NoSourceServedError, OrderedSource
from prefetch.support.errors import (
    AccessDeniedError,
    NoMatchingFilesError,
    NotFoundError,
    PrefetchError,
    RevisionNotFoundError,
    SourceError,
    TransientSourceError,
)

SPEC = ModelSpec(source=parse_source_uri("hf://org/model"))


class Failing:
    """A source whose resolve raises ``error``."""

    def __init__(self, error: SourceError) -> None:
        self.error = error

    def resolve(self, spec: ModelSpec) -> Snapshot:
        raise self.error

    def describe(self, file: RemoteFile) -> RemoteFile:
        raise AssertionError("never read")

    def open_range(self, file: RemoteFile, start: int, end: int) -> RangeReader:
        raise AssertionError("never read")


class HintedRevisionError(RevisionNotFoundError):
    """A subclass whose constructor takes other arguments than a message."""

    def __init__(self, revision: str) -> None:
        super().__init__(f"no {revision}", hint=f"is {revision} mirrored?")


@pytest.mark.parametrize(
    ("last", "kind"),
    [
        (HintedRevisionError("v9"), RevisionNotFoundError),
        (NoMatchingFilesError("nothing matches"), NoMatchingFilesError),
        (NotFoundError("gone"), NotFoundError),
        (AccessDeniedError("denied"), AccessDeniedError),
        (TransientSourceError("slow down", retry_after=3.0), TransientSourceError),
    ],
)
def test_when_no_source_serves_the_error_is_of_the_last_ones_kind_and_keeps_it_as_cause(
    last: SourceError, kind: type[SourceError]
) -> None:
    first = NotFoundError("s3 mirror lacks it")
    source = OrderedSource([("s3://b/m/", Failing(first)), ("hf://org/model", Failing(last))])
    with pytest.raises(kind) as caught:
        source.resolve(SPEC)
    error = caught.value
    assert isinstance(error, NoSourceServedError) and isinstance(error, PrefetchError)
    assert error.__cause__ is last
    assert error.failures == (("s3://b/m/", first), ("hf://org/model", last))
    assert str(error) == (
        f"no source could serve hf://org/model: s3://b/m/: {first}; hf://org/model: {last}"
    )
    assert error.hint == last.hint
    if isinstance(last, TransientSourceError):
        assert isinstance(error, TransientSourceError) and error.retry_after == 3.0


def test_one_source_alone_raises_its_own_error() -> None:
    only = AccessDeniedError("denied")
    with pytest.raises(AccessDeniedError) as caught:
        OrderedSource([("s3://b/m/", Failing(only))]).resolve(SPEC)
    assert caught.value is only


class Serving:
    """A source that lists ``a.bin`` and describes it (with its bytes when ``whole``)."""

    def __init__(self, whole: bool) -> None:
        self.file = RemoteFile("a.bin", 3, version="v")
        if whole:
            self.describe_whole = lambda f, within=None: (f.with_(described=True), b"abc")

    def resolve(self, spec: ModelSpec) -> Snapshot:
        return Snapshot("x://", "rev", (self.file,))

    def describe(self, file: RemoteFile) -> RemoteFile:
        return file.with_(described=True, version="described")

    def open_range(self, file: RemoteFile, start: int, end: int) -> RangeReader:
        raise AssertionError("never read")


@pytest.mark.parametrize("whole", [True, False])
def test_describe_whole_goes_to_the_owner_when_it_can_else_to_its_describe(whole: bool) -> None:
    """The engine's whole-object path (DescribesWhole) through an ordered source: the bytes of
    an owner that brings them, the plain describe of one that cannot (the Hub, say)."""
    owner = Serving(whole)
    source = OrderedSource([("x://", owner)])
    assert isinstance(source, DescribesWhole)
    (file,) = source.resolve(SPEC).files
    described, body = source.describe_whole(file)
    assert described.described
    assert (body, described.version) == ((b"abc", "v") if whole else (None, "described"))
