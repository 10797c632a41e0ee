"""The agent's config file (YAML, camelCase keys), parsed into frozen values.

::

    cacheDir: /var/cache/model-prefetch   # = HF_HOME for vLLM: hub/ (HF layout) and models/<name>/
    labelPrefix: model-prefetch.io        # node labels <prefix>/<model>=ready
    startupTaint: model-prefetch.io/warming   # key of the startup taint (effect NoSchedule)
    listen: 0.0.0.0:8090                  # /healthz, /readyz, /metrics
    concurrency: 16                       # ranged requests in flight per model sync
    chunkSize: 64MiB
    minRate: 64KiB                        # a request slower than this over stallTimeout is retried
    stallTimeout: 30s                     # (from its last byte; minRate 0: off)
    parallelModels: 2                     # models synced at the same time
    verifyInterval: 0                     # re-hash cached files this often (0/off: never)
    verifyReadRate: 200MB                 # bytes/s bound for those reads (0: unbounded)
    resolveInterval: 10m                  # re-resolve branches / S3 listings this often (0: never)
    retryBackoff: {initial: 10s, max: 10m}    # per-model backoff after a failed sync (doubles)
    syncDeadline: auto                    # bound of one sync attempt (auto: 10m, or the bytes to
                                          # fetch at 4 MiB/s if longer; a duration; off: none)
    minFreeSpace: 1GiB                    # kept free on the cache filesystem
    warmMemoryShare: 0.5                  # a warm-up fills at most this share of free memory
    warmReadRate: 2GB                     # bytes/s bound for warm-up reads (0: unbounded)
    s3: {endpointUrl: null}               # default: AWS_ENDPOINT_URL, else AWS
    caBundle: /etc/ssl/private-ca.pem     # CA bundle (PEM) for TLS to every source (default:
                                          # REQUESTS_CA_BUNDLE, SSL_CERT_FILE, AWS_CA_BUNDLE...)
    models:
      - name: llama-3-70b-awq             # DNS label; used in node labels
        source: hf://org/name             # or s3://bucket/prefix
        revision: main                    # hf: branch/tag/sha; others with hfRepo: 40-hex commit
        include: ["*.safetensors", "*.json"]
        exclude: []
        required: true                    # gates /readyz and the startup taint
        hfRepo: org/name                  # not hf: publish in the HF layout under this id
        pin: false                        # never evicted, even after leaving the config
        proxy: http://proxy:3128          # this model's sources through this proxy ("none":
                                          # direct); default HTTP(S)_PROXY; NO_PROXY applies
        mirrors: [s3://bucket/hf/org/name/]   # hf only: `prefetch mirror` prefixes tried first,
        hubFallback: true                 # in order; then the Hub unless this is false
        syncDeadline: 2h                  # this model's attempts (default: the top-level one)
        warmPageCache: false              # read the files into the page cache once published
        gateOnWarm: false                 # ready only after that warm-up (implies warmPageCache)
        caBundle: /etc/ssl/private-ca.pem # this model's sources' CAs (default: the top-level
                                          # caBundle, else the system's)

Every key, its values and default: docs/config.md, generated (like the chart's values.schema.json)
from the tables in :mod:`prefetch.agent.config_tables`
(:class:`~prefetch.agent.config_fields.Table`): a key is one ``Field`` line there, its parser and
its schema one :class:`~prefetch.agent.config_fields.Kind`. This module reads the file and its
top level; the sections have their own parsers (:mod:`~prefetch.agent.config_models`,
:mod:`~prefetch.agent.config_compile_caches`), and the result is an
:class:`~prefetch.agent.config_values.AgentConfig`.

One model per Hub repo: two models that publish into the same ``hub/models--org--name`` (two
``hf://`` sources of one repo, whatever their revisions, or an S3 mirror whose ``hfRepo`` is
another model's repo) are rejected, naming both; merge their include patterns into one model.
A model's ``pin`` is written into the cache's records each time the config loads, so pinning (or
unpinning) a model that is already cached takes effect at once, with no download.

Every error is a :class:`~prefetch.support.errors.ConfigError` whose message starts with the file
and the field path (``models[1].source: ...``). Unknown keys and duplicate model names are rejected.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from prefetch.agent.config_checks import check_keys, get, mapping
from prefetch.agent.config_compile_caches import parse_compile_caches
from prefetch.agent.config_models import ca_bundle, flagged, parse_models, per_model
from prefetch.agent.config_tables import BACKOFF, S3, TOP
from prefetch.agent.config_values import AgentConfig, Backoff, SyncDeadline
from prefetch.pipeline.spec import ModelSpec
from prefetch.support.errors import ConfigError

__all__ = ["load_config", "parse_config", "spec_digest"]


def load_config(path: str | Path) -> AgentConfig:
    """Read and validate the config file at ``path``."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{p}: config file not found",
            hint="pass --config (or PREFETCH_CONFIG) pointing at the agent's models.yaml",
        ) from exc
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the config file: {exc.strerror}") from exc
    return parse_config(data, path=p)


def parse_config(data: bytes | str, *, path: Path | None = None) -> AgentConfig:
    """Validate config text; errors name ``<file>: <field path>: <reason>``."""
    where = f"{path}: " if path is not None else ""
    raw = data.encode() if isinstance(data, str) else data
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}not valid YAML{at}: {problem}") from exc
    try:
        config = _parse(doc if doc is not None else {})
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc}", hint=exc.hint) from exc
    return replace(config, path=path, digest=hashlib.sha256(raw).hexdigest())


def spec_digest(spec: ModelSpec) -> str:
    """What decides a model's content: a changed digest means the cached copy is not it.

    Where the bytes come from (``spec.fetch_route``: mirrors, Hub fallback, proxy) is not
    content: a mirror serves the Hub's commit, checked against the Hub's ids, so adding or
    reordering mirrors keeps the copy ready (the agent confirms it with the new sources)."""
    text = "\0".join(
        [
            str(spec.source),
            spec.revision or "",
            ",".join(spec.include),
            ",".join(spec.exclude),
            spec.hf_repo or "",
            spec.hf_revision or "",
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- the top level (the sections: config_models, config_compile_caches) ---------------------


def _backoff(value: Any, path: str) -> Backoff:
    m = BACKOFF.check(value, path)
    initial = BACKOFF.get(m, "initial", path, Backoff.initial)
    cap = BACKOFF.get(m, "max", path, Backoff.max)
    if cap < initial:
        raise ConfigError(f"{path}.max: must not be shorter than {path}.initial")
    return Backoff(initial=initial, max=cap)


def _s3(value: Any, path: str) -> str | None:
    if value is None:
        return None
    url: str | None = S3.get(S3.check(value, path), "endpointUrl", path, None)
    return url


def _parse(doc: Any) -> AgentConfig:
    return _parse_fields(doc).with_gpu_product(None)


def _parse_fields(doc: Any) -> AgentConfig:
    m = mapping(doc, "")
    check_keys(m, TOP.keys, "")
    d = AgentConfig()

    def top(key: str, default: Any) -> Any:
        return TOP.get(m, key, "", default)

    verify_rate = top("verifyReadRate", d.verify_read_rate or 0)
    warm_rate = top("warmReadRate", d.warm_read_rate or 0)
    models = get(m, "models", "", parse_models, ())
    caches = get(m, "compileCaches", "", parse_compile_caches, ())
    taken = {spec.name for spec in models}
    for i, entry in enumerate(caches):
        if entry.name in taken:
            raise ConfigError(f"compileCaches[{i}].name: {entry.name!r} is also a model's name")
    listed = m.get("models") if models else None
    top_ca_bundle = top("caBundle", None)
    return AgentConfig(
        cache_dir=Path(top("cacheDir", str(d.cache_dir))),
        label_prefix=top("labelPrefix", d.label_prefix),
        startup_taint=top("startupTaint", d.startup_taint),
        listen=top("listen", d.listen),
        concurrency=top("concurrency", d.concurrency),
        chunk_size=top("chunkSize", d.chunk_size),
        min_rate=top("minRate", d.min_rate),
        stall_timeout=top("stallTimeout", d.stall_timeout),
        parallel_models=top("parallelModels", d.parallel_models),
        verify_interval=top("verifyInterval", d.verify_interval),
        verify_read_rate=verify_rate or None,
        resolve_interval=top("resolveInterval", d.resolve_interval),
        superseded_grace=top("supersededGrace", d.superseded_grace) or 0.0,
        retry_backoff=get(m, "retryBackoff", "", _backoff, d.retry_backoff),
        sync_deadline=top("syncDeadline", d.sync_deadline),
        model_deadlines=per_model(listed, "models", "syncDeadline", SyncDeadline()),
        min_free_space=top("minFreeSpace", d.min_free_space),
        s3_endpoint_url=get(m, "s3", "", _s3, None),
        models=models,
        compile_cache_entries=caches,
        warm_page_cache=frozenset(flagged(m, ("warmPageCache", "gateOnWarm"))),
        gate_on_warm=frozenset(flagged(m, ("gateOnWarm",))),
        warm_memory_share=top("warmMemoryShare", d.warm_memory_share),
        warm_read_rate=warm_rate or None,
        ca_bundle=ca_bundle(top_ca_bundle, "caBundle"),
    )
