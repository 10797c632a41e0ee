"""S3 source: list, describe (HEAD with checksums) and ranged GETs pinned to the ETag.

S3 is addressing plus a signer, on the one transport seam (:mod:`prefetch.sources.http.transport`):
every object request (HEAD, whole-object GET, ranged GET, part-size HEAD, metadata reads) is built
by an :class:`~prefetch.sources.s3.direct.S3Bucket` and signed by one of two signers: static keys
(SigV4 here, :mod:`prefetch.sources.s3.direct`: no botocore import, no client) or botocore's
credential chain (its public ``S3SigV4Auth``, :mod:`prefetch.sources.s3.sdk`), whose
addressing comes from the listing botocore made. What stays on botocore's client: the listing
when the keys are not static, keys with "." / ".." segments and what the seam cannot sign (see
sdk), through :class:`~prefetch.sources.s3.sdk.BotocoreObjects`, answered in the
same shape. boto3's retries are off (:func:`make_s3_client`): retrying lives in
prefetch.pipeline.retry.

The source is the sum of pieces with one job each: the client and the seam's pool for it
(:mod:`~prefetch.sources.s3.factory`), the requests of the bucket, addressed, signed, paced and
retried (:mod:`~prefetch.sources.s3.sender`), the listing (:mod:`~prefetch.sources.s3.lister`),
describe (:mod:`~prefetch.sources.s3.describe`) and the errors (:mod:`~prefetch.sources.s3.errors`);
the ranged read, one call per chunk, is here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from prefetch.pipeline.deadline import SCOPE
from prefetch.pipeline.retry import AdaptiveRate, RetryPolicy
from prefetch.pipeline.snapshot import RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, SourceURI
from prefetch.sources.http.transport import BodyReader, checked_range_body
from prefetch.sources.s3.describe import S3Describer, if_match
from prefetch.sources.s3.errors import read_failure
from prefetch.sources.s3.factory import LazyS3Client
from prefetch.sources.s3.lister import S3Lister
from prefetch.sources.s3.sender import S3Requests
from prefetch.support.errors import PrefetchError, SourceChangedError

if TYPE_CHECKING:  # imported where used: a pull with static keys never needs botocore's path
    from prefetch.sources.s3.direct import S3Bucket
    from prefetch.sources.s3.sdk import BotocoreObjects, S3Client


class S3Source:
    """Objects under ``s3://bucket/prefix``; a file's path is its key relative to the prefix."""

    def __init__(
        self,
        client: S3Client | LazyS3Client,
        uri: SourceURI,
        *,
        retry: RetryPolicy | None = None,
        pace: AdaptiveRate | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        if uri.scheme != "s3":
            raise ValueError(f"not an S3 URI: {uri}")
        self._uri = uri
        #: Every request waits its turn here: the one given (the agent's, per endpoint), else
        #: the lazy client's (shared by its other sources), else this source's own.
        if pace is None:
            pace = client.pace if isinstance(client, LazyS3Client) else AdaptiveRate()
        self._pace = pace
        #: The bucket's requests (addressing, signing, pace, retries); ``ca_bundle``: the CA
        #: bundle a flag or config key chose for a client that is not lazy.
        self._requests = S3Requests(
            client, uri, retry=retry or RetryPolicy(), pace=pace, ca_bundle=ca_bundle
        )
        self._lister = S3Lister(self._requests, uri)
        self._describer = S3Describer(self._requests, uri)

    @property
    def pace(self) -> AdaptiveRate:
        """The request rate every request of this source waits its turn on."""
        return self._pace

    @property
    def metadata_timeout(self) -> float:
        """Seconds one attempt at a listing page or a metadata object may take in all."""
        return self._requests.metadata_timeout

    @metadata_timeout.setter
    def metadata_timeout(self, seconds: float) -> None:
        self._requests.metadata_timeout = seconds

    @property
    def small_get_limit(self) -> float:
        """Seconds a whole-object GET of a small object (see SMALL_OBJECT) may take."""
        return self._describer.small_get_limit

    @small_get_limit.setter
    def small_get_limit(self, seconds: float) -> None:
        self._describer.small_get_limit = seconds

    @property
    def signed_requests(self) -> bool:
        """False: every request goes through botocore's client (for comparisons; see bench/)."""
        return self._requests.signed_requests

    @signed_requests.setter
    def signed_requests(self, signed: bool) -> None:
        self._requests.signed_requests = signed

    def objects_for(self, key: str) -> S3Bucket | BotocoreObjects:
        """Who sends requests about ``key`` (see :meth:`S3Requests.objects_for`)."""
        return self._requests.objects_for(key)

    def list_page(self, what: str, **kwargs: str | int) -> Mapping[str, object]:
        """One ListObjectsV2 page of the bucket (see :meth:`S3Requests.list_page`)."""
        return self._requests.list_page(what, **kwargs)

    def ensure_signed_path(self) -> None:
        """Set up the seam's bucket for a reader that lists nothing (the mirror source reads
        its blobs by key): see :meth:`S3Requests.ensure_signed_path`."""
        self._requests.ensure_signed_path()

    def read_object(self, key: str, what: str, *, limit: int) -> bytes | None:
        """The whole body of the object ``key`` (None: there is no such object), refused past
        ``limit`` bytes: see :meth:`S3Requests.read_object`."""
        return self._requests.read_object(key, what, limit=limit)

    def resolve(self, spec: ModelSpec) -> Snapshot:
        return self._lister.resolve(spec)

    def describe(self, file: RemoteFile) -> RemoteFile:
        return self._describer.describe(file)

    def describe_whole(
        self, file: RemoteFile, *, within: float | None = None
    ) -> tuple[RemoteFile, bytes | None]:
        """(:class:`~prefetch.sources.base.DescribesWhole`) an object up to SMALL_OBJECT bytes
        described by one GET of the whole object, its bytes with it; others by a HEAD."""
        return self._describer.describe_whole(file, within=within)

    # -- read --------------------------------------------------------------------------------

    def open_range(self, file: RemoteFile, start: int, end: int) -> BodyReader:
        bucket, key = self._uri.location, file.locator
        what = f"s3://{bucket}/{key} bytes {start}-{end - 1}"
        headers = {"Range": f"bytes={start}-{end - 1}", **if_match(file.version)}
        ticket = self._pace.acquire(SCOPE.raise_if_aborted)
        try:
            answer = self._requests.answer("GET", key, what, headers=headers)
        except PrefetchError as exc:
            self._requests.paced(ticket, exc)
            raise
        self._pace.succeeded(ticket)
        etag = str(answer.headers.get("ETag") or "").strip('"')
        if file.version and etag and etag != file.version:
            answer.discard()
            raise SourceChangedError(f"{what}: the object changed during the download")
        return checked_range_body(answer, what, start, end, file.size, translate=read_failure)
