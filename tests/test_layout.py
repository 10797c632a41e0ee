"""The layout package: which layout a model gets (one factory), and no import cycle in it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prefetch.pipeline.layout import (
    HfCacheLayout,
    PlainLayout,
    check_repo_folder,
    layout_for,
    layout_name_for,
    layouts_under,
    repo_state_dir,
)
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.store import Store
from prefetch.support.errors import ConfigError, LayoutError

HF = ModelSpec(source=parse_source_uri("hf://org/model"))
MIRROR = ModelSpec(source=parse_source_uri("s3://bucket/m"), hf_repo="org/mirror")
S3 = ModelSpec(source=parse_source_uri("s3://bucket/m"), name="m")


def test_the_factory_picks_hf_for_hf_sources_and_hf_repo_mirrors(tmp_path: Path) -> None:
    hub = layout_for(HF, tmp_path)
    assert isinstance(hub, HfCacheLayout)
    assert hub.root == tmp_path / "hub/models--org--model"
    mirror = layout_for(MIRROR, tmp_path)
    assert isinstance(mirror, HfCacheLayout)
    assert mirror.root == tmp_path / "hub/models--org--mirror"
    assert layout_name_for(HF) == layout_name_for(MIRROR) == "hf"


def test_the_factory_picks_plain_otherwise_and_when_asked(tmp_path: Path) -> None:
    plain = layout_for(S3, tmp_path)
    assert isinstance(plain, PlainLayout)
    assert plain.root == tmp_path  # the CLI's DEST holds the files
    for spec in (HF, MIRROR):
        asked = layout_for(spec, tmp_path, layout_name="plain")
        assert isinstance(asked, PlainLayout)
        assert asked.root == tmp_path
    assert layout_name_for(S3) == layout_name_for(HF, "plain") == "plain"


def test_in_a_shared_cache_a_plain_model_gets_its_own_folder(tmp_path: Path) -> None:
    assert layout_for(S3, tmp_path, shared=True).root == tmp_path / "models/m"
    assert layout_for(HF, tmp_path, shared=True).root == tmp_path / "hub/models--org--model"


def test_the_store_and_the_factory_agree_on_every_models_place(tmp_path: Path) -> None:
    store = Store(tmp_path)
    for spec in (HF, MIRROR, S3):
        assert store.layout(spec).root == layout_for(spec, tmp_path, shared=True).root
        assert store.entry_dir(spec) == store.layout(spec).root
    assert store.entry_key(S3) == "models/m"
    assert store.entry_key(MIRROR) == "hub/models--org--mirror"


def test_the_hf_layout_without_a_repo_id_or_an_unknown_layout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs a Hub repo id"):
        layout_for(S3, tmp_path, layout_name="hf")
    with pytest.raises(ConfigError, match="unknown layout"):
        layout_for(S3, tmp_path, layout_name="flat")


def test_verify_checks_the_recorded_hub_repos_of_an_hf_home_else_the_plain_dest(
    tmp_path: Path,
) -> None:
    (layout,) = layouts_under(tmp_path)
    assert isinstance(layout, PlainLayout)
    assert layout.root == tmp_path
    (tmp_path / "hub/models--other--tool").mkdir(parents=True)  # not recorded by us
    assert layouts_under(tmp_path) == []


def test_hub_folder_names_are_checked_before_a_state_path_is_built(tmp_path: Path) -> None:
    assert check_repo_folder("models--org--m") == "models--org--m"
    state = repo_state_dir(tmp_path, "models--org--m")
    assert state == tmp_path / ".prefetch/hub/models--org--m"
    for bad in ("datasets--x", "models--a/../b", "..", ""):
        with pytest.raises(LayoutError):
            repo_state_dir(tmp_path, bad)


# -- structure --------------------------------------------------------------------------------

_ISOLATED_IMPORT = """
import sys, types
from pathlib import Path
import prefetch
# the package as a bare namespace: importing a submodule must not need its __init__ (nor the
# pipeline's, which imports the layouts)
pipeline = types.ModuleType("prefetch.pipeline")
pipeline.__path__ = [str(Path(prefetch.__file__).parent / "pipeline")]
sys.modules["prefetch.pipeline"] = pipeline
package = types.ModuleType("prefetch.pipeline.layout")
package.__path__ = [str(Path(prefetch.__file__).parent / "pipeline" / "layout")]
sys.modules["prefetch.pipeline.layout"] = package
import importlib
importlib.import_module(sys.argv[1])
print(" ".join(sorted(m for m in sys.modules if m.startswith("prefetch.pipeline.layout."))))
"""


@pytest.mark.parametrize(
    ("module", "imports"),
    [
        ("prefetch.pipeline.layout.base", ["prefetch.pipeline.layout.base"]),
        (
            "prefetch.pipeline.layout.plain",
            ["prefetch.pipeline.layout.base", "prefetch.pipeline.layout.plain"],
        ),
        (
            "prefetch.pipeline.layout.hf",
            [
                "prefetch.pipeline.layout.base",
                "prefetch.pipeline.layout.hf",
                "prefetch.pipeline.layout.hf_tree",
            ],
        ),
    ],
)
def test_each_layout_module_imports_only_base_so_the_package_has_no_cycle(
    module: str, imports: list[str]
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _ISOLATED_IMPORT, module],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.split() == imports


def test_the_layout_package_imports_on_its_own_in_a_fresh_interpreter() -> None:
    code = "import prefetch.pipeline.layout as p; print(p.layout_for.__module__)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "prefetch.pipeline.layout"
