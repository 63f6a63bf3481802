# Tandem gateway: the OpenAI-compatible HTTP API (python -m frontend_svc). No torch, no CUDA:
# the package's base dependencies only.
#
#   docker build -f docker/frontend.Dockerfile -t tandem-frontend .
#   docker run -p 8000:8000 -e TANDEM_ENGINE=engine-host:50051 -e TANDEM_API_KEY=... tandem-frontend
#
# Build arguments: PYTHON_IMAGE (python:3.12-slim-bookworm; any Debian-like image whose `python`
# is 3.10 or newer with venv), PIP_INDEX_URL (an index other than PyPI for the builder's pip;
# builder stage only, never in the image that runs).
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# ---- builder ----
FROM ${PYTHON_IMAGE} AS builder
ARG PIP_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY frontend_svc ./frontend_svc
RUN pip install . \
    && python -I -c "import importlib.util as u, frontend_svc.server.app; assert u.find_spec('torch') is None"

# ---- runtime ----
FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 tandem \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin tandem
COPY --from=builder /opt/venv /opt/venv
# TANDEM_HOST rather than a --host flag, so arguments given to `docker run` keep it.
ENV PATH=/opt/venv/bin:$PATH \
    TANDEM_HOST=0.0.0.0 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/tandem
EXPOSE 8000
# Liveness: the process answers HTTP (GET /live). /health (200 only once the engine is
# connected) is the readiness check; docker-compose.yml uses that one.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/live' % (os.environ.get('TANDEM_PORT') or '8000'), timeout=3)"]
# Flags or TANDEM_* variables: --engine/TANDEM_ENGINE, --port/TANDEM_PORT, --api-key/TANDEM_API_KEY.
ENTRYPOINT ["python", "-m", "frontend_svc"]
