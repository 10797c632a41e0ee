"""The mirror's S3 destination: the few write calls it makes, each retried and translated.

The boto3 client is passed in (built by :func:`prefetch.sources.s3.source.make_s3_client`, so
boto3's own retries are off and retrying lives in :mod:`prefetch.pipeline.retry`); this module never
imports an SDK. Every object is written with a CRC64NVME checksum the caller computed from the bytes
it streamed: a one-request object as PutObject with ``ChecksumCRC64NVME``, a larger one as a
multipart upload of type FULL_OBJECT whose parts carry their own CRC and whose completion
carries the whole object's, so S3 itself refuses an object whose stored bytes are not the ones
we checked (BadDigest).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from prefetch.pipeline import verify
from prefetch.pipeline.retry import RetryPolicy, call_with_retries
from prefetch.sources.s3.listing import ListingPages, listed_objects
from prefetch.sources.s3.source import translate
from prefetch.support.errors import BucketNotFoundError, PrefetchError, SourceError

log = logging.getLogger(__name__)
T = TypeVar("T")
#: S3's limits on multipart uploads.
MIN_PART_SIZE = 5 * 1024 * 1024
MAX_PART_SIZE = 5 * 1024 * 1024 * 1024
MAX_PARTS = 10_000


def crc64nvme_b64(value: int) -> str:
    """A CRC64NVME as S3 states it (base64 of the 8 big-endian bytes)."""
    return base64.b64encode(value.to_bytes(8, "big")).decode()


def crc64nvme_of(data: bytes | memoryview) -> int:
    hasher = verify.new_hasher("crc64nvme")
    hasher.update(data)
    return int.from_bytes(hasher.digest(), "big")


def make_writer_client(
    make: Callable[..., Any], endpoint_url: str | None, **kwargs: object
) -> Any:  # boto3's client: untyped
    """The destination's client (``make`` is :func:`prefetch.sources.s3.source.make_s3_client`),
    sending bodies unsigned over HTTPS: each one carries a CRC64NVME in a signed header that
    S3 checks, and TLS keeps it intact on the way, so SHA256-signing every part too (which
    botocore does when the caller states the checksum) would hash each byte once more for
    nothing. Over plain HTTP the payload stays signed, as botocore would have it."""
    if endpoint_url is not None and not endpoint_url.lower().startswith("https://"):
        return make(endpoint_url=endpoint_url, **kwargs)
    client = make(endpoint_url=endpoint_url, sign_payloads=False, **kwargs)
    if str(client.meta.endpoint_url).lower().startswith("https://"):
        return client
    # no endpoint given, but the AWS config named a plain-HTTP one
    return make(endpoint_url=endpoint_url, **kwargs)


@dataclass(frozen=True)
class ListedObject:
    """An object under the prefix: its key relative to the prefix, size and ETag."""

    path: str
    key: str
    size: int
    etag: str


@dataclass(frozen=True)
class StoredObject:
    """What a HEAD says about an object: its size, and its whole-object CRC64NVME if S3 keeps
    one (None for an object uploaded without it, or with a COMPOSITE checksum)."""

    size: int
    crc64nvme: str | None


@dataclass(frozen=True)
class PendingUpload:
    """A multipart upload in progress (ListMultipartUploads)."""

    key: str
    upload_id: str
    initiated: datetime | None
    #: what the upload was created with, when the server says (SeaweedFS does not)
    checksum_algorithm: str | None
    checksum_type: str | None


@dataclass(frozen=True)
class UploadedPart:
    """A part already uploaded (ListParts): its number, size, ETag and CRC64NVME when listed."""

    number: int
    size: int
    etag: str
    crc64nvme: str | None


class S3Prefix:
    """A bucket and key prefix: where a mirror writes (and, for an s3:// source, reads the
    metadata of the mirror it copies)."""

    def __init__(
        self, client: Any, bucket: str, prefix: str, *, retry: RetryPolicy | None = None
    ) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix
        self._retry = retry or RetryPolicy()

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}"

    def _call(self, what: str, fn: Callable[..., T], **kwargs: object) -> T:
        result = self._call_or_missing(what, fn, **kwargs)
        if result is None:
            raise SourceError(f"{what}: not found (404)")
        return result

    def _call_or_missing(self, what: str, fn: Callable[..., T], **kwargs: object) -> T | None:
        """``fn(Bucket=..., **kwargs)`` retried; None when S3 answers 404 for the key or upload
        (a missing bucket is an error: :meth:`check_bucket` runs first)."""

        def once() -> T | None:
            try:
                return fn(Bucket=self.bucket, **kwargs)
            except PrefetchError:
                raise
            except Exception as exc:
                if _missing_key(exc):
                    return None
                raise translate(exc, what) from exc

        return call_with_retries(once, self._retry, what=what)

    # -- whole objects -------------------------------------------------------------------------

    def check_bucket(self) -> None:
        """Fail early, in one clear line, when the bucket is missing or not ours to list."""
        what = f"listing {self.url(self.prefix)}"
        if (
            self._call_or_missing(what, self.client.list_objects_v2, Prefix=self.prefix, MaxKeys=1)
            is None
        ):
            raise BucketNotFoundError(f"{self.url()}: bucket does not exist")

    def head(self, key: str) -> StoredObject | None:
        """The object at ``key``, or None when there is none."""
        head = self._call_or_missing(
            f"HEAD {self.url(key)}", self.client.head_object, Key=key, ChecksumMode="ENABLED"
        )
        if head is None:
            return None
        full = head.get("ChecksumType") in (None, "FULL_OBJECT")
        crc = head.get("ChecksumCRC64NVME") if full else None
        return StoredObject(int(head["ContentLength"]), str(crc) if crc else None)

    def list_objects(self) -> list[ListedObject]:
        """Every object under the prefix (folder markers left out), in key order."""
        found: list[ListedObject] = []
        token: dict[str, str] = {}
        pages = ListingPages(self.url(self.prefix))
        while True:
            page = self._call(
                f"listing {self.url(self.prefix)}",
                self.client.list_objects_v2,
                Prefix=self.prefix,
                **token,
            )
            for obj in listed_objects(page, self.url(self.prefix)):
                key = str(obj["Key"])
                rel = key[len(self.prefix) :]
                if rel and not rel.endswith("/"):
                    etag = str(obj.get("ETag", "")).strip('"')
                    found.append(ListedObject(rel, key, int(obj["Size"]), etag))
            next_token = pages.next_token(page)
            if next_token is None:
                return sorted(found, key=lambda o: o.key)
            token = {"ContinuationToken": next_token}

    def put_small(self, key: str, body: bytes) -> None:
        """PutObject of a small body (metadata, a ref) with its CRC64NVME."""
        self.put(key, body, crc64nvme_b64(crc64nvme_of(body)))

    def get_bytes(self, key: str) -> bytes | None:
        """A small object's body (a ref, a snapshot's metadata), or None when there is none."""
        what = f"GET {self.url(key)}"

        def get(**kwargs: object) -> bytes:
            return bytes(self.client.get_object(**kwargs)["Body"].read())

        return self._call_or_missing(what, get, Key=key)

    def put(self, key: str, body: bytes | memoryview, crc64nvme: str) -> str:
        """PutObject with its CRC64NVME (base64; S3 refuses the object if the bytes do not
        match it); returns that checksum."""
        value = crc64nvme
        self._call(
            f"PUT {self.url(key)}",
            _with_body(self.client.put_object, body),
            Key=key,
            ChecksumCRC64NVME=value,
        )
        return value

    # -- multipart -----------------------------------------------------------------------------

    def create_upload(self, key: str) -> str:
        resp = self._call(
            f"starting an upload of {self.url(key)}",
            self.client.create_multipart_upload,
            Key=key,
            ChecksumAlgorithm="CRC64NVME",
            ChecksumType="FULL_OBJECT",
        )
        return str(resp["UploadId"])

    def upload_part(
        self, key: str, upload_id: str, number: int, body: memoryview, crc: int
    ) -> UploadedPart:
        value = crc64nvme_b64(crc)
        resp = self._call(
            f"uploading part {number} of {self.url(key)}",
            _with_body(self.client.upload_part, body),
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            ChecksumCRC64NVME=value,
        )
        return UploadedPart(number, len(body), str(resp["ETag"]), value)

    def complete_upload(
        self, key: str, upload_id: str, parts: list[UploadedPart], crc64nvme: str
    ) -> str | None:
        """Complete with the whole object's CRC64NVME (base64; S3 checks it against the
        parts'); returns the CRC64NVME S3 says the object has (None: it kept none, as for an
        upload created without the checksum algorithm)."""
        value = crc64nvme
        listed = [
            {"PartNumber": p.number, "ETag": p.etag}
            | ({"ChecksumCRC64NVME": p.crc64nvme} if p.crc64nvme else {})
            for p in parts
        ]
        resp = self._call(
            f"completing the upload of {self.url(key)}",
            self.client.complete_multipart_upload,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": listed},
            ChecksumCRC64NVME=value,
            ChecksumType="FULL_OBJECT",
        )
        stated = resp.get("ChecksumCRC64NVME")
        return str(stated) if stated else None

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort, logging (not raising) a failure: aborting is cleanup, and a failed abort must
        not hide the error that made us abort."""
        try:
            self._call_or_missing(
                f"aborting the upload of {self.url(key)}",
                self.client.abort_multipart_upload,
                Key=key,
                UploadId=upload_id,
            )
        except SourceError as exc:
            log.warning("could not abort upload %s of %s: %s", upload_id, key, exc)

    def pending_uploads(self, key: str) -> list[PendingUpload]:
        """The multipart uploads in progress for exactly ``key``, oldest first."""
        return [u for u in self.uploads_under(key) if u.key == key]

    def uploads_under(self, prefix: str) -> list[PendingUpload]:
        """The multipart uploads in progress for keys starting with ``prefix``, oldest first."""
        found: list[PendingUpload] = []
        marker: dict[str, str] = {}
        while True:
            page = self._call(
                f"listing uploads under {self.url(prefix)}",
                self.client.list_multipart_uploads,
                Prefix=prefix,
                **marker,
            )
            for u in page.get("Uploads", []):
                if str(u.get("Key", "")).startswith(prefix):
                    found.append(
                        PendingUpload(
                            str(u["Key"]),
                            str(u["UploadId"]),
                            u.get("Initiated"),
                            u.get("ChecksumAlgorithm"),
                            u.get("ChecksumType"),
                        )
                    )
            if not page.get("IsTruncated"):
                break
            marker = {
                "KeyMarker": str(page.get("NextKeyMarker", "")),
                "UploadIdMarker": str(page.get("NextUploadIdMarker", "")),
            }
        found.sort(key=lambda u: (u.initiated is not None, u.initiated or 0))
        return found

    def uploaded_parts(self, key: str, upload_id: str) -> list[UploadedPart]:
        parts: list[UploadedPart] = []
        marker: dict[str, int] = {}
        while True:
            page = self._call(
                f"listing the parts of {self.url(key)}",
                self.client.list_parts,
                Key=key,
                UploadId=upload_id,
                **marker,
            )
            for p in page.get("Parts", []):
                crc = p.get("ChecksumCRC64NVME")
                parts.append(
                    UploadedPart(
                        int(p["PartNumber"]),
                        int(p["Size"]),
                        str(p["ETag"]),
                        str(crc) if crc else None,
                    )
                )
            if not page.get("IsTruncated"):
                break
            marker = {"PartNumberMarker": int(page["NextPartNumberMarker"])}
        return parts


def _missing_key(exc: Exception) -> bool:
    """A botocore error answer saying the key or upload does not exist (404, not NoSuchBucket).
    Read from the answer the error carries, so this module needs no botocore import."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return False
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code != "NoSuchBucket" and (status == 404 or code in ("NoSuchKey", "NoSuchUpload"))


class _ViewBody:
    """A read-only file over a memoryview, so botocore streams a part from the pooled buffer
    (it seeks back to resend on its own retries and to sign) instead of us copying it: ``read``
    hands out slices of the buffer itself (the HTTP connection only sends them; a part is
    read in 16 KiB blocks, so copying each would cost a copy of every byte uploaded), and
    ``readinto`` fills the signer's buffer directly when the payload is signed."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def read(self, n: int = -1) -> memoryview:
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        data = self._view[self._pos : end]
        self._pos = end
        return data

    def readinto(self, into: memoryview | bytearray) -> int:
        data = self.read(len(into))
        into[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._view)


def _with_body(call: Callable[..., T], data: bytes | memoryview) -> Callable[..., T]:
    """``call`` with ``Body=`` a fresh reader of ``data`` on every attempt (a retry after a
    failure mid-send must start from the first byte, not where the last attempt stopped)."""

    def send(**kwargs: object) -> T:
        return call(Body=data if isinstance(data, bytes) else _ViewBody(data), **kwargs)

    return send
