#!/usr/bin/env bash
# Session 8, device call 2 (nvidia-h200-x2): the waiting scan enqueued before stage 1, with a fixed config.
#   run(command="bash scripts/gpu_s8_call2.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=590)
# GPU 0: the B1 T16384 H16 K128 forward variants against fla in one process (scripts/kda_sweep.py), then
#        `k3 bench-kernel --against fla` at B1 three times and B8 once in one process;
# GPU 1: the whole GPU tier of tests/ops/test_kda.py (the segmented test races the waiting scan against stage 1).
set -uo pipefail
source scripts/gpu_env.sh
( export CUDA_VISIBLE_DEVICES=0
  SWEEP_LAST_SHAPE=1 timeout 330 python3 scripts/kda_sweep.py fla base nowait wait_seg8 wait_seg2 wait_w4s2 \
    wait_seg8_w4s2 > "$OUT/sweep_b1.txt" 2>&1
  timeout 200 python3 -m k3cli.cli bench-kernel --kernel chunk_kda --shape 1,16384,16,16,128 \
    --shape 1,16384,16,16,128 --shape 1,16384,16,16,128 --shape 8,2048,16,16,128 --against fla --json \
    > "$OUT/bench_b1.txt" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 530 python3 -m pytest -q -m gpu tests/ops/test_kda.py -p no:cacheprovider -rf --durations=5 \
    > "$OUT/gpu_tier.txt" 2>&1 ) &
wait
tail -12 "$OUT/gpu_tier.txt"; grep -h "\[bench" "$OUT/bench_b1.txt" | grep -v compiling; tail -9 "$OUT/sweep_b1.txt"
