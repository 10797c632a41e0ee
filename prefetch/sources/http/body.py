"""One answer on the seam and the reader of its body (the hot path: one per chunk).

* :class:`Response`: an answer's status, headers and unread body, released or discarded.
* :class:`BodyReader`: the body of one ranged answer, read with the ``http.client`` response's
  ``readinto`` straight into the engine's buffer (urllib3's and botocore's own ``readinto`` read
  into a temporary bytes object and copy it: half the client CPU per byte, measured), never
  more or less than the range, with an ``abort()`` that wakes a read blocked in another thread.
* :func:`check_range_answer` (THE range rule), :func:`range_body_reader`, and
  :func:`checked_range_body` (the one, then the other).

Imported through :mod:`prefetch.sources.http.transport`, the seam's public face.
"""

from __future__ import annotations

import http.client
from collections.abc import Callable, Mapping
from typing import Protocol, cast

from prefetch.sources.base import range_answer_problem, shutdown_socket_of
from prefetch.sources.http.errors import transport_error
from prefetch.support.errors import SourceChangedError, SourceError, TransientSourceError

# ---- the body reader ---------------------------------------------------------------------------


class SupportsReadinto(Protocol):
    def readinto(self, buf: memoryview, /) -> int: ...


class ResponseBody(SupportsReadinto, Protocol):
    """What the seam uses of an answer's unread body: urllib3's response, or botocore's
    ``StreamingBody`` (whose ``release_conn`` is absent: it is looked up, not required)."""

    def read(self, amt: int | None = ..., /) -> bytes: ...
    def close(self) -> None: ...


def http_client_response(response: object) -> http.client.HTTPResponse | None:
    """The ``http.client`` response under a urllib3 response (or the response itself), or None
    when there is none: the layers are private, so a caller falls back to the outer object."""
    if isinstance(response, http.client.HTTPResponse):
        return response
    fp = getattr(response, "_fp", None)
    return fp if isinstance(fp, http.client.HTTPResponse) else None


def body_finished(response: object) -> bool:
    """Has the body of ``response`` (urllib3's, or the ``http.client`` response itself) been
    read to its end, so its connection may serve another request? ``http.client`` closes a
    response at the end of its body; one with no body (a HEAD, a 204 or 304) has nothing left.
    A response with no ``http.client`` response under it cannot be told: true (the caller's
    word)."""
    return _finished(http_client_response(response))


def _finished(fp: http.client.HTTPResponse | None) -> bool:
    """:func:`body_finished` of the ``http.client`` response ``fp`` (None: true)."""
    if fp is None or fp.isclosed():
        return True
    return not fp.chunked and fp.length == 0


class BodyReader:
    """The body of one answer to a ranged GET of ``length`` bytes: never more, never less.

    ``raw`` is the ``http.client`` response to read from (straight into the caller's buffer;
    it honours Content-Length and chunked encoding); when None, ``body`` (the library's own
    response object) is read instead. A body that ends early is a TransientSourceError (the
    engine retries from the last byte written); one that runs past the range (possible only
    without a Content-Length, so checked only then) is an ``overrun`` error. ``translate``
    turns a read failure into the package's error. ``on_close(reusable)`` finishes the
    response: ``reusable`` is true only when the whole body was read and nothing aborted it.
    """

    def __init__(
        self,
        body: SupportsReadinto,
        what: str,
        length: int,
        *,
        raw: http.client.HTTPResponse | None,
        socket_owner: object,
        on_close: Callable[[bool], None],
        length_known: bool = True,
        translate: Callable[[Exception, str], Exception] = transport_error,
        overrun: type[SourceError] = SourceChangedError,
    ) -> None:
        self._body = body
        self._raw = raw
        self._socket_owner = socket_owner
        self._on_close = on_close
        self._what = what
        self._left = length
        self._length_known = length_known
        self._translate = translate
        self._overrun = overrun
        self._clean = False
        self._aborted = False

    def readinto(self, buf: memoryview, /) -> int:
        if self._left <= 0:
            return 0
        view = buf[: self._left] if len(buf) > self._left else buf
        n = self._read(view)
        if n <= 0:
            raise TransientSourceError(
                f"{self._what}: the body ended {self._left} bytes before the end of the range"
            )
        self._left -= n
        if self._left == 0:
            self._finish()
        return n

    def _read(self, view: memoryview) -> int:
        try:
            if self._raw is not None:
                return self._raw.readinto(view)
            return int(self._body.readinto(view))
        except Exception as exc:
            raise self._translate(exc, self._what) from exc

    def _finish(self) -> None:
        """The range is complete: a body without Content-Length must end here too."""
        if not self._length_known and self._read(memoryview(bytearray(1))) > 0:
            raise self._overrun(f"{self._what}: the body is longer than the range")
        self._clean = True

    def abort(self) -> None:
        """Make a read blocked in another thread return now (see RangeReader); the connection
        is then never reused."""
        self._aborted = True
        shutdown_socket_of(self._raw if self._raw is not None else self._socket_owner)

    def close(self) -> None:
        self._on_close(self._clean and not self._aborted)


# ---- one answer ---------------------------------------------------------------------------------


class Response:
    """One answer on the seam: the status, the headers (case-insensitive), and ``raw``, the
    response whose body is still unread (None when a library already consumed it). ``error``:
    the (code, message) a library parsed from an error answer, when it did."""

    def __init__(
        self,
        status: int,
        headers: Mapping[str, str],
        raw: ResponseBody | None,
        *,
        error: tuple[str, str] | None = None,
    ) -> None:
        self.status = status
        self.headers = headers
        self.raw = raw
        self.error = error

    def read(self, limit: int) -> bytes:
        """At most ``limit`` bytes of the body (urllib3's ``read(limit)`` of a body it does not
        decode is one read of the ``http.client`` response: no buffer, no copy)."""
        return self.raw.read(limit) if self.raw is not None else b""

    def read_whole(self, limit: int, what: str) -> bytes:
        """At most ``limit`` bytes of a small body (a listing page), then :meth:`release`; a
        read that fails discards the connection and is the transport error saying ``what``."""
        try:
            data = self.read(limit)
        except Exception as exc:
            self.discard()
            raise transport_error(exc, what) from exc
        self.release()
        return data

    def release(self) -> None:
        """The body was read to its end (or there is none: a HEAD): the connection goes back to
        the pool, ready for its next request. One whose body was not read to its end (a caller
        that stopped at its limit) is closed instead: the next request on it would fail, or
        read the rest of this body as its answer."""
        if self.raw is None:
            return
        release = getattr(self.raw, "release_conn", None)
        fp = http_client_response(self.raw)
        if release is None or not _finished(fp):
            self.discard()
            return
        if fp is not None:
            # An answer with no body (a HEAD's) is finished but still open: http.client
            # refuses the connection's next request until it is closed ("ResponseNotReady").
            fp.close()
        release()

    def discard(self) -> None:
        """Close the connection without reading (it may be the one that failed)."""
        if self.raw is None:
            return
        try:
            self.raw.close()
        finally:
            release = getattr(self.raw, "release_conn", None)
            if release is not None:
                release()


def check_range_answer(
    what: str,
    start: int,
    end: int,
    size: int,
    status: int | None,
    content_range: str | None,
    content_length: int | str | None,
) -> None:
    """THE range rule of every source: the answer to a GET of bytes ``[start, end)`` of a
    ``size``-byte object must be exactly that range (:func:`range_answer_problem`); anything else
    would write wrong bytes at this offset, so it is a SourceChangedError (the partial file is
    dropped: its bytes can no longer be trusted)."""
    problem = range_answer_problem(start, end, size, status, content_range, content_length)
    if problem is not None:
        raise SourceChangedError(f"{what}: {problem}")


def range_body_reader(
    answer: Response,
    what: str,
    length: int,
    *,
    translate: Callable[[Exception, str], Exception] = transport_error,
) -> BodyReader:
    """The reader of a checked ranged answer: straight from the ``http.client`` response when
    the seam sent it (else through the library's body object); the connection goes back to the
    pool only after a clean read."""

    def finish(reusable: bool) -> None:
        if reusable:
            answer.release()
        else:
            answer.discard()

    # a ranged answer that passed its checks always has its body (only an error has none)
    body = cast("ResponseBody", answer.raw)
    return BodyReader(
        body,
        what,
        length,
        raw=http_client_response(body),
        socket_owner=body,
        on_close=finish,
        length_known=answer.headers.get("Content-Length") is not None,
        translate=translate,
    )


def checked_range_body(
    answer: Response,
    what: str,
    start: int,
    end: int,
    size: int,
    *,
    translate: Callable[[Exception, str], Exception] = transport_error,
) -> BodyReader:
    """The reader of the answer to a GET of bytes ``[start, end)`` of a ``size``-byte object,
    once :func:`check_range_answer` passed it (refused: the answer is discarded)."""
    try:
        check_range_answer(
            what, start, end, size, answer.status, answer.headers.get("Content-Range"),
            answer.headers.get("Content-Length"),
        )  # fmt: skip
    except SourceChangedError:
        answer.discard()
        raise
    return range_body_reader(answer, what, end - start, translate=translate)
