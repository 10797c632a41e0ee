"""Helpers shared by several test modules (fixtures live in conftest.py).

One place for what used to be defined in one test module and imported by others: a fast transfer
configuration, the CLI and agent runners, uploads to S3, the Hub test model's names, environments
for subprocesses, and polling. No test module imports another test module.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from prefetch.demo.locals3 import SeaweedS3
from prefetch.demo.modelgen import generate_model, upload_model
from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.snapshot import Checksum, RemoteFile, Snapshot
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import SyncResult, sync
from prefetch.sources.s3.source import S3Source

if TYPE_CHECKING:
    from prefetch.agent.loop import Agent

    from .fakes.hubserver import HubServer

MiB = 1024 * 1024
REPO_ROOT = Path(__file__).resolve().parent.parent

HUB_REPO = "acme/tiny"
"""The Hub repo most Hub tests serve."""
HUB_SHARDS = (3 * MiB, 2 * MiB)
"""Its safetensors shard sizes."""
HUB_TOKEN = "hf_PrefetchTestToken_7f3a9c"
"""A token that looks real enough for the redaction rules to catch."""


# -- transfers ------------------------------------------------------------------------------------


def fast_config(*, concurrency: int = 8, attempts: int = 4) -> TransferConfig:
    """Small chunks and millisecond backoff, so failure paths run in a test's time."""
    return TransferConfig(
        concurrency=concurrency,
        chunk_size=1 * MiB,
        buffer_size=256 * 1024,
        retry=RetryPolicy(attempts=attempts, base_delay=0.01, max_delay=0.05),
    )


FAST = fast_config()


def pull_s3(
    client: Any, uri: str, dest: Path, *, config: TransferConfig = FAST, **spec_kwargs: Any
) -> SyncResult:
    """Sync ``uri`` into a plain layout at ``dest`` in-process."""
    spec = ModelSpec(source=parse_source_uri(uri), **spec_kwargs)
    return sync(spec, S3Source(client, spec.source), PlainLayout(dest), config)


def journaled_bytes(partial: Path) -> int:
    """Bytes the resume journals under ``partial`` record as written."""
    done = 0
    for journal in partial.glob("*.journal") if partial.exists() else []:
        if not journal.with_suffix(".incomplete").exists():
            continue  # published a moment ago: its bytes are counted as a published file
        try:
            lines = journal.read_text().splitlines()
        except FileNotFoundError:
            continue
        if not lines:
            continue
        try:
            chunks = json.loads(lines[0])["chunks"]
            for line in lines[1:]:
                start, end = chunks[json.loads(line)["i"]]
                done += end - start
        except (ValueError, KeyError, IndexError):
            continue
    return done


# -- S3 -------------------------------------------------------------------------------------------


def put(client: Any, bucket: str, key: str, data: bytes, **kwargs: Any) -> None:
    """``put_object``, working around SeaweedFS's answer to an empty PUT."""
    if not data:
        # SeaweedFS 4.48 answers an empty PUT with a stray second response that poisons the
        # keep-alive connection for the next request: upload empty objects on a throwaway client.
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=client.meta.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=client._request_signer._credentials.access_key,
            aws_secret_access_key=client._request_signer._credentials.secret_key,
        )
    client.put_object(Bucket=bucket, Key=key, Body=data, **kwargs)


def upload(
    client: Any,
    bucket: str,
    prefix: str,
    work: Path,
    size: int,
    *,
    seed: int = 0,
    create_bucket: bool = False,
) -> dict[str, bytes]:
    """Generate and upload a model; returns its files (relative path -> bytes)."""
    files = generate_model(work / f"src-{bucket}-{prefix}", size, shards=3, seed=seed)
    upload_model(client, bucket, prefix, files, create_bucket=create_bucket)
    return {f.path: f.local.read_bytes() for f in files}


# -- the local cache ------------------------------------------------------------------------------


def publish_plain(cache: Path, s: ModelSpec, files: dict[str, bytes]) -> PlainLayout:
    """Put a model into the plain layout through the layout's own publish/commit."""
    layout = PlainLayout(cache / "models" / s.name)
    layout.staging_dir().mkdir(parents=True, exist_ok=True)
    remote = []
    for path, data in files.items():
        f = RemoteFile(path=path, size=len(data), version="etag-1")
        staged = layout.staging_dir() / "staged"
        staged.write_bytes(data)
        layout.publish(f, staged, (Checksum("sha256", hashlib.sha256(data).hexdigest()),))
        remote.append(f)
    layout.commit(Snapshot(str(s.source), "rev-" + s.name, tuple(remote)), s, delete=False)
    return layout


@contextlib.contextmanager
def mounted_tmpfs(size_mib: int) -> Iterator[Path]:
    """A tmpfs of ``size_mib`` MiB, outside pytest's tmp dirs (which other sessions may clean
    up); skips the test where mounting is not allowed, fails it in CI."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = Path(tempfile.mkdtemp(prefix="prefetch-small-fs-"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        mnt.rmdir()
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a tmpfs in CI: {done.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        with contextlib.suppress(OSError):
            mnt.rmdir()


# -- subprocesses ---------------------------------------------------------------------------------


def s3_subprocess_env(server: SeaweedS3, work: Path) -> dict[str, str]:
    """Environment for a `prefetch` subprocess talking to the local S3 server: its endpoint and
    credentials (and, over HTTPS, its CA: :meth:`SeaweedS3.aws_env`, beside the session CA this
    process trusts), AWS and HF config files under ``work`` (never the user's), unbuffered
    output."""
    env = dict(os.environ)
    env.update(
        server.aws_env(work),
        HF_HOME=str(work / "hf-home"),
        PYTHONUNBUFFERED="1",
    )
    env.pop("PREFETCH_DEBUG", None)
    return env


def run_cli(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m prefetch.cli ARGS`` with output captured."""
    return subprocess.run(
        [sys.executable, "-m", "prefetch.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment without HF_*/PREFETCH_*/proxy settings, HF_HOME=home."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGING", "PREFETCH_")) and "proxy" not in k.lower()
    }
    env.update(
        HF_HOME=str(home),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        NO_PROXY="127.0.0.1,localhost",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO_ROOT),
        **extra,
    )
    return env


def hf_check(home: Path, body: str, *, endpoint: str | None = None, **params: Any) -> Any:
    """Run ``body`` with huggingface_hub in a fresh interpreter, HF_HOME=home, offline unless an
    endpoint is given; the body fills ``out``, which is returned."""
    script = "import json, sys\nimport huggingface_hub as hf\n"
    script += "params = json.loads(sys.argv[1])\nout = {}\n"
    script += textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    extra = {"HF_ENDPOINT": endpoint} if endpoint else {"HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(params)],
        env=clean_env(home, **extra),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=home,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def server_files(hub: HubServer, repo: str = HUB_REPO, revision: str = "main") -> dict[str, bytes]:
    """What the Hub server serves for ``repo`` at ``revision``, by path."""
    return {p: f.read() for p, f in hub.files(repo, revision).items()}


# -- polling --------------------------------------------------------------------------------------


def wait_for(
    check: Callable[[], Any],
    what: str,
    timeout: float = 30.0,
    dump: Callable[[], Any] | None = None,
    interval: float = 0.1,
) -> Any:
    """Poll ``check`` until it returns something true (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{json.dumps(dump(), indent=1, default=str)}" if dump else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{extra}")
        time.sleep(interval)


def kill_9_when(
    proc: subprocess.Popen[bytes],
    reached: Callable[[], bool],
    what: str,
    *,
    timeout: float = 60.0,
    interval: float = 0.01,
) -> None:
    """SIGKILL ``proc`` as soon as ``reached()`` (a crash mid-work, for the resume tests); fail
    if it ended first. Its pipes are closed and it is reaped whatever happens."""
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not reached():
            time.sleep(interval)
        assert proc.poll() is None, f"the {what} ended before it could be killed: {proc.poll()}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


# -- the agent ------------------------------------------------------------------------------------


def config_text(cache: Path, models: list[dict[str, Any]], **top: Any) -> str:
    """An agent config file's text with quick retries."""
    doc: dict[str, Any] = {
        "cacheDir": str(cache),
        "minFreeSpace": "1MiB",
        "retryBackoff": {"initial": "1s", "max": "2s"},
        **top,
        "models": models,
    }
    return yaml.safe_dump(doc, sort_keys=False)


class AgentThread:
    """An in-process agent on its own event loop thread."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="agent", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self.agent.run())
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> Agent:
        self.thread.start()
        wait_for(lambda: self.agent.passes > 0 or self.error, "the agent's first pass")
        if self.error:
            raise self.error
        return self.agent

    def __exit__(self, *exc: object) -> None:
        self.agent.request_stop()
        self.thread.join(40)
        assert not self.thread.is_alive(), "the agent did not stop"
        if self.error and not exc[0]:
            raise self.error


def model_status(agent: Agent, name: str) -> dict[str, Any]:
    """The agent's status entry for model ``name`` ({} if absent)."""
    for m in agent.status()["models"]:
        if m["name"] == name:
            return m
    return {}


def is_ready(agent: Agent, name: str) -> bool:
    return bool(model_status(agent, name).get("ready"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class AgentProcess:
    """``python -m prefetch.cli agent`` with its stderr captured to a file."""

    def __init__(self, config: Path, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("ab") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "prefetch.cli",
                    "agent",
                    "--config",
                    str(config),
                    "--listen",
                    f"127.0.0.1:{self.port}",
                ],
                env=env,
                cwd=REPO_ROOT,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )

    def get(self, path: str) -> tuple[int, bytes]:
        return http_get(self.base + path)

    def up(self) -> bool:
        with contextlib.suppress(OSError):
            return self.get("/healthz")[0] == 200
        assert self.proc.poll() is None, f"the agent exited:\n{self.stderr()}"
        return False

    def metric(self, name: str, **labels: str) -> float | None:
        from prometheus_client.parser import text_string_to_metric_families

        _, body = self.get("/metrics")
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        return None

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def ready_then_terminated(self, timeout: float = 60) -> dict[str, Any]:
        """Wait until /readyz answers 200, then SIGTERM the agent and check it exits 0; the
        /readyz body it had when ready."""
        wait_for(lambda: self.up() and self.get("/readyz")[0] == 200, "ready", timeout=timeout)
        body: dict[str, Any] = json.loads(self.get("/readyz")[1])
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(30) == 0, self.stderr()
        return body

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# -- mirrors --------------------------------------------------------------------------------------


def write_mirror(
    client: Any,
    bucket: str,
    prefix: str,
    hub: HubServer,
    repo: str = HUB_REPO,
    revision: str = "main",
    *,
    refs: tuple[str, ...] | None = None,
    repo_id: str | None = None,
) -> str:
    """Write ``repo@revision`` as the Hub server serves it into ``s3://bucket/prefix`` in the
    mirror format (prefetch/sources/s3_mirror/format.py), directly with boto3 as ``prefetch mirror``
    would: blobs named by Hub id, then the commit's metadata, then its refs (``refs``: default
    ``(revision,)`` unless it is a sha). ``repo_id`` overrides the recorded repo. Returns the
    commit sha."""
    import base64
    from datetime import UTC, datetime

    from prefetch.pipeline import verify
    from prefetch.sources.s3_mirror.format import (
        MirrorCommit,
        MirrorFile,
        blob_key,
        is_commit,
        ref_key,
        snapshot_key,
    )

    found = hub.repos[repo].resolve(revision)
    assert found is not None, f"{repo} has no {revision}"
    commit = found.sha
    files = []
    for path, f in sorted(hub.files(repo, commit).items()):
        data = f.read()
        crc = verify.new_hasher("crc64nvme")
        crc.update(data)
        kind = "sha256" if f.sha256 is not None else "git-sha1"
        crc64 = base64.b64encode(crc.digest()).decode()
        files.append(MirrorFile(path, f.size, f.etag, kind, crc64))
        put(client, bucket, blob_key(prefix, f.etag), data)
    meta = MirrorCommit(
        repo_id=repo_id or repo,
        commit=commit,
        ref=revision,
        source=f"hf://{repo}@{revision}",
        mirrored_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        files=tuple(files),
    )
    put(client, bucket, snapshot_key(prefix, commit), meta.to_json())
    for ref in refs if refs is not None else (() if is_commit(revision) else (revision,)):
        put(client, bucket, ref_key(prefix, ref), commit.encode() + b"\n")
    return commit
