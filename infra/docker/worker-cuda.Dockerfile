# syntax=docker/dockerfile:1
# A shoal worker on an NVIDIA GPU: the CPU worker's image with a CUDA build of torch.
#
#   docker build -f infra/docker/worker-cuda.Dockerfile -t shoal-worker-cuda .    # repo root
#   docker run --gpus all ... shoal-worker-cuda                # NVIDIA Container Toolkit
#
# TORCH_SPEC is the Makefile's (torch==2.13.0); from PyPI that release is the CUDA 13.0
# build (it depends on cuda-toolkit 13.0.3, cuDNN 9 and NCCL as pip wheels), so the base is
# CUDA 13.0's runtime image and the host needs a driver for CUDA 13.0 (>= 580). The install
# is otherwise the Makefile's: pip upgraded in a venv, torch first, then the project.
# Python 3.11 as `make install` uses: Ubuntu 22.04's python3.11.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu22.04
FROM ${CUDA_IMAGE}

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG TORCH_CUDA=13.0

RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        python3.11 python3.11-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    VIRTUAL_ENV=/opt/shoal \
    PATH=/opt/shoal/bin:$PATH

RUN python3.11 -m venv /opt/shoal && pip install -q --upgrade pip
RUN pip install -q --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC" \
    && python -c "import sys, torch; cuda = torch.version.cuda or 'none'; sys.exit('torch ' + torch.__version__ + ' is built for CUDA ' + cuda + ', not $TORCH_CUDA') if not cuda.startswith('$TORCH_CUDA') else print('torch', torch.__version__, 'CUDA', cuda)"

COPY pyproject.toml README.md /src/
COPY app /src/app
COPY models /src/models
COPY tasks /src/tasks
COPY batching /src/batching
COPY runtimes /src/runtimes
COPY gateway /src/gateway
RUN pip install -q /src \
    && python -c "import sys, torch; sys.exit('pip replaced torch') if not (torch.version.cuda or '').startswith('$TORCH_CUDA') else None"

RUN useradd --create-home --uid 10001 --user-group shoal \
    && mkdir -p /var/lib/shoal/blobs && chown -R shoal:shoal /var/lib/shoal
USER shoal
WORKDIR /home/shoal

# SHOAL_DEVICE is the torch device; the worker's /metrics on the container's interfaces.
ENV SHOAL_DEVICE=cuda \
    SHOAL_WORKER_METRICS_HOST=0.0.0.0 \
    SHOAL_WORKER_METRICS_PORT=9540
EXPOSE 9540

HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('SHOAL_WORKER_METRICS_PORT', '9540'), timeout=4)"]

# exec form: shoal is PID 1 and gets SIGTERM itself; it drains within SHOAL_SHUTDOWN_GRACE_S
# (25 s): give it a stop timeout of at least that + 5 s.
ENTRYPOINT ["shoal"]
CMD ["worker"]
