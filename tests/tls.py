"""TLS for the test suite, as production has it: one private CA for the session (``trustme``),
server certificates for a host name that is not ``localhost`` and resolves to 127.0.0.1, and the
environment a user with a private CA sets (``SSL_CERT_FILE`` and friends).

The name: ``prefetch.test`` and its sub-domains (RFC 6761 reserves ``.test``), listed in
``/etc/hosts`` for 127.0.0.1 (``.ci/run`` adds them; :func:`ensure_test_hosts` does too when it can
write the file). Where it can not and the names do not resolve, servers are reached as
``127.0.0.1``, which every certificate also names, and :data:`TestCA.host` says which is in use.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme

#: The names the test servers answer to; each resolves to 127.0.0.1 (``/etc/hosts``).
TEST_DOMAIN = "prefetch.test"
TEST_HOSTS = (
    TEST_DOMAIN,
    f"s3.{TEST_DOMAIN}",
    f"hub.{TEST_DOMAIN}",
    f"cdn.{TEST_DOMAIN}",
    f"registry.{TEST_DOMAIN}",
    f"mirror.{TEST_DOMAIN}",
    f"proxy.{TEST_DOMAIN}",
    f"k8s.{TEST_DOMAIN}",
)
HOSTS_FILE = Path("/etc/hosts")


def resolves_to_loopback(name: str) -> bool:
    try:
        return {info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)} == {
            "127.0.0.1"
        }
    except OSError:
        return False


def ensure_test_hosts(hosts_file: Path = HOSTS_FILE) -> bool:
    """Make every name of :data:`TEST_HOSTS` resolve to 127.0.0.1 (one line added to the hosts
    file when it is writable); True when they all do."""
    if all(resolves_to_loopback(name) for name in TEST_HOSTS):
        return True
    with contextlib.suppress(OSError):
        text = hosts_file.read_text()
        line = "127.0.0.1 " + " ".join(TEST_HOSTS) + "  # model-prefetch tests\n"
        if line not in text:
            with hosts_file.open("a") as f:
                f.write(("" if text.endswith("\n") or not text else "\n") + line)
    return all(resolves_to_loopback(name) for name in TEST_HOSTS)


@dataclass(frozen=True)
class TestCA:
    """The session's private CA and one server certificate for every test name.

    ``ca_file`` is the bundle a client trusts; ``cert_file`` / ``key_file`` are what a server
    presents (the leaf and its chain / the private key, PEM); ``host`` is the name servers are
    reached by (``prefetch.test`` where it resolves, else ``127.0.0.1``)."""

    __test__ = False  # not a test class, whatever pytest thinks of the name

    ca: trustme.CA
    directory: Path
    ca_file: Path
    cert_file: Path
    key_file: Path
    host: str

    @classmethod
    def create(cls, directory: Path) -> TestCA:
        directory.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA(organization_name="model-prefetch test CA")
        ca_file = directory / "ca.pem"
        ca.cert_pem.write_to_path(str(ca_file))
        host = TEST_DOMAIN if ensure_test_hosts() else "127.0.0.1"
        cert_file, key_file = _issue(ca, directory, "server", [*TEST_HOSTS, "127.0.0.1"])
        return cls(ca, directory, ca_file, cert_file, key_file, host)

    def host_for(self, role: str) -> str:
        """The name of one role's server (``s3``, ``hub``, ``cdn``, ``registry``, ...): its own
        sub-domain, so two servers on one machine are two hosts to a client, as in production."""
        return f"{role}.{TEST_DOMAIN}" if self.host == TEST_DOMAIN else self.host

    def url(self, port: int, role: str = "", scheme: str = "https") -> str:
        host = self.host_for(role) if role else self.host
        return f"{scheme}://{host}:{port}"

    def server_context(self) -> ssl.SSLContext:
        """An SSL context for a Python test server presenting the session's certificate."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """An SSL context that trusts the session CA (and only it), hostname checks on."""
        return ssl.create_default_context(cafile=str(self.ca_file))

    def env(self) -> dict[str, str]:
        """The variables a user with a private CA sets, each naming the session CA."""
        ca = str(self.ca_file)
        return {
            "SSL_CERT_FILE": ca,
            "REQUESTS_CA_BUNDLE": ca,
            "AWS_CA_BUNDLE": ca,
            "CURL_CA_BUNDLE": ca,
        }

    def issue(
        self,
        name: str,
        hosts: list[str],
        *,
        not_after: datetime.datetime | None = None,
        ca: trustme.CA | None = None,
    ) -> tuple[Path, Path]:
        """Another server certificate (cert chain, key): for other names, already expired
        (``not_after`` in the past), or signed by another CA (``ca``), for refusal tests."""
        return _issue(ca or self.ca, self.directory, name, hosts, not_after=not_after)


def _issue(
    ca: trustme.CA,
    directory: Path,
    name: str,
    hosts: list[str],
    *,
    not_after: datetime.datetime | None = None,
) -> tuple[Path, Path]:
    leaf = ca.issue_cert(*hosts, not_after=not_after)
    cert_file = directory / f"{name}.pem"
    key_file = directory / f"{name}.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert_file))
    for pem in leaf.cert_chain_pems[1:]:
        pem.write_to_path(str(cert_file), append=True)
    leaf.private_key_pem.write_to_path(str(key_file))
    return cert_file, key_file
