# One image for every kvstore process; the command picks the role:
#   kvstore-agent  --config /etc/kvstore/agent.yaml    (default)
#   kvstore-router --config /etc/kvstore/router.yaml
#   kvctl ...
# Build:  docker build -t kvstore:0.1.0 .   (or podman/buildah build; no BuildKit-only syntax,
#         so Debian 12's buildah 1.28 builds it too; `make image-check` builds and runs it)
# CPU-only torch (a much smaller image, for CPU agents and routers):
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t kvstore:0.1.0-cpu .
# The default torch wheel from PyPI carries the CUDA runtime; the NVIDIA container toolkit
# supplies the driver at run time.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: compile the C extension and install everything into a venv -----------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# Same system packages `make install` uses, minus etcd (etcd runs in its own pods).
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
# Pinned, so two builds of one commit install the same build tools.
RUN python -m venv /opt/kvstore \
 && /opt/kvstore/bin/pip install pip==26.3 setuptools==84.2.1 wheel==0.48.0
ENV PATH=/opt/kvstore/bin:$PATH
WORKDIR /src

# Dependencies first, from pyproject.toml alone, so a source edit does not reinstall torch.
COPY pyproject.toml setup.py deploy/docker/ucx_requirement.py ./
RUN python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["server"]))' > /tmp/requirements.txt
# TORCH_INDEX_URL: where torch comes from (e.g. PyTorch's CPU index); its dependencies may
# come from PyPI, and a local-version wheel (+cpu) wins over PyPI's build of that version.
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
      pip install --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple \
        "$(grep '^torch' /tmp/requirements.txt)"; \
    fi \
 && pip install -r /tmp/requirements.txt
# UCX for peer transfers, built for the CUDA this torch was built for (cu13 for PyPI's
# default torch, cu12 for CUDA 12 and for a CPU torch, where it runs without a GPU).
RUN python ucx_requirement.py > /tmp/ucx-requirements.txt \
 && pip install -r /tmp/ucx-requirements.txt

COPY . .
# Fail the build, not the pod: the image must have the C extension, and every console
# script must resolve from the installed package (run from / so the source tree cannot
# stand in for it): deploy/docker/check_install.py.
RUN pip install --no-deps . && cd / && python /src/deploy/docker/check_install.py

# ---- runtime ----------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="kvstore" \
      org.opencontainers.image.description="Distributed KV-cache store for LLM inference: node agent, router, kvctl" \
      org.opencontainers.image.source="https://github.com/kvstore/kvstore"
# UID/GID 10001: the Helm chart's securityContext uses the same numbers.
RUN groupadd --system --gid 10001 kvstore \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/kvstore --create-home \
      --shell /usr/sbin/nologin kvstore \
 && mkdir -p /etc/kvstore /var/lib/kvstore \
 && chown 10001:10001 /var/lib/kvstore
COPY --from=build /opt/kvstore /opt/kvstore
COPY --chmod=0755 deploy/docker/kvstore_health.py /opt/kvstore/bin/kvstore-health
# Defaults that work in a container (listen on every interface, data under the volume
# path); mount your own /etc/kvstore/agent.yaml or router.yaml over them (tenants, tokens).
COPY deploy/docker/agent.yaml deploy/docker/router.yaml /etc/kvstore/
ENV PATH=/opt/kvstore/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/kvstore
# 50051: agent gRPC, 50050: router gRPC, 9500/9400: their Prometheus metrics.
EXPOSE 50051 50050 9500 9400
# Kubernetes uses native gRPC probes (the chart sets them); this is for plain Docker.
# KVSTORE_HEALTH_ADDR picks the port for a router container (127.0.0.1:50050).
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 CMD ["kvstore-health"]
CMD ["kvstore-agent", "--config", "/etc/kvstore/agent.yaml"]
