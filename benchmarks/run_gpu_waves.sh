#!/usr/bin/env bash
# Several run_gpu.sh stages at once on one GPU (the embedded model leaves it mostly idle), detached so that a
# wave can outlast one device call; results in /root/r. Stage the model first (run_gpu.sh stage 1..6).
#   start FILE   each line of FILE is one run_gpu.sh command line (e.g. `accuracy ltri-stream 16k _tag --set
#                k=v`); the lines of a wave run at once, waves (separated by blank lines) one after another
#   wait S       wait up to S seconds for the waves; copy what is done to $OUT as one tar
set -uo pipefail
mkdir -p /root/r
case "$1" in
  start)
    bash benchmarks/run_gpu.sh install || exit 1  # once, before the runs that need it start side by side
    {
      echo "cd $PWD"
      echo "export OUT=/root/r"
      n=0
      while IFS= read -r line || [ -n "$line" ]; do
        if [ -z "$line" ]; then echo wait; continue; fi
        n=$((n + 1))
        echo "bash benchmarks/run_gpu.sh $line > /root/r/run$n.log 2>&1 &"
      done < "$2"
      echo wait
      echo "touch /root/r/done"
    } > /root/r/waves.sh
    cp "$2" /root/r/waves.txt
    setsid nohup bash /root/r/waves.sh > /root/r/waves.log 2>&1 < /dev/null &
    echo started ;;
  wait)
    for _ in $(seq "$2"); do [ -f /root/r/done ] && break; sleep 1; done
    ls /root/r; tail -n 4 /root/r/run*.log
    tar -C /root/r -czf "$OUT/waves.tar.gz" . ;;
  *) echo "usage: $0 start FILE | wait SECONDS"; exit 2 ;;
esac
