"""`prefetch pull oci://...` against a real registry (Debian's docker-registry, distribution 2.8)
over HTTPS with the session CA (registry.prefetch.test on 127.0.0.1), with artifacts pushed by
hand-built manifests (and skopeo where installed). Plain HTTP only where it is the point: a
node-local mirror listed in PREFETCH_OCI_PLAIN_HTTP."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prefetch.pipeline.engine.transfer import TransferConfig
from prefetch.pipeline.layout import PlainLayout
from prefetch.pipeline.layout.hf import HfCacheLayout
from prefetch.pipeline.retry import RetryPolicy
from prefetch.pipeline.spec import ModelSpec, parse_source_uri
from prefetch.pipeline.sync import sync
from prefetch.sources import SourceSettings, open_source
from prefetch.support.errors import (
    ChecksumMismatchError,
    InvalidListingError,
    SourceChangedError,
    UnsafePathError,
)

from .fakes.oci_proxy import RegistryProxy
from .fakes.registry import (
    MODELPACK_ARTIFACT,
    OCI_INDEX,
    OCI_MANIFEST,
    Pusher,
    Registry,
    sha256_digest,
)
from .support import config_text

MiB = 1024 * 1024
CONFIG = TransferConfig(
    concurrency=4,
    chunk_size=1 * MiB,
    buffer_size=64 * 1024,
    retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.1),
)
FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "model.safetensors": os.urandom(3 * MiB + 7),
    "tokenizer/tokenizer.json": b'{"version": "1.0"}',
}


@pytest.fixture(scope="module")
def pusher(registry: Registry) -> Pusher:
    return registry.pusher()


def pull(uri: str, dest: Path, *, hf_repo: str | None = None, config: TransferConfig = CONFIG):
    spec = ModelSpec(source=parse_source_uri(uri), hf_repo=hf_repo)
    source = open_source(spec, SourceSettings(concurrency=config.concurrency))
    layout = HfCacheLayout(dest, hf_repo) if hf_repo else PlainLayout(dest)
    return sync(spec, source, layout, config)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefetch.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_pull_by_tag_resolves_the_digest_once_and_writes_every_layer(registry, pusher, tmp_path):
    pushed = pusher.modelpack("models/tiny", "v1", FILES)
    run = cli("pull", f"oci://{registry.host}/models/tiny:v1", str(tmp_path / "d"), "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["revision"] == pushed.digest.split(":", 1)[1]
    for path, data in FILES.items():
        assert (tmp_path / "d" / path).read_bytes() == data
    assert result["files_verified"] == len(FILES)
    again = cli("pull", f"oci://{registry.host}/models/tiny@{pushed.digest}", str(tmp_path / "d"))
    assert again.returncode == 0, again.stderr
    assert "up to date, 0 bytes downloaded" in again.stdout
    check = cli("verify", str(tmp_path / "d"))
    assert check.returncode == 0, check.stderr
    assert f"{len(FILES)} files verified" in check.stdout


def test_hf_layout_loads_offline_with_huggingface_hub(registry, pusher, tmp_path):
    from huggingface_hub import snapshot_download, try_to_load_from_cache

    pushed = pusher.modelpack("models/hfl", "latest", FILES)
    home = tmp_path / "home"
    run = cli("pull", f"oci://{registry.host}/models/hfl", str(home), "--hf-repo", "acme/hfl")
    assert run.returncode == 0, run.stderr
    cache = home / "hub"
    found = try_to_load_from_cache("acme/hfl", "model.safetensors", cache_dir=cache)
    assert isinstance(found, str)
    assert Path(found).read_bytes() == FILES["model.safetensors"]
    # the blob is named by its sha256, as the Hub names LFS blobs
    assert Path(found).resolve().name == pushed.layers["model.safetensors"].split(":", 1)[1]
    snap = snapshot_download("acme/hfl", cache_dir=cache, local_files_only=True)
    assert Path(snap, "tokenizer/tokenizer.json").read_bytes() == FILES["tokenizer/tokenizer.json"]
    check = cli("verify", str(home))
    assert check.returncode == 0, check.stderr
    models = [{"name": "hfl", "source": f"oci://{registry.host}/models/hfl", "hfRepo": "acme/hfl"}]
    (tmp_path / "models.yaml").write_text(config_text(home, models))
    listed = cli("ls", "--config", str(tmp_path / "models.yaml"))
    assert listed.returncode == 0 and "acme/hfl" in listed.stdout, listed.stdout + listed.stderr


def test_a_tampered_blob_is_refused_and_nothing_is_published(registry, pusher, tmp_path):
    # bytes of its own: the registry stores a blob once, and the other tests read FILES
    files = {**FILES, "model.safetensors": os.urandom(3 * MiB + 7)}
    pushed = pusher.modelpack("models/tamper", "v1", files)
    data = registry.blob_data(pushed.layers["model.safetensors"])
    content = bytearray(data.read_bytes())
    content[2 * MiB] ^= 0xFF
    data.write_bytes(bytes(content))
    with pytest.raises(ChecksumMismatchError, match=r"model\.safetensors"):
        pull(f"oci://{registry.host}/models/tamper:v1", tmp_path / "d")
    assert not (tmp_path / "d" / "model.safetensors").exists()


def test_a_manifest_whose_bytes_do_not_match_its_digest_is_refused(registry, pusher, tmp_path):
    pushed = pusher.modelpack("models/badman", "v1", FILES)
    stored = registry.blob_data(pushed.digest)
    stored.write_bytes(pushed.manifest.replace(b'"schemaVersion": 2', b'"schemaVersion":  2'))
    with pytest.raises(SourceChangedError, match="digest"):
        pull(f"oci://{registry.host}/models/badman@{pushed.digest}", tmp_path / "d")
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())


def test_a_layer_path_with_dotdot_is_refused_before_any_byte(registry, pusher, tmp_path):
    pusher.modelpack("models/evil", "v1", {"w.bin": b"x" * 10}, paths={"w.bin": "../../etc/evil"})
    with pytest.raises(UnsafePathError, match=r"\.\."):
        pull(f"oci://{registry.host}/models/evil:v1", tmp_path / "d")
    assert not (tmp_path / "etc").exists()
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())


def test_an_image_that_is_not_a_model_is_refused_naming_its_types(registry, pusher, tmp_path):
    pusher.modelpack(
        "models/image",
        "v1",
        {"w.bin": b"x"},
        artifact_type=None,
        config_media="application/vnd.oci.image.config.v1+json",
    )
    with pytest.raises(InvalidListingError, match=r"not a model artifact.*image\.config"):
        pull(f"oci://{registry.host}/models/image:v1", tmp_path / "d")


@pytest.mark.parametrize(
    ("artifact_type", "config_media"),
    [
        (None, "application/vnd.cnai.model.config.v1+json"),  # modctl's older names
        (
            "application/vnd.kitops.modelkit.manifest.v1+json",
            "application/vnd.kitops.modelkit.config.v1+json",
        ),
        (None, "application/vnd.docker.ai.model.config.v0.1+json"),
    ],
)  # fmt: skip
def test_every_model_family_is_read(registry, pusher, tmp_path, artifact_type, config_media):
    pusher.modelpack(
        "models/family",
        "v1",
        {"w.bin": b"w"},
        artifact_type=artifact_type,
        config_media=config_media,
    )
    pull(f"oci://{registry.host}/models/family:v1", tmp_path / "d")
    assert (tmp_path / "d" / "w.bin").read_bytes() == b"w"


def _index(pusher: Pusher, repo: str, tag: str, entries: list[tuple[str, str, str | None]]) -> None:
    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [
            {
                "mediaType": OCI_MANIFEST,
                "digest": d,
                "size": n,
                **({"artifactType": a} if a else {}),
            }
            for d, n, a in entries
        ],
    }
    pusher.manifest(repo, tag, doc, OCI_INDEX)


def test_an_index_picks_its_one_model_manifest(registry, pusher, tmp_path):
    model = pusher.modelpack("models/idx", "model", {"w.bin": b"model"})
    image = pusher.modelpack(
        "models/idx", "image", {"x.bin": b"image"}, artifact_type=None,
        config_media="application/vnd.oci.image.config.v1+json",
    )  # fmt: skip
    _index(pusher, "models/idx", "both", [
        (image.digest, len(image.manifest), None),
        (model.digest, len(model.manifest), None),
    ])  # fmt: skip
    result = pull(f"oci://{registry.host}/models/idx:both", tmp_path / "d")
    assert (tmp_path / "d" / "w.bin").read_bytes() == b"model"
    assert result.revision == model.digest.split(":", 1)[1]


def test_an_index_of_two_models_fails_naming_them(registry, pusher, tmp_path):
    one = pusher.modelpack("models/idx2", "a", {"w.bin": b"a"})
    two = pusher.modelpack("models/idx2", "b", {"w.bin": b"b"})
    _index(pusher, "models/idx2", "two", [
        (one.digest, len(one.manifest), MODELPACK_ARTIFACT),
        (two.digest, len(two.manifest), MODELPACK_ARTIFACT),
    ])  # fmt: skip
    with pytest.raises(InvalidListingError, match="2 model manifests") as info:
        pull(f"oci://{registry.host}/models/idx2:two", tmp_path / "d")
    assert one.digest[:19] in str(info.value) and two.digest[:19] in str(info.value)


def test_an_unknown_tag_is_one_error_line(registry, tmp_path):
    run = cli("pull", f"oci://{registry.host}/models/nothing:v9", str(tmp_path / "d"))
    assert run.returncode != 0
    assert run.stderr.startswith("Error: "), run.stderr
    assert "Traceback" not in run.stderr
    assert "manifest v9" in run.stderr


def test_digest_helper_matches_pushed(pusher):
    assert pusher.blob("models/h", b"abc") == sha256_digest(b"abc")


# -- registry mirrors ----------------------------------------------------------------------------


def test_a_pull_through_mirror_serves_the_origin_digest_and_then_the_origin_may_stop(
    tmp_path_factory, tmp_path, test_ca
):
    origin = Registry(tmp_path_factory.mktemp("origin"), test_ca)
    origin.start()
    # a pull-through cache of an https origin, itself https under another name
    mirror = Registry(
        tmp_path_factory.mktemp("mirror"), test_ca, proxy_of=origin.url, role="mirror"
    )
    mirror.start()
    try:
        assert origin.url.startswith("https://") and mirror.url.startswith("https://")
        pushed = origin.pusher().modelpack("models/m", "v1", FILES)
        uri = f"oci://{origin.host}/models/m:v1"
        run = cli("pull", uri, str(tmp_path / "a"), "--mirror", f"oci://{mirror.host}", "--json")
        assert run.returncode == 0, run.stderr
        first = json.loads(run.stdout)
        assert first["served_by"].startswith(f"oci://{mirror.host}/models/m@"), first
        assert first["revision"] == pushed.digest.split(":", 1)[1]
        origin.stop()
        pinned = f"oci://{origin.host}/models/m@{pushed.digest}"
        run = cli("pull", pinned, str(tmp_path / "b"), "--mirror", f"oci://{mirror.host}", "--json")
        assert run.returncode == 0, run.stderr
        for path, data in FILES.items():
            assert (tmp_path / "b" / path).read_bytes() == data
        # a tag needs the origin (a mirror cannot say what a tag means)
        run = cli("pull", uri, str(tmp_path / "c"), "--mirror", f"oci://{mirror.host}",
                  "--attempts", "2")  # fmt: skip
        assert run.returncode != 0
        assert run.stderr.startswith("Error: ") and "manifest v1" in run.stderr
    finally:
        mirror.stop()
        origin.stop()


# -- an artifact another tool pushed ---------------------------------------------------------------


def oci_layout_dir(root: Path, files: dict[str, bytes]) -> str:
    """An OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256``) holding a ModelPack
    artifact, built by hand; returns its manifest digest."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        digest = sha256_digest(data)
        (blobs / digest.split(":", 1)[1]).write_bytes(data)
        return digest

    config = b'{"descriptor": {"name": "sk"}, "modelfs": {"type": "layers", "diffIds": []}}'
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": MODELPACK_ARTIFACT,
        "config": {"mediaType": "application/vnd.cncf.model.config.v1+json",
                   "digest": put(config), "size": len(config)},
        "layers": [
            {"mediaType": "application/vnd.cncf.model.weight.v1.raw", "digest": put(data),
             "size": len(data), "annotations": {"org.cncf.model.filepath": path}}
            for path, data in files.items()
        ],
    }).encode()  # fmt: skip
    digest = put(manifest)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({
        "schemaVersion": 2,
        "manifests": [{"mediaType": OCI_MANIFEST, "digest": digest, "size": len(manifest),
                       "annotations": {"org.opencontainers.image.ref.name": "v1"}}],
    }))  # fmt: skip
    return digest


@pytest.mark.skipif(shutil.which("skopeo") is None, reason="skopeo is not installed")
def test_an_artifact_pushed_by_skopeo_is_pulled_into_the_hf_layout(registry, tmp_path, test_ca):
    from huggingface_hub import snapshot_download

    digest = oci_layout_dir(tmp_path / "layout", FILES)
    certs = tmp_path / "certs"  # skopeo trusts the *.crt of --dest-cert-dir (verification on)
    certs.mkdir()
    shutil.copy(test_ca.ca_file, certs / "ca.crt")
    copy = subprocess.run(
        ["skopeo", "copy", "--dest-cert-dir", str(certs), "--preserve-digests",
         f"oci:{tmp_path / 'layout'}:v1", f"docker://{registry.host}/models/skopeo:v1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert copy.returncode == 0, copy.stderr
    home = tmp_path / "home"
    run = cli("pull", f"oci://{registry.host}/models/skopeo:v1", str(home),
              "--hf-repo", "acme/skopeo", "--json")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["revision"] == digest.split(":", 1)[1]
    snap = snapshot_download("acme/skopeo", cache_dir=home / "hub", local_files_only=True)
    for path, data in FILES.items():
        assert Path(snap, path).read_bytes() == data


def test_a_range_past_the_end_is_clamped_to_the_descriptor_size(registry, pusher):
    pusher.modelpack("models/clamp", "v1", {"w.bin": b"0123456789"})
    spec = ModelSpec(source=parse_source_uri(f"oci://{registry.host}/models/clamp:v1"))
    source = open_source(spec)
    (file,) = source.resolve(spec).files
    reader = source.open_range(file, 4, file.size + 1000)  # a registry would answer 416
    buf = bytearray(64)
    n = reader.readinto(memoryview(buf))
    assert reader.readinto(memoryview(buf)[n:]) == 0
    reader.close()
    assert bytes(buf[:n]) == b"456789"


def test_a_blob_the_mirror_lacks_is_read_from_the_origin(tmp_path_factory, tmp_path, test_ca):
    origin = Registry(tmp_path_factory.mktemp("origin2"), test_ca)
    mirror = Registry(tmp_path_factory.mktemp("mirror2"), test_ca, role="mirror")
    origin.start()
    mirror.start()
    try:
        files = {**FILES, "model.safetensors": os.urandom(8 * MiB + 1)}  # 9 chunks
        pushed = origin.pusher().modelpack("models/part", "v1", files)
        assert mirror.pusher().modelpack("models/part", "v1", files).digest == pushed.digest
        gone = pushed.layers["model.safetensors"]  # a mirror that has the rest only
        http = mirror.client()
        assert http.request("DELETE", f"{mirror.url}/v2/models/part/blobs/{gone}").status == 202
        proxy = RegistryProxy(mirror.url, test_ca).start()
        try:
            spec = ModelSpec(
                source=parse_source_uri(f"oci://{origin.host}/models/part@{pushed.digest}"),
                mirrors=(parse_source_uri(f"oci://{proxy.host}"),),
            )
            result = sync(spec, open_source(spec), PlainLayout(tmp_path / "d"), CONFIG)
        finally:
            proxy.stop()
        assert result.served_by.startswith(f"oci://{proxy.host}/")
        for path, data in files.items():
            assert (tmp_path / "d" / path).read_bytes() == data
        served = {p.split("/blobs/", 1)[1].split("?")[0] for p, _ in proxy.blob_gets()}
        assert pushed.layers["config.json"] in served  # the mirror served what it has
        # the blob it lacks: asked once per chunk in flight at most, then only at the origin
        assert 1 <= sum(gone in p for p, _ in proxy.blob_gets()) <= CONFIG.concurrency
    finally:
        mirror.stop()
        origin.stop()


# -- plain HTTP where it is the point --------------------------------------------------------------


def test_a_plain_http_mirror_is_spoken_to_over_http_only_when_listed(
    tmp_path_factory, tmp_path, test_ca
):
    """An in-cluster mirror without TLS, reached by a name (not loopback): https by default, so
    the pull fails; listed in PREFETCH_OCI_PLAIN_HTTP, it is pulled over plain HTTP."""
    if test_ca.host != "prefetch.test":
        pytest.skip("the prefetch.test names do not resolve here")
    plain = Registry(tmp_path_factory.mktemp("plain"))
    plain.start()
    try:
        assert plain.url.startswith("http://")
        plain.pusher().modelpack("models/plain", "v1", FILES)
        host = f"{test_ca.host_for('mirror')}:{plain.port}"
        uri = f"oci://{host}/models/plain:v1"
        refused = cli("pull", uri, str(tmp_path / "a"), "--attempts", "1",
                      env={"PREFETCH_OCI_PLAIN_HTTP": ""})  # fmt: skip
        assert refused.returncode != 0 and refused.stderr.startswith("Error: "), refused.stderr
        assert not (tmp_path / "a" / "config.json").exists()
        run = cli("pull", uri, str(tmp_path / "b"), env={"PREFETCH_OCI_PLAIN_HTTP": host})
        assert run.returncode == 0, run.stderr
        for path, data in FILES.items():
            assert (tmp_path / "b" / path).read_bytes() == data
    finally:
        plain.stop()
