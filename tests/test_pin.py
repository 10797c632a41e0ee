"""A pin follows the config whenever it is loaded, not only when a sync downloads bytes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from prefetch.agent.loop import Agent
from prefetch.cli import main
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.store import Store
from tests.support import AgentThread, config_text, is_ready, publish_plain, upload, wait_for

MiB = 1024 * 1024


def spec(name: str, *, pin: bool) -> ModelSpec:
    return ModelSpec(source=parse_source_uri(f"s3://bucket/{name}"), name=name, pin=pin)


def listed(config: Path) -> dict[str, dict[str, Any]]:
    """``prefetch ls --config FILE --json`` by model directory name."""
    result = CliRunner().invoke(main, ["ls", "--config", str(config), "--json"])
    assert result.exit_code == 0, result.output
    return {e["name"]: e for e in json.loads(result.stdout)}


# -- the store -----------------------------------------------------------------------------------


def test_record_pin_pins_and_unpins_a_cached_model(tmp_path: Path) -> None:
    store = Store(tmp_path)
    publish_plain(tmp_path, spec("a", pin=False), {"w.bin": b"x" * 100})
    store.touch(spec("a", pin=False))

    assert store.record_pin(spec("a", pin=True))
    assert store.entry("models/a").pinned  # type: ignore[union-attr]
    assert store.eviction_candidates([]) == []
    assert not store.record_pin(spec("a", pin=True))  # unchanged: nothing written

    assert store.record_pin(spec("a", pin=False))
    assert [e.key for e in store.eviction_candidates([])] == ["models/a"]


def test_record_pin_leaves_models_not_in_the_cache_alone(tmp_path: Path) -> None:
    store = Store(tmp_path)
    assert not store.record_pin(spec("absent", pin=True))
    assert not (tmp_path / "models" / "absent").exists()


# -- the agent -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_pin_added_to_a_cached_model_is_recorded_and_keeps_it_after_it_leaves_the_config(
    s3_client: Any, bucket: str, small_fs: Path, tmp_path: Path
) -> None:
    # 124 MiB filesystem, 64 MiB kept free: a and c (12 MiB each) fit, d (45 MiB) needs room
    for i, (name, size) in enumerate((("a", 12 * MiB), ("c", 12 * MiB), ("d", 45 * MiB))):
        upload(s3_client, bucket, name, tmp_path, size, seed=i)
    cache = small_fs / "cache"
    config = tmp_path / "models.yaml"

    def write(**pins: bool) -> None:
        models = [{"name": n, "source": f"s3://{bucket}/{n}", "pin": p} for n, p in pins.items()]
        config.write_text(config_text(cache, models, minFreeSpace="64MiB"))

    def pinned(name: str) -> bool:
        return bool(listed(config)[name]["pinned"])

    write(a=False, c=False)
    agent = Agent(config, s3_client=s3_client, serve=False, tick=0.2)
    with AgentThread(agent):
        wait_for(lambda: is_ready(agent, "a") and is_ready(agent, "c"), "a and c")
        assert not pinned("a")

        write(a=True, c=False)  # the pin comes later, with the model already cached
        wait_for(lambda: pinned("a"), "prefetch ls to show a pinned", dump=agent.status)

        store = Store(cache)
        store.set_last_used("models/a", time.time() - 3000)  # the oldest: first to go if unpinned
        store.set_last_used("models/c", time.time() - 1000)
        write(d=False)  # a and c leave the config; d needs one of them evicted
        wait_for(lambda: is_ready(agent, "d"), "d after an eviction", dump=agent.status)
        assert sorted(p.name for p in (cache / "models").iterdir()) == ["a", "d"]

        write(d=False, a=False)  # unpinned while wanted again
        wait_for(lambda: not pinned("a"), "prefetch ls to show a unpinned", dump=agent.status)
        write(d=False)
        wait_for(lambda: agent.config.model("a") is None, "the agent to drop a from its config")
    assert [e.key for e in Store(cache).eviction_candidates(agent.config.models)] == ["models/a"]


@pytest.mark.slow
def test_a_pin_added_later_keeps_prefetch_gc_off_the_model_and_an_unpin_lets_it_go(
    s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    upload(s3_client, bucket, "a", tmp_path, 1 * MiB)
    cache = tmp_path / "cache"
    config = tmp_path / "models.yaml"

    def write(pin: bool | None) -> None:
        models = [] if pin is None else [{"name": "a", "source": f"s3://{bucket}/a", "pin": pin}]
        config.write_text(config_text(cache, models))

    def gc() -> str:
        done = CliRunner().invoke(main, ["gc", "--config", str(config)])
        assert done.exit_code == 0, done.output
        return done.stderr

    write(pin=False)
    agent = Agent(config, s3_client=s3_client, serve=False, tick=0.2)
    with AgentThread(agent):
        wait_for(lambda: is_ready(agent, "a"), "a", dump=agent.status)
        write(pin=True)
        wait_for(lambda: listed(config)["a"]["pinned"], "a pinned", dump=agent.status)
    write(pin=None)  # a leaves the config: gc keeps it, pinned
    assert "kept models/a: pinned" in gc()
    assert (cache / "models" / "a").is_dir()

    write(pin=False)  # back, unpinned: recorded as soon as the config loads
    agent = Agent(config, s3_client=s3_client, serve=False, tick=0.2)
    with AgentThread(agent):
        wait_for(lambda: not listed(config)["a"]["pinned"], "a unpinned", dump=agent.status)
    write(pin=None)
    assert "evicted models/a" in gc()
    assert not (cache / "models" / "a").exists()
