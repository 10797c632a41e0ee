"""The agent's config file as the reconcile loop reads it: parsed, with the command line's
overrides applied, and each distinct content acted on once, so that a rejected file is reported
once (on /readyz, in the metrics and in one log line) rather than on every poll."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

from prefetch.agent.config import AgentConfig, load_config, parse_config
from prefetch.agent.metrics import AgentMetrics
from prefetch.support.errors import ConfigError

# Its lines keep the logger name they have always had, so log queries keep matching.
log = logging.getLogger("prefetch.agent.loop")

__all__ = ["ConfigFile"]


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
