"""What a newcomer reads when something is wrong (issue 34): no network, a destination that is
not writable, ``prefetch ls`` after a pull, a source URI with one slash."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import urllib3
from click.testing import CliRunner

from prefetch.cli import main
from prefetch.pipeline.retry import RetryPolicy, call_with_retries
from prefetch.pipeline.spec import parse_source_uri
from prefetch.sources.http.transport import transport_error
from prefetch.support.errors import ConfigError, TransientSourceError

from .support import HUB_REPO, clean_env, free_port, mounted_tmpfs, run_cli

HINT = (
    "Hint: check the network and DNS; behind a proxy set HTTPS_PROXY (or --proxy); "
    "a Hub mirror: HF_ENDPOINT (or --endpoint); another S3 server: --endpoint-url"
)


def _fails_fast(what: str, exc: BaseException) -> TransientSourceError:
    """``exc`` as the sources translate it, through the one retry loop (2 attempts, no wait)."""

    def attempt() -> None:
        raise transport_error(exc, what) from exc

    policy = RetryPolicy(attempts=2, base_delay=0.0, max_delay=0.0)
    with pytest.raises(TransientSourceError) as info:
        call_with_retries(attempt, policy, what=what)
    return info.value


def test_no_dns_answer_is_one_line_naming_the_host_with_a_network_hint() -> None:
    conn = urllib3.connection.HTTPSConnection("huggingface.co", 443)
    lost = urllib3.exceptions.NameResolutionError(
        "huggingface.co", conn, socket.gaierror(-2, "Name or service not known")
    )
    error = _fails_fast("resolving org/name@main", lost)
    assert str(error) == (
        "resolving org/name@main: giving up after 2 attempts: cannot reach huggingface.co:443: "
        "Failed to resolve 'huggingface.co' ([Errno -2] Name or service not known)"
    )
    assert error.hint is not None and f"Hint: {error.hint}" == HINT


def test_a_refused_hub_is_one_error_line_and_the_hint_from_the_command(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there: connection refused
    env = clean_env(tmp_path / "hf-home", HF_ENDPOINT=f"https://127.0.0.1:{port}")
    proc = run_cli("pull", f"hf://{HUB_REPO}", str(tmp_path / "d"), "--attempts", "2", env=env)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"Error: resolving {HUB_REPO}@main: giving up after 2 attempts: cannot reach "
        f"127.0.0.1:{port}: Failed to establish a new connection: [Errno 111] Connection refused",
        HINT,
    ]


def test_a_failed_pull_leaves_no_folder_it_made_and_keeps_one_that_was_there(
    tmp_path: Path,
) -> None:
    port = free_port()  # nothing listens there: connection refused
    env = clean_env(tmp_path / "hf-home", HF_ENDPOINT=f"https://127.0.0.1:{port}")
    new = tmp_path / "new" / "models"
    proc = run_cli("pull", f"hf://{HUB_REPO}", str(new), "--attempts", "1", env=env)
    assert proc.returncode == 1, proc.stderr
    assert not (tmp_path / "new").exists()  # both folders it made are gone again
    there = tmp_path / "there"
    there.mkdir()
    proc = run_cli("pull", f"hf://{HUB_REPO}", str(there / "sub"), "--attempts", "1", env=env)
    assert proc.returncode == 1, proc.stderr
    assert there.is_dir() and list(there.iterdir()) == []


def _root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (to mount a read-only file system, or to become another user)")


def test_a_read_only_destination_says_so(tmp_path: Path) -> None:
    _root_only()
    with mounted_tmpfs(4) as mnt:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        env = clean_env(tmp_path / "hf-home")
        proc = run_cli("pull", f"hf://{HUB_REPO}", str(mnt), env=env)
        assert proc.returncode == 1
        assert proc.stderr.splitlines() == [
            f"Error: the destination {mnt} is not writable: read-only file system"
        ]


def test_a_destination_of_another_user_says_permission_denied() -> None:
    _root_only()
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run(
        [*nobody, sys.executable, "-c", "import prefetch.cli"],
        env=clean_env(Path("/nonexistent")), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if probe.returncode != 0:  # e.g. a virtual environment in a folder only root may read
        pytest.skip(f"user nobody cannot run this Python environment: {probe.stderr[-200:]}")
    # outside pytest's tmp dirs (mode 0700): user nobody may look in, not write
    dest = Path(tempfile.mkdtemp(prefix="prefetch-root-only-"))
    dest.chmod(0o755)
    env = clean_env(Path("/nonexistent"))
    proc = subprocess.run(
        [*nobody, sys.executable, "-m", "prefetch.cli", "pull", f"hf://{HUB_REPO}", str(dest)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    dest.rmdir()
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [
        f"Error: the destination {dest} is not writable: permission denied "
        "(owner uid 0, drwxr-xr-x; this process runs as uid 65534)"
    ]


def test_ls_after_a_pull_explains_every_unknown(hub: object, tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = clean_env(tmp_path / "hf-home", HF_ENDPOINT=hub.endpoint)  # type: ignore[attr-defined]
    assert run_cli("pull", f"hf://{HUB_REPO}", str(home), env=env).returncode == 0
    listed = run_cli("ls", "--cache-dir", str(home), env=env)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split()[:4] == ["NAME", "KIND", "SIZE", "REVISION"]
    cells = row.split()
    assert "-" not in cells and "?" not in cells, row
    assert "unknown" in cells
    assert listed.stderr.splitlines() == [
        "VERIFIED, LAST USED unknown: no agent sync recorded in this cache (a model "
        "`prefetch pull` wrote: `prefetch verify DIR` re-checks it)",
        "WANTED unknown: no agent config to compare with (pass --config or set PREFETCH_CONFIG)",
    ]


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("hf:/org/name", "malformed Hub URI 'hf:/org/name': expected hf://org/name"),
        ("hf:org/name", "malformed Hub URI 'hf:org/name': expected hf://org/name"),
        ("hf:///org/name", "malformed Hub URI 'hf:///org/name': expected hf://org/name"),
        ("oci:/ghcr.io/a:b", "malformed OCI URI 'oci:/ghcr.io/a:b': expected oci://registry/"),
        ("s3:/bucket", "malformed S3 URI 's3:/bucket': no bucket"),
    ],
)
def test_one_slash_after_the_scheme_is_refused(uri: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_source_uri(uri)
    assert str(info.value).startswith(message)
    result = CliRunner().invoke(main, ["pull", uri, "/tmp/never-written"])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {message}")


@pytest.mark.parametrize(
    "uri", ["oci://[0]/models/m:v1", "oci://[::1/models/m:v1", "s3://[bkt]/p/", "hf://[o]/n"]
)
def test_a_bracketed_host_that_is_no_ip_address_is_one_error_line(uri: str) -> None:
    """Before: urlsplit's ValueError went up as a traceback (the agent's config too)."""
    with pytest.raises(ConfigError) as info:
        parse_source_uri(uri)
    assert str(info.value).startswith(f"malformed URI {uri!r}: ")
    result = CliRunner().invoke(main, ["pull", uri, "/tmp/never-written"])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: malformed URI {uri!r}: "), result.stderr


def test_ctrl_c_before_any_download_says_only_interrupted(tmp_path: Path) -> None:
    """A Hub that takes the connection and never answers: the pull waits in resolving."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the backlog; nothing ever reads them
        env = clean_env(
            tmp_path / "hf-home", HF_ENDPOINT=f"http://127.0.0.1:{silent.getsockname()[1]}"
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefetch.cli", "pull", f"hf://{HUB_REPO}",
             str(tmp_path / "d")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        silent.settimeout(60)
        held, _ = silent.accept()  # the pull has asked: it waits for the answer now
        with held:
            time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.splitlines() == ["Interrupted."]
