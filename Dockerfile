# dpserve on a GPU node: the official vLLM wheel (gpu extra) and the router.
# First version: one image for the engines and the router; hardened later.
# Run with --init (or tini) so that the engine processes' children are reaped.
FROM nvidia/cuda:12.8.1-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3-pip tini \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/dpserve
COPY pyproject.toml README.md ./
COPY dpserve ./dpserve
COPY loadtest ./loadtest
RUN python3.11 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir ".[gpu]"
ENV PATH=/opt/venv/bin:$PATH

RUN useradd --create-home --uid 1000 dpserve
USER dpserve
EXPOSE 8000
ENTRYPOINT ["tini", "--", "dpserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--help"]
