# syntax=docker/dockerfile:1
# One image for every kvstore process; the command picks the role:
#   kvstore-agent  --config /etc/kvstore/agent.yaml    (default)
#   kvstore-router --config /etc/kvstore/router.yaml
#   kvctl ...
# Build:  docker build -t kvstore:0.1.0 .
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
RUN python -m venv /opt/kvstore && /opt/kvstore/bin/pip install --upgrade pip setuptools wheel
ENV PATH=/opt/kvstore/bin:$PATH
WORKDIR /src

# Dependencies first, from pyproject.toml alone, so a source edit does not reinstall torch.
COPY pyproject.toml setup.py ./
RUN python - <<'EOF' > /tmp/requirements.txt
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["server"]))
EOF
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
      pip install --index-url "$TORCH_INDEX_URL" "$(grep '^torch' /tmp/requirements.txt)"; \
    fi \
 && pip install -r /tmp/requirements.txt

COPY . .
# Fail the build, not the pod: the C extension is optional in setup.py (pure-Python
# fallbacks exist) but the image must have it, and every console script must resolve from
# the installed package (run from / so the source tree cannot stand in for it).
RUN pip install --no-deps . && cd / && python - <<'EOF'
import importlib, importlib.metadata as md
import kvstore._native
for ep in md.distribution("kvstore").entry_points:
    if ep.group == "console_scripts":
        ep.load()
# The entry points import their servers lazily; load those too (catches a package that
# setuptools left out, e.g. one missing from [tool.setuptools.packages.find]).
for name in ("node_agent.server", "router.server"):
    importlib.import_module(name)
EOF

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
