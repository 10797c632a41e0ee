"""The Hub token, found as huggingface_hub finds it, without importing huggingface_hub (~0.3 s of
CPU): the environment, then the token file `hf auth login` writes; the library is asked only for
what it alone does (an OIDC exchange, a Colab secret, refreshing a browser login's token)."""

from __future__ import annotations

import sys
from pathlib import Path

from prefetch.support import settings
from prefetch.support.errors import ConfigError


def token_of(option: str | bool | None) -> str | None:
    """The token :attr:`HubOptions.token` asks for: a string is one (empty: none), False is
    none, None or True the one huggingface_hub would find (:func:`hub_token`)."""
    if isinstance(option, str):
        return option or None
    return None if option is False else hub_token()


def hub_token() -> str | None:
    """The token huggingface_hub's ``get_token`` finds, read without importing huggingface_hub
    (~0.3 s of CPU): ``HF_TOKEN`` (else ``HUGGING_FACE_HUB_TOKEN``), then the token file that
    `hf auth login` writes (``HF_TOKEN_PATH``, else ``$HF_HOME/token``); None when neither has one.

    The library is asked only for what it alone does: an OIDC exchange (``HF_OIDC_RESOURCE``),
    a Colab secret, and refreshing the token of a browser (OAuth) login, which it records with a
    ``refresh_token`` in the ``stored_tokens`` file beside the token file.
    """
    if settings.hf_oidc_resource() or "google.colab" in sys.modules:
        return _library_token()
    token = _clean_token(settings.hf_token())
    if token is not None:
        return token
    path = settings.hf_token_path()
    token = _clean_token(_read_token_file(path))
    if token is not None and _may_need_refresh(path):
        return _library_token()
    return token


def _library_token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def _clean_token(text: str | None) -> str | None:
    """A token as huggingface_hub keeps it: no line breaks, no surrounding blanks; None if empty."""
    if text is None:
        return None
    return text.replace("\r", "").replace("\n", "").strip() or None


def _read_token_file(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"the Hub token file {path} cannot be read: {getattr(exc, 'strerror', None) or exc}",
            hint="fix its permissions, or pass --token / set HF_TOKEN",
        ) from exc


def _may_need_refresh(token_path: Path) -> bool:
    """Was the token file written by a browser (OAuth) login, whose token expires and is
    refreshed by huggingface_hub? Such a login leaves a ``refresh_token`` in ``stored_tokens``."""
    try:
        return "refresh_token" in (token_path.parent / "stored_tokens").read_text(errors="replace")
    except OSError:
        return False
