#!/usr/bin/env bash
# The foundation issue's GPU run (one H100): GPU tests, then the dense benchmark and HF's eager baseline on
# random:llama-3.1-8b at 32K and 128K. Results land in ${OUT:-benchmarks/results}.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
mkdir -p "$out"
{
  echo "# command: python3 -m pytest -q -m gpu tests/"
  echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | paste -sd, -)"
  echo "# versions: $(python3 -c 'import sys, torch, transformers, triton; print(sys.version.split()[0], torch.__version__, transformers.__version__, triton.__version__)')"
  python3 -m pytest -q -m gpu tests/ 2>&1
} > "$out/gpu_tests.log"; tail -n 3 "$out/gpu_tests.log"
for chunk in ${CHUNKS:-2048 8192}; do
  python3 -m longctx_cli bench --profile dense --model random:llama-3.1-8b --lengths 32k,128k --compare none \
    --steps 64 --chunk-size "$chunk" --json "$out/dense_llama8b_chunk$chunk.json" 2>&1 | grep "│"
done
[ -n "${SKIP_HF:-}" ] || python3 benchmarks/hf_baseline.py --model random:llama-3.1-8b --lengths 32k,128k \
  --out "$out/hf_eager_llama8b.json" 2>&1 | tail -n 2
