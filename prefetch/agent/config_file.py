"""The agent's config file as the reconcile loop reads it: parsed, with the command line's
overrides applied, and each distinct content acted on once, so that a rejected file is reported
once (on /readyz, in the metrics and in one log line) rather than on every poll; and when the
loop reads it again (:class:`ReloadTimer`: shortly after a change event, else on a poll)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from pathlib import Path

from prefetch.agent.config import load_config, parse_config
from prefetch.agent.config_values import AgentConfig
from prefetch.agent.metrics import AgentMetrics
from prefetch.support.errors import ConfigError

# Its lines keep the logger name they have always had, so log queries keep matching.
log = logging.getLogger("prefetch.agent.loop")

#: Re-read the config file this often even without a watchdog event (belt and braces).
CONFIG_POLL_INTERVAL = 30.0
#: Wait this long after a config change event before reading (kubelet swaps in a few steps).
CONFIG_DEBOUNCE = 0.3

__all__ = [
    "CONFIG_DEBOUNCE",
    "CONFIG_POLL_INTERVAL",
    "ConfigFile",
    "ReloadTimer",
    "keep_restart_fields",
    "log_reloaded",
]


class ConfigFile:
    """The config file as the agent reads it: parsed, with the command line's overrides, and
    each content acted on once (unchanged bytes, or a rejection already reported, are quiet)."""

    def __init__(
        self,
        path: Path | None,
        metrics: AgentMetrics,
        *,
        cache_dir: Path | None = None,
        listen: str | None = None,
        gpu_product: str | None = None,
    ) -> None:
        self.path = path
        self._metrics = metrics
        self._cache_dir = cache_dir
        self._listen = listen
        self._gpu_product = gpu_product
        self._seen_digest = ""
        #: Why the last reload was rejected (shown on /readyz); None after a good one.
        self.last_error: str | None = None

    def overridden(self, config: AgentConfig) -> AgentConfig:
        config = config.with_overrides(
            cache_dir=self._cache_dir, listen=self._listen, gpu_product=self._gpu_product
        )
        for name in config.unkeyed_compile_caches:
            log.warning(
                "%s: compile cache left out: no gpuProduct and no GPU product for this node "
                "(the node label nvidia.com/gpu.product, or --gpu-product)",
                name,
                extra={"model": name, "phase": "config"},
            )
        return config

    def load_first(self) -> AgentConfig:
        """At start-up: the file must load (errors are the process's)."""
        assert self.path is not None
        config = load_config(self.path)
        self._seen_digest = config.digest
        return config

    async def read_changed(self) -> AgentConfig | None:
        """The file's config (overridden) if it parses and differs from the last one seen; None
        when unchanged or rejected (why is in :attr:`last_error`, logged once)."""
        if self.path is None:
            return None
        try:
            data = await asyncio.to_thread(self.path.read_bytes)
        except OSError as exc:
            message = f"{self.path}: cannot read: {exc.strerror or exc}"
            self._reject(message, "unreadable:" + message)
            return None
        try:
            new = parse_config(data, path=self.path)
        except ConfigError as exc:
            self._reject(str(exc), hashlib.sha256(data).hexdigest())
            return None
        if new.digest == self._seen_digest:
            return None
        self._seen_digest = new.digest
        return self.overridden(new)

    def accepted(self) -> None:
        """The config :meth:`read_changed` returned is in use."""
        self.last_error = None
        self._metrics.config_last_reload_successful.set(1)

    def _reject(self, message: str, digest: str) -> None:
        if digest == self._seen_digest:
            return  # already rejected these very bytes (or this very error)
        self._seen_digest = digest
        self.last_error = message
        self._metrics.config_reload_failures.inc()
        self._metrics.config_last_reload_successful.set(0)
        log.error(
            "config reload rejected, the last good config keeps running: %s",
            message,
            extra={"phase": "config", "error": message},
        )


def keep_restart_fields(old: AgentConfig, new: AgentConfig) -> AgentConfig:
    """``new`` with ``old``'s cacheDir and listen: those take effect after a restart only."""
    if new.cache_dir == old.cache_dir and new.listen == old.listen:
        return new
    log.warning(
        "cacheDir and listen changes take effect after a restart; keeping %s, %s",
        old.cache_dir,
        old.listen,
        extra={"phase": "config"},
    )
    return dataclasses.replace(new, cache_dir=old.cache_dir, listen=old.listen)


def log_reloaded(old: AgentConfig, new: AgentConfig) -> None:
    """The log line of a reload: how many models, which were added and removed."""
    before = {m.name for m in old.models}
    after = {m.name for m in new.models}
    log.info(
        "config reloaded: %d model(s); added %s, removed %s",
        len(new.models),
        sorted(after - before) or "none",
        sorted(before - after) or "none",
        extra={"phase": "config"},
    )


class ReloadTimer:
    """When the loop reads the config file again: :data:`CONFIG_DEBOUNCE` after a change event
    (:meth:`changed`), and every :data:`CONFIG_POLL_INTERVAL` regardless. Used from the loop."""

    def __init__(self) -> None:
        self._reload_at: float | None = None
        self._next_poll = 0.0

    def read(self, now: float) -> None:
        """The file was just read: the next poll is an interval away."""
        self._reload_at = None
        self._next_poll = now + CONFIG_POLL_INTERVAL

    def changed(self) -> None:
        """A change event came: read soon (after the debounce)."""
        self._reload_at = time.monotonic() + CONFIG_DEBOUNCE

    def due(self, now: float) -> bool:
        """Whether the file should be read on this pass."""
        return (self._reload_at is not None and now >= self._reload_at) or now >= self._next_poll

    def wait_at_most(self, timeout: float) -> float:
        """How long the loop may sleep (shortened to the debounce's end)."""
        if self._reload_at is None:
            return timeout
        return max(0.0, min(timeout, self._reload_at - time.monotonic()))
