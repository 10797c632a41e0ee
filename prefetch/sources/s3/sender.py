"""The requests of one S3 bucket: who sends each, and how it is retried and paced.

Addressing and signing: an object request goes on the transport seam through the bucket's
:class:`~prefetch.sources.s3.direct.S3Bucket` (addressing plus a signer: static keys signed
here, or botocore's signer taken from the listing it made), else through botocore's client
(:class:`~prefetch.sources.s3.sdk.BotocoreObjects`, answered in the same shape). Every
call waits its turn on the endpoint's :class:`~prefetch.pipeline.retry.AdaptiveRate`, is retried per
the :class:`~prefetch.pipeline.retry.RetryPolicy` and fails with the package's error
(:mod:`prefetch.sources.s3.errors`); a listing page or a metadata object is bounded as a whole
to ``metadata_timeout``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from prefetch.pipeline.deadline import SCOPE, Alarms, call_with_deadline
from prefetch.pipeline.retry import AdaptiveRate, RetryPolicy, call_with_retries
from prefetch.pipeline.spec import SourceURI
from prefetch.sources.http.transport import Response, transport_error
from prefetch.sources.s3.direct import S3Bucket, sends_as_signed
from prefetch.sources.s3.errors import answer_error, error_code_and_message, translate
from prefetch.sources.s3.factory import LazyS3Client, seam_pool
from prefetch.support.errors import (
    BucketNotFoundError,
    PrefetchError,
    SourceError,
    ThrottledError,
    TlsError,
)

if TYPE_CHECKING:  # imported where used: a pull with static keys never needs botocore's path
    from prefetch.sources.s3.sdk import BotocoreObjects, S3Client

T = TypeVar("T")

#: A listing page or a metadata object (sidecar, mirror refs and commits) must arrive within this
#: many seconds per attempt (as the Hub's metadata calls).
METADATA_TIMEOUT = 120.0


class S3Requests:
    """The bucket of ``uri`` as requests: sent on the seam or through botocore, paced,
    retried, their failures the package's errors."""

    def __init__(
        self,
        client: S3Client | LazyS3Client,
        uri: SourceURI,
        *,
        retry: RetryPolicy,
        pace: AdaptiveRate,
        ca_bundle: str | None = None,
    ) -> None:
        self._client = client
        self._uri = uri
        self._retry = retry
        #: Every request waits its turn here (see S3Source).
        self.pace = pace
        #: the CA bundle a flag or config key chose for a client that is not lazy (a lazy
        #: client's settings carry their own), see :func:`~prefetch.sources.s3.factory.seam_pool`
        self._ca_choice = ca_bundle
        #: Seconds one attempt at a listing page or a metadata object may take in all.
        self.metadata_timeout = METADATA_TIMEOUT
        self.alarms = Alarms(name="s3-alarms")
        #: The bucket on the transport seam (addressing + a signer), set up by the first
        #: listing; None until then, or when the seam cannot reproduce botocore's requests.
        self.bucket: S3Bucket | None = None
        #: Object requests through botocore's client (see ``objects_for``), made when needed.
        self._botocore: BotocoreObjects | None = None
        #: False: every request goes through botocore's client (for comparisons; see bench/).
        self.signed_requests = True

    def call(
        self, what: str, fn: Callable[..., T], *, bounded: bool = False, **kwargs: object
    ) -> T:
        """``fn(**kwargs)`` retried per the policy, its errors the package's; ``bounded``: each
        attempt as a whole within ``metadata_timeout`` (a listing page or metadata object
        trickled byte by byte resets the socket timeout at every byte)."""

        def attempt() -> T:
            ticket = self.pace.acquire(SCOPE.raise_if_aborted)
            try:
                result = fn(**kwargs)
            except TlsError as exc:
                self.paced(ticket, exc)
                raise transport_error(exc, what) from exc  # the seam's, named with what failed
            except PrefetchError as exc:  # already one of ours (e.g. a stalled small GET)
                self.paced(ticket, exc)
                raise
            except Exception as exc:
                SCOPE.raise_if_aborted()  # a stop interrupted it: not a failure to retry
                error = translate(exc, what)
                self.paced(ticket, error)
                raise error from exc
            self.pace.succeeded(ticket)
            return result

        def once() -> T:
            if not bounded:
                return attempt()
            return call_with_deadline(attempt, self.metadata_timeout, what=what, alarms=self.alarms)

        return call_with_retries(once, self._retry, what=what)

    def paced(self, ticket: float, error: Exception) -> None:
        """Tell the pace how the request of ``ticket`` ended (it failed with ``error``)."""
        if isinstance(error, ThrottledError):
            self.pace.throttled(ticket)
        else:
            self.pace.succeeded(ticket)

    def objects_for(self, key: str) -> S3Bucket | BotocoreObjects:
        """Who sends requests about ``key``: the seam's bucket once a listing set it up, else
        botocore's client (and for a key with a dot segment: see ``sends_as_signed``)."""
        bucket = self.bucket
        if bucket is None or not sends_as_signed(key):
            if self._botocore is None:
                from prefetch.sources.s3.sdk import BotocoreObjects

                self._botocore = BotocoreObjects(self._client, self._uri.location)
            return self._botocore
        return bucket

    def answer(
        self, method: str, key: str, what: str, *, headers: dict[str, str], query: str = ""
    ) -> Response:
        """Send one object request; an error answer or a transport failure raises the
        package's error (the same whoever sent it: the seam or botocore's client)."""
        try:
            answer = self.objects_for(key).send(method, key, headers=headers, query=query)
        except Exception as exc:
            raise translate(exc, what) from exc
        if answer.status >= 300:
            raise answer_error(what, answer, has_body=method != "HEAD")
        return answer

    def list_page(self, what: str, **kwargs: str | int) -> Mapping[str, object]:
        """One ListObjectsV2 page of the bucket (botocore's arguments but Bucket, and answer
        shape): on the seam with static keys (see LazyS3Client), else through botocore, whose
        signed request then sets up the seam's bucket with botocore's signer."""
        bucket = self._uri.location
        direct = self._direct_client()
        lister = direct.direct_bucket(bucket) if direct is not None else None
        if lister is not None:
            named = functools.partial(lister.list_objects_v2, what=what)
            page: Mapping[str, object] = self.call(
                what, named, bounded=True, Bucket=bucket, **kwargs
            )
            if self.signed_requests and self.bucket is None:
                self.bucket = lister  # its object requests need no botocore either
            return page
        from prefetch.sources.s3.sdk import botocore_signed_endpoint, capture_listing_requests

        with capture_listing_requests(self._client) as sent:
            page = self.call(
                what, self._client.list_objects_v2, bounded=True, Bucket=bucket, **kwargs
            )
        if self.signed_requests and self.bucket is None:
            found = botocore_signed_endpoint(sent)
            if found is not None:
                endpoint, signer = found
                http, timeout = seam_pool(self._client, self._ca_choice)
                self.bucket = S3Bucket(
                    bucket, base_url=lambda _region: endpoint.base_url, region=endpoint.region,
                    signer=signer, http=http, timeout=timeout,
                    on_error=lambda what, answer: answer_error(what, answer, has_body=True),
                )  # fmt: skip
        return page

    def ensure_signed_path(self) -> None:
        """Set up the seam's bucket for a reader that lists nothing (the mirror source reads
        its blobs by key): a listing of at most one key under the prefix tells where the bucket
        is and how to sign, as the model's listing would."""
        if self.signed_requests and self.bucket is None:
            where = f"s3://{self._uri.location}/{self._uri.path}"
            self.list_page(f"listing {where}", Prefix=self._uri.path, MaxKeys=1)

    def _direct_client(self) -> LazyS3Client | None:
        """The client when it may list without botocore (see LazyS3Client), else None."""
        client = self._client
        return client if self.signed_requests and isinstance(client, LazyS3Client) else None

    def read_object(self, key: str, what: str, *, limit: int) -> bytes | None:
        """The whole body of the object ``key`` of the bucket (None: there is no such object),
        refused past ``limit`` bytes; retried like every S3 call. For metadata (a sidecar, a
        mirror's refs and commits): on the seam once it is set up, so a pull with static keys
        reads them without botocore too."""
        objects = self.objects_for(key)

        def read() -> bytes | None:
            answer = objects.send("GET", key, headers={})
            if answer.status >= 300:
                if answer.status == 404:
                    code, _ = error_code_and_message(answer, has_body=True)
                    if code != "NoSuchBucket":
                        return None
                    raise BucketNotFoundError(f"{what}: bucket does not exist")
                raise answer_error(what, answer, has_body=True)
            data = answer.read(limit + 1)
            if len(data) > limit:
                answer.discard()
                raise SourceError(f"{what}: larger than {limit} bytes")
            answer.release()
            return data

        found: bytes | None = self.call(what, read, bounded=True)
        return found
