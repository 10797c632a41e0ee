"""Holding a compile cache key on S3 while it is published: the first write is a claim object
(``If-None-Match: *``: of two writers one wins), renewed while the push runs (``If-Match`` its
own ETag) so a push that dies blocks the key only until its lease ends, then taken over; the
last write is :data:`COMPLETE`, which a reader requires and no one overwrites. Also the
conditional PUT and HEAD every step of a push uses."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from prefetch.sources.s3.errors import translate
from prefetch.support.errors import CompileCacheError

#: Ours, at the top of a published key: the claim (the first write) and the completion marker
#: (the last). Neither is a vLLM file; both are small JSON.
CLAIM = ".prefetch-claim.json"
COMPLETE = ".prefetch-complete.json"
#: Why a push left a key alone that has its :data:`COMPLETE` marker.
PUBLISHED = "exists: another writer published this key"
#: The most of a claim object read (ours are a few hundred bytes).
CLAIM_LIMIT = 64 * 1024

# Its lines keep the logger name they have always had, so log queries keep matching.
log = logging.getLogger("prefetch.publish.compile_cache")

__all__ = [
    "CLAIM",
    "CLAIM_LIMIT",
    "COMPLETE",
    "PUBLISHED",
    "Claim",
    "Refused",
    "exists",
    "put",
    "put_new",
    "split_uri",
]


class Refused(NamedTuple):
    """Why a push leaves a key alone: published (``pending`` False), or held by another
    writer's live claim or taken over by another first (``pending``: look again later)."""

    reason: str
    pending: bool = False


def split_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://") or "/" not in uri[5:].strip("/"):
        raise CompileCacheError(f"{uri!r}: expected s3://bucket/prefix/<key>")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix.strip("/") + "/"


def _exists_error(exc: Exception) -> bool:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return False
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = response.get("Error", {}).get("Code")
    # 412: the object exists; 409: another conditional write to it is in progress
    return status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict")


def _status(exc: Exception) -> int | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def put(
    client: Any, bucket: str, key: str, body: Any, *, checksum: str = "", **condition: str
) -> str | None:
    """PUT under ``condition`` (``IfNoneMatch="*"``: only if nothing is there; ``IfMatch=etag``:
    only if that version is), with the body's SHA-256 (base64) when given, else one botocore
    computes: the new object's ETag, None when the condition does not hold."""
    sha256 = {"ChecksumSHA256": checksum} if checksum else {"ChecksumAlgorithm": "SHA256"}
    try:
        answer = client.put_object(Bucket=bucket, Key=key, Body=body, **sha256, **condition)
    except Exception as exc:
        if _exists_error(exc):
            return None
        raise translate(exc, f"s3://{bucket}/{key}") from exc
    return str(answer.get("ETag", ""))


def put_new(client: Any, bucket: str, key: str, body: Any) -> bool:
    """PUT only if nothing is there (``If-None-Match: *``): False when something is."""
    return put(client, bucket, key, body, IfNoneMatch="*") is not None


def exists(client: Any, bucket: str, key: str) -> bool:
    try:
        client.head_object(Bucket=bucket, Key=key)
    except Exception as exc:
        if _status(exc) == 404:
            return False
        raise translate(exc, f"s3://{bucket}/{key}") from exc
    return True


@dataclass(frozen=True)
class _Held:
    """A claim found on the key: its ETag (to replace exactly it) and when its lease ends."""

    etag: str
    expires_at: float


def _read_claim(client: Any, bucket: str, key: str, lease: float) -> _Held | None:
    """The claim at ``key`` (None: gone meanwhile). Its lease ends at the ``expires_at`` its
    writer put in it; a claim without one (an older push, or unreadable) at its upload time
    plus ``lease``."""
    try:
        answer = client.get_object(Bucket=bucket, Key=key)
        body = answer["Body"].read(CLAIM_LIMIT)
    except Exception as exc:
        if _status(exc) == 404:
            return None
        raise translate(exc, f"s3://{bucket}/{key}") from exc
    expires = answer["LastModified"].timestamp() + lease
    try:
        written = json.loads(body).get("expires_at")
    except (ValueError, AttributeError):
        written = None
    if isinstance(written, int | float) and not isinstance(written, bool):
        expires = float(written)
    return _Held(str(answer.get("ETag", "")), expires)


def _clear(client: Any, bucket: str, prefix: str) -> None:
    """Delete what a push that died left under ``prefix`` (all but the claim): this push now
    holds the key, and a reader must not get the dead push's files with the new ones."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    try:
        for page in pages:
            for obj in page.get("Contents", []):
                if obj["Key"] not in (prefix + CLAIM, prefix + COMPLETE):
                    client.delete_object(Bucket=bucket, Key=obj["Key"])
    except Exception as exc:
        raise translate(exc, f"s3://{bucket}/{prefix}") from exc


class Claim:
    """This push's hold on the key: a small JSON object with the time its lease ends, renewed
    (``If-Match`` its own ETag) while the push runs, so a push killed after its claim blocks the
    key only until the lease ends; the next writer then takes it over (``If-Match`` the expired
    claim's ETag: of two, one does). A key with :data:`COMPLETE` is never taken over."""

    def __init__(
        self, client: Any, bucket: str, prefix: str, fields: dict[str, Any],
        lease: float, clock: Callable[[], float],
    ) -> None:  # fmt: skip
        self._client, self._bucket, self._key = client, bucket, prefix + CLAIM
        self._prefix, self._fields, self._lease, self._clock = prefix, fields, lease, clock
        self._etag = ""
        self._renew_at = 0.0
        self.took_over = False
        self.lost = False

    def _body(self) -> bytes:
        now = self._clock()
        self._renew_at = now + self._lease / 2
        return json.dumps(
            {**self._fields, "claimed_at": now, "lease_seconds": self._lease,
             "expires_at": now + self._lease}
        ).encode()  # fmt: skip

    def take(self) -> Refused | None:
        """Claim the key: None when this push holds it, else why not (published, or held by a
        live claim)."""
        etag = put(self._client, self._bucket, self._key, self._body(), IfNoneMatch="*")
        if etag is None:
            if exists(self._client, self._bucket, self._prefix + COMPLETE):
                return Refused(PUBLISHED)
            held = _read_claim(self._client, self._bucket, self._key, self._lease)
            if held is not None and self._clock() < held.expires_at:
                until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(held.expires_at))
                return Refused(f"exists: another writer is publishing this key "
                               f"(its claim holds until {until})", pending=True)  # fmt: skip
            condition = {"IfMatch": held.etag} if held is not None else {"IfNoneMatch": "*"}
            etag = put(self._client, self._bucket, self._key, self._body(), **condition)
            if etag is None:
                why = "exists: another writer took this key over first"
                return Refused(why, pending=True)
            self.took_over = True
        self._etag = etag
        if exists(self._client, self._bucket, self._prefix + COMPLETE):
            # published although no claim was there (a claim deleted by hand): leave it
            self.release()
            return Refused(PUBLISHED)
        _clear(self._client, self._bucket, self._prefix)
        return None

    def renew(self, *, force: bool = False) -> None:
        """Extend the lease (past half of it, or ``force``); CompileCacheError when another
        writer took the key over (this push's lease ran out)."""
        if not force and self._clock() < self._renew_at:
            return
        etag = put(self._client, self._bucket, self._key, self._body(), IfMatch=self._etag)
        if etag is None:
            self.lost = True
            raise CompileCacheError(
                f"s3://{self._bucket}/{self._key}: another writer took this key over (this "
                "push's claim expired)",
                hint="a push must renew its claim within the lease; see --lease",
            )
        self._etag = etag

    def release(self) -> None:
        """Give the key up after a failed push (best effort: the lease ends anyway); not when
        another writer holds it now."""
        if self.lost:
            return
        try:
            self._client.delete_object(Bucket=self._bucket, Key=self._key)
        except Exception as exc:  # the claim then expires with its lease
            log.debug("s3://%s/%s: claim not released: %s", self._bucket, self._key, exc)
