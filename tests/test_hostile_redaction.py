"""Hostile review, issue 22: ``-vv`` never prints a session token, a signature, an Authorization
header, a canonical request or a proxy password, whether it is logged as text or as bytes."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import pytest

from prefetch.support.redact import RedactingFilter, redact

from .support import run_cli, upload

TOKEN = "FwoGZXIvYXdzEJrHostileSessionToken0123456789abcdefXYZ"


@pytest.mark.parametrize(
    "text",
    [
        f"headers={{'X-Amz-Security-Token': b'{TOKEN}', 'Host': b'bkt'}}",
        f"headers={{'X-Amz-Security-Token': '{TOKEN}'}}",
        f'{{"x-amz-security-token": "{TOKEN}"}}',
        f"x-amz-security-token:{TOKEN}",
        f"X-Amz-Security-Token: {TOKEN}",
        f"'Authorization': b'AWS4-HMAC-SHA256 Credential=AKIAX/2026/us-east-1/s3/aws4_request, "
        f"SignedHeaders=host, Signature=feedfacefeedface{TOKEN}'",
        f"'Proxy-Authorization': b'Basic {TOKEN}'",
        f"Signature:\nfeedfacefeedface{TOKEN}",
        f"CanonicalRequest:\nGET\n/\nlist-type=2\nx-amz-security-token:{TOKEN}\n\nhost\n",
        f"StringToSign:\nAWS4-HMAC-SHA256\n20261204T000000Z\n{TOKEN}",
        f"proxy http://user:{TOKEN}@127.0.0.1:3128 refused",
        f"ProxyManager(proxy_headers={{'proxy-authorization': 'Basic {TOKEN}'}})",
    ],
)
def test_redact_hides_tokens_in_str_and_bytes_reprs(text: str) -> None:
    assert TOKEN not in redact(text)
    assert TOKEN[:12] not in redact(text)


def test_botocore_signing_records_are_never_printed() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("botocore.auth")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        logger.debug("CanonicalRequest:\n%s", f"GET\n/\n\nhost:b\n\nhost\n{TOKEN[:20]}")
        logger.debug("StringToSign:\n%s", "AWS4-HMAC-SHA256\n2026\nscope\nabc")
        logger.debug("Signature:\n%s", TOKEN)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    assert TOKEN[:12] not in stream.getvalue()


@pytest.mark.parametrize("via", ["profile", "environment"])
def test_vv_never_prints_the_session_token(
    s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path, via: str
) -> None:
    """A profile's credentials take the botocore path (which logs every header at -vv); keys
    in the environment take the direct one. The server refuses the made-up token: the request,
    logged before the answer, is what matters."""
    upload(s3_client, bucket, "m", tmp_path, 64 * 1024)
    env = dict(s3_env)
    if via == "profile":
        key, secret = env.pop("AWS_ACCESS_KEY_ID"), env.pop("AWS_SECRET_ACCESS_KEY")
        Path(env["AWS_SHARED_CREDENTIALS_FILE"]).write_text(
            f"[tok]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n"
            f"aws_session_token = {TOKEN}\n"
        )
        env["AWS_PROFILE"] = "tok"
    else:
        env["AWS_SESSION_TOKEN"] = TOKEN
    proc = run_cli("-vv", "pull", f"s3://{bucket}/m", str(tmp_path / "dest"), env=env)
    out = proc.stdout + proc.stderr
    if via == "profile":
        assert "X-Amz-Security-Token" in out  # the header was logged, with its value masked
    assert TOKEN[:12] not in out
    assert "Signature=" not in out.replace("Signature=***", "")
    assert "Credential=prefetch" not in out  # the Authorization header's value is all masked


def test_json_log_fields_of_any_type_are_redacted() -> None:
    import json

    from prefetch.support.logjson import JsonFormatter

    record = logging.LogRecord("prefetch.x", logging.WARNING, __file__, 1, "failed", None, None)
    record.error = ValueError(f"proxy http://user:{TOKEN}@127.0.0.1:3128 refused")
    record.source = {"proxy": f"http://user:{TOKEN}@127.0.0.1:3128", "n": 3}
    record.bytes = 42
    line = JsonFormatter().format(record)
    assert TOKEN[:12] not in line
    doc = json.loads(line)
    assert doc["bytes"] == 42 and doc["source"]["n"] == 3
    assert doc["source"]["proxy"] == "http://user:***@127.0.0.1:3128"


def test_redaction_keeps_plain_words() -> None:
    text = "a basic listing of 3 files; the HF cache's token file is absent"
    assert redact(text) == text
