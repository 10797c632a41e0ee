"""``prefetch demo``: the whole path on one machine, against a real local S3 server."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import click

from prefetch.layout import PlainLayout
from prefetch.locals3 import SeaweedS3
from prefetch.modelgen import generate_model, upload_model
from prefetch.progress import TerminalProgress
from prefetch.sources import SourceSettings, open_source
from prefetch.spec import ModelSpec, parse_source_uri
from prefetch.sync import sync, verify_local
from prefetch.transfer import TransferConfig
from prefetch.units import format_bytes

BUCKET = "demo-models"
PREFIX = "llama-demo"


def run_demo(total_size: int, dest: str | None, *, as_json: bool = False) -> None:
    def say(text: str) -> None:
        click.echo(text, err=True)

    with tempfile.TemporaryDirectory(prefix="prefetch-demo-") as work:
        work_dir = Path(work)
        say(f"Generating a {format_bytes(total_size)} model in {work_dir / 'model'} ...")
        files = generate_model(work_dir / "model", total_size, shards=3, seed=7)
        say("Starting a local S3 server (SeaweedFS) on 127.0.0.1 ...")
        with SeaweedS3(data_dir=work_dir / "s3") as server:
            client = server.client()
            upload_model(client, BUCKET, PREFIX, files)
            uri = f"s3://{BUCKET}/{PREFIX}/"
            say(f"Uploaded {len(files)} files to {uri} at {server.endpoint} "
                "(shards multipart with CRC64NVME)")  # fmt: skip
            target = Path(dest).resolve() if dest else Path(tempfile.mkdtemp(prefix="prefetch-"))
            spec = ModelSpec(source=parse_source_uri(uri), name="llama-demo")
            layout = PlainLayout(target)
            reach = SourceSettings(s3_client=client)
            source = open_source(spec, reach, layout="plain").source
            result = sync(spec, source, layout, TransferConfig(),
                          progress=TerminalProgress(sys.stderr))  # fmt: skip
            report = verify_local(layout)
            again = sync(spec, open_source(spec, reach, layout="plain").source, layout,
                         TransferConfig())  # fmt: skip
    algorithms = ", ".join(f"{n} x {a}" for a, n in sorted(result.checksum_algorithms.items()))
    say(f"Pulled {result.files} files, {format_bytes(result.bytes_downloaded)} in "
        f"{result.seconds:.1f}s; verified: {algorithms}")  # fmt: skip
    say(f"prefetch verify: {len(report.checked)} files re-hashed, "
        f"{'all good' if report.ok else 'FAILURES'}")  # fmt: skip
    say(f"Second pull: {again.bytes_downloaded} bytes downloaded (up to date)")
    if as_json:
        click.echo(json.dumps(result.to_json(), sort_keys=True))
    else:
        click.echo(f"The model is in {target}")
    if not report.ok:
        sys.exit(1)
