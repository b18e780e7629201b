#!/usr/bin/env bash
# Session 10, call 1 (nvidia-h200-x2, carry .whl):
# GPU 0: session 9's code on a GPU for the first time: tests/ops/test_launch.py's CUDA branch, then the segmented /
#        interleaved forward bit-equal to one range, fp32 accuracy, long memory, fast_launch against Triton's path.
# GPU 1: the forward scan at 32 / 16 value columns with 16-bit operands, K_d^T transposed in registers or loaded
#        directly (TUNING scan_kd_t), each config in its own process (scripts/kda_scan_bv.py); then the B1 forward
#        repeated next to fla (shipped, inter8), then the scan_kd_t variants in a process of their own.
set -uo pipefail
source scripts/gpu_env.sh
( CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m pytest -q tests/ops/test_launch.py > "$OUT/launch_tests.txt" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 500 python3 -m pytest -q -m gpu tests/ops/test_kda.py \
    -k "segmented or fp32 or long_memory or fast_launch" > "$OUT/gpu_tests.txt" 2>&1 ) &
p0=$!
( CUDA_VISIBLE_DEVICES=1 timeout 200 python3 scripts/kda_scan_bv.py > "$OUT/scan_bv.txt" 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 200 python3 scripts/kda_b1_repeat.py 6 --only=shipped,inter8 > "$OUT/b1_repeat.txt" 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 150 python3 scripts/kda_b1_repeat.py 6 --no-fla --only=shipped,kdt,kdt8,kdt_inter8 \
    > "$OUT/b1_kdt.txt" 2>&1 ) &
p1=$!
wait $p0 $p1
tail -2 "$OUT/launch_tests.txt"; tail -4 "$OUT/gpu_tests.txt"; cat "$OUT/scan_bv.txt"
grep -v Warning "$OUT/b1_repeat.txt" | tail -4; grep -v Warning "$OUT/b1_kdt.txt" | tail -6
