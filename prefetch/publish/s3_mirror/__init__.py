"""``prefetch mirror``: copy a Hub commit (or a mirror) into an S3 mirror prefix.

``upload`` holds the S3 write calls, ``stream`` the part streamer (source ranges through pooled
buffers into checked S3 objects), ``run`` the order of writes of the mirror format
(:mod:`prefetch.sources.s3_mirror.format`): blobs, then a commit's metadata, then its ref.
"""

from __future__ import annotations

from prefetch.publish.s3_mirror.run import MirrorResult, mirror_hub, mirror_s3
from prefetch.publish.s3_mirror.stream import MirrorConfig
from prefetch.publish.s3_mirror.upload import S3Prefix

__all__ = ["MirrorConfig", "MirrorResult", "S3Prefix", "mirror_hub", "mirror_s3"]
