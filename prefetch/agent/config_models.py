"""The config file's ``models``: each entry a :class:`~prefetch.pipeline.spec.ModelSpec` (its keys
read through the ``MODEL`` table), duplicate names and models sharing one Hub repo rejected, and the
per-model settings the :class:`~prefetch.agent.config_values.AgentConfig` keeps by model name
(``syncDeadline``, ``warmPageCache``, ``gateOnWarm``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from prefetch.agent.config_checks import kind_of
from prefetch.agent.config_tables import MODEL
from prefetch.pipeline.spec import ModelSpec, SpecError, publish_revision
from prefetch.support import settings
from prefetch.support.errors import ConfigError

__all__ = ["ca_bundle", "flagged", "parse_models", "per_model", "render_spec_error"]

T = TypeVar("T")
#: The keys of a model in the file, by the ModelSpec field each sets (the others match).
_SPEC_KEYS = {"hf_repo": "hfRepo", "hf_revision": "revision", "hub_fallback": "hubFallback"}


def per_model(value: Any, path: str, key: str, default: T) -> dict[str, T]:
    """The models' own ``key`` by name, where set (the list was checked by :func:`parse_models`)."""
    out: dict[str, T] = {}
    for i, item in enumerate(value or ()):
        if key in item:
            out[item["name"]] = MODEL.get(item, key, f"{path}[{i}]", default)
    return out


def parse_models(value: Any, path: str) -> tuple[ModelSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list of models, got {kind_of(value)}")
    specs: list[ModelSpec] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        spec = _model(item, where)
        if spec.name in seen:
            raise ConfigError(
                f"{where}.name: duplicate model name {spec.name!r} (also {path}[{seen[spec.name]}])"
            )
        seen[spec.name] = i
        specs.append(spec)
    _reject_shared_repos(specs, path)
    return tuple(specs)


def _reject_shared_repos(specs: list[ModelSpec], path: str) -> None:
    """One model per Hub repo: models sharing ``hub/models--org--name`` would undo each other.

    Every sync deletes what its own include/exclude patterns leave out of the snapshot, a moved
    branch prunes the snapshots and blobs no ref names, and eviction and re-verification work on
    the whole repo folder. Two models publishing into one repo (two ``hf://`` sources, or an S3
    mirror whose ``hfRepo`` is a Hub model's repo) therefore delete each other's files on every
    resolve and re-download them, both reporting ready. Different revisions do not make it safe:
    a branch can move onto the commit another model asked for, and then both write one snapshot.
    Repo ids are compared as the Hub does, ignoring case. Plain models cannot collide: each has
    its own ``models/<name>`` and names are unique.
    """
    owners: dict[str, int] = {}
    for i, spec in enumerate(specs):
        repo = spec.repo_id
        if repo is None:
            continue
        first = owners.setdefault(repo.casefold(), i)
        if first != i:
            raise ConfigError(
                f"{path}[{i}] ({spec.name}): same Hub repo as {path}[{first}] "
                f"({specs[first].name}) ({repo}); one model per repo: merge their include "
                "patterns",
                hint="list the repo once, with every file pattern its users need",
            )


def _model(value: Any, where: str) -> ModelSpec:
    m = MODEL.check(value, where)
    name = MODEL.get(m, "name", where, "")
    source = MODEL.get(m, "source", where, None)
    revision = MODEL.get(m, "revision", where, None)
    hf_repo = MODEL.get(m, "hfRepo", where, None)
    revision, hf_revision = publish_revision(source, hf_repo, revision)
    try:
        return ModelSpec(
            source=source,
            name=name,
            revision=revision,
            include=MODEL.get(m, "include", where, ()),
            exclude=MODEL.get(m, "exclude", where, ()),
            required=MODEL.get(m, "required", where, True),
            pin=MODEL.get(m, "pin", where, False),
            hf_repo=hf_repo,
            hf_revision=hf_revision,
            proxy=MODEL.get(m, "proxy", where, None),
            ca_bundle=ca_bundle(MODEL.get(m, "caBundle", where, None), f"{where}.caBundle"),
            mirrors=MODEL.get(m, "mirrors", where, ()),
            hub_fallback=MODEL.get(m, "hubFallback", where, True),
        )
    except SpecError as exc:
        raise render_spec_error(exc, f"{where}.") from exc


def render_spec_error(exc: SpecError, prefix: str) -> ConfigError:
    """``exc`` as the config file's users know its fields (``hfRepo``), after ``prefix``."""
    return ConfigError(exc.render(_SPEC_KEYS, prefix=prefix), hint=exc.hint)


def ca_bundle(value: str | None, path: str) -> str | None:
    """A ``caBundle``: a PEM file of CA certificates that exists (checked at load, so a wrong
    path is the config's error, not every sync's); None: none."""
    return None if not value else settings.check_ca_bundle(value, path)


def flagged(doc: Mapping[str, Any], keys: tuple[str, ...]) -> list[str]:
    """The names of the models (already validated) with any of the boolean ``keys`` true."""
    entries = doc.get("models") or []
    return [
        str(e["name"])
        for i, e in enumerate(entries)
        if any(MODEL.get(e, k, f"models[{i}]", False) for k in keys)
    ]
