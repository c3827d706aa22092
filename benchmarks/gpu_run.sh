#!/usr/bin/env bash
# The GPU benchmark in one call, on a machine with torch and triton preinstalled and no network:
#   bash benchmarks/gpu_run.sh [OUT_DIR] [extra benchmarks/gpu.py flags]
# Installs iterserve from this tree without dependencies (or, where pip cannot, puts a namespace shim
# on PYTHONPATH), then runs benchmarks/gpu.py; results land in OUT_DIR/gpu.json (default: $OUT or
# benchmarks/results/gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
OUT_DIR="${1:-${OUT:-benchmarks/results/gpu}}"
shift || true
PY=""
for candidate in ${PYTHON:-} python3 python; do  # the first interpreter that has torch
    if "$candidate" -c "import torch" >/dev/null 2>&1; then PY="$candidate"; break; fi
done
[ -n "$PY" ] || { echo "no python with torch found (set PYTHON=...)" >&2; exit 3; }

if [ "${GPU_RUN_SHIM:-0}" != "1" ] && "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/tmp/iterserve-pip.log 2>&1; then
    echo "installed iterserve from $ROOT (editable, no dependencies)"
else
    # iterserve.server -> server/, iterserve.kernels -> kernels/, iterserve.operator -> operator/:
    # a folder `iterserve` of links is an implicit namespace package with the same layout
    SHIM="$(mktemp -d)/shim"
    mkdir -p "$SHIM/iterserve"
    for part in server kernels operator; do ln -s "$ROOT/$part" "$SHIM/iterserve/$part"; done
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
    echo "pip install failed or skipped (see /tmp/iterserve-pip.log); using the namespace shim $SHIM"
fi
"$PY" -c "import iterserve.server.config, iterserve.kernels.triton_backend" || exit 3
exec "$PY" benchmarks/gpu.py --out "$OUT_DIR" "$@"
