# Tandem engine: the gRPC service that owns the GPU (python -m engine_svc).
#
#   docker build -f docker/engine.Dockerfile -t tandem-engine .
#   docker run --gpus 1 -v /path/to/hf-checkpoint:/models:ro -p 50051:50051 tandem-engine
#
# Build arguments (defaults: CUDA 12.8, torch's cu128 wheels, CuPy kernels):
#   BASE_IMAGE       nvidia/cuda:12.8.1-runtime-ubuntu24.04 (ubuntu:24.04 for a CPU-only image)
#   TORCH_INDEX_URL  https://download.pytorch.org/whl/cu128 (.../whl/cu126 for older drivers,
#                    .../whl/cpu for a CPU-only image)
#   TORCH_SPEC       the torch requirement; the same range as the `engine` extra of pyproject.toml
#   EXTRAS           engine,gpu (engine alone leaves out CuPy)
#   CPU_KERNELS      1: gcc in the image, so the engine builds its C CPU kernels on first use (for
#                    the CPU it runs on: -march=native); 0 (GPU images): none, and an engine run
#                    with --device cpu falls back to torch's attention
#   PIP_INDEX_URL    an index other than PyPI for the builder's pip (a mirror, a local wheelhouse:
#                    scripts/compose_smoke.sh); builder stage only, never in the image that runs
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- builder: a virtual environment with torch and the package, no build tools kept ----
FROM ${BASE_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_SPEC="torch>=2.5,<2.15"
ARG EXTRAS=engine,gpu
ARG PIP_INDEX_URL
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the index that carries the wanted CUDA build; its own layer, cached across
# source changes. The package install below then finds torch satisfied and keeps it.
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY kernels ./kernels
COPY engine_svc ./engine_svc
RUN pip install ".[${EXTRAS}]" \
    && python -I -c "import torch, engine_svc.healthcheck; print('torch', torch.__version__)"

# ---- runtime ----
FROM ${BASE_IMAGE}
ARG CPU_KERNELS=0
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && if [ "${CPU_KERNELS}" = 1 ]; then \
        apt-get install -y --no-install-recommends gcc libc6-dev; \
    fi \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 tandem \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin tandem \
    && mkdir -p /models /var/cache/tandem \
    && chown tandem:tandem /var/cache/tandem
COPY --from=builder /opt/venv /opt/venv
# TANDEM_CACHE_DIR: where the embedded default model is built when no --model is given.
ENV PATH=/opt/venv/bin:$PATH \
    TANDEM_CACHE_DIR=/var/cache/tandem \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/tandem
EXPOSE 50051
# Loading a large checkpoint takes a while: failures in the first 10 minutes do not count.
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-m", "engine_svc.healthcheck", "--timeout", "3"]
# Mount a Hugging Face checkpoint directory read-only at /models. Arguments after the image name
# replace CMD, so repeat --model when adding flags (`docker run IMAGE --model /models
# --max-num-seqs 128`); leave it out to serve the embedded default model. --host 0.0.0.0 stays
# (a later --host wins).
ENTRYPOINT ["python", "-m", "engine_svc", "--host", "0.0.0.0"]
CMD ["--model", "/models"]
