#!/usr/bin/env bash
# Session 7, device call 3 (nvidia-h200-x2): the H16 / H32 K = 128 shapes of `k3 bench-kernel --shapes k3
# --against fla` not reached in call 2 (fla's first call takes ~165 s per new shape there), the two acceptance
# shapes first, one per GPU.
#   run(command="bash scripts/gpu_s7_call3.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=570)
set -uo pipefail
source scripts/gpu_env.sh
( export CUDA_VISIBLE_DEVICES=0
  timeout 555 $BENCH --shape 8,2048,16,16,128 --shape 4,4096,16,16,128 --shape 2,8192,16,16,128 \
    > "$OUT/bench_gpu0.txt" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 555 $BENCH --shape 1,16384,16,16,128 --shape 4,4096,32,32,128 --shape 1,32768,32,32,128 \
    > "$OUT/bench_gpu1.txt" 2>&1 ) &
wait
grep -h "\[bench" "$OUT/bench_gpu0.txt" "$OUT/bench_gpu1.txt" | grep -v compiling
