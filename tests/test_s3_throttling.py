"""Issue 29 items 20-22: the botocore listing path under a refusing proxy and a throttling S3
(a scripted HTTPS endpoint, tests/fakes/scripted_s3.py): one sentence for a refused CONNECT, a
listing that waits the server's Retry-After, and a throttled node that slows down as a whole
instead of multiplying its requests."""

from __future__ import annotations

import contextlib
import itertools
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from .fakes.scripted_s3 import ScriptedS3
from .support import AgentProcess, clean_env, config_text, run_cli
from .tls import TestCA

PROFILE = "[throttled]\naws_access_key_id = AKIATHROTTLED\naws_secret_access_key = s3cret\n"


def profile_env(tmp_path: Path, ca: TestCA, endpoint: str) -> dict[str, str]:
    """A `prefetch` subprocess's environment with credentials from a profile: botocore lists."""
    credentials = tmp_path / "aws-credentials"
    credentials.write_text(PROFILE)
    return clean_env(
        tmp_path / "hf",
        **ca.env(),
        AWS_ENDPOINT_URL=endpoint,
        AWS_PROFILE="throttled",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(credentials),
    )


# -- item 20: a refused CONNECT on the botocore path --------------------------------------------


class _Refusing(BaseHTTPRequestHandler):
    """A forward proxy refusing every tunnel with 403."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_CONNECT(self) -> None:
        body = b"tunnels forbidden here"
        self.send_response(403, "Forbidden")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True


@contextlib.contextmanager
def refusing_proxy() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://user:pr0xy-pw@127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize(
    "source",
    [["s3://bkt/m"], ["hf://acme/x", "--mirror", "s3://bkt/m", "--no-hub-fallback"]],
    ids=["s3", "mirror"],
)
def test_a_refused_connect_on_the_botocore_listing_is_one_sentence(
    test_ca: TestCA, tmp_path: Path, source: list[str]
) -> None:
    with refusing_proxy() as proxy:
        env = profile_env(tmp_path, test_ca, "https://s3.prefetch.test:9")
        env.update(HTTPS_PROXY=proxy, HTTP_PROXY=proxy, NO_PROXY="")
        env["HF_ENDPOINT"] = "https://hub.prefetch.test:9"
        proc = run_cli("pull", source[0], str(tmp_path / "d"), *source[1:], "--attempts", "1",
                       env=env, timeout=60)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("Error: listing s3://bkt/m"), first
    assert "the proxy refused the connection (Tunnel connection failed: 403" in first, first
    assert "ProxyConnectionError" not in first and "Failed to connect to proxy URL" not in first
    assert "pr0xy-pw" not in proc.stderr


# -- item 21: Retry-After on the botocore listing path ------------------------------------------


def test_the_botocore_listing_waits_the_retry_after(test_ca: TestCA, tmp_path: Path) -> None:
    objects = {"m/config.json": b"{}", "m/w.bin": bytes(range(256)) * 64}
    with ScriptedS3(test_ca, objects=objects, listing_retry_after=["3", "3"]) as s3:
        env = profile_env(tmp_path, test_ca, s3.endpoint)
        proc = run_cli("pull", "s3://bkt/m", str(tmp_path / "d"), env=env, timeout=60)
        listings = [r for r in s3.requests() if r.kind == "list"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r.status for r in listings[:3]] == [503, 503, 200], listings
    gaps = [b.at - a.at for a, b in itertools.pairwise(listings[:3])]
    assert all(gap >= 2.9 for gap in gaps), gaps  # the server's 3 s, not the 0.25 s backoff
    assert (tmp_path / "d" / "w.bin").read_bytes() == objects["m/w.bin"]


# -- item 22: a throttled node slows down as a whole ---------------------------------------------

PULLS = 4
FILES = {f"m/w{i:02d}.bin": bytes([i]) * (1024 * 1024 + 1) for i in range(12)}  # HEAD + 5 GETs


def pulls(env: dict[str, str], tmp_path: Path, count: int) -> list[subprocess.Popen[str]]:
    """``count`` pulls of s3://bkt/m started together (each its own process: one node)."""
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefetch.cli",
                "pull",
                "s3://bkt/m",
                str(tmp_path / f"d{n}"),
                "--chunk-size",
                "256KiB",
                "--json",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(count)
    ]


def finished(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    out = []
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        out.append((proc.returncode, err))
    return out


@pytest.mark.slow
def test_throttled_pulls_stay_within_half_again_the_minimum_requests(
    test_ca: TestCA, tmp_path: Path
) -> None:
    with ScriptedS3(test_ca, objects=dict(FILES)) as s3:
        (tmp_path / "one").mkdir()
        env = profile_env(tmp_path / "one", test_ca, s3.endpoint)
        (one,) = finished(pulls(env, tmp_path / "one", 1))
        assert one[0] == 0, one[1][-2000:]
        minimum, listings = PULLS * s3.count(), PULLS * s3.count("list")
    with ScriptedS3(test_ca, objects=dict(FILES), rate=40) as s3:
        env = profile_env(tmp_path, test_ca, s3.endpoint)
        results = finished(pulls(env, tmp_path, PULLS))
        sent, throttled = s3.count(), s3.count(status=503)
        listed = s3.count("list", status=200)
    for code, err in results:
        assert code == 0, err[-2000:]  # every node ready
    for n in range(PULLS):
        assert (tmp_path / f"d{n}" / "w11.bin").read_bytes() == FILES["m/w11.bin"]
    assert throttled > 0  # the server did throttle
    assert sent <= 1.5 * minimum, (sent, throttled, minimum)
    assert listed == listings  # throttled requests were retried, never a pull from its listing


def agents_until_ready(
    s3: ScriptedS3, ca: TestCA, tmp_path: Path, count: int
) -> list[dict[str, object]]:
    """``count`` agents (one node each) started together on s3://bkt/m, until each is ready;
    the /readyz body of each."""
    started = []
    for n in range(count):
        work = tmp_path / f"node{n}"
        work.mkdir(parents=True)
        config = work / "models.yaml"
        config.write_text(
            config_text(work / "cache", [{"name": "m", "source": "s3://bkt/m"}], chunkSize="256KiB")
        )
        env = profile_env(work, ca, s3.endpoint)
        started.append(AgentProcess(config, env, work / "agent.log"))
    try:
        return [agent.ready_then_terminated(timeout=90) for agent in started]
    finally:
        for agent in started:
            agent.stop()


@pytest.mark.slow
def test_throttled_agents_stay_within_half_again_the_minimum_requests(
    test_ca: TestCA, tmp_path: Path
) -> None:
    """Each agent's models share one pace per endpoint: three nodes scaling up together against
    a throttling endpoint all get ready without multiplying their requests."""
    with ScriptedS3(test_ca, objects=dict(FILES)) as s3:
        agents_until_ready(s3, test_ca, tmp_path / "one", 1)
        minimum, listings = 3 * s3.count(), 3 * s3.count("list")
    with ScriptedS3(test_ca, objects=dict(FILES), rate=25) as s3:
        bodies = agents_until_ready(s3, test_ca, tmp_path / "three", 3)
        sent, throttled = s3.count(), s3.count(status=503)
        listed = s3.count("list", status=200)
    assert all(body["ready"] for body in bodies)
    assert throttled > 0
    assert sent <= 1.5 * minimum, (sent, throttled, minimum)
    assert listed == listings  # no sync started again from its listing
