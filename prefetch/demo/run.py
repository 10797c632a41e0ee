"""``prefetch demo``: the whole path on one machine, against a real local S3 server.

Everything it makes (the generated model, the server's data, the pulled copy unless ``--dest``
says where) is in one folder of the temp directory, removed at the end unless ``--keep``: on
success, on an error and on Ctrl-C alike, and the server is stopped first in every case.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import click

from prefetch.demo.locals3 import REGION, SeaweedS3, interrupts_deferred
from prefetch.demo.modelgen import generate_model, upload_model
from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.progress import TerminalProgress
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import SyncResult, sync
from prefetch.pipeline.verify_at_rest import VerifyReport, verify_local
from prefetch.sources import SourceSettings, open_source
from prefetch.support.units import format_bytes

BUCKET = "demo-models"
PREFIX = "llama-demo"


def equivalent_command(server: SeaweedS3, uri: str, target: Path) -> str:
    """The ``prefetch pull`` a user would type to do what the demo does against ``server``."""
    env = {
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_DEFAULT_REGION": REGION,
    }
    words = ["prefetch", "pull", uri, str(target), "--endpoint-url", server.endpoint]
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, words)])


def run_demo(
    total_size: int, dest: str | None, *, as_json: bool = False, keep: bool = False
) -> None:
    def say(text: str) -> None:
        click.echo(text, err=True)

    work = Path(tempfile.mkdtemp(prefix="prefetch-demo-"))
    target = Path(dest).resolve() if dest else work / "pulled"
    try:
        result, report, again = _pull_from_a_local_server(work, target, total_size, say)
        algorithms = ", ".join(f"{n} x {a}" for a, n in sorted(result.checksum_algorithms.items()))
        say(f"Pulled {result.files} files, {format_bytes(result.bytes_downloaded)} in "
            f"{result.seconds:.1f}s; verified: {algorithms}")  # fmt: skip
        say(f"prefetch verify: {len(report.checked)} files re-hashed, "
            f"{'all good' if report.ok else 'FAILURES'}")  # fmt: skip
        say(f"Second pull: {again.bytes_downloaded} bytes downloaded (up to date)")
        if as_json:
            click.echo(json.dumps(result.to_json(), sort_keys=True))
        if dest or keep:
            say(f"The model is in {target}")
        else:
            say(f"The model was in {target} (--keep keeps it, --dest DIR puts it where you want)")
    finally:  # also on an error or a Ctrl-C, at any point
        _clean_up(work, keep, say)
    if not report.ok:
        sys.exit(1)


#: Said under the printed pull: copied after the demo, it would find no server at that port.
SERVER_NOTE = (
    "it reaches the demo's server, which stops when the demo ends; for a bucket of your own, "
    "leave out the AWS_ variables and --endpoint-url"
)


def _pull_from_a_local_server(
    work: Path, target: Path, total_size: int, say: Callable[[str], None]
) -> tuple[SyncResult, VerifyReport, SyncResult]:
    """Generate a model in ``work``, serve it from a local S3 server, pull it into ``target``,
    verify it and pull again; the server is stopped when this returns or raises."""
    say(f"Generating a {format_bytes(total_size)} model in {work / 'model'} ...")
    files = generate_model(work / "model", total_size, shards=3, seed=7)
    say("Starting a local S3 server (SeaweedFS) on 127.0.0.1 ...")
    with SeaweedS3(data_dir=work / "s3") as server:
        client = server.client()
        upload_model(client, BUCKET, PREFIX, files)
        uri = f"s3://{BUCKET}/{PREFIX}/"
        say(f"Uploaded {len(files)} files to {uri} at {server.endpoint} "
            "(shards multipart with CRC64NVME)")  # fmt: skip
        say(f"Pulling; the same by hand:\n  {equivalent_command(server, uri, target)}")
        say(f"  ({SERVER_NOTE})")
        spec = ModelSpec(source=parse_source_uri(uri), name="llama-demo")
        layout = PlainLayout(target)
        reach = SourceSettings(s3_client=client)
        source = open_source(spec, reach, layout="plain")
        result = sync(spec, source, layout, TransferConfig(),
                      progress=TerminalProgress(sys.stderr))  # fmt: skip
        report = verify_local(layout)
        again = sync(spec, open_source(spec, reach, layout="plain"), layout,
                     TransferConfig())  # fmt: skip
    return result, report, again


def _clean_up(work: Path, keep: bool, say: Callable[[str], None]) -> None:
    """Remove the demo's folder (the generated model, the server's data, the pulled copy
    unless --dest put it elsewhere), or say where it is kept."""
    if keep:
        say(f"The demo's data is kept in {work} (remove it with: rm -rf {shlex.quote(str(work))})")
        return
    with interrupts_deferred():  # a second Ctrl-C does not leave half of it
        shutil.rmtree(work, ignore_errors=True)
    say(f"Removed the demo's data ({work}); --keep keeps it")
