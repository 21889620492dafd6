#!/usr/bin/env bash
# Installs longctx (editable) into the current Python environment, on a CPU-only or a CUDA machine.
# torch comes first and is chosen here, because a bare `torch` requirement would pull the newest CUDA build:
# - torch already importable (e.g. a CUDA machine's own build): kept as it is;
# - a CUDA GPU visible: the registry's default (CUDA) build;
# - otherwise the CPU build torch==2.13.0 (override with TORCH_SPEC=...).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install "${TORCH_SPEC:-torch>=2.5}"
  else
    "$PY" -m pip install "${TORCH_SPEC:-torch==2.13.0}"
  fi
fi
"$PY" -m pip install -e ".[test]"
