"""Every environment variable model-prefetch reads itself, read here and nowhere else.

Each function reads its variable when called (never at import), from ``environ`` when given and
from ``os.environ`` otherwise, so a test or a long-running agent sees the environment as it is
now. A value that cannot be meant raises :class:`~prefetch.support.errors.ConfigError` naming the
variable.

Not here: the variables the CLI's options read through click (``envvar=`` beside each option:
``PREFETCH_CONCURRENCY``, ``PREFETCH_CHUNK_SIZE``, ``PREFETCH_CONFIG``, ``NODE_NAME``...), which
click parses and reports with the option, and those huggingface_hub, boto3 and the Kubernetes
client read for themselves (``HF_OIDC_ID_TOKEN``, ``AWS_PROFILE``...).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from prefetch.support.errors import ConfigError

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _flag(name: str, environ: Mapping[str, str] | None) -> bool:
    value = _environ(environ).get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}: {value!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _http_url(name: str, environ: Mapping[str, str] | None) -> str | None:
    value = _environ(environ).get(name, "").strip()
    if not value:
        return None
    parts = urlsplit(value)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{name}: {value!r} is not an http(s) URL")
    return value


def debug(environ: Mapping[str, str] | None = None) -> bool:
    """``PREFETCH_DEBUG``: show tracebacks instead of one ``Error:`` line (default off)."""
    return _flag("PREFETCH_DEBUG", environ)


def hf_endpoint(environ: Mapping[str, str] | None = None) -> str | None:
    """``HF_ENDPOINT``: the Hub or a mirror (None: the caller's default, https://huggingface.co)."""
    return _http_url("HF_ENDPOINT", environ)


def hf_token(environ: Mapping[str, str] | None = None) -> str | None:
    """``HF_TOKEN``, else its old name ``HUGGING_FACE_HUB_TOKEN``, as set (None: neither is);
    huggingface_hub's order. Blank means none (the caller cleans it as the library does)."""
    env = _environ(environ)
    return env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN") or None


def hf_token_path(environ: Mapping[str, str] | None = None) -> Path:
    """The token file `hf auth login` writes, where huggingface_hub looks for it:
    ``HF_TOKEN_PATH``, else ``HF_HOME/token``, ``HF_HOME`` defaulting to
    ``$XDG_CACHE_HOME/huggingface`` (``~/.cache/huggingface``); ``~`` and ``$VARS`` expanded
    (from ``os.environ``, as the library expands them)."""
    env = _environ(environ)
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = os.path.expandvars(os.path.expanduser(env.get("HF_HOME") or f"{cache}/huggingface"))
    path = env.get("HF_TOKEN_PATH") or os.path.join(home, "token")
    return Path(os.path.expandvars(os.path.expanduser(path)))


def hf_oidc_resource(environ: Mapping[str, str] | None = None) -> str | None:
    """``HF_OIDC_RESOURCE``: the Hub token is to be exchanged for a CI job's OIDC identity
    (Trusted Publishers), which only huggingface_hub knows how to do."""
    return _environ(environ).get("HF_OIDC_RESOURCE") or None


def aws_endpoint_url(environ: Mapping[str, str] | None = None) -> str | None:
    """``AWS_ENDPOINT_URL``: an S3-compatible endpoint (None: AWS itself)."""
    return _http_url("AWS_ENDPOINT_URL", environ)


def aws_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``AWS_*`` variables, for code that must resolve S3 settings exactly as botocore reads
    them from the environment (``sources/s3_direct.py``'s listing without a botocore client)."""
    return {k: v for k, v in _environ(environ).items() if k.startswith("AWS_")}


def gcs_endpoint(environ: Mapping[str, str] | None = None) -> str | None:
    """``STORAGE_EMULATOR_HOST``: a Cloud Storage emulator or another endpoint (None: Google's,
    https://storage.googleapis.com), the variable Google's own libraries honour; written
    ``host:port`` it means ``http://host:port``, as they read it."""
    value = _environ(environ).get("STORAGE_EMULATOR_HOST", "").strip()
    if not value:
        return None
    if "://" not in value:
        value = f"http://{value}"
    parts = urlsplit(value)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"STORAGE_EMULATOR_HOST: {value!r} is not host:port or an http(s) URL")
    return value.rstrip("/")


def gcs_access_token(environ: Mapping[str, str] | None = None) -> str | None:
    """``GOOGLE_OAUTH_ACCESS_TOKEN``: an OAuth access token for Cloud Storage, used as it is
    instead of Application Default Credentials (the name Google's Terraform provider reads;
    gcloud's own is ``CLOUDSDK_AUTH_ACCESS_TOKEN``, read second). Blank means none."""
    env = _environ(environ)
    token = env.get("GOOGLE_OAUTH_ACCESS_TOKEN") or env.get("CLOUDSDK_AUTH_ACCESS_TOKEN") or ""
    return token.strip() or None


def google_application_credentials(environ: Mapping[str, str] | None = None) -> str | None:
    """``GOOGLE_APPLICATION_CREDENTIALS``: a credentials JSON named explicitly. google-auth
    reads it itself; a ``gs://`` source asks only whether it is set (an emulator's endpoint is
    read anonymously unless credentials are named)."""
    return _environ(environ).get("GOOGLE_APPLICATION_CREDENTIALS", "").strip() or None


def in_kubernetes(environ: Mapping[str, str] | None = None) -> bool:
    """``KUBERNETES_SERVICE_HOST`` is set: the process runs in a pod (the node gate may work)."""
    return bool(_environ(environ).get("KUBERNETES_SERVICE_HOST"))


def kubeconfig(environ: Mapping[str, str] | None = None) -> str | None:
    """``KUBECONFIG`` (one path, or several joined by ``:``) for ``prefetch status``; read here
    because the kubernetes client reads it once, when it is imported."""
    return _environ(environ).get("KUBECONFIG") or None


def oci_plain_http(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """``PREFETCH_OCI_PLAIN_HTTP``: registries (``host[:port]``, comma-separated, lower-cased)
    spoken to over plain HTTP, e.g. a node-local mirror such as Spegel's."""
    listed = _environ(environ).get("PREFETCH_OCI_PLAIN_HTTP", "")
    return frozenset(registry_host(h.strip().lower()) for h in listed.split(",") if h.strip())


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def registry_host(text: str) -> str:
    """``host[:port]`` as a registry reference spells it: an IPv6 address in brackets. On an
    IPv6 cluster the node's IP (``$(NODE_IP):30020``, ``${NODE_IP}``) is a bare address, and
    ``fd00::1:30020`` is read as the address ``fd00::1`` and the port 30020 (a port of five
    digits: ``fd00::1:3002`` is itself an address; write ``[fd00::1]:3002``)."""
    if text.startswith("[") or text.count(":") < 2:
        return text
    if _is_ipv6(text):
        return f"[{text}]"
    head, _, port = text.rpartition(":")
    return f"[{head}]:{port}" if port.isdigit() and _is_ipv6(head) else text


def oci_staging(environ: Mapping[str, str] | None = None) -> str | None:
    """``PREFETCH_OCI_STAGING``: where archive layers are unpacked before publishing (None: the
    temporary folder)."""
    return _environ(environ).get("PREFETCH_OCI_STAGING") or None


def docker_config_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where ``docker login`` keeps its ``config.json``: ``DOCKER_CONFIG``, else ``~/.docker``."""
    base = _environ(environ).get("DOCKER_CONFIG")
    return Path(base) if base else Path.home() / ".docker"


def variable(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The environment variable ``name`` a config names itself (``${NODE_IP}`` in a registry
    host: the downward API's values reach a DaemonSet only as its environment)."""
    return _environ(environ).get(name) or None


#: A per-source proxy setting that means "connect directly", whatever the environment says.
DIRECT_WORDS = frozenset({"", "none", "direct"})


@dataclass(frozen=True)
class Proxies:
    """``HTTP_PROXY``/``HTTPS_PROXY``/``NO_PROXY`` (lower case first, as curl and urllib do),
    or a source's own proxy setting in place of the first two.

    ``by_scheme`` maps "http"/"https" to the proxy URL; ``no_proxy`` is the raw bypass list,
    matched by :func:`no_proxy_matches`. :meth:`proxy_for` is THE routing rule every source
    applies (the Hub's pool, its metadata client and the S3 client), so they never disagree.
    """

    by_scheme: Mapping[str, str]
    no_proxy: str | None = None

    def proxy_for(self, url: str) -> str | None:
        """The proxy a request for ``url`` goes through, or None for a direct connection."""
        parts = urlsplit(url)
        proxy = self.by_scheme.get(parts.scheme.lower())
        if proxy is None or no_proxy_matches(parts.hostname or "", self.no_proxy or ""):
            return None
        return proxy

    def key(self) -> tuple[tuple[tuple[str, str], ...], str | None]:
        """A hashable value equal for equal settings (to share clients between them)."""
        return tuple(sorted(self.by_scheme.items())), self.no_proxy


def no_proxy_matches(host: str, no_proxy: str) -> bool:
    """Does ``NO_PROXY`` (comma-separated names, ``*`` for all) exempt ``host``? As curl and
    urllib read it: a name matches itself and its subdomains, a leading dot is ignored."""
    host = host.lower().rstrip(".")
    for entry in no_proxy.split(","):
        name = entry.strip().lstrip(".").lower()
        if name == "*":
            return True
        if name and (host == name or host.endswith("." + name)):
            return True
    return False


def parse_proxy(value: str, *, field: str) -> str:
    """A source's own proxy setting: an ``http(s)://host:port`` URL, or ``""`` for direct
    (``none`` and ``direct`` say the same). ConfigError, naming ``field``, for anything else."""
    text = value.strip()
    if text.lower() in DIRECT_WORDS:
        return ""
    parts = urlsplit(text)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{field}: {value!r} is not a proxy URL like http://host:3128 (or none: direct)"
        )
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as exc:
        raise ConfigError(f"{field}: {value!r} has an invalid port") from exc
    return text


def proxies(environ: Mapping[str, str] | None = None, *, override: str | None = None) -> Proxies:
    """The proxies for HTTP and HTTPS, and the hosts that bypass them.

    ``override`` is a source's own setting (see :func:`parse_proxy`): a URL replaces
    ``HTTP(S)_PROXY`` for both schemes, ``""`` means direct; None (the default) takes the
    environment's. ``NO_PROXY`` applies in every case, so a host it names is never proxied.
    """
    env = _environ(environ)
    no_proxy = (env.get("no_proxy") or env.get("NO_PROXY") or "").strip() or None
    if override is not None:
        override = parse_proxy(override, field="proxy")
        by_scheme = {"http": override, "https": override} if override else {}
        return Proxies(by_scheme=by_scheme, no_proxy=no_proxy)
    found: dict[str, str] = {}
    for scheme in ("http", "https"):
        name = f"{scheme}_proxy"
        # as urllib: under CGI, HTTP_PROXY may be a request header (httpoxy), so it is ignored
        upper = None if scheme == "http" and "REQUEST_METHOD" in env else env.get(name.upper())
        value = (env.get(name) or upper or "").strip()
        if not value:
            continue
        parts = urlsplit(value if "://" in value else f"http://{value}")
        if not parts.hostname:
            raise ConfigError(f"{name.upper()}: {value!r} is not a proxy URL")
        found[scheme] = value
    return Proxies(by_scheme=found, no_proxy=no_proxy)


# ---- trust: the CA bundle TLS is verified with -------------------------------------------------

#: The variables naming a CA bundle, in the order they are asked (after a flag or config key).
CA_BUNDLE_VARIABLES = ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "AWS_CA_BUNDLE")


@dataclass(frozen=True)
class CaBundle:
    """The CA bundle every backend verifies TLS with: ``path`` (None: the system's default
    store) and ``origin``, where the choice came from (a flag, a config key, a variable), for
    messages."""

    path: str | None
    origin: str


def ca_bundle(
    chosen: str | None = None,
    *,
    origin: str = "--ca-bundle",
    environ: Mapping[str, str] | None = None,
    aws_profile: str | None = None,
) -> CaBundle:
    """THE trust rule, the same for every backend (Hub, S3, OCI, mirrors, pushes): in order
    ``chosen`` (``--ca-bundle`` or a ``caBundle`` config key, named by ``origin``), then
    ``REQUESTS_CA_BUNDLE``, ``SSL_CERT_FILE``, ``AWS_CA_BUNDLE``, then the ``ca_bundle`` of the
    AWS profile (``aws_profile``, else ``AWS_PROFILE``), else the system's default store. A
    variable naming a public store (:func:`public_stores`) is passed over for a later one or
    the profile's, and chosen only when nothing else names a bundle. A bundle that is missing
    or not PEM is a ConfigError naming the file and its origin (the public store is only checked
    to exist: it is the system's own). Hostname verification is never affected: there is no way
    to turn verification off."""
    env = _environ(environ)
    found: tuple[str, str] | None = (chosen, origin) if chosen else None
    named = [(env[n].strip(), n) for n in CA_BUNDLE_VARIABLES if env.get(n, "").strip()]
    # a variable naming the public store itself (many images set REQUESTS_CA_BUNDLE to it for
    # every tool) chooses nothing: it gives way to one naming a private CA, or the profile's
    public = public_stores() if named and found is None else frozenset()
    for path, name in named:
        if found is None and os.path.realpath(os.path.expanduser(path)) not in public:
            found = (path, name)
    if found is None:
        section = aws_profile_section({**env, "AWS_PROFILE": aws_profile} if aws_profile else env)
        if section and section.get("ca_bundle"):
            found = (section["ca_bundle"], "the AWS profile's ca_bundle")
    if found is None and named:
        # the public store, named: botocore is given it (else its own bundle). It is the system's
        # own file, as the default store (never parsed here either): its ~140 certificates are
        # not parsed at start-up (~35 ms of a pull; a TLS connection loads them anyway), only its
        # existence is checked.
        path, where = named[0]
        return CaBundle(existing_ca_bundle(path, where), where)
    if found is None:
        return CaBundle(None, "the system's default store")
    path, where = found
    return CaBundle(check_ca_bundle(path, where), where)


def public_stores() -> frozenset[str]:
    """The real paths of the public CA stores a variable may name without meaning a private CA:
    OpenSSL's compiled-in default file and certifi's bundle (what requests and botocore ship)."""
    import ssl  # only when a CA variable is set

    paths = [ssl.get_default_verify_paths().openssl_cafile]
    with contextlib.suppress(ImportError):
        import certifi  # requests' and botocore's bundle; installed with them

        paths.append(certifi.where())
    return frozenset(os.path.realpath(p) for p in paths if p)


def existing_ca_bundle(path: str, origin: str) -> str:
    """``path`` (``~`` expanded) when it is a file; else a one-line ConfigError naming the file
    and ``origin``."""
    full = os.path.expanduser(path)
    if not os.path.isfile(full):
        raise ConfigError(
            f"{origin}: the CA bundle {path} does not exist (or is not a file)",
            hint="name a PEM file of CA certificates",
        )
    return full


def check_ca_bundle(path: str, origin: str) -> str:
    """``path`` (``~`` expanded) when it is a readable PEM bundle of CA certificates; else a
    one-line ConfigError naming the file and ``origin``."""
    import ssl  # only when a bundle is named (the CLI's startup)

    full = existing_ca_bundle(path, origin)
    try:
        ssl.create_default_context(cafile=full)
    except (ssl.SSLError, OSError, UnicodeError, ValueError) as exc:
        raise ConfigError(
            f"{origin}: the CA bundle {path} is not a PEM file of CA certificates ({exc})",
            hint="name a PEM file of CA certificates (-----BEGIN CERTIFICATE----- blocks)",
        ) from exc
    return full


def aws_profile_section(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The AWS config file's section of the active profile (``AWS_CONFIG_FILE``, else
    ``~/.aws/config``; ``AWS_DEFAULT_PROFILE``, else ``AWS_PROFILE``, else ``default``): {} when
    there is no file, or no such section for the default profile; None when botocore would fail
    or must decide (a named profile that is not there, a file that does not parse)."""
    import configparser  # only when a profile is read (a no-op pull's startup)

    env = _environ(environ)
    name = env.get("AWS_DEFAULT_PROFILE") or env.get("AWS_PROFILE") or "default"
    path = os.path.expanduser(env.get("AWS_CONFIG_FILE") or "~/.aws/config")
    parser = configparser.RawConfigParser()
    try:
        with open(path, encoding="utf-8") as f:
            parser.read_file(f)
    except FileNotFoundError:
        return {} if name == "default" else None
    except (OSError, UnicodeError, configparser.Error):
        return None
    section = "default" if name == "default" else f"profile {name}"
    if not parser.has_section(section):
        return {} if name == "default" else None
    return {k.strip(): v.strip() for k, v in parser.items(section)}


__all__ = [
    "CA_BUNDLE_VARIABLES",
    "DIRECT_WORDS",
    "CaBundle",
    "Proxies",
    "aws_endpoint_url",
    "aws_profile_section",
    "ca_bundle",
    "check_ca_bundle",
    "debug",
    "hf_endpoint",
    "hf_oidc_resource",
    "hf_token",
    "hf_token_path",
    "in_kubernetes",
    "no_proxy_matches",
    "parse_proxy",
    "proxies",
]


#: The Azure Storage variables :func:`azure_storage` reads (also what ``az`` reads, where it has
#: one of the same name).
AZURE_STORAGE_VARIABLES = (
    "AZURE_STORAGE_BLOB_ENDPOINT",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_AUTH_MODE",
)
#: Variables that say Microsoft Entra credentials are there for ``azure-identity`` to find
#: (workload identity on AKS, a service principal, a managed identity's endpoint).
AZURE_ENTRA_VARIABLES = (
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_CLIENT_SECRET",
    "AZURE_CLIENT_CERTIFICATE_PATH",
    "IDENTITY_ENDPOINT",
    "MSI_ENDPOINT",
)


def azure_storage(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Azure Storage settings of the environment (:data:`AZURE_STORAGE_VARIABLES`, the
    non-empty ones), plus ``entra="1"`` when a variable of :data:`AZURE_ENTRA_VARIABLES` is
    set. ``AZURE_STORAGE_BLOB_ENDPOINT`` is checked to be an http(s) URL."""
    env = _environ(environ)
    found = {n: env[n].strip() for n in AZURE_STORAGE_VARIABLES if env.get(n, "").strip()}
    if "AZURE_STORAGE_BLOB_ENDPOINT" in found:
        found["AZURE_STORAGE_BLOB_ENDPOINT"] = str(_http_url("AZURE_STORAGE_BLOB_ENDPOINT", env))
    if any(env.get(n, "").strip() for n in AZURE_ENTRA_VARIABLES):
        found["entra"] = "1"
    return found
