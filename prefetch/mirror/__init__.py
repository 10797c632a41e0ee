"""``prefetch mirror``: copy a Hub commit (or a mirror) into an S3 mirror prefix.

``upload`` holds the S3 write calls, ``stream`` the part streamer (source ranges through pooled
buffers into checked S3 objects), ``run`` the order of writes of the mirror format
(:mod:`prefetch.mirror_format`): blobs, then a commit's metadata, then its ref.
"""

from __future__ import annotations

from prefetch.mirror.run import MirrorResult, mirror_hub, mirror_s3
from prefetch.mirror.stream import MirrorConfig
from prefetch.mirror.upload import S3Prefix

__all__ = ["MirrorConfig", "MirrorResult", "S3Prefix", "mirror_hub", "mirror_s3"]
