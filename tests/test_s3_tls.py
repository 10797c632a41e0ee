"""S3 over TLS, as production has it (issue 28.5): a pull reuses its connections, so it pays one
TLS handshake per pooled connection, not one per request.

The handshakes are counted at the server: the fault proxy (tests/fakes/s3proxy.py, no fault
armed) in front of the session's SeaweedFS is a TLS server that counts the handshakes it
completes (tests/fakes/tlsserver.py) and the requests it answers.
"""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import trustme

from prefetch.demo.locals3 import SeaweedS3
from prefetch.demo.modelgen import generate_model, upload_model
from prefetch.sources import pool_size
from prefetch.support.errors import PrefetchError

from .fakes.s3proxy import S3FaultProxy
from .support import run_cli
from .tls import TestCA

MiB = 1024 * 1024
CONCURRENCY = 8


def test_a_64_mib_multi_file_pull_does_one_handshake_per_pooled_connection(
    test_ca: TestCA,
    s3_server: SeaweedS3,
    s3_client: Any,
    bucket: str,
    s3_env: dict[str, str],
    tmp_path: Path,
) -> None:
    files = generate_model(tmp_path / "src", 64 * MiB, shards=8, small_files=4, seed=28)
    upload_model(s3_client, bucket, "m", files, create_bucket=False)
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        env = {**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}
        proc = run_cli(
            "pull", f"s3://{bucket}/m", str(tmp_path / "d"), "--json",
            "--concurrency", str(CONCURRENCY), "--chunk-size", "1MiB", env=env,
        )  # fmt: skip
        handshakes, accepted = proxy.handshakes, proxy.accepted
        requests = len(proxy.requests)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["files"] == len(files)
    gets = sum(1 for method, _, _ in proxy.requests if method == "GET")
    assert gets >= 64  # a ranged GET per MiB at least: many more requests than connections
    # every connection did its handshake (none was plain HTTP or refused), and there were no
    # more of them than the pull's pool holds: connections were kept alive and reused
    assert 0 < handshakes == accepted <= pool_size(CONCURRENCY)
    assert handshakes * 4 <= requests
    print(f"TLS handshakes: {handshakes} for {requests} requests ({gets} GETs)")


def test_a_server_whose_certificate_is_not_trusted_fails_to_start_at_once(
    test_ca: TestCA, tmp_path: Path
) -> None:
    """SeaweedS3 waits for its server to answer; a certificate its clients refuse is not a
    server still starting (the wait was the whole start-up timeout, 60 s)."""
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    server = SeaweedS3(
        data_dir=tmp_path / "s3", tls_cert=test_ca.cert_file, tls_key=test_ca.key_file,
        ca_file=other, host=test_ca.host_for("s3"), startup_timeout=60,
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(PrefetchError, match=r"refused: .*CERTIFICATE_VERIFY_FAILED"):
        server.start()
    assert time.monotonic() - started < 30


def test_the_sessions_s3_server_speaks_https_only_under_its_test_name(
    test_ca: TestCA, s3_server: SeaweedS3
) -> None:
    """Every test on ``s3_server`` talks TLS: its endpoint is https:// under the test name its
    certificate holds, and its port answers plain HTTP with a refusal, never with S3."""
    parts = urlsplit(s3_server.endpoint)
    assert parts.port is not None
    assert s3_server.endpoint == test_ca.url(parts.port, "s3")
    assert parts.scheme == "https"
    plain = http.client.HTTPConnection("127.0.0.1", parts.port, timeout=10)
    try:
        plain.request("GET", "/")
        answer = plain.getresponse()
        assert answer.status == 400 and b"HTTPS server" in answer.read()
    finally:
        plain.close()
