"""Publish: where verified files land, and the records that say what landed.

Two layouts: :class:`PlainLayout` (files at ``DEST/<path>``, in :mod:`.plain`) and the Hugging
Face cache layout :class:`HfCacheLayout` (in :mod:`.hf`); what they share is in :mod:`.base`.
Which one a model gets is decided here, once: :func:`layout_for` (the CLI's pull, the agent and
the Store) and :func:`layouts_under` (``prefetch verify``).
"""

from __future__ import annotations

from pathlib import Path

from prefetch.pipeline.layout.base import (
    Layout,
    RecordBook,
    RecordedFile,
    atomic_write,
    entry_checksums,
    file_entry,
    fsync_file,
    make_dirs_inside,
    model_lock,
    refuse_symlinks,
    safe_join,
)
from prefetch.pipeline.layout.hf import (
    HUB_DIR,
    REPO_PREFIX,
    HfCacheLayout,
    check_repo_folder,
    hub_layouts,
    is_repo_folder,
    repo_dir,
    repo_folder,
    repo_id_of,
    repo_state_dir,
)
from prefetch.pipeline.layout.plain import MODELS_DIR, PlainLayout, model_dir
from prefetch.pipeline.spec import LAYOUT_NAMES, ModelSpec, layout_kind
from prefetch.support.paths import STATE_DIR


def layout_name_for(spec: ModelSpec, layout_name: str | None = None) -> str:
    """The layout a model is published in (the rule is
    :func:`prefetch.pipeline.spec.layout_kind`)."""
    return layout_kind(spec, layout_name)


def layout_for(
    spec: ModelSpec, dest: Path, *, layout_name: str | None = None, shared: bool = False
) -> Layout:
    """The layout ``spec`` is published in under ``dest`` (chosen by :func:`layout_name_for`).

    The Hugging Face layout treats ``dest`` as an HF_HOME: the repo goes to
    ``dest/hub/models--<org>--<name>``. A plain model's files go to ``dest`` itself (the CLI's
    DEST), or with ``shared`` (``dest`` is a cache holding many models: the agent's
    ``cacheDir``, = HF_HOME) to their own folder ``dest/models/<name>``.
    """
    dest = Path(dest)
    name = layout_name_for(spec, layout_name)  # "hf" only with a repo id
    if name == "hf" and spec.repo_id is not None:
        return HfCacheLayout(dest, spec.repo_id)
    return PlainLayout(model_dir(dest, spec.name) if shared else dest)


def layouts_under(dest: Path) -> list[Layout]:
    """The layouts ``prefetch verify DEST`` checks: when ``dest`` is an HF_HOME (it has
    ``hub/models--*``), every Hub repo there we recorded (possibly none); else ``dest``'s plain
    layout."""
    dest = Path(dest)
    if any((dest / HUB_DIR).glob(f"{REPO_PREFIX}*")):
        return [layout for layout in hub_layouts(dest) if layout.recorded()]
    return [PlainLayout(dest)]


__all__ = [
    "HUB_DIR",
    "LAYOUT_NAMES",
    "MODELS_DIR",
    "REPO_PREFIX",
    "STATE_DIR",
    "HfCacheLayout",
    "Layout",
    "PlainLayout",
    "RecordBook",
    "RecordedFile",
    "atomic_write",
    "check_repo_folder",
    "entry_checksums",
    "file_entry",
    "fsync_file",
    "hub_layouts",
    "is_repo_folder",
    "layout_for",
    "layout_name_for",
    "layouts_under",
    "make_dirs_inside",
    "model_dir",
    "model_lock",
    "refuse_symlinks",
    "repo_dir",
    "repo_folder",
    "repo_id_of",
    "repo_state_dir",
    "safe_join",
]
