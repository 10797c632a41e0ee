"""Static checks of bootstrap/: shell lint and format, the CLI surface, the systemd unit, and the
generated EC2 user data (up to date, small enough, and carrying the script byte for byte).

What the script does to real disks is tested in a QEMU guest: tests/test_bootstrap_guest.py.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.guest import userdata

BOOTSTRAP = userdata.BOOTSTRAP
SCRIPT = BOOTSTRAP / "setup-local-nvme.sh"
UNIT = BOOTSTRAP / "setup-local-nvme.service"
RENDER = BOOTSTRAP / "render-user-data.sh"
USER_DATA = BOOTSTRAP / "user-data.mime"
SHELL_FILES = sorted(BOOTSTRAP.glob("*.sh"))
#: EC2 takes 16 KiB of user data; Karpenter adds its own NodeConfig part (CA, endpoint, kubelet
#: settings: 2-3 KiB), so ours must leave room for it.
USER_DATA_BUDGET = 12 * 1024


def _run(*args: str | Path, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(arg) for arg in args], capture_output=True, text=True, check=False, **kwargs
    )


@pytest.fixture(scope="module")
def shell_part(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user data's shell part, as the file cloud-init would run."""
    path = tmp_path_factory.mktemp("user-data") / "part-001.sh"
    path.write_bytes(userdata.shell_part(USER_DATA.read_bytes()))
    return path


def test_the_shell_files_are_the_expected_ones() -> None:
    assert [path.name for path in SHELL_FILES] == ["render-user-data.sh", "setup-local-nvme.sh"]
    for path in SHELL_FILES:
        assert os.access(path, os.X_OK), f"{path} is not executable"


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda path: path.name)
def test_shellcheck(path: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    result = _run("shellcheck", "--external-sources", path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_user_data_shell_part(shell_part: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    result = _run("shellcheck", shell_part)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shfmt() -> None:
    if shutil.which("shfmt") is None:
        pytest.skip("shfmt is not installed (apt-get install shfmt)")
    # No flags: shfmt reads bootstrap/.editorconfig.
    result = _run("shfmt", "-d", *SHELL_FILES)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda path: path.name)
def test_bash_syntax(path: Path) -> None:
    result = _run("bash", "-n", path)
    assert result.returncode == 0, result.stderr


def test_bash_syntax_user_data_shell_part(shell_part: Path) -> None:
    result = _run("bash", "-n", shell_part)
    assert result.returncode == 0, result.stderr


def test_help_lists_every_flag_and_its_environment_twin() -> None:
    result = _run(SCRIPT, "--help")
    assert result.returncode == 0, result.stderr
    for flag, variable in [
        ("--model-match", "LOCAL_NVME_MODEL_MATCH"),
        ("--array-name", "LOCAL_NVME_ARRAY_NAME"),
        ("--fs-label", "LOCAL_NVME_FS_LABEL"),
        ("--chunk-kib", "LOCAL_NVME_CHUNK_KIB"),
        ("--mount-point", "LOCAL_NVME_MOUNT_POINT"),
        ("--cache-dir", "LOCAL_NVME_CACHE_DIR"),
        ("--cache-owner", "LOCAL_NVME_CACHE_OWNER"),
        ("--cache-mode", "LOCAL_NVME_CACHE_MODE"),
    ]:
        assert flag in result.stdout
        assert variable in result.stdout
    assert '(now: "Amazon EC2 NVMe Instance Storage")' in result.stdout
    assert "(now: /mnt/k8s-disks/local-nvme)" in result.stdout


def test_help_shows_values_from_the_environment() -> None:
    env = {**os.environ, "LOCAL_NVME_MOUNT_POINT": "/mnt/elsewhere", "LOCAL_NVME_CHUNK_KIB": "256"}
    result = _run(SCRIPT, "--chunk-kib", "1024", "--help", env=env)
    assert result.returncode == 0, result.stderr
    assert "(now: /mnt/elsewhere)" in result.stdout
    # Flags are read in order: --help prints what was parsed before it.
    assert "(now: 1024)" in result.stdout


def test_render_help() -> None:
    result = _run(RENDER, "--help")
    assert result.returncode == 0, result.stderr
    assert "--stdout" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "unknown argument: --bogus"),
        (["--mount-point"], "--mount-point needs a value"),
        (["--chunk-kib", "384"], "--chunk-kib: a power of two"),
        (["--chunk-kib", "2"], "--chunk-kib: a power of two"),
        (["--mount-point", "relative/path"], "--mount-point: an absolute path"),
        (["--mount-point", "/mnt/../etc"], "--mount-point: an absolute path"),
        (["--mount-point", "/mnt/k8s-disks/"], "--mount-point: an absolute path"),
        (["--cache-dir", "../escape"], "--cache-dir: a relative path"),
        (["--cache-dir", "/abs"], "--cache-dir: a relative path"),
        (["--cache-owner", "agent"], "--cache-owner: numeric UID:GID"),
        (["--cache-mode", "rwx"], "--cache-mode: an octal mode"),
        (["--fs-label", "much-too-long-label"], "--fs-label: up to 12"),
        (["--array-name", "a/b"], "--array-name"),
        (["--model-match", ""], "--model-match must not be empty"),
    ],
)
def test_rejects_bad_arguments(args: list[str], message: str) -> None:
    result = _run(SCRIPT, *args)
    assert result.returncode == 1
    assert f"setup-local-nvme: error: {message}" in result.stderr
    assert "unexpected failure" not in result.stderr


def test_rejects_bad_environment() -> None:
    result = _run(SCRIPT, env={**os.environ, "LOCAL_NVME_CACHE_MODE": "999"})
    assert result.returncode == 1
    assert "--cache-mode: an octal mode" in result.stderr


def test_refuses_to_run_as_non_root() -> None:
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root and setpriv (util-linux) is missing")
        command = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "bash", str(SCRIPT)]
    else:
        command = ["bash", str(SCRIPT)]
    result = _run(*command)
    assert result.returncode == 1
    assert "setup-local-nvme: error: must run as root" in result.stderr


def test_unit_runs_the_installed_script_once_per_boot_before_kubelet() -> None:
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(UNIT.read_text())
    assert unit["Service"]["Type"] == "oneshot"
    assert unit["Service"]["RemainAfterExit"] == "yes"
    assert unit["Service"]["ExecStart"] == userdata.INSTALLED_SCRIPT
    before = unit["Unit"]["Before"].split()
    assert {"kubelet.service", "containerd.service", "nodeadm-run.service"} <= set(before)
    assert "local-fs.target" in unit["Unit"]["After"].split()
    assert "systemd-udev-trigger.service" in unit["Unit"]["After"].split()
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_user_data_is_up_to_date() -> None:
    committed = USER_DATA.read_bytes()
    assert committed == userdata.render(), (
        "bootstrap/user-data.mime is stale: run bootstrap/render-user-data.sh"
    )
    result = _run(RENDER, "--check")
    assert result.returncode == 0, result.stderr


def test_render_check_notices_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "user-data.mime"
    stale.write_bytes(USER_DATA.read_bytes().replace(b"oneshot", b"simple"))
    result = _run(RENDER, "--check", "--output", stale)
    assert result.returncode == 1
    assert "is not up to date" in result.stderr
    assert _run(RENDER, "--output", stale).returncode == 0
    assert stale.read_bytes() == USER_DATA.read_bytes()


def test_user_data_parts() -> None:
    mime = USER_DATA.read_bytes()
    kinds = [kind for kind, _ in userdata.parts(mime)]
    assert kinds == ["application/node.eks.aws", "text/x-shellscript"]
    nodeconfig = yaml.safe_load(userdata.parts(mime)[0][1])
    assert nodeconfig["apiVersion"] == "node.eks.aws/v1alpha1"
    assert nodeconfig["kind"] == "NodeConfig"
    # The instance-store disks belong to setup-local-nvme, not to the AMI's setup-local-disks.
    assert "localStorage" not in (nodeconfig.get("spec") or {}).get("instance", {})
    assert userdata.parts(mime)[0][1] == (BOOTSTRAP / "nodeconfig.yaml").read_bytes()


def test_user_data_carries_the_script_and_unit_byte_for_byte() -> None:
    shell = userdata.shell_part(USER_DATA.read_bytes())
    assert shell.startswith(b"#!/bin/bash\n")
    assert userdata.embedded_script(shell) == SCRIPT.read_bytes()
    unit = UNIT.read_bytes()
    assert b"<< 'SETUP_LOCAL_NVME_SERVICE'\n" + unit + b"SETUP_LOCAL_NVME_SERVICE\n" in shell
    assert b"systemctl enable --now setup-local-nvme.service\n" in shell


def test_user_data_fits_ec2_limit_with_room_for_karpenter() -> None:
    size = USER_DATA.stat().st_size
    assert size <= USER_DATA_BUDGET, f"user data is {size} bytes, budget {USER_DATA_BUDGET}"


def test_bootstrap_files_are_ascii() -> None:
    for path in [*SHELL_FILES, UNIT, USER_DATA, BOOTSTRAP / "nodeconfig.yaml"]:
        path.read_bytes().decode("ascii")
