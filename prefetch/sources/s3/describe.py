"""Describing an S3 object: its checksums from a HEAD (or a whole-object GET for a small one).

:class:`S3Describer` reads what S3 states of an object (the additional checksums, the ETag as
MD5 when it is one, a multipart ETag or composite checksum with the part layout it needs) and
checks it is still the listed object. :meth:`S3Describer.describe_whole` (the source's
:class:`~prefetch.sources.base.DescribesWhole`) fetches a small object (:data:`SMALL_OBJECT`)
whole instead of a HEAD (the GET answers the same checksum headers) and hands its bytes to the
caller: a small file costs one request, and the engine writes the bytes without a read.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from prefetch.pipeline.deadline import Watch
from prefetch.pipeline.snapshot import Checksum, RemoteFile
from prefetch.pipeline.spec import SourceURI
from prefetch.pipeline.verify import STRENGTH
from prefetch.sources.base import shutdown_socket_of
from prefetch.sources.http.transport import Response
from prefetch.sources.s3.sender import S3Requests
from prefetch.support.errors import SourceChangedError, SourceError, TransientSourceError

log = logging.getLogger("prefetch.sources.s3")  # the S3 source's log, as before the split

#: S3 additional checksums, strongest first, with the response field that carries each.
_ADDITIONAL = (
    ("sha256", "ChecksumSHA256"),
    ("sha1", "ChecksumSHA1"),
    ("crc64nvme", "ChecksumCRC64NVME"),
    ("crc32c", "ChecksumCRC32C"),
    ("crc32", "ChecksumCRC32"),
)

_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")

_MULTIPART_ETAG = re.compile(r"^[0-9a-f]{32}-(\d+)$")

#: botocore's response field name -> the header it comes from (what the S3 source reads).
HEADER_FIELDS = (
    ("ETag", "etag"),
    ("ContentLength", "content-length"),
    ("ContentRange", "content-range"),
    ("ChecksumSHA256", "x-amz-checksum-sha256"),
    ("ChecksumSHA1", "x-amz-checksum-sha1"),
    ("ChecksumCRC64NVME", "x-amz-checksum-crc64nvme"),
    ("ChecksumCRC32C", "x-amz-checksum-crc32c"),
    ("ChecksumCRC32", "x-amz-checksum-crc32"),
    ("ChecksumType", "x-amz-checksum-type"),
    ("ServerSideEncryption", "x-amz-server-side-encryption"),
    ("SSECustomerAlgorithm", "x-amz-server-side-encryption-customer-algorithm"),
)

#: Objects up to this size are described by one GET of the whole object (see the module's notes).
SMALL_OBJECT = 1024 * 1024
#: A small object's body must arrive within this many seconds (at least 17 KiB/s for 1 MiB).
SMALL_GET_LIMIT = 60.0


class S3Describer:
    """Describes the objects of the bucket of ``uri`` through ``requests``."""

    def __init__(self, requests: S3Requests, uri: SourceURI) -> None:
        self._requests = requests
        self._uri = uri
        #: Seconds a whole-object GET of a small object (see SMALL_OBJECT) may take.
        self.small_get_limit = SMALL_GET_LIMIT

    def describe_whole(
        self, file: RemoteFile, *, within: float | None = None
    ) -> tuple[RemoteFile, bytes | None]:
        """A small object (:data:`SMALL_OBJECT`, one part) described by one GET of the whole
        object, with its bytes; any other described by a HEAD (no bytes)."""
        if (
            0 < file.size <= SMALL_OBJECT
            and not file.described
            and not _MULTIPART_ETAG.match(file.version)
        ):
            return self._describe_by_get(file, within)
        return self.describe(file), None

    def describe(self, file: RemoteFile) -> RemoteFile:
        """``file`` with what a HEAD of the object states (its checksums, part layout)."""
        if file.described:
            return file
        bucket, key = self._uri.location, file.locator
        what = f"s3://{bucket}/{key}"
        head = self._requests.call(
            f"HEAD {what}", self._head, key=key, label=f"HEAD {what}",
            headers={"x-amz-checksum-mode": "ENABLED", **if_match(file.version)},
        )  # fmt: skip
        return self._described(file, head, what)

    def _head(
        self, *, key: str, label: str, headers: dict[str, str], query: str = ""
    ) -> dict[str, str]:
        """A HEAD, its headers under botocore's names (``label`` names it in errors)."""
        answer = self._requests.answer("HEAD", key, label, headers=headers, query=query)
        answer.release()
        return fields_of(answer)

    def _described(self, file: RemoteFile, head: dict[str, str], what: str) -> RemoteFile:
        """``file`` with the checksums a HEAD (or whole-object GET) response states."""
        bucket, key = self._uri.location, file.locator
        etag = str(head.get("ETag", "")).strip('"')
        size = int(head["ContentLength"])
        if (file.version and etag != file.version) or size != file.size:
            raise SourceChangedError(f"{what}: the object changed since it was listed")
        m = _MULTIPART_ETAG.match(etag)
        parts: tuple[int, ...] | None = None
        if m is not None and _part_layout_needed(head):
            parts = self._part_sizes(bucket, key, size, int(m.group(1)))
        composite_type = head.get("ChecksumType") == "COMPOSITE"
        found: list[Checksum] = []
        for algorithm, field_name in _ADDITIONAL:
            value = head.get(field_name)
            if not value:
                continue
            is_composite = composite_type or bool(re.search(r"-\d+$", value))
            if is_composite and parts is None:
                continue  # composite of a layout we do not know: cannot be checked
            found.append(
                Checksum(
                    algorithm,
                    value,
                    encoding="base64",
                    part_sizes=parts if is_composite else None,
                    origin="s3-checksum",
                )
            )
        encrypted_kms = str(head.get("ServerSideEncryption", "")).startswith("aws:kms") or bool(
            head.get("SSECustomerAlgorithm")
        )
        if not encrypted_kms and _MD5_ETAG.match(etag):
            found.append(Checksum("md5", etag, origin="etag"))
        elif not encrypted_kms and parts is not None:
            found.append(Checksum("md5", etag, part_sizes=parts, origin="multipart etag"))
        return file.with_(
            checksums=(*found, *file.checksums), described=True, version=etag or file.version
        )

    def _describe_by_get(
        self, file: RemoteFile, within: float | None = None
    ) -> tuple[RemoteFile, bytes]:
        bucket, key = self._uri.location, file.locator
        what = f"s3://{bucket}/{key}"

        def get() -> tuple[int, dict[str, str], bytes]:
            answer = self._requests.answer(
                "GET", key, f"GET {what}",
                headers={"x-amz-checksum-mode": "ENABLED", **if_match(file.version)},
            )  # fmt: skip
            data = self._read_small_body(answer, what, within)
            return answer.status, fields_of(answer), data

        status, resp, data = self._requests.call(f"GET {what}", get)
        if status != 200:
            raise SourceError(f"GET {what}: the server answered {status} to a whole-object GET")
        if len(data) != int(resp.get("ContentLength", -1)) or len(data) != file.size:
            raise TransientSourceError(
                f"GET {what}: got {len(data)} bytes of the object, the listing says {file.size}"
            )
        return self._described(file, resp, what), data

    def _read_small_body(self, answer: Response, what: str, within: float | None) -> bytes:
        """The whole body of a small object's GET (then the connection is released). A
        trickling server would hold this read for ever (each byte resets the socket's read
        timeout), and the engine's stall rule counts the bytes of ranged reads only: so the read
        is bounded by ``within`` (the engine's rule for a body of this size), else by
        ``small_get_limit``."""
        body = answer.raw
        watch = Watch(f"GET {what}")
        watch.attach(lambda: shutdown_socket_of(body))
        limit = self.small_get_limit if within is None else within
        too_slow = TransientSourceError(
            f"GET {what}: the body took longer than {limit:g}s (a stalled server; "
            "--min-rate, --stall-timeout)"
        )
        alarm = self._requests.alarms.schedule(limit, lambda: watch.abort(too_slow))
        clean = False
        try:
            data = bytes(body.read()) if body is not None else b""
            clean = True
            return data
        except Exception:
            watch.raise_if_aborted()
            raise
        finally:
            alarm.cancel()
            watch.close()  # from here no abort: the connection may go back to the pool
            if clean and not watch.aborted:
                answer.release()
            else:
                answer.discard()

    def _part_sizes(self, bucket: str, key: str, size: int, count: int) -> tuple[int, ...] | None:
        """Part layout of a multipart object: HEAD ?partNumber=1, assuming equal parts but the last;
        when the sizes do not add up, HEAD every part."""
        what = f"HEAD s3://{bucket}/{key} part"

        def part_size(n: int) -> int:
            h = self._requests.call(
                f"{what} {n}", self._head, key=key, label=f"{what} {n}", headers={},
                query=f"partNumber={n}",
            )  # fmt: skip
            return int(h["ContentLength"])

        try:
            first = part_size(1)
        except SourceError as exc:
            log.warning("cannot read the part layout of s3://%s/%s: %s", bucket, key, exc)
            return None
        last = size - first * (count - 1)
        if count == 1:
            return (size,)
        if 0 < last <= first:
            return (first,) * (count - 1) + (last,)
        sizes = tuple([first] + [part_size(n) for n in range(2, count + 1)])
        return sizes if sum(sizes) == size else None


def fields_of(answer: Response) -> dict[str, str]:
    """An answer's headers under botocore's names (``ETag``, ``ContentLength``, ``Checksum*``,
    ...): what the describe code reads. A ``ContentLength`` that is not a whole number is
    left out."""
    out: dict[str, str] = {}
    for name, header in HEADER_FIELDS:
        value = answer.headers.get(header)
        if value is not None:
            out[name] = value
    if "ContentLength" in out:
        try:
            int(out["ContentLength"])
        except ValueError:
            del out["ContentLength"]
    return out


def _part_layout_needed(head: Mapping[str, str]) -> bool:
    """Does checking this multipart object need its part sizes (a HEAD ?partNumber=1 more)?
    Only for a composite checksum, or for the multipart ETag when no full-object checksum
    stronger than MD5 is served: Verify checks the strongest served checksum, so with a
    FULL_OBJECT CRC64NVME (the usual upload today) the layout would go unused."""
    composite_type = head.get("ChecksumType") == "COMPOSITE"
    strong_full_object = False
    for algorithm, field_name in _ADDITIONAL:
        value = head.get(field_name)
        if not value:
            continue
        if composite_type or re.search(r"-\d+$", str(value)):
            return True
        strong_full_object |= STRENGTH.index(algorithm) < STRENGTH.index("md5")
    encrypted = str(head.get("ServerSideEncryption", "")).startswith("aws:kms") or bool(
        head.get("SSECustomerAlgorithm")
    )
    return not strong_full_object and not encrypted


def if_match(version: str) -> dict[str, str]:
    """The If-Match header pinning a request to the listed ETag (none when unknown)."""
    return {"If-Match": version} if version else {}
