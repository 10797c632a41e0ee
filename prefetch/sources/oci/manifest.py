"""OCI manifests of model artifacts: which documents are models, and the files their layers are.

A model artifact is an OCI image manifest whose ``artifactType`` or config media type is one of
the model families below (ModelPack, the older CNAI names modctl still writes, KitOps ModelKits,
Docker model artifacts). Its layers are files: a raw layer is written to the path its
``org.cncf.model.filepath`` annotation names (or ``org.opencontainers.image.title``, as oras
writes it); a layer whose media type says tar is an archive, unpacked at that path. An image
index names several manifests: :func:`pick_model` takes the one model among them.

Every document is checked against its digest before it is parsed, and parsed with bounds (size,
layer count): a registry is not trusted to send what it was asked for.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from prefetch.support.errors import InvalidListingError, SourceChangedError
from prefetch.support.safejson import load_json

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
#: What a manifest GET accepts (the index types first: a tag may name one).
ACCEPT = ", ".join((OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST))
#: The distribution spec's bound on a manifest (registries refuse larger ones too).
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MAX_LAYERS = 100_000
MAX_INDEX_ENTRIES = 64
#: Media type prefixes of model artifacts (artifactType or config media type).
MODEL_TYPE_PREFIXES = (
    "application/vnd.cncf.model.",  # ModelPack (modelpack/model-spec)
    "application/vnd.cnai.model.",  # its earlier names, still written by modctl
    "application/vnd.kitops.modelkit.",  # KitOps ModelKits
    "application/vnd.docker.ai.",  # Docker model artifacts (Docker Model Runner)
)
FILEPATH_ANNOTATIONS = ("org.cncf.model.filepath", "org.opencontainers.image.title")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class Layer:
    """One layer of a model manifest: ``path`` is where it goes (relative to DEST), ``archive``
    is None for a raw layer, else "tar", "tar+gzip" or "tar+zstd"."""

    digest: str
    size: int
    media_type: str
    path: str  # a raw layer's file; an archive's name (its members carry their own paths)
    archive: str | None = None

    @property
    def hex(self) -> str:
        return self.digest.split(":", 1)[1]


@dataclass(frozen=True)
class ModelManifest:
    digest: str
    media_type: str
    artifact_type: str
    config_digest: str
    config_size: int
    layers: tuple[Layer, ...]


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_digest(data: bytes, expected: str, what: str) -> None:
    """Refuse a document whose bytes are not the ones its digest names."""
    actual = digest_of(data)
    if actual != expected:
        raise SourceChangedError(
            f"{what}: the registry sent a manifest whose digest is {actual}, not {expected} "
            "(refused: a manifest is trusted only by its digest)"
        )


def is_model_type(media_type: str) -> bool:
    return media_type.startswith(MODEL_TYPE_PREFIXES)


def parse_document(data: bytes, what: str) -> dict[str, object]:
    """A manifest or index as JSON (an object), bounded in size."""
    doc = load_json(data, where=what, max_bytes=MAX_MANIFEST_BYTES, error=InvalidListingError)
    if not isinstance(doc, dict):
        raise InvalidListingError(f"{what}: not a JSON object")
    return doc


def document_type(doc: dict[str, object], header: str | None) -> str:
    """The media type of a document: its own ``mediaType``, else the Content-Type it came with."""
    media = doc.get("mediaType")
    if isinstance(media, str) and media:
        return media
    if "manifests" in doc:
        return OCI_INDEX
    return (header or OCI_MANIFEST).split(";", 1)[0].strip()


def is_index(media_type: str) -> bool:
    return media_type in (OCI_INDEX, DOCKER_LIST)


@dataclass(frozen=True)
class IndexEntry:
    digest: str
    media_type: str
    artifact_type: str
    platform: str

    def describe(self) -> str:
        kind = self.artifact_type or self.platform or self.media_type
        return f"{self.digest[:19]}... ({kind})"


def index_entries(doc: dict[str, object], what: str) -> list[IndexEntry]:
    manifests = doc.get("manifests")
    if not isinstance(manifests, list):
        raise InvalidListingError(f"{what}: an index without a manifests list")
    if len(manifests) > MAX_INDEX_ENTRIES:
        raise InvalidListingError(f"{what}: an index of {len(manifests)} manifests")
    out = []
    for entry in manifests:
        if not isinstance(entry, dict):
            raise InvalidListingError(f"{what}: an index entry is not an object")
        platform = entry.get("platform")
        plat = ""
        if isinstance(platform, dict):
            plat = "/".join(str(platform.get(k, "")) for k in ("os", "architecture") if k)
        out.append(
            IndexEntry(
                _digest(entry.get("digest"), what),
                _str(entry.get("mediaType"), what, "mediaType"),
                str(entry.get("artifactType") or ""),
                plat,
            )
        )
    return out


def parse_model_manifest(doc: dict[str, object], digest: str, what: str) -> ModelManifest:
    """A model artifact's manifest, or InvalidListingError naming why it is not one: the layers
    as files, each path checked (see :mod:`prefetch.support.paths`) by the snapshot built from
    them."""
    media_type = document_type(doc, None)
    if media_type not in (OCI_MANIFEST, DOCKER_MANIFEST):
        raise InvalidListingError(f"{what}: {media_type!r} is not an image manifest")
    config = doc.get("config")
    if not isinstance(config, dict):
        raise InvalidListingError(f"{what}: no config descriptor")
    config_type = _str(config.get("mediaType"), what, "config.mediaType")
    artifact_type = str(doc.get("artifactType") or "")
    if not (is_model_type(artifact_type) or is_model_type(config_type)):
        raise InvalidListingError(
            f"{what}: not a model artifact (artifactType {artifact_type or 'none'!r}, config "
            f"media type {config_type!r}); expected a ModelPack, KitOps or Docker model artifact"
        )
    layers_doc = doc.get("layers")
    if not isinstance(layers_doc, list):
        raise InvalidListingError(f"{what}: no layers list")
    if len(layers_doc) > MAX_LAYERS:
        raise InvalidListingError(f"{what}: {len(layers_doc)} layers")
    layers = tuple(_layer(entry, what) for entry in layers_doc)
    return ModelManifest(
        digest=digest,
        media_type=media_type,
        artifact_type=artifact_type or config_type,
        config_digest=_digest(config.get("digest"), what),
        config_size=_size(config.get("size"), what),
        layers=layers,
    )


def _layer(entry: object, what: str) -> Layer:
    if not isinstance(entry, dict):
        raise InvalidListingError(f"{what}: a layer descriptor is not an object")
    digest = _digest(entry.get("digest"), what)
    size = _size(entry.get("size"), what)
    media_type = _str(entry.get("mediaType"), what, "layer mediaType")
    annotations = entry.get("annotations")
    path = None
    if isinstance(annotations, dict):
        path = next(
            (v for k in FILEPATH_ANNOTATIONS if isinstance(v := annotations.get(k), str) and v),
            None,
        )
    archive = archive_kind(media_type)
    if path is None and archive is None:
        raise InvalidListingError(
            f"{what}: layer {digest} ({media_type}) names no file path "
            f"(annotation {FILEPATH_ANNOTATIONS[0]})"
        )
    # an archive's members carry their own paths; its annotation only names it in messages
    return Layer(digest, size, media_type, path or digest, archive)


def archive_kind(media_type: str) -> str | None:
    """None for a raw layer, else the archive format its media type names."""
    base = media_type.rsplit(".", 1)[-1]
    for kind in ("tar+gzip", "tar+zstd", "tar"):
        if base == kind or base.endswith("." + kind) or media_type.endswith("." + kind):
            return kind
    if media_type.endswith(("+gzip", ".gzip")) and ".tar" in media_type:
        return "tar+gzip"
    return None


def _digest(value: object, what: str) -> str:
    if not isinstance(value, str) or not _DIGEST.match(value):
        raise InvalidListingError(f"{what}: {value!r} is not a sha256 digest")
    return value


def _size(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidListingError(f"{what}: {value!r} is not a size")
    return value


def _str(value: object, what: str, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidListingError(f"{what}: {name} missing")
    return value
