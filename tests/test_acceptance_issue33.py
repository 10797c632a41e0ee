"""Issue 33's performance changes tried as a user would (QA): the CLI as a subprocess against
SeaweedFS over HTTPS with the session CA, behind the fault proxy or a stub where a fault is
needed.

What these guard: the whole-object path of small S3 objects (a body corrupted always or once,
a GET cut or refused once, an object replaced between the listing and its GET, a gzip-encoded
object, a stop or a full disk in the middle of many small files, small files beside multipart
ones at any concurrency, with --processes 2 or without verification, more small bytes than the
body budget); the request seam (a pull signed across several seconds, a bucket in another
region, an endpoint written in capitals or with a trailing slash); one TLS context per pool (a
bundle rotated to one without the CA refused by the next connection, an https:// proxy verified
with the chosen bundle); the CA variables (the public store named while the endpoint uses a
private CA); the lazily imported commands (every command's help, an unknown or mistyped one).
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import trustme

from prefetch.demo.locals3 import SeaweedS3
from prefetch.sources.http.transport import make_http_pool, send
from prefetch.support import settings
from prefetch.support.errors import TlsError

from .fakes.forward_proxy import ForwardProxy
from .fakes.s3proxy import S3FaultProxy
from .fakes.tlsserver import TLSThreadingHTTPServer
from .support import put, run_cli, wait_for
from .tls import TestCA

MiB = 1024 * 1024


def small_files(n: int, prefix: str = "s", size: int = 700) -> dict[str, bytes]:
    """``n`` distinct small files (their bytes differ from the first on)."""
    return {f"{prefix}/f{i:04d}.json": i.to_bytes(4, "big") + os.urandom(size) for i in range(n)}


def put_multipart(client: Any, bucket: str, key: str, data: bytes) -> None:
    """A multipart upload in parts of 5 MiB, with a full-object CRC64NVME."""
    up = client.create_multipart_upload(
        Bucket=bucket, Key=key, ChecksumAlgorithm="CRC64NVME", ChecksumType="FULL_OBJECT"
    )
    parts = []
    for n, off in enumerate(range(0, len(data), 5 * MiB), 1):
        r = client.upload_part(
            Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=n,
            Body=data[off : off + 5 * MiB], ChecksumAlgorithm="CRC64NVME",
        )  # fmt: skip
        parts.append(
            {"PartNumber": n, "ETag": r["ETag"], "ChecksumCRC64NVME": r["ChecksumCRC64NVME"]}
        )
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=up["UploadId"], MultipartUpload={"Parts": parts}
    )


def upload_all(client: Any, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        put(client, bucket, f"{prefix}/{path}", data)


def published(dest: Path) -> dict[str, bytes]:
    """The files a user sees in a plain-layout destination (the tool's own folder left out)."""
    return {
        p.relative_to(dest).as_posix(): p.read_bytes()
        for p in dest.rglob("*")
        if p.is_file() and ".prefetch" not in p.relative_to(dest).parts
    }


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


def proxied_env(env: dict[str, str], proxy: S3FaultProxy) -> dict[str, str]:
    return dict(env, AWS_ENDPOINT_URL=proxy.endpoint)


# -- the whole-object path of small S3 objects ------------------------------------------------


def test_a_small_object_corrupted_on_every_get_fails_the_pull_naming_it(
    test_ca: TestCA, s3_server: SeaweedS3, s3_client: Any, bucket: str, s3_env: dict[str, str],
    tmp_path: Path,
) -> None:  # fmt: skip
    files = small_files(30)
    upload_all(s3_client, bucket, "m", files)
    bad = "s/f0007.json"
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        proxy.faults.flip_key = f"m/{bad}"
        proxy.faults.flip_offset = 100
        dest = tmp_path / "d"
        proc = run_cli("pull", f"s3://{bucket}/m", str(dest), env=proxied_env(s3_env, proxy))
        as_json = run_cli(
            "pull", f"s3://{bucket}/m", str(tmp_path / "j"), "--json",
            env=proxied_env(s3_env, proxy),
        )  # fmt: skip
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and "f0007.json" in errors[0], proc.stderr
    summary = json.loads(as_json.stdout)  # a script reads why
    assert as_json.returncode != 0 and summary["error_reason"] == "checksum_mismatch", summary
    got = published(dest)
    assert bad not in got  # never published
    assert all(files[p] == data for p, data in got.items())  # what is there is right
    assert not list(dest.rglob("f0007.json*")) or all(
        ".prefetch" in p.parts for p in dest.rglob("f0007.json*")
    )


def test_a_small_object_corrupted_once_is_fetched_again_and_published(
    test_ca: TestCA, s3_server: SeaweedS3, s3_client: Any, bucket: str, s3_env: dict[str, str],
    tmp_path: Path,
) -> None:  # fmt: skip
    files = small_files(20)
    upload_all(s3_client, bucket, "m", files)
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        proxy.faults.flip_key = "m/s/f0003.json"
        proxy.faults.flip_offset = 5
        proxy.faults.flip_times = 1
        dest = tmp_path / "d"
        proc = run_cli("pull", f"s3://{bucket}/m", str(dest), env=proxied_env(s3_env, proxy))
        assert proxy.faults.flip_times == 0  # the corruption did happen
    assert proc.returncode == 0, proc.stderr
    assert published(dest) == files
    assert run_cli("verify", str(dest), env=s3_env).returncode == 0


def test_a_small_object_replaced_after_the_listing_is_never_mixed(
    test_ca: TestCA, s3_server: SeaweedS3, s3_client: Any, bucket: str, s3_env: dict[str, str],
    tmp_path: Path,
) -> None:  # fmt: skip
    files = small_files(10)
    upload_all(s3_client, bucket, "m", files)
    key = "m/s/f0004.json"
    new = b"replaced" + os.urandom(3000)
    replaced = threading.Event()

    def replace_on_first_get(method: str, path: str) -> None:
        if method == "GET" and path.split("?")[0].endswith(key) and not replaced.is_set():
            replaced.set()
            put(s3_client, bucket, key, new)
        return None

    with S3FaultProxy(s3_server.endpoint, test_ca, gate=replace_on_first_get) as proxy:
        dest = tmp_path / "d"
        proc = run_cli("pull", f"s3://{bucket}/m", str(dest), env=proxied_env(s3_env, proxy))
    assert replaced.is_set()
    assert "Traceback" not in proc.stderr
    got = published(dest)
    if proc.returncode == 0:  # a consistent result: the new object, whole
        assert got == {**files, "s/f0004.json": new}
    else:  # a clear error naming the object, and never its old or mixed bytes published
        errors = error_lines(proc.stderr)
        assert len(errors) == 1 and "f0004.json" in errors[0], proc.stderr
        assert got.get("s/f0004.json", new) == new
        assert all(files[p] == d for p, d in got.items() if p != "s/f0004.json")
    again = run_cli("pull", f"s3://{bucket}/m", str(dest), env=s3_env)
    assert again.returncode == 0, again.stderr
    assert published(dest) == {**files, "s/f0004.json": new}


def test_a_small_object_stored_gzip_encoded_is_pulled_as_stored(
    s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """An object uploaded with Content-Encoding: gzip (a web tool's habit for .json) is S3's
    bytes as stored: the whole-object GET must not decode them (a ranged read would not)."""
    raw = json.dumps({"vocab": list(range(3000))}).encode()
    stored = gzip.compress(raw)
    put(s3_client, bucket, "m/tokenizer.json", stored, ContentEncoding="gzip",
        ContentType="application/json")  # fmt: skip
    put(s3_client, bucket, "m/config.json", b'{"a": 1}')
    head = s3_client.head_object(Bucket=bucket, Key="m/tokenizer.json")
    assert head.get("ContentEncoding") == "gzip"  # the server does say so
    dest = tmp_path / "d"
    proc = run_cli("pull", f"s3://{bucket}/m", str(dest), env=s3_env)
    assert proc.returncode == 0, proc.stderr
    assert published(dest) == {"tokenizer.json": stored, "config.json": b'{"a": 1}'}


def test_more_small_bytes_than_the_body_budget_at_a_high_concurrency(
    s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """72 objects of exactly 1 MiB (the largest fetched whole) at --concurrency 64: more than
    the 64 MiB the describes may hold, so some go the HEAD-and-ranged-read way; all arrive."""
    files = {f"w/{i:03d}.bin": i.to_bytes(2, "big") + os.urandom(MiB - 2) for i in range(72)}
    upload_all(s3_client, bucket, "m", files)
    dest = tmp_path / "d"
    proc = run_cli("pull", f"s3://{bucket}/m", str(dest), "--concurrency", "64", env=s3_env)
    assert proc.returncode == 0, proc.stderr
    assert published(dest) == files
    assert run_cli("verify", str(dest), env=s3_env).returncode == 0


@pytest.mark.parametrize("fault", ["cut", "refuse"])
def test_a_small_objects_get_failing_once_is_retried_and_published(
    test_ca: TestCA, s3_server: SeaweedS3, s3_client: Any, bucket: str, s3_env: dict[str, str],
    tmp_path: Path, fault: str,
) -> None:  # fmt: skip
    """The one GET that describes a small object, cut mid-body or refused with 503 SlowDown:
    retried, and the object published whole."""
    files = small_files(6, size=40_000)
    upload_all(s3_client, bucket, "m", files)
    key = "m/s/f0002.json"
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        f = proxy.faults
        if fault == "cut":
            f.cut_key, f.cut_after, f.cut_times = key, 1000, 1
        elif fault == "refuse":
            f.refuse_key, f.refuse_times, f.refuse_retry_after = key, 2, "0"
        else:
            f.trickle_key, f.trickle, f.trickle_times = key, (1000, 1.0), 1
        dest = tmp_path / "d"
        args = ("--stall-timeout", "2s") if fault == "trickle" else ()
        proc = run_cli("pull", f"s3://{bucket}/m", str(dest), *args, env=proxied_env(s3_env, proxy))
        gets = [r for r in proxy.requests if r[0] == "GET" and r[1] == key]
    assert proc.returncode == 0, proc.stderr
    assert published(dest) == files
    assert len(gets) >= 2  # the fault did happen


@pytest.mark.parametrize("options", [("--concurrency", "1"), ("--concurrency", "64"),
                                     ("--no-verify",), ("--processes", "2")])  # fmt: skip
def test_small_files_beside_multipart_ones_at_any_concurrency(
    s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path, options: tuple[str, ...]
) -> None:
    files = small_files(60)
    files["empty.txt"] = b""
    files["exactly-1MiB.bin"] = os.urandom(MiB)
    files["just-over.bin"] = os.urandom(MiB + 1)
    upload_all(s3_client, bucket, "m", files)
    # multipart: a large one, and a small one of one part (its ETag "...-1": described by a HEAD)
    for name, data in (
        ("big.bin", os.urandom(11 * MiB + 5)),
        ("one-part.bin", os.urandom(300_000)),
    ):
        put_multipart(s3_client, bucket, f"m/{name}", data)
        files[name] = data
    dest = tmp_path / "d"
    proc = run_cli("pull", f"s3://{bucket}/m", str(dest), *options, env=s3_env)
    assert proc.returncode == 0, proc.stderr
    assert published(dest) == files
    assert not list((dest / ".prefetch").rglob("*.incomplete"))
    if "--no-verify" not in options:
        check = run_cli("verify", str(dest), env=s3_env)
        assert check.returncode == 0, check.stderr


@pytest.mark.parametrize(
    ("sig", "processes"), [(signal.SIGINT, 1), (signal.SIGTERM, 1), (signal.SIGINT, 2)]
)
def test_a_stop_in_the_middle_of_many_small_files_then_the_next_run_completes(
    test_ca: TestCA, s3_server: SeaweedS3, s3_client: Any, bucket: str, s3_env: dict[str, str],
    tmp_path: Path, sig: signal.Signals, processes: int,
) -> None:  # fmt: skip
    """The signal goes to the whole process group, as a terminal's Ctrl-C does (with
    --processes 2, the children get it too)."""
    files = small_files(400, size=2000)
    upload_all(s3_client, bucket, "m", files)
    dest = tmp_path / "d"
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        proxy.faults.throttle_bps = 1_300_000  # a body waits ~50 ms: the pull lasts to be stopped
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefetch.cli", "pull", f"s3://{bucket}/m", str(dest),
             "--concurrency", "4", "--processes", str(processes)],
            env=proxied_env(s3_env, proxy), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        try:
            wait_for(lambda: len(list(dest.glob("s/*.json"))) >= 20, "20 files published")
            os.killpg(proc.pid, sig)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    stderr = err.decode()
    assert "Traceback" not in stderr
    if sig == signal.SIGINT:  # docs/pulling.md: a Ctrl-C exits with status 130
        assert proc.returncode == 130, stderr
    else:  # SIGTERM (the agent's, a Job's end): the pull stops, one error line
        assert proc.returncode == 1 and len(error_lines(stderr)) == 1, stderr
    got = published(dest)
    assert 20 <= len(got) < len(files)
    assert all(files[p] == data for p, data in got.items())  # nothing half-written shown
    again = run_cli("pull", f"s3://{bucket}/m", str(dest), env=s3_env)
    assert again.returncode == 0, again.stderr
    assert published(dest) == files
    assert not list((dest / ".prefetch").rglob("*.incomplete"))
    assert run_cli("verify", str(dest), env=s3_env).returncode == 0


def test_a_pull_lasting_several_seconds_is_signed_right_throughout(
    test_ca: TestCA, s3_server: SeaweedS3, s3_client: Any, bucket: str, s3_env: dict[str, str],
    tmp_path: Path,
) -> None:  # fmt: skip
    """Static keys against SeaweedFS's signature checks, through a slow proxy: requests signed
    across several seconds (the X-Amz-Date kept per second) are all accepted."""
    files = small_files(40, size=3000)
    upload_all(s3_client, bucket, "m", files)
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        proxy.faults.throttle_bps = 440_000  # a body (< 64 KiB) waits ~150 ms: some 3 s
        dest = tmp_path / "d"
        proc = run_cli(
            "pull", f"s3://{bucket}/m", str(dest), "--concurrency", "2",
            env=proxied_env(s3_env, proxy),
        )  # fmt: skip
        gets = [r for r in proxy.requests if r[0] == "GET" and not r[2]]  # (no listing)
    assert proc.returncode == 0, proc.stderr
    assert len(gets) == len(files)  # every one signed right the first time
    assert published(dest) == files


def test_a_disk_filling_up_during_small_file_writes_is_one_clear_line(
    test_ca: TestCA, s3_server: SeaweedS3, s3_client: Any, bucket: str, s3_env: dict[str, str],
    small_fs: Path,
) -> None:  # fmt: skip
    """The disk fills (another writer) while small files are written whole: one error line,
    only whole, right files visible; once room is made the next run completes."""
    files = small_files(150, size=200 * 1024)
    upload_all(s3_client, bucket, "m", files)
    dest = small_fs / "d"
    with S3FaultProxy(s3_server.endpoint, test_ca) as proxy:
        proxy.faults.throttle_bps = 4 * MiB  # a body waits ~16 ms: time to fill the disk
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefetch.cli", "pull", f"s3://{bucket}/m", str(dest),
             "--concurrency", "4"],
            env=proxied_env(s3_env, proxy), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            wait_for(lambda: len(list(dest.glob("s/*.json"))) >= 10, "10 files published")
            filler = small_fs / "filler"
            with filler.open("wb") as out, contextlib.suppress(OSError):
                while True:
                    out.write(b"\0" * MiB)
                    out.flush()
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    stderr = err.decode()
    assert proc.returncode != 0, stderr
    assert "Traceback" not in stderr
    errors = error_lines(stderr)
    assert len(errors) == 1 and "space" in errors[0].lower(), stderr
    got = published(dest)
    assert 10 <= len(got) < len(files)
    assert all(files[p] == data for p, data in got.items())
    filler.unlink()
    again = run_cli("pull", f"s3://{bucket}/m", str(dest), env=s3_env)
    assert again.returncode == 0, again.stderr
    assert published(dest) == files


class _RegionalFront(BaseHTTPRequestHandler):
    """SeaweedFS as a bucket in eu-west-1: a request signed for another region is answered
    as S3 does (``status``, x-amz-bucket-region), one signed for eu-west-1 is forwarded."""

    protocol_version = "HTTP/1.1"
    upstream: tuple[str, int] = ("", 0)
    ca: TestCA
    status = 301
    seen: list[tuple[str, str, str]] = []

    def _handle(self) -> None:
        match = re.search(r"Credential=[^/]+/\d{8}/([^/]+)/", self.headers["Authorization"] or "")
        region = match.group(1) if match else ""
        type(self).seen.append((self.command, self.path, region))
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        if region != "eu-west-1":
            answer = b"<Error><Code>PermanentRedirect</Code><Message>moved</Message></Error>"
            self.send_response(self.status)
            self.send_header("x-amz-bucket-region", "eu-west-1")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(answer)
            return
        up = http.client.HTTPSConnection(*self.upstream, context=self.ca.client_context())
        up.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
        resp = up.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                self.send_header(k, v)
        if self.command != "HEAD" or resp.getheader("Content-Length"):
            self.send_header("Content-Length", resp.getheader("Content-Length") or str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        up.close()

    do_GET = do_HEAD = _handle

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize("status", [301, 400])
def test_a_bucket_in_another_region_is_pulled_signed_for_its_region(
    test_ca: TestCA, s3_server: SeaweedS3, s3_client: Any, bucket: str, s3_env: dict[str, str],
    tmp_path: Path, status: int,
) -> None:  # fmt: skip
    """Every request after the region redirect (the bucket's URL taken apart once, rebuilt)
    is signed for the bucket's region: the listing, the small files' GETs, a large file's
    HEAD and ranged GETs."""
    files = small_files(12)
    files["big.bin"] = os.urandom(3 * MiB + 7)
    upload_all(s3_client, bucket, "m", files)
    up = urlsplit(s3_server.endpoint)
    handler = type(
        "Front", (_RegionalFront,),
        {"upstream": (up.hostname, up.port), "ca": test_ca, "status": status, "seen": []},
    )  # fmt: skip
    server = TLSThreadingHTTPServer(("127.0.0.1", 0), handler, test_ca.server_context())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = dict(s3_env, AWS_ENDPOINT_URL=test_ca.url(server.server_address[1], "s3"))
        env["AWS_DEFAULT_REGION"] = "us-east-1"
        dest = tmp_path / "d"
        proc = run_cli("pull", f"s3://{bucket}/m", str(dest), env=env)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr
    assert published(dest) == files
    regions = [r for _, _, r in handler.seen]
    assert regions[0] == "us-east-1" and regions.count("us-east-1") == 1, handler.seen
    assert len([1 for m, p, r in handler.seen if m == "GET" and "big.bin" in p]) >= 1


@pytest.mark.parametrize("spelling", ["upper", "slash"])
def test_an_endpoint_written_another_way_is_signed_as_sent(
    s3_server: SeaweedS3, s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path,
    spelling: str,
) -> None:  # fmt: skip
    """The bucket's URL taken apart once: an endpoint in capitals or with a trailing slash
    still signs the Host header and path that go on the wire (SeaweedFS checks them)."""
    files = small_files(4)
    files["big.bin"] = os.urandom(2 * MiB + 1)
    upload_all(s3_client, bucket, "m", files)
    endpoint = s3_server.endpoint
    if spelling == "upper":
        scheme, rest = endpoint.split("://", 1)
        host, port = rest.rsplit(":", 1)
        endpoint = f"{scheme.upper()}://{host.upper()}:{port}"
    else:
        endpoint += "/"
    dest = tmp_path / "d"
    proc = run_cli(
        "pull", f"s3://{bucket}/m", str(dest), env=dict(s3_env, AWS_ENDPOINT_URL=endpoint)
    )
    assert proc.returncode == 0, proc.stderr
    assert published(dest) == files


# -- TLS trust ---------------------------------------------------------------------------------


class _Closing(BaseHTTPRequestHandler):
    """Answers every GET 200 and closes the connection: each request needs a new handshake."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(b"ok")
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def closing_https(test_ca: TestCA) -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Closing)
    server.daemon_threads = True
    server.socket = test_ca.server_context().wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_a_bundle_rotated_to_one_without_the_ca_refuses_the_next_connection(
    closing_https: int, test_ca: TestCA, tmp_path: Path
) -> None:
    """A long-lived pool (the agent's) once trusting the CA stops trusting it when the bundle
    on disk no longer holds it: the cached context is not kept (written in place, as an editor
    or a copy does, and replaced by a new file, as a ConfigMap is)."""
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(test_ca.ca_file.read_bytes())
    pool = make_http_pool(4, proxies=settings.proxies({}), ca_certs=str(bundle))
    url = test_ca.url(closing_https, "hub") + "/x"
    for _ in range(2):
        assert send(pool, "GET", url, headers={}).raw.status == 200
    other = trustme.CA(organization_name="not the test CA").cert_pem.bytes()
    bundle.write_bytes(other)  # in place: the same inode
    with pytest.raises(TlsError, match="certificate verify failed"):
        send(pool, "GET", url, headers={})
    bundle.write_bytes(test_ca.ca_file.read_bytes())
    assert send(pool, "GET", url, headers={}).raw.status == 200
    rotated = tmp_path / "rotated.pem"
    rotated.write_bytes(other)
    rotated.replace(bundle)  # a new file
    with pytest.raises(TlsError, match="certificate verify failed"):
        send(pool, "GET", url, headers={})


@pytest.mark.parametrize("trust", ["AWS_CA_BUNDLE", "--ca-bundle"])
def test_an_s3_pull_through_an_https_proxy_trusts_the_chosen_bundle_for_it(
    test_ca: TestCA, s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path,
    trust: str,
) -> None:  # fmt: skip
    """HTTPS_PROXY=https://... with a certificate from the private CA, the CA named only by
    AWS_CA_BUNDLE or --ca-bundle (no SSL_CERT_FILE): the proxy and the server are both verified
    with it, the listing's requests as the objects'."""
    files = small_files(5)
    files["big.bin"] = os.urandom(2 * MiB + 3)
    upload_all(s3_client, bucket, "m", files)
    proxy = ForwardProxy()
    server = proxy._server  # (the test fake's own server, given TLS: an https:// proxy)
    server.socket = test_ca.server_context().wrap_socket(server.socket, server_side=True)
    env = {
        k: v
        for k, v in s3_env.items()
        if k not in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
    }
    ca = env.pop("AWS_CA_BUNDLE")
    args = ("--ca-bundle", ca) if trust == "--ca-bundle" else ()
    if not args:
        env["AWS_CA_BUNDLE"] = ca
    with proxy:
        port = server.server_address[1]
        env.update(HTTPS_PROXY=test_ca.url(port, "proxy"), NO_PROXY="")
        env = {k: v for k, v in env.items() if k.lower() not in ("http_proxy", "no_proxy")}
        dest = tmp_path / "d"
        proc = run_cli("pull", f"s3://{bucket}/m", str(dest), *args, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proxy.through(s3_client.meta.endpoint_url) >= 1
        other = tmp_path / "other.pem"  # a bundle without the CA: the proxy refused, named
        trustme.CA(organization_name="not the test CA").cert_pem.write_to_path(str(other))
        env.pop("AWS_CA_BUNDLE", None)
        refused = run_cli(
            "pull", f"s3://{bucket}/m", str(tmp_path / "e"), "--ca-bundle", str(other), env=env
        )
    assert published(dest) == files
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    errors = error_lines(refused.stderr)
    assert len(errors) == 1 and "certificate verify failed" in errors[0], refused.stderr
    assert "proxy" in errors[0], refused.stderr


def test_a_public_store_named_while_the_endpoint_uses_a_private_ca_is_one_clear_line(
    s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    import certifi

    put(s3_client, bucket, "m/config.json", b"{}")
    env = {
        k: v
        for k, v in s3_env.items()
        if k not in ("SSL_CERT_FILE", "AWS_CA_BUNDLE", "CURL_CA_BUNDLE")
    }
    env["REQUESTS_CA_BUNDLE"] = certifi.where()
    proc = run_cli("pull", f"s3://{bucket}/m", str(tmp_path / "d"), env=env)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and "certificate" in errors[0], proc.stderr
    # the private CA named by a later variable is chosen over the public store
    env["AWS_CA_BUNDLE"] = s3_env["AWS_CA_BUNDLE"]
    ok = run_cli("pull", f"s3://{bucket}/m", str(tmp_path / "d"), env=env)
    assert ok.returncode == 0, ok.stderr


def test_a_wrong_ca_bundle_is_refused_in_one_line(
    s3_client: Any, bucket: str, s3_env: dict[str, str], tmp_path: Path
) -> None:
    put(s3_client, bucket, "m/config.json", b"{}")
    other = tmp_path / "other.pem"
    trustme.CA(organization_name="not the test CA").cert_pem.write_to_path(str(other))
    proc = run_cli(
        "pull", f"s3://{bucket}/m", str(tmp_path / "d"), "--ca-bundle", str(other), env=s3_env
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and "certificate verify failed" in errors[0], proc.stderr


# -- the command line, its commands imported lazily -------------------------------------------


def _commands(env: dict[str, str]) -> list[str]:
    out = run_cli("--help", env=env).stdout
    listed = out.split("Commands:", 1)[1].split("\n\n", 1)[0]
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def test_every_command_and_subcommand_has_its_help(tmp_path: Path) -> None:
    env = dict(os.environ, HF_HOME=str(tmp_path))
    commands = _commands(env)
    assert {"pull", "agent", "mirror", "verify", "cache"} <= set(commands)
    for name in commands:
        proc = run_cli(name, "--help", env=env)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (name, proc.stderr)
        assert proc.stdout.startswith("Usage:"), name
        if "Commands:" in proc.stdout:
            for sub in proc.stdout.split("Commands:", 1)[1].split("\n\n", 1)[0].splitlines():
                if sub.strip():
                    inner = run_cli(name, sub.split()[0], "--help", env=env)
                    assert inner.returncode == 0, (name, sub, inner.stderr)
                    assert "Traceback" not in inner.stderr


def test_an_unknown_command_and_a_malformed_uri_are_one_line(tmp_path: Path) -> None:
    env = dict(os.environ, HF_HOME=str(tmp_path))
    unknown = run_cli("frobnicate", env=env)
    assert unknown.returncode == 2 and error_lines(unknown.stderr) == [
        "Error: No such command 'frobnicate'."
    ]
    for uri in ("s3://", "nope://x", "hf://", "oci://"):
        proc = run_cli("pull", uri, str(tmp_path / "d"), env=env)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, (uri, proc.stderr)
        assert len(error_lines(proc.stderr)) == 1, (uri, proc.stderr)
    version = run_cli("--version", env=env)
    assert version.returncode == 0 and version.stdout.startswith("prefetch, version ")


@pytest.mark.parametrize(("typo", "meant"), [("pul", "pull"), ("verfy", "verify"),
                                             ("agnet", "agent")])  # fmt: skip
def test_a_mistyped_command_still_suggests_the_command_meant(
    tmp_path: Path, typo: str, meant: str
) -> None:
    """click's "Did you mean" looks among the commands the group holds: the lazily imported
    ones must be among them (before issue 33 every command was)."""
    proc = run_cli(typo, env=dict(os.environ, HF_HOME=str(tmp_path)))
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == [f"Error: No such command '{typo}'. Did you mean '{meant}'?"]
