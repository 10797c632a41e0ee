"""Issue 29: memory bounds, measured as peak RSS in a subprocess. Item 5: the tar padding after
the end-of-archive blocks is hashed in bounded buffers (read whole, 384 MiB of padding peaked at
802 MB RSS). Item 9: a credential helper's answer is bounded while it is read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

MiB = 1 << 20

_PADDED_UNPACK = textwrap.dedent(
    """
    import hashlib, io, json, resource, sys, tarfile
    from pathlib import Path
    from prefetch.sources.oci.archive import unpack_layer

    padding = int(sys.argv[2])
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        info = tarfile.TarInfo("config.json")
        info.size = 10_000
        archive.addfile(info, io.BytesIO(b"x" * 10_000))
    head = out.getvalue()
    zeros = bytes(1 << 20)
    hasher = hashlib.sha256(head)
    for _ in range(padding // len(zeros)):
        hasher.update(zeros)

    class Body:  # the blob as a registry streams it: the archive, then its padding
        def __init__(self):
            self.head, self.left = head, padding
        def read(self, n=-1):
            if self.head:
                piece, self.head = self.head[:n], self.head[n:]
                return piece
            take = min(n if n >= 0 else self.left, self.left, len(zeros))
            self.left -= take
            return zeros[:take]

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    members = unpack_layer(
        Body(), kind="tar", size=len(head) + padding, digest_hex=hasher.hexdigest(),
        staging=Path(sys.argv[1]), what="layer", max_unpacked=1 << 30,
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"members": [m.path for m in members], "before": before, "peak": peak}))
    """
)


def test_tar_padding_is_hashed_in_bounded_buffers(tmp_path: Path) -> None:
    padding = 384 * MiB
    done = subprocess.run(
        [sys.executable, "-c", _PADDED_UNPACK, str(tmp_path), str(padding)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    seen = json.loads(done.stdout)
    assert seen["members"] == ["config.json"]
    grew_kib = seen["peak"] - seen["before"]  # ru_maxrss is in KiB on Linux
    assert grew_kib < 64 * 1024, f"unpacking grew the peak RSS by {grew_kib} KiB"


_HELPER_CALL = textwrap.dedent(
    """
    import json, resource
    from prefetch.support.errors import SourceError
    from prefetch.sources.oci.auth import helper_credentials

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        helper_credentials("big", "registry.example")
        error = None
    except SourceError as exc:
        error = str(exc)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"error": error, "before": before, "peak": peak}))
    """
)


def test_a_credential_helper_answer_is_bounded_while_it_is_read(tmp_path: Path) -> None:
    """Item 9: a helper printing 200 MiB is refused after 1 MiB, not read whole (429 MB)."""
    helper = tmp_path / "bin" / "docker-credential-big"
    helper.parent.mkdir()
    helper.write_text("#!/bin/sh\nhead -c 209715200 /dev/zero\n")
    helper.chmod(0o755)
    env = {**os.environ, "PATH": f"{helper.parent}:{os.environ['PATH']}"}
    done = subprocess.run(
        [sys.executable, "-c", _HELPER_CALL],
        capture_output=True, text=True, timeout=120, check=True, env=env,
    )  # fmt: skip
    seen = json.loads(done.stdout)
    grew_kib = seen["peak"] - seen["before"]
    assert grew_kib < 64 * 1024, f"reading the helper grew the peak RSS by {grew_kib} KiB"
    assert seen["error"] is not None and "more than 1048576 bytes" in seen["error"]
