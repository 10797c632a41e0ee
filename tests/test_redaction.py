"""Nothing printed carries a credential, and no name from a source can forge an output line."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from prefetch.cli.common import fail
from prefetch.support.errors import LayoutError
from prefetch.support.logjson import setup_logging
from prefetch.support.redact import RedactingFilter, printable, redact

from .fakes.hubserver import HubServer, make_model_dir
from .support import HUB_REPO as REPO
from .support import HUB_SHARDS as SHARDS
from .support import HUB_TOKEN as TOKEN
from .support import clean_env, run_cli
from .tls import TestCA

SIGNED = (
    "https://cdn.example.com/cdn/abc?Expires=1700000000&Signature=c2lnbmF0dXJlLXZhbHVl"
    "&Key-Pair-Id=K2ABCDEF"
)
PRESIGNED = (
    "https://bucket.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256"
    "&X-Amz-Credential=AKIAEXAMPLE%2F20261203%2Fus-east-1%2Fs3%2Faws4_request"
    "&X-Amz-Signature=0123456789abcdef0123456789abcdef&X-Amz-Security-Token=FwoGZXIvYXdzEJr"
)


# -- the functions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "secrets"),
    [
        (SIGNED, ["c2lnbmF0dXJlLXZhbHVl", "1700000000", "K2ABCDEF"]),
        (PRESIGNED, ["AKIAEXAMPLE", "0123456789abcdef0123456789abcdef", "FwoGZXIvYXdzEJr"]),
        ("{'Authorization': 'Bearer hf_abcdefghijklmnopqrstu'}", ["hf_abcdefghijklmnopqrstu"]),
        (
            "Authorization: AWS4-HMAC-SHA256 Credential=AKIAEXAMPLE/2026, Signature=feedface",
            ["AKIAEXAMPLE", "feedface"],
        ),
    ],
)
def test_redact_removes_signatures_credentials_and_tokens(text: str, secrets: list[str]) -> None:
    clean = redact(text)
    assert [s for s in secrets if s in clean] == []
    assert "***" in clean


def test_redact_keeps_the_rest_of_a_url() -> None:
    assert redact(SIGNED).startswith("https://cdn.example.com/cdn/abc?Expires=***&Signature=***")


def test_printable_escapes_controls_and_keeps_names_readable() -> None:
    assert printable("evil\nError: forged") == "evil\\nError: forged"
    assert printable("a\rb\x1b[2Jc\u2028d\u202ee\x00") == "a\\rb\\x1b[2Jc\\u2028d\\u202ee\\x00"
    assert printable("modèle/日本語 v1.safetensors") == "modèle/日本語 v1.safetensors"


def test_a_log_record_is_redacted_and_one_line_whatever_its_args() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("test_redaction.urllib3ish")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning('"GET %s HTTP/1.1" 206 %s', SIGNED.split("cdn.example.com")[1], 10)
        logger.warning("skipping %s", "evil\nError: forged")
        try:
            raise ValueError(f"redirected to {PRESIGNED}")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "c2lnbmF0dXJlLXZhbHVl" not in out and "0123456789abcdef0123456789abcdef" not in out
    assert [ln for ln in out.splitlines() if ln.startswith("Error:")] == []


def test_the_agents_text_log_is_one_line_per_record_and_redacted() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        setup_logging("text", level=logging.DEBUG, stream=stream)
        logging.getLogger("urllib3.connectionpool").warning("GET %s", SIGNED)
        logging.getLogger("prefetch.pipeline.sync").warning(
            "no checksum for %s", "evil\nError: forged"
        )
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "c2lnbmF0dXJlLXZhbHVl" not in lines[0]
    assert lines[1].endswith("no checksum for evil\\nError: forged")


def test_an_error_message_with_a_newline_is_one_error_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fail(LayoutError("cannot publish evil\nError: forged", hint="fix\nHint: forged"))
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "Error: cannot publish evil\\nError: forged",
        "Hint: fix\\nHint: forged",
    ]


# -- the command line, against real servers ------------------------------------------------------


def test_debug_output_never_shows_the_cdn_signature(tmp_path: Path, test_ca: TestCA) -> None:
    model = tmp_path / "model"
    make_model_dir(model, seed=3, shard_sizes=SHARDS)
    with HubServer(test_ca, token=TOKEN) as hub:
        hub.add_commit(REPO, model)
        env = clean_env(tmp_path / "hf-home", HF_ENDPOINT=hub.endpoint, HF_TOKEN=TOKEN)
        done = run_cli("-vv", "pull", f"hf://{REPO}", str(tmp_path / "dest"), env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        signatures = {
            m.group(1)
            for r in hub.requests
            if r.port == "cdn"
            for m in [re.search(r"[?&]Signature=([^&]+)", r.path)]
            if m
        }
    assert signatures, "the pull went through the CDN"
    assert "Signature=***" in done.stderr  # urllib3 did log the CDN request, redacted
    assert [s for s in signatures if s in done.stderr] == []
    assert TOKEN not in done.stderr


def test_an_s3_key_with_a_newline_yields_exactly_one_error_line(
    s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    s3_client.put_object(Bucket=bucket, Key="m/evil\nError: forged", Body=b"x" * 10)
    s3_client.put_object(Bucket=bucket, Key="m/config.json", Body=b"{}")
    done = run_cli("-v", "pull", f"s3://{bucket}/m", str(tmp_path / "dest"), env=s3_env)
    assert done.returncode == 1
    assert len([ln for ln in done.stderr.splitlines() if ln.startswith("Error:")]) == 1
