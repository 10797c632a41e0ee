"""The Hub's refusals in words: what to tell the user about an error answer of the Hub (or the
CDN it redirected to), with a hint; the class comes from the one status table
(:func:`prefetch.sources.http.transport.error_class`)."""

from __future__ import annotations

from dataclasses import dataclass

from prefetch.sources.http.transport import error_class, status_error
from prefetch.support.errors import (
    AccessDeniedError,
    NotFoundError,
    RepoNotFoundError,
    RevisionNotFoundError,
    SourceChangedError,
    SourceError,
    TransientSourceError,
)

_TOKEN_HINT = "pass --token, set HF_TOKEN, or log in with `hf auth login` (token file in HF_HOME)"


@dataclass(frozen=True)
class HubRefusal:
    """One error answer from the Hub (or the CDN it redirected to), as :func:`hub_error` needs
    it. ``reading``: the answer to a ranged read of a file of ``size`` bytes, not to a metadata
    call; ``where``: "the Hub" or the redacted URL that answered."""

    what: str
    status: int
    repo: str
    revision: str
    has_token: bool
    where: str = "the Hub"
    error_code: str = ""
    server_message: str = ""
    retry_after: str | None = None
    reading: bool = False
    size: int | None = None


def hub_error(r: HubRefusal) -> SourceError:
    """The package's error for an answer of the Hub: the class from the one status table
    (:func:`prefetch.sources.http.transport.error_class`), the words and hint from here."""
    message, hint = _hub_wording(r)
    return status_error(
        r.status,
        f"{r.what}: {message}",
        error_code=r.error_code,
        credentials=r.has_token,
        retry_after=r.retry_after,
        hint=hint,
    )


def _hub_wording(r: HubRefusal) -> tuple[str, str | None]:
    """What to tell the user about ``r`` (message without the ``what:`` prefix, and a hint)."""
    cls = error_class(r.status, r.error_code, credentials=r.has_token)
    detail = f" ({r.server_message})" if r.server_message else ""
    if cls is TransientSourceError:
        if r.status == 429:
            return f"rate limited by {r.where} (429)", None
        return f"{r.where} answered {r.status}{detail}", None
    if cls is AccessDeniedError:
        return _access_denied_wording(r, detail)
    if cls is RepoNotFoundError:
        if r.has_token:
            return (
                f"repository {r.repo} not found, or the token has no access to it{detail}",
                "check the repo id (org/name) and that the token's account can read it",
            )
        return (
            f"repository {r.repo} not found{detail}",
            "check the repo id (org/name); for a private repo, " + _TOKEN_HINT,
        )
    if cls is RevisionNotFoundError:
        return (
            f"revision {r.revision!r} not found in {r.repo}{detail}",
            "give a branch, a tag or a full 40-hex commit sha",
        )
    if cls is NotFoundError and r.reading:
        return f"{r.where} has no such file ({r.status}){detail}", None
    if cls is SourceChangedError and r.status == 416:
        return (
            f"{r.where} says the range is not satisfiable: the file is shorter than the "
            f"{r.size} bytes the listing stated",
            None,
        )
    if r.status == 200 and r.reading:
        return f"{r.where} ignored the Range header (200, not 206)", None
    return f"{r.where} answered {r.status}{detail}", None


def _access_denied_wording(r: HubRefusal, detail: str) -> tuple[str, str | None]:
    if r.error_code == "GatedRepo":
        why = "the token has no access to it" if r.has_token else "no token was given"
        return (
            f"{r.repo} is a gated repository and {why}",
            "accept the repo's conditions on its page with the token's account, then "
            + _TOKEN_HINT,
        )
    if r.status == 401 and not r.has_token:
        return (
            f"{r.where} refused {r.repo} without a token (401): it is private, gated, "
            "or does not exist",
            _TOKEN_HINT,
        )
    if r.status == 401:
        return (
            f"{r.where} rejected the token (401: invalid or expired){detail}",
            "check the token; create one at https://huggingface.co/settings/tokens",
        )
    refused = "the download" if r.reading else f"access to {r.repo}"
    return (
        f"{r.where} refused {refused} ({r.status}){detail}",
        "use a token with read access to the repository",
    )
