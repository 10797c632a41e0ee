"""The agent's config rejects two models that would publish into one Hub repo folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefetch.agent.config import parse_config
from prefetch.support.errors import ConfigError


def _config(*models: str) -> str:
    return "models:\n" + "".join(models)


def _model(name: str, source: str, extra: str = "") -> str:
    return f"  - name: {name}\n    source: {source}\n{extra}"


def test_two_hub_models_of_one_repo_are_rejected_naming_both() -> None:
    text = _config(
        _model("llama-a", "hf://org/name", '    include: ["*.safetensors"]\n'),
        _model("other", "hf://org/other"),
        _model("llama-b", "hf://org/name", '    include: ["*.json"]\n'),
    )
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    assert str(err.value) == (
        "models[2] (llama-b): same Hub repo as models[0] (llama-a) (org/name); "
        "one model per repo: merge their include patterns"
    )


def test_an_s3_mirror_publishing_as_a_hub_models_repo_is_rejected() -> None:
    text = _config(
        _model("hub", "hf://org/name"),
        _model("mirror", "s3://bucket/org/name/", "    hfRepo: org/name\n"),
    )
    with pytest.raises(ConfigError, match=r"models\[1\] \(mirror\): same Hub repo as models\[0\]"):
        parse_config(text)


def test_two_s3_mirrors_with_one_hf_repo_are_rejected() -> None:
    text = _config(
        _model("mirror-a", "s3://bucket-a/org/name/", "    hfRepo: org/name\n"),
        _model("mirror-b", "s3://bucket-b/org/name/", "    hfRepo: org/name\n"),
    )
    with pytest.raises(
        ConfigError, match=r"\(mirror-b\): same Hub repo as models\[0\] \(mirror-a\)"
    ):
        parse_config(text)


def test_one_repo_at_two_revisions_is_rejected_because_a_branch_can_move_onto_the_other() -> None:
    text = _config(
        _model("llama-main", "hf://org/name", "    revision: main\n"),
        _model("llama-v1", "hf://org/name", "    revision: v1.0\n"),
    )
    with pytest.raises(ConfigError, match="one model per repo"):
        parse_config(text)


def test_repo_ids_differing_only_in_case_are_one_hub_repo() -> None:
    text = _config(_model("a", "hf://Org/Name"), _model("b", "hf://org/name"))
    with pytest.raises(ConfigError, match="same Hub repo"):
        parse_config(text)


def test_distinct_repos_and_plain_s3_models_of_one_prefix_are_accepted() -> None:
    # plain S3 models each get models/<name>/, and names are unique: they cannot collide
    text = _config(
        _model("hub-a", "hf://org/a"),
        _model("hub-b", "hf://org/b"),
        _model("mirror-c", "s3://bucket/org/c/", "    hfRepo: org/c\n"),
        _model("plain-1", "s3://bucket/models/x/", '    include: ["*.json"]\n'),
        _model("plain-2", "s3://bucket/models/x/", '    include: ["*.bin"]\n'),
    )
    assert [m.name for m in parse_config(text).models] == [
        "hub-a",
        "hub-b",
        "mirror-c",
        "plain-1",
        "plain-2",
    ]


def test_the_error_is_prefixed_with_the_config_file() -> None:
    text = _config(_model("a", "hf://org/name"), _model("b", "hf://org/name"))
    with pytest.raises(ConfigError, match=r"^models\.yaml: models\[1\] \(b\): same Hub repo"):
        parse_config(text, path=Path("models.yaml"))
