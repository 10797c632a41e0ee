#!/usr/bin/env python3
"""Copy bootstrap/user-data.mime into the EC2NodeClass's spec.userData, byte for byte.

    python deploy/karpenter/sync-user-data.py           # rewrite ec2nodeclass.yaml
    python deploy/karpenter/sync-user-data.py --check   # exit 1 when it is out of date

``userData`` must be the last key of ec2nodeclass.yaml, written as a block scalar
(``userData: |``): everything after that line is replaced. Comments above it are kept.
Regenerate the MIME file first with bootstrap/render-user-data.sh.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
NODECLASS = HERE / "ec2nodeclass.yaml"
USER_DATA = HERE.parent.parent / "bootstrap" / "user-data.mime"
KEY = "  userData: |"
INDENT = "    "


def block_scalar(text: str) -> str:
    """``text`` as the header indicator and body of a YAML literal block under ``spec``."""
    stripped = text.rstrip("\n")
    trailing = len(text) - len(stripped)
    # clip keeps exactly one final newline, strip none, keep all of them.
    indicator = {0: "|-", 1: "|"}.get(trailing, "|+")
    lines = stripped.split("\n") + [""] * (trailing - 1 if trailing > 1 else 0)
    body = "".join(f"{INDENT}{line}\n" if line else "\n" for line in lines)
    return f"{indicator}\n{body}"


def render(manifest: str, user_data: str) -> str:
    head, sep, _ = manifest.partition("\n" + KEY)
    if not sep:
        sys.exit(f"{NODECLASS}: no line {KEY.strip()!r} (it must be the last key of spec)")
    return f"{head}\n{KEY[: -len('|')]}{block_scalar(user_data)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="only check, change nothing")
    args = parser.parse_args()
    if not USER_DATA.is_file():
        sys.exit(f"{USER_DATA} is missing: run bootstrap/render-user-data.sh first")
    user_data = USER_DATA.read_text(encoding="ascii")
    if any(c != "\n" and (ord(c) < 0x20 or ord(c) == 0x7F) for c in user_data):
        sys.exit(f"{USER_DATA}: control characters cannot go into a YAML literal block")
    current = NODECLASS.read_text(encoding="utf-8")
    wanted = render(current, user_data)
    embedded = yaml.safe_load(wanted)["spec"]["userData"]
    if embedded != user_data:
        sys.exit("internal error: the rendered userData does not round-trip through YAML")
    if args.check:
        if wanted != current:
            print(f"{NODECLASS} is out of date: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        NODECLASS.write_text(wanted, encoding="utf-8")
        print(f"updated {NODECLASS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
