"""The command line starts without the heavy libraries only some commands need (issue 15:
start-up decides small pulls and no-op pulls); commands imported lazily still work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
from click.testing import CliRunner

from prefetch.cli import main

from .support import put

#: Libraries `import prefetch.cli` must not load: each is imported by the command that needs it.
HEAVY = (
    "boto3", "botocore", "huggingface_hub", "kubernetes", "prometheus_client", "awscrt", "psutil",
    "yaml", "prefetch.agent", "prefetch.sources.s3.source", "prefetch.sources.hf.source",
)  # fmt: skip


def test_importing_the_cli_loads_no_sdk_or_agent_module() -> None:
    code = (
        "import json, sys; import prefetch.cli; "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_lazy_commands_are_listed_and_resolve_to_themselves() -> None:
    ctx = click.Context(main)
    names = main.list_commands(ctx)
    for name in main.lazy_commands:
        assert name in names
        command = main.get_command(ctx, name)
        assert command is not None and command.name == name


def test_help_of_a_lazy_command_runs() -> None:
    result = CliRunner().invoke(main, ["agent", "--help"])
    assert result.exit_code == 0, result.output
    assert "--config" in result.output


def test_the_pipeline_a_pull_runs_loads_no_warm_up_code() -> None:
    """psutil and the warm-up module are imported for a warm-up only (a no-op pull is timed)."""
    code = (
        "import json, sys; import prefetch.cli, prefetch.pipeline.compose; "
        "print(json.dumps(sorted(m for m in ('psutil', 'prefetch.pipeline.warmup') "
        "if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_the_top_level_help_loads_no_cluster_client() -> None:
    """``prefetch --help`` lists ``status`` without loading the kubernetes client its report
    reads the cluster with (the command imports it when it runs)."""
    code = (
        "import json, sys; from prefetch.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(json.dumps(sorted(m for m in ('kubernetes', 'prefetch.cli.status_report') "
        "if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == []


#: What the group and the commands that transfer nothing (``--version``, ``verify``, ``ls``,
#: ``status``) start without: the engine, the HTTP stack, the other commands (issue 33).
TRANSFER = (
    "prefetch.pipeline.engine.transfer", "http.client", "urllib3", "prefetch.cli.pull",
    "prefetch.cli.mirror", "prefetch.cli.demo", "prefetch.cli.verify",
)  # fmt: skip


def test_importing_the_cli_loads_no_engine_and_no_command() -> None:
    code = (
        "import json, sys; import prefetch.cli; "
        f"print(json.dumps(sorted(m for m in {TRANSFER!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


#: Run ``prefetch ARGS`` in this interpreter, then print on stderr's last line which of the
#: modules named in argv[1] (JSON) were imported; the report is the test's, not the product's.
REPORT_MODULES = """\
import atexit, json, sys
watch = json.loads(sys.argv.pop(1))
atexit.register(lambda: print(json.dumps(sorted(m for m in watch if m in sys.modules)),
                              file=sys.stderr))
sys.argv[0] = "prefetch"
from prefetch.cli import main
main()
"""

#: Not needed by ``prefetch pull s3://...`` with static keys, over HTTPS, of a SHA256 object:
#: botocore (the direct signer sends the requests), awscrt (no CRC to check), the other
#: sources, the agent and the other commands.
NOT_FOR_AN_S3_PULL = (
    "boto3", "botocore", "awscrt", "kubernetes", "prometheus_client", "psutil",
    "prefetch.agent", "prefetch.sources.hf.source", "prefetch.sources.oci.source",
    "prefetch.sources.gcs.source", "prefetch.sources.azure.source", "prefetch.sources.file.source",
    "prefetch.cli.mirror", "prefetch.cli.demo", "prefetch.cli.verify", "prefetch.cli.agent",
)  # fmt: skip


def test_an_s3_pull_imports_only_what_it_uses(
    s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    put(s3_client, bucket, "m/a.bin", b"x" * 1000, ChecksumAlgorithm="SHA256")
    dest = tmp_path / "dest"
    proc = subprocess.run(
        [sys.executable, "-c", REPORT_MODULES, json.dumps(NOT_FOR_AN_S3_PULL),
         "pull", f"s3://{bucket}/m/", str(dest), "--json"],
        env=s3_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["files_downloaded"] == 1
    assert json.loads(proc.stderr.splitlines()[-1]) == []


def test_the_command_line_freezes_the_collector_at_exit() -> None:
    """The interpreter's last collection at exit skips what the imports made (gc.freeze)."""
    code = (
        "import atexit, gc\n"
        "atexit.register(lambda: print(gc.get_freeze_count()))  # runs after the CLI's hook\n"
        "import prefetch.cli\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) > 10_000
    # importing it changes nothing before the exit
    code = "import gc, prefetch.cli; print(gc.get_freeze_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == 0
