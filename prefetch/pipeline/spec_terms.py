"""The words a spec's rules are stated in: :class:`SpecError` (a rule broken, naming the field
at fault) and the checks every backend's rules share. Below :mod:`prefetch.pipeline.spec` and the
backends (:mod:`prefetch.pipeline.backends`), which both state their rules with them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from prefetch.support.errors import ConfigError
from prefetch.support.paths import ref_name_problem

if TYPE_CHECKING:
    from prefetch.pipeline.backends import SpecFields

#: A Hub repo id (org/name, or a bare name in a URI).
HF_REPO = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$|^[A-Za-z0-9][\w.\-]*$")
#: A 40-hex commit sha.
COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
#: The ModelSpec fields, and the layout asked for, that a rule's message may name (as
#: ``{field}`` in its reason).
SPEC_FIELDS = (
    "name", "source", "revision", "include", "exclude", "hf_repo", "hf_revision", "proxy",
    "mirrors", "hub_fallback", "layout",
)  # fmt: skip


class SpecError(ConfigError):
    """A ModelSpec rule broken: ``field`` is the spec field at fault, ``reason`` says why and
    may name other fields as ``{hf_repo}``-style placeholders. ``cross_field`` is true for a
    rule about a combination of fields (its reason names the others). ``leads``: the message
    starts with the field's name (``hf_repo: ...``); off, the reason names the field itself
    where the sentence needs it (``{layout} hf needs {hf_repo} ...``).

    ``str()`` names fields by their ModelSpec names (``hf_repo: ...``); a front end whose users
    know the fields by other names (the CLI's flags, the config file's keys) calls
    :meth:`render` with its names and the location of the spec, and changes nothing else.
    """

    def __init__(
        self,
        field: str,
        reason: str,
        *,
        cross_field: bool = False,
        hint: str | None = None,
        leads: bool = True,
    ) -> None:
        self.field = field
        self.reason = reason
        self.cross_field = cross_field
        self.leads = leads
        super().__init__(self.render(), hint=hint)

    def render(self, names: Mapping[str, str] | None = None, *, prefix: str = "") -> str:
        """The message with each field called by ``names`` (default: its spec name), the
        faulty field's name preceded by ``prefix`` (e.g. ``models[0].``)."""
        called = {f: f for f in SPEC_FIELDS} | dict(names or {})
        if not self.leads:
            return f"{prefix}{self.reason.format_map(called)}"
        return f"{prefix}{called.get(self.field, self.field)}: {self.reason.format_map(called)}"


def escape(text: str) -> str:
    """``text`` taken literally inside a SpecError reason (braces doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


def literal(value: object) -> str:
    """``repr(value)`` taken literally inside a SpecError reason."""
    return escape(repr(value))


def validate_revision(revision: str, *, field_name: str = "revision") -> str:
    """A revision must be a valid git ref name (or a commit sha, which is one): it names a file
    under the cache's ``refs/`` and is sent in URLs, so ``../../x`` is refused up front."""
    problem = ref_name_problem(revision)
    if problem is not None:
        raise SpecError(
            field_name,
            f"{literal(revision)} is not a valid branch, tag or commit name ({escape(problem)})",
        )
    return revision


def check_no_revisions(spec: SpecFields, sources: str, *, aside: str = "") -> None:
    """The rules of a source read as it is now (an object-store prefix, a directory): no
    ``revision`` (its message names the ``sources`` as ``"S3"``, ``"gs://"``..., then ``aside``
    in brackets), and ``hf_revision`` (the commit to publish under in the Hub layout) only with
    ``hf_repo``."""
    if spec.revision is not None:
        raise SpecError(
            "revision",
            f"{sources} sources have no revisions; {{revision}} is for hf:// sources"
            + (f" ({aside})" if aside else ""),
            cross_field=True,
        )
    if spec.hf_revision is not None and spec.hf_repo is None:
        raise SpecError(
            "hf_revision",
            "needs {hf_repo} org/name (the repo id to publish under)",
            cross_field=True,
        )


def hub_commit_split(hf_repo: str | None, revision: str | None) -> tuple[str | None, str | None]:
    """``(revision, hf_revision)`` from one ``revision`` field for a source without revisions
    published in the Hub layout: with ``hf_repo``, a 40-hex commit is the commit to publish
    under (``hf_revision``); anything else stays the ``revision`` (which the spec refuses)."""
    if hf_repo is not None and COMMIT_SHA.match(revision or ""):
        return None, revision
    return revision, None
