"""A forward proxy's credentials and refusals, for the urllib3 pools of :mod:`.transport`.

urllib3's ``ProxyManager`` connects to ``http://user:password@proxy:3128`` but sends no
``Proxy-Authorization`` of its own: :func:`proxy_headers` makes the Basic one from the URL's
user info (percent-decoded, as curl and botocore read it). :func:`proxy_failure` turns urllib3's
``ProxyError('Unable to connect to proxy', OSError(...))`` into one sentence: what the proxy
said (``Tunnel connection failed: 407 Proxy Authentication Required``) or why it could not be
reached, and whether trying again can help. The proxy URL is never part of it (it may carry the
password).
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

import urllib3

__all__ = ["proxy_failure", "proxy_headers"]

#: urllib3's "Tunnel connection failed: 403 Forbidden" (http.client's wording of a CONNECT
#: answered with an error status).
_TUNNEL_STATUS = re.compile(r"Tunnel connection failed: (\d{3})\b")
#: The object repr urllib3 puts before a connection error ("<...HTTPConnection object at 0x..>: ").
_OBJECT_REPR = re.compile(r"<[^<>]*object at 0x[0-9a-f]+>:\s*")


def proxy_headers(proxy_url: str) -> dict[str, str]:
    """The headers to send a proxy whose URL holds credentials (none when it holds none)."""
    parts = urlsplit(proxy_url)
    if parts.username is None:
        return {}
    user, password = unquote(parts.username), unquote(parts.password or "")
    return dict(urllib3.make_headers(proxy_basic_auth=f"{user}:{password}"))


def proxy_failure(exc: urllib3.exceptions.ProxyError) -> tuple[str, bool]:
    """What went wrong with the proxy, in words, and whether it is worth retrying (a proxy that
    refuses the tunnel with a 4xx will refuse it again; one that cannot be reached may not)."""
    cause = getattr(exc, "original_error", None)
    said = cause if isinstance(cause, BaseException) else (exc.args[0] if exc.args else "")
    text = _OBJECT_REPR.sub("", str(said)).strip()
    if isinstance(cause, urllib3.exceptions.NewConnectionError):
        # worded with the connection's repr (a private class name): its host and port instead
        conn = cause.conn
        detail = str(cause).removeprefix(f"{conn}: ")
        return f"cannot connect to the proxy {conn.host}:{conn.port} ({detail})", True
    status = _TUNNEL_STATUS.search(text)
    if status is not None:
        code = int(status.group(1))
        if code == 407:
            return f"the proxy wants credentials ({text})", False
        return f"the proxy refused the connection ({text})", not 400 <= code < 500
    return f"cannot connect through the proxy ({text or type(exc).__name__})", True
