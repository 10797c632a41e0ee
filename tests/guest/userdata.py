"""Read the generated EC2 user data (bootstrap/user-data.mime) the way a node would.

``render()`` runs the generator (``bootstrap/render-user-data.sh --stdout``); ``parts()`` splits a
MIME document into (content type, payload) pairs; ``embedded_script()`` decodes the script that the
shell part installs, so tests can compare it byte for byte with bootstrap/setup-local-nvme.sh.
A later check of an EC2NodeClass's ``spec.userData`` can compare it with ``render()`` too.
"""

from __future__ import annotations

import base64
import email
import email.policy
import gzip
import re
import subprocess
from pathlib import Path

__all__ = [
    "BOOTSTRAP",
    "INSTALLED_SCRIPT",
    "INSTALLED_UNIT",
    "embedded_script",
    "parts",
    "render",
    "shell_part",
]

BOOTSTRAP = Path(__file__).resolve().parents[2] / "bootstrap"
#: Where the shell part installs the script and the unit on a node.
INSTALLED_SCRIPT = "/usr/local/sbin/setup-local-nvme.sh"
INSTALLED_UNIT = "/etc/systemd/system/setup-local-nvme.service"


def render() -> bytes:
    """What the generator prints now (the committed user-data.mime must be equal to it)."""
    result = subprocess.run(
        ["bash", str(BOOTSTRAP / "render-user-data.sh"), "--stdout"],
        capture_output=True,
        check=True,
    )
    return result.stdout


def parts(mime: bytes) -> list[tuple[str, bytes]]:
    """The (content type, payload) of each part of a multipart document, in order."""
    message = email.message_from_bytes(mime, policy=email.policy.compat32)
    if not message.is_multipart():
        raise ValueError("user data is not a MIME multipart document")
    return [
        (part.get_content_type(), part.get_payload(decode=True))
        for part in message.walk()
        if not part.is_multipart()
    ]


def shell_part(mime: bytes) -> bytes:
    shells = [payload for kind, payload in parts(mime) if kind == "text/x-shellscript"]
    if len(shells) != 1:
        raise ValueError(f"expected one text/x-shellscript part, found {len(shells)}")
    return shells[0]


def embedded_script(shell: bytes) -> bytes:
    """Decode the script the shell part writes (a gzip, base64 here-document)."""
    match = re.search(
        rb"^base64 -d << '(?P<end>\w+)' \| gunzip > (?P<dest>\S+)\n(?P<body>.*?)^(?P=end)$",
        shell,
        re.M | re.S,
    )
    if match is None:
        raise ValueError("no base64 here-document in the shell part")
    return gzip.decompress(base64.b64decode(match.group("body")))
