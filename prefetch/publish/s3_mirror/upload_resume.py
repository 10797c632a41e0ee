"""Resuming a mirror's interrupted uploads: the multipart upload a killed mirror left for a key
is found again (ListMultipartUploads, ListParts) and continued with its parts whose size fits the
plan; every other upload of the key (older duplicates, another checksum or part size) is aborted.
A kept part is re-read from the source for hashing only and compared (:func:`same_bytes`) with
the part's stored CRC64NVME or, where ListParts states none (SeaweedFS), its MD5 ETag.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

from prefetch.publish.s3_mirror.upload import S3Prefix, UploadedPart, crc64nvme_b64

#: the streamer's logger (``<package>.stream``): these lines keep the logger they had there
log = logging.getLogger(__name__.rpartition(".")[0] + ".stream")


class UploadResumer:
    """Finds the multipart upload a killed mirror left for a key, to continue it (with the parts
    worth keeping), or creates one; every other upload of the key is aborted."""

    def __init__(self, dest: S3Prefix, count: Callable[..., None]) -> None:
        self._dest = dest
        self._count = count  # StreamStats.add: counts the uploads aborted

    def find(self, key: str, ranges: list[tuple[int, int]]) -> tuple[str, dict[int, UploadedPart]]:
        """The upload to continue for this key (with the parts worth keeping), or a new one;
        every other upload of the key is aborted."""
        candidates: list[tuple[int, str, dict[int, UploadedPart]]] = []
        abandon: list[str] = []
        for pending in self._dest.pending_uploads(key):  # oldest first
            fits = pending.checksum_algorithm in (None, "CRC64NVME") and pending.checksum_type in (
                None,
                "FULL_OBJECT",
            )
            parts = self._dest.uploaded_parts(key, pending.upload_id) if fits else []
            # an upload without parts saves nothing and may lack our checksum (SeaweedFS lists
            # no ChecksumAlgorithm): abandon it
            if fits and parts and all(_part_fits(ranges, p) for p in parts):
                kept = {p.number - 1: p for p in parts}
                candidates.append((sum(p.size for p in parts), pending.upload_id, kept))
            else:
                log.info("%s: aborting an upload of another checksum or part size", key)
                abandon.append(pending.upload_id)
        # the one holding the most bytes (the newest of equals) is continued
        candidates.sort(key=lambda c: c[0])
        chosen = candidates.pop() if candidates else None
        abandon += [upload_id for _, upload_id, _ in candidates]
        for upload_id in abandon:
            self._dest.abort_upload(key, upload_id)
            self._count(uploads_aborted=1)
        if chosen is None:
            return self._dest.create_upload(key), {}
        log.info("%s: resuming an upload holding %d bytes", key, chosen[0])
        return chosen[1], chosen[2]


def _part_fits(ranges: list[tuple[int, int]], part: UploadedPart) -> bool:
    """Does an uploaded part have the number and size of a part of this plan?"""
    if not 1 <= part.number <= len(ranges):
        return False
    start, end = ranges[part.number - 1]
    return part.size == end - start


def same_bytes(part: UploadedPart, data: memoryview, crc: int) -> bool:
    """Does an already uploaded part hold ``data``? By its stored CRC64NVME when ListParts
    states one, else by its ETag when that is the MD5 of the part (it is, unless SSE-KMS)."""
    if part.crc64nvme:
        return part.crc64nvme == crc64nvme_b64(crc)
    etag = part.etag.strip('"').lower()
    if len(etag) == 32:
        return hashlib.md5(data).hexdigest() == etag
    return False
