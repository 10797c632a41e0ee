"""``prefetch cache``: compile caches (see :mod:`prefetch.publish.compile_cache`).

``prefetch cache key ...`` prints the key for a vLLM build, model, revision, TP size and GPU;
``prefetch cache push DIR s3://bucket/prefix/<key>`` publishes a finished cache once.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from prefetch.cli.common import ca_bundle_option, json_even_on_failure
from prefetch.cli.help import HelpGroup
from prefetch.publish.compile_cache import DEFAULT_LEASE, DEFAULT_SETTLE, CacheKey, PushResult, push


@click.group(
    "cache",
    cls=HelpGroup,
    examples=[
        ("The key of a vLLM build, model and GPU",
         "prefetch cache key --vllm 0.11.0 --model org/name --revision main "
         "--tensor-parallel 4 --gpu-product NVIDIA-H100-80GB-HBM3"),
        ("Publish a finished compile cache under its key",
         "prefetch cache push /var/cache/vllm s3://my-bucket/compile-cache/KEY"),
    ],
)  # fmt: skip
def cache() -> None:
    """Compile caches shared by the fleet (vLLM's VLLM_CACHE_ROOT)."""


@cache.command(
    "key",
    examples=[
        ("The key of a vLLM build, model and GPU",
         "prefetch cache key --vllm 0.11.0 --model org/name --revision main "
         "--tensor-parallel 4 --gpu-product NVIDIA-H100-80GB-HBM3"),
    ],
)  # fmt: skip
@click.option("--vllm", required=True, help="vLLM image digest (sha256:...) or version.")
@click.option("--model", required=True, help="The model's name or repo id.")
@click.option("--revision", required=True, help="The model's revision (commit).")
@click.option("--tensor-parallel", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--gpu-product", required=True, help="The node label nvidia.com/gpu.product.")
@click.option("--torch", "torch_version", default=None, help="torch version, when pinned.")
@click.option("--cuda", "cuda_version", default=None, help="CUDA version, when pinned.")
@click.option("--json", "as_json", is_flag=True, help="Print the key and its fields as JSON.")
def key_cmd(
    vllm: str,
    model: str,
    revision: str,
    tensor_parallel: int,
    gpu_product: str,
    torch_version: str | None,
    cuda_version: str | None,
    as_json: bool,
) -> None:
    """Print the cache key (the last segment of the cache's S3 prefix)."""
    key = CacheKey(
        vllm=vllm, model=model, revision=revision, tensor_parallel=tensor_parallel,
        gpu_product=gpu_product, torch=torch_version, cuda=cuda_version,
    )  # fmt: skip
    if as_json:
        click.echo(json.dumps({"key": key.key, "fields": key.fields()}, sort_keys=True))
    else:
        click.echo(key.key)


@cache.command(
    "push",
    short_help="Publish a finished compile cache at its key, unless one is there.",
    examples=[
        ("Publish a finished compile cache under its key",
         "prefetch cache push /var/cache/vllm s3://my-bucket/compile-cache/KEY"),
    ],
)  # fmt: skip
@click.argument("directory", type=click.Path(path_type=Path))
@click.argument("uri")
@click.option("--endpoint-url", envvar="AWS_ENDPOINT_URL", help="S3 endpoint (default: AWS).")
@ca_bundle_option
@click.option(
    "--settle",
    default=DEFAULT_SETTLE,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds to watch the files for changes before uploading.",
)
@click.option(
    "--lease",
    default=DEFAULT_LEASE,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Seconds a claim holds the key unrenewed; a push that dies blocks it this long.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON result on stdout.")
@json_even_on_failure(lambda params: PushResult(uri=params["uri"], uploaded=False))
def push_cmd(
    directory: Path,
    uri: str,
    endpoint_url: str | None,
    ca_bundle: str | None,
    settle: float,
    lease: float,
    as_json: bool,
    record: PushResult,
) -> None:
    """Publish the finished compile cache DIRECTORY at URI (s3://bucket/prefix/<key>), unless
    one is there already: the first writer wins, nothing is overwritten. A claim left by a
    push that died is taken over once its lease ends; a published cache never is."""
    from prefetch.sources.s3.source import make_s3_client

    client = make_s3_client(endpoint_url=endpoint_url, ca_bundle=ca_bundle)
    result = push(client, directory, uri, settle=settle, lease=lease)
    if as_json:
        click.echo(json.dumps(result.to_json(), sort_keys=True))
    elif result.uploaded:
        click.echo(f"{uri}: published {result.files} file(s), {result.bytes} bytes")
    else:
        click.echo(f"{uri}: not uploaded ({result.reason})")
