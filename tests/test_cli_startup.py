"""The command line starts without the heavy libraries only some commands need (issue 15:
start-up decides small pulls and no-op pulls); commands imported lazily still work."""

from __future__ import annotations

import json
import subprocess
import sys

import click
from click.testing import CliRunner

from prefetch.cli import main

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
