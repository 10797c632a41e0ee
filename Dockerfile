# syntax=docker/dockerfile:1
#
# The model-prefetch agent image: `prefetch agent` by default (daemonset/daemonset.yaml).
#
#   docker build -t ghcr.io/model-prefetch/model-prefetch:0.1.0 .
#
# The only network access at build time is pip fetching the package's dependencies (wheels)
# from PyPI; the package itself is installed from this checkout. Pin the base image by digest
# in CI (FROM python:3.11-slim-bookworm@sha256:...) for reproducible builds.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
# The package and its metadata only (.dockerignore keeps everything else out of the context).
COPY pyproject.toml ./
COPY prefetch/ prefetch/
# A virtualenv, so the runtime stage copies one self-contained directory.
RUN python -m venv /opt/prefetch \
 && /opt/prefetch/bin/pip install --no-cache-dir . \
 && /opt/prefetch/bin/prefetch --version

FROM ${PYTHON_IMAGE}
# 65532: the uid/gid the DaemonSet runs as (runAsUser/runAsGroup) and that the node bootstrap
# gives the cache directory on the host. Change all three together.
ARG PREFETCH_UID=65532
RUN groupadd --system --gid "${PREFETCH_UID}" prefetch \
 && useradd --system --uid "${PREFETCH_UID}" --gid "${PREFETCH_UID}" \
      --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin prefetch
COPY --from=build /opt/prefetch /opt/prefetch
ENV PATH=/opt/prefetch/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_DISABLE_TELEMETRY=1
USER ${PREFETCH_UID}:${PREFETCH_UID}
# /healthz, /readyz, /metrics (prefetch.support.constants.DEFAULT_LISTEN)
EXPOSE 8090
ENTRYPOINT ["prefetch"]
CMD ["agent"]
