"""The TLS context every HTTPS connection of one pool verifies with, built once and shared.

urllib3, given a CA bundle (or none: the system's store), builds a context and loads the bundle
into it for every connection it opens: ~33 ms of CPU with a bundle of a public store's size, and
a pull opens one connection per concurrent request. :class:`TlsTrust` builds it on the first
HTTPS connection (an HTTP-only pull pays nothing) and again only when the bundle's file changes.
"""

from __future__ import annotations

import os
import ssl
import threading
from collections.abc import Callable

import urllib3


def tls_context(ca_certs: str | None) -> ssl.SSLContext:
    """The context urllib3 would build for one HTTPS connection (its own options: minimum TLS
    version, ciphers, certificate and host name required...), with ``ca_certs`` (else the
    system's CA certificates) loaded into it; an unreadable bundle raises urllib3's
    ``SSLError``, as urllib3 does when it loads one."""
    context = urllib3.util.create_urllib3_context()
    try:
        if ca_certs:
            context.load_verify_locations(cafile=ca_certs)
        else:
            context.load_default_certs()
    except OSError as exc:
        raise urllib3.exceptions.SSLError(exc) from exc
    return context


class TlsTrust:
    """The TLS context every HTTPS connection of one pool (:func:`make_http_pool`, its proxies
    included) verifies with, built on the first connection and shared by all.

    Given ``ca_certs`` (or nothing: the system's store), urllib3 builds a context and loads the
    bundle into it for every connection: some 30 ms of CPU with a bundle of a public store's
    size. Here it is built once (under a lock: many threads connect at once) and built again
    only when the bundle file changes on disk (its inode, size or time, looked at per
    connection), so a long-lived agent still trusts a rotated bundle on its next connections,
    as it did when urllib3 read the file per connection. urllib3 sets ``verify_mode`` on the
    shared context per connection to the value it already has (CERT_REQUIRED: the connections
    are given no ``cert_reqs``) and leaves ``check_hostname`` on (no ``assert_hostname`` or
    fingerprint is given), so no connection weakens another's checks.
    ``build``: how a context is made (default :func:`tls_context`)."""

    def __init__(
        self,
        ca_certs: str | None,
        build: Callable[[str | None], ssl.SSLContext] = tls_context,
    ) -> None:
        self._ca_certs = ca_certs
        #: the file whose change rebuilds the context (the system store's file, if any)
        self._file = ca_certs or ssl.get_default_verify_paths().cafile
        self._build = build
        self._lock = threading.Lock()
        self._context: ssl.SSLContext | None = None
        self._stamp: tuple[int, int, int] | None = None

    def context(self) -> ssl.SSLContext:
        """The context to verify the next connection with."""
        stamp = _file_stamp(self._file)
        with self._lock:
            if self._context is None or stamp != self._stamp:
                self._context = self._build(self._ca_certs)
                self._stamp = stamp
            return self._context


def _file_stamp(path: str | None) -> tuple[int, int, int] | None:
    """What tells a changed file: its inode, size and modification time (None: no such file)."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
