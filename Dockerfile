# syntax=docker/dockerfile:1.7
#
# exlq images. Three targets:
#
#   gpu  (default, last stage): CUDA + torch + exllamav2 and exllamav3, their extensions
#        prebuilt (`--engine auto` serves EXL2, EXL3 and Hugging Face fp16 models).
#        docker build -t exlq-worker .
#        docker run --gpus all -v /srv/models:/models:ro \
#            -e EXLQ_REDIS_URL=redis://redis:6379/0 -e EXLQ_MODEL=/models/my-model exlq-worker
#
#   lite: Python only, no torch, no CUDA: the `echo` engine for laptops, CI and
#        testing Redis, dashboards and alerts before GPUs are attached.
#        docker build --target lite -t exlq-worker:lite .
#        docker run -e EXLQ_ENGINE=echo -e EXLQ_QUEUE=echo exlq-worker:lite
#
#   gateway: Python only: the producers that speak other protocols, `exlq gateway openai`
#        (OpenAI's HTTP API, port 8000) and `exlq gateway websocket` (exllamav2's
#        WebSocket protocol, port 7862). No torch, no GPU, no model.
#        docker build --target gateway -t exlq-gateway .
#        docker run -p 127.0.0.1:8000:8000 -e EXLQ_REDIS_URL=redis://redis:6379/0 exlq-gateway
#        docker run -p 127.0.0.1:7862:7862 -e EXLQ_REDIS_URL=redis://redis:6379/0 \
#            -e EXLQ_PORT=7862 exlq-gateway gateway websocket --queue my-model
#
# exllamav2 0.3.2 ships as a pure-Python wheel and compiles its CUDA extension
# (torch JIT, ninja + nvcc) at first import. The gpu stage does that at build time,
# so a worker starts in seconds instead of ~2 minutes. Compiling needs nvcc, not a
# GPU. The JIT re-checks its build at every start (a ninja no-op), so the image
# keeps the CUDA toolkit (devel base), the same TORCH_CUDA_ARCH_LIST (a different
# one would recompile), and a build directory the runtime user can write to (torch
# takes a lock file there).

ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-devel-ubuntu24.04

# ------------------------------------------------------------------------- python
# What the lite worker and the gateway share: Python and the runtime user.
FROM ${PYTHON_IMAGE} AS python
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 exlq \
 && useradd --system --uid 10001 --gid exlq --home-dir /home/exlq --create-home --shell /usr/sbin/nologin exlq

# ---------------------------------------------------------------------------- lite
FROM python AS lite
ENV EXLQ_ENGINE=echo \
    EXLQ_METRICS_HOST=0.0.0.0 \
    EXLQ_METRICS_PORT=9400
RUN mkdir -p /models
COPY . /app
# The base install is the whole echo worker (prometheus-client included); every version
# as constraints.txt pins it, as CI tests it.
RUN pip install -c /app/constraints.txt /app
USER exlq
WORKDIR /home/exlq
EXPOSE 9400
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('EXLQ_METRICS_PORT', '9400'), timeout=4)" || exit 1
STOPSIGNAL SIGTERM
ENTRYPOINT ["exlq"]
CMD ["worker"]

# ------------------------------------------------------------------------- gateway
# A stage of its own, not the lite one with the extra: the worker needs none of FastAPI,
# uvicorn, sse-starlette, websockets or tokenizers, and the gateway none of the worker's
# settings (engine, metrics port, its health check on 9400).
FROM python AS gateway
# Listen on every interface of the container (the gateways' default is 127.0.0.1, which
# nothing outside the container reaches). EXLQ_PORT is left unset on purpose: each gateway
# then takes its own default (8000 openai, 7862 websocket), and the websocket one would
# take EXLQ_PORT too.
ENV EXLQ_HOST=0.0.0.0
COPY . /app
RUN pip install -c /app/constraints.txt "/app[gateway]"
USER exlq
WORKDIR /home/exlq
EXPOSE 8000 7862
# Liveness of whichever gateway runs: /healthz on EXLQ_PORT, or on either default port
# when it is unset. Move a gateway with EXLQ_PORT, not --port, so that this follows it.
# (/readyz, which needs Redis, is for orchestrators: compose and Kubernetes probe it.)
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD for port in ${EXLQ_PORT:-8000 7862}; do python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "http://127.0.0.1:$port/healthz" 2>/dev/null && exit 0; done; exit 1
# SIGTERM: the OpenAI gateway stops accepting, ends its SSE streams and lets whole answers
# in flight finish; the WebSocket gateway closes its connections and cancels their jobs.
STOPSIGNAL SIGTERM
ENTRYPOINT ["exlq"]
CMD ["gateway", "openai"]

# ----------------------------------------------------------------------------- gpu
FROM ${CUDA_IMAGE} AS gpu

# torch must be built for the same CUDA major as the toolkit above (nvcc).
ARG TORCH_VERSION=2.7.1
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
# Keep in step with constraints.txt (the pin there is what the last install below holds
# to); an argument here so that a change of constraints.txt does not rebuild this layer.
ARG EXLLAMAV2_VERSION=0.3.2
ARG EXLLAMAV3_VERSION=1.6.5
# GPUs to compile the extension for: A100 (8.0), A10/3090 (8.6), L4/L40/4090 (8.9), H100/H200 (9.0).
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"
ARG MAX_JOBS=8
# Optional: a URL or path of a prebuilt flash-attn wheel matching torch/CUDA/Python.
# Without flash-attn >= 2.5.7 the worker uses EXLQ_EXLLAMAV2_ATTENTION=exlq (its own paged attention).
ARG FLASH_ATTN_WHEEL=""

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions \
    MAX_JOBS=${MAX_JOBS} \
    EXLQ_METRICS_HOST=0.0.0.0 \
    EXLQ_METRICS_PORT=9400

# Ubuntu 24.04 gives Python 3.12; python3-dev for Python.h (the extension build).
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev g++ ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && pip install --upgrade pip setuptools wheel

# Non-root runtime user (uid 1000 is taken by "ubuntu" in the 24.04 base image).
RUN groupadd --system --gid 10001 exlq \
 && useradd --system --uid 10001 --gid exlq --home-dir /home/exlq --create-home --shell /usr/sbin/nologin exlq \
 && mkdir -p /models /opt/torch_extensions \
 && chown exlq:exlq /opt/torch_extensions

# Heavy, rarely-changing layers first: torch, exllamav2, exllamav3, the compiled extensions.
RUN pip install --index-url ${TORCH_INDEX_URL} "torch==${TORCH_VERSION}" \
 && pip install "exllamav2==${EXLLAMAV2_VERSION}" "exllamav3==${EXLLAMAV3_VERSION}" \
 && if [ -n "${FLASH_ATTN_WHEEL}" ]; then pip install "${FLASH_ATTN_WHEEL}"; fi

# Compile both extensions as the runtime user, into TORCH_EXTENSIONS_DIR (exllamav3's
# takes about twice exllamav2's time).
USER exlq
# a+rwX: torch takes a lock file in the build directory at every start, so a
# runtime uid other than 10001 (OpenShift, runAsUser) must be able to write there.
RUN python -c "import exllamav2, exllamav2.ext; print('exllamav2 extension ready')" \
 && python -c "import exllamav3, exllamav3.ext; print('exllamav3 extension ready')" \
 && find /opt/torch_extensions -name 'exllamav2_ext*.so' | grep -q . \
 && find /opt/torch_extensions -name 'exllamav3_ext*.so' | grep -q . \
 && chmod -R a+rwX /opt/torch_extensions
USER root

# The project itself (producer + worker) and its engines' extras, every version as
# constraints.txt pins it. torch, exllamav2 and exllamav3 are already satisfied.
COPY . /app
RUN pip install -c /app/constraints.txt "/app[exllamav2,exllamav3]"

# Check the start-up path as the runtime user: the extension loads without a rebuild.
# (Never import exllamav2 as root here: files root writes into the build directory
# would make the JIT fail for the runtime user.)
USER exlq
WORKDIR /home/exlq
RUN python -c "import torch, exllamav2, exllamav2.ext, exllamav3.ext; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'exllamav2', exllamav2.__version__)"

# Models are mounted read-only at /models; point EXLQ_MODEL at /models/<name>.
EXPOSE 9400

# /healthz answers 200 while the process lives; readiness (/readyz) is for orchestrators.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('EXLQ_METRICS_PORT', '9400'), timeout=4)" || exit 1

# SIGTERM: the worker stops reading, finishes running jobs within EXLQ_GRACE_SECONDS
# and exits 0. Give the container longer than that (docker stop -t / stop_grace_period).
STOPSIGNAL SIGTERM
ENTRYPOINT ["exlq"]
CMD ["worker"]
