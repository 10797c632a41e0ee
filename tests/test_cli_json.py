"""``--json`` prints one JSON object on stdout when a command fails, too.

The object has the success summary's keys (what was done before the failure), plus ``error`` (the
one-line message) and ``error_reason`` (a stable name for scripts); the ``Error: ...`` line still
goes to stderr and the exit status stays 1.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from prefetch.cli import main
from prefetch.cli.common import error_reason
from prefetch.pipeline.engine.transfer import Cancelled
from prefetch.support.errors import (
    BucketNotFoundError,
    ChecksumMismatchError,
    DeadlineExceededError,
    InsufficientSpaceError,
    NoMatchingFilesError,
)

MiB = 1024 * 1024
SUCCESS_KEYS = {
    "model", "source", "revision", "path", "files", "bytes_total", "bytes_downloaded",
    "files_downloaded", "files_verified", "files_unverified", "checksum_algorithms", "deleted",
    "retries", "checksum_failures", "resumed_bytes", "seconds", "up_to_date",
}  # fmt: skip


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


def failure_object(result: Result) -> dict[str, Any]:
    """The one JSON object a failed command printed on stdout, checked for the common shape."""
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("Error: ")
    (line,) = result.stdout.splitlines()
    out: dict[str, Any] = json.loads(line)
    assert out["error"] == result.stderr.splitlines()[0].removeprefix("Error: ")
    return out


def test_a_malformed_uri_prints_the_error_and_zero_progress_as_json(tmp_path: Path) -> None:
    out = failure_object(run("pull", "s3:/no-bucket", str(tmp_path / "d"), "--json"))
    assert out["error_reason"] == "config"
    assert out.keys() >= SUCCESS_KEYS
    assert out["files"] == out["bytes_downloaded"] == out["files_downloaded"] == 0


def test_a_missing_bucket_prints_not_found_as_json(s3_env: dict[str, str], tmp_path: Path):
    out = failure_object(
        run("pull", "s3://no-such-bucket-here/m", str(tmp_path / "d"), "--json", env=s3_env)
    )
    assert out["error_reason"] == "not_found"
    assert out["source"] == "s3://no-such-bucket-here/m"
    assert out["bytes_downloaded"] == out["files_downloaded"] == 0


def test_a_checksum_mismatch_prints_what_was_done_before_it(
    s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    good, bad = b'{"a": 1}', os.urandom(2 * MiB)
    s3_client.put_object(Bucket=bucket, Key="m/a.json", Body=good, ChecksumAlgorithm="CRC32")
    s3_client.put_object(Bucket=bucket, Key="m/w.bin", Body=bad, ChecksumAlgorithm="CRC64NVME")
    wrong = hashlib.sha256(b"not it").hexdigest()
    sums = f"{hashlib.sha256(good).hexdigest()}  a.json\n{wrong}  w.bin\n"
    s3_client.put_object(Bucket=bucket, Key="m/SHA256SUMS", Body=sums.encode())
    result = run("pull", f"s3://{bucket}/m", str(tmp_path / "d"), "--json", env=s3_env)
    out = failure_object(result)
    assert out["error_reason"] == "checksum_mismatch"
    assert "w.bin" in out["error"] and "sha256" in out["error"]
    assert out.keys() >= SUCCESS_KEYS
    assert out["files"] == 2 and out["bytes_total"] == len(good) + len(bad)
    assert out["files_downloaded"] == 1  # a.json was published before w.bin failed
    assert out["bytes_downloaded"] >= len(good) + 2 * len(bad)  # w.bin was fetched twice
    assert out["checksum_failures"] == 2


def test_verify_json_reports_a_failure_to_start_as_json(tmp_path: Path) -> None:
    out = failure_object(run("verify", str(tmp_path / "missing"), "--json"))
    assert out["error_reason"] == "layout"
    assert out["ok"] is False and out["checked"] == 0


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (ChecksumMismatchError("f", "sha256", "a", "b"), "checksum_mismatch"),
        (NoMatchingFilesError("none"), "no_matching_files"),
        (BucketNotFoundError("gone"), "not_found"),
        (InsufficientSpaceError("full"), "insufficient_space"),
        (Cancelled("stopped"), "cancelled"),
        (DeadlineExceededError("late"), "deadline"),  # was transfer_failed
        (KeyboardInterrupt(), "cancelled"),
        (RuntimeError("a bug"), "internal"),
    ],
)
def test_error_reasons_name_the_most_specific_kind(exc: BaseException, reason: str) -> None:
    assert error_reason(exc) == reason
