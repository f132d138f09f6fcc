#!/usr/bin/env bash
# The suite's timing-sensitive modules, ROUNDS times in a row, with BUSY busy loops beside
# them (a loaded CI machine: on 2 cores, 2 loops halve the CPU every test process gets).
# Stops at the first failing round. `make stress` runs it; ROUNDS=1 for one quick look.
#   ROUNDS=5 BUSY=2 bash infra/stress-tests.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${ROUNDS:-5}"
BUSY="${BUSY:-2}"
# Kills, closes, loads and drains mid-batch; deadlines, revokes and hand-backs behind busy
# runtimes; the gateway's and worker's shutdown: every test that acts while something runs.
MODULES=(
  tests/runtime/test_process.py tests/runtime/test_spare.py tests/runtime/test_pipeline.py
  tests/runtime/test_replicas.py tests/runtime/test_lazy_loading.py
  tests/unit/app/test_claims.py tests/unit/gateway/test_http_edge.py
  tests/e2e/test_isolation.py tests/e2e/test_worker_shutdown.py tests/e2e/test_replicas.py
  tests/e2e/test_worker_health.py tests/e2e/test_duplicate_ids.py tests/e2e/test_http_edge.py
)

loops=()
trap 'kill "${loops[@]}" 2>/dev/null || true' EXIT
for _ in $(seq 1 "$BUSY"); do
  python3 -c 'while True: pass' &
  loops+=("$!")
done
for round in $(seq 1 "$ROUNDS"); do
  started=$(date +%s)
  if ! .venv/bin/python -m pytest -q -p no:cacheprovider "${MODULES[@]}"; then
    echo "stress: round $round of $ROUNDS FAILED (with $BUSY busy loops)" >&2
    exit 1
  fi
  echo "stress: round $round of $ROUNDS passed in $(( $(date +%s) - started )) s (with $BUSY busy loops)"
done
