"""Names and defaults shared by the CLI, the agent and the manifests (read by consistency tests)."""

from __future__ import annotations

#: Node label prefix: the agent labels its node ``<prefix>/<model-name>=ready``.
DEFAULT_LABEL_PREFIX = "model-prefetch.io"
#: Karpenter startup taint the agent removes once every required model is ready.
DEFAULT_STARTUP_TAINT_KEY = "model-prefetch.io/warming"
DEFAULT_STARTUP_TAINT_EFFECT = "NoSchedule"
#: Where the agent's HTTP server listens: /healthz, /readyz, /metrics.
DEFAULT_LISTEN = "0.0.0.0:8090"
HEALTHZ_PATH = "/healthz"
READYZ_PATH = "/readyz"
METRICS_PATH = "/metrics"
#: Where the bootstrap mounts the instance-store volume on the host, and the cache folder in it.
HOST_MOUNT_POINT = "/mnt/k8s-disks/local-nvme"
HOST_CACHE_DIR = HOST_MOUNT_POINT + "/huggingface"
#: Prefix of every Prometheus metric.
METRICS_PREFIX = "model_prefetch"
#: The node annotation where the agent writes its progress (JSON), read by ``prefetch status``.
PROGRESS_ANNOTATION = "model-prefetch.io/progress"
#: Least seconds between two writes of the progress annotation by one agent (one per node).
PROGRESS_INTERVAL = 30.0
