# syntax=docker/dockerfile:1.7
#
# Four images from one file:
#
#   docker build --target operator    -t REGISTRY/tandem-operator:0.1.0 .
#   docker build --target router      -t REGISTRY/tandem-router:0.1.0 .
#   docker build --target worker      -t REGISTRY/tandem-worker:0.1.0 .
#   docker build --target worker-vllm -t REGISTRY/tandem-worker-vllm:0.1.0 .
#
# operator: kopf and the Kubernetes client only (no torch): small, starts in a second.
# router:   the OpenAI endpoint: aiohttp, tokenizers, jinja2, the Kubernetes client (no torch).
# worker:   torch, transformers, tokenizers and NIXL (UCX) for the prefill, decode and
#           colocated roles.
# worker-vllm: vLLM's own GPU image with Tandem's launcher added (`tandem worker --runtime vllm`,
#           spec.runtime.name: vllm): vLLM's torch, kernels and NIXL stay exactly as vLLM ships
#           them (docs/runtimes.md says why this and not vLLM's image run bare).
#
# Base images are pinned to a full version tag; pin the digest as well when you
# publish (`python:3.11.14-slim-bookworm@sha256:...`), which needs a registry to look up.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
# The vLLM Tandem renders for and tests with (tandem.contracts.vllm_serve.VLLM_VERSION).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# ---------------------------------------------------------------------------------------------
# base: the Python runtime, a non-root user and a virtualenv on PATH.
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/tandem \
    PATH=/opt/tandem/bin:$PATH
# A fixed numeric uid/gid so that `runAsNonRoot: true` can be verified by the kubelet.
RUN groupadd --system --gid 10001 tandem \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/tandem --create-home \
       --shell /usr/sbin/nologin tandem \
    && python -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir pip==25.3

# ---------------------------------------------------------------------------------------------
# source: only what `pip install .` reads (see .dockerignore for what is kept out).
FROM base AS source
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY cli/ cli/
COPY contracts/ contracts/
COPY operator/ operator/
COPY router/ router/
COPY worker/ worker/
COPY planning/ planning/
COPY weights/ weights/

# ---------------------------------------------------------------------------------------------
# operator-build: the operator extra only; torch is never installed here.
# DL3013 (pin versions in pip) is ignored on both `pip install '.[extra]'` lines: every
# dependency is pinned exactly in pyproject.toml, which hadolint cannot read.
FROM source AS operator-build
# hadolint ignore=DL3013
RUN pip install --no-cache-dir '.[operator]'

# ---------------------------------------------------------------------------------------------
# operator: the image the Helm chart deploys.
FROM base AS operator
COPY --from=operator-build /opt/tandem /opt/tandem
USER 10001:10001
WORKDIR /home/tandem
# kopf's liveness endpoint (the chart passes the same address with --liveness).
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["tandem"]
CMD ["operator", "--all-namespaces", "--liveness", "http://0.0.0.0:8080/healthz"]

# ---------------------------------------------------------------------------------------------
# router-build: the router extra only; torch is never installed here.
FROM source AS router-build
# hadolint ignore=DL3013
RUN pip install --no-cache-dir '.[router]'

# ---------------------------------------------------------------------------------------------
# router: the OpenAI endpoint the operator deploys per InferenceService.
FROM base AS router
COPY --from=router-build /opt/tandem /opt/tandem
USER 10001:10001
WORKDIR /home/tandem
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["tandem"]
CMD ["router", "--help"]

# ---------------------------------------------------------------------------------------------
# worker-build: torch first, then NIXL, so NIXL's resolver sees the torch already there
# and never pulls its own (the same order as the Makefile).
FROM source AS worker-build
ARG NIXL_VERSION=1.5.1
# hadolint ignore=DL3013
RUN pip install --no-cache-dir '.[worker]' \
    && pip install --no-cache-dir "nixl-cu12==${NIXL_VERSION}"

# ---------------------------------------------------------------------------------------------
# worker: prefill, decode and colocated roles.
FROM base AS worker
# rdma-core's user-space verbs libraries: UCX (inside NIXL) loads them to reach the RDMA
# NIC (mlx5 for InfiniBand and RoCE). The kernel driver and the device plugin live on the node.
# g++: torch.compile (inductor) builds the CPU decode step's kernels with it at start-up; without
# a compiler a CPU worker runs the slower eager step (`compile: auto` falls back and says so).
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
       g++=4:12.2.0-3 \
       ibverbs-providers=44.0-2 \
       libibverbs1=44.0-2 \
       librdmacm1=44.0-2 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=worker-build /opt/tandem /opt/tandem
# Model weights from a hub (where the cluster has internet) are cached here; mount a volume.
ENV HF_HOME=/home/tandem/.cache/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/home/tandem/.cache/torchinductor
USER 10001:10001
WORKDIR /home/tandem
# The worker and router HTTP port (the operator sets --port to the same value).
EXPOSE 8000
# /health answers once the process is up; readiness (/ready: model loaded) is the kubelet's job.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["tandem"]
CMD ["worker", "--help"]

# ---------------------------------------------------------------------------------------------
# worker-vllm: runtime vllm's prefill and decode roles. Tandem's package goes into vLLM's own
# Python without dependencies: the launcher needs only aiohttp, prometheus-client and pyyaml,
# which vLLM's image already carries, and nothing of Tandem may move vLLM's pinned torch or
# transformers. The launcher execs $TANDEM_VLLM serve with the role's arguments
# (tandem.contracts.vllm_serve), so the pod's process is vLLM itself.
FROM ${VLLM_IMAGE} AS worker-vllm
COPY --from=source /src /tmp/tandem-src
# hadolint ignore=DL3013
RUN python3 -m pip install --no-cache-dir --no-deps /tmp/tandem-src \
    && rm -rf /tmp/tandem-src \
    && groupadd --system --gid 10001 tandem \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/tandem --create-home \
       --shell /usr/sbin/nologin tandem
ENV TANDEM_VLLM=/usr/local/bin/vllm \
    HOME=/home/tandem \
    HF_HOME=/home/tandem/.cache/huggingface \
    VLLM_CACHE_ROOT=/home/tandem/.cache/vllm
USER 10001:10001
WORKDIR /home/tandem
# vLLM's OpenAI server (http), NIXL's handshake (nixl), the KV events publisher (kv-events).
EXPOSE 8000 5600 5557
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["tandem"]
CMD ["worker", "--runtime", "vllm", "--help"]
