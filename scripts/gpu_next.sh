#!/usr/bin/env bash
# The next session's device call (session 9 spent its device time, notes/session9_gpu.md):
#   run(command="bash scripts/gpu_next.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=590)
# Session 9's final code has not run on a GPU (its GPU figures are from 44a13d7 / b0a72db, notes/session9_gpu.md).
# GPU 0: the segmented / overlapped forward bit-equal to one range (now also with TUNING
#        fwd_segments_interleave, never run on a GPU), fp32 accuracy, long memory, the direct launches
#        (fast_launch) against Triton's path, and tests/ops/test_launch.py's CUDA branch.
# GPU 1: the B1 T16384 forward repeated next to fla's: whether enqueuing each range's scan right after its
#        stage 1 ("inter4", "inter8") removes the slow rounds that 8 ranges had in 4 of 18 rounds (session 9);
#        then the bf16 accuracy matrix, causality and batch invariance on the final code.
# Then, if inter8 is both faster than fla and free of slow rounds, make it the "auto" plan (chunk.auto_segment_count,
# TUNING fwd_segments_interleave) and re-run `k3 bench-kernel --shapes k3 --against fla` for the closing table.
set -uo pipefail
source scripts/gpu_env.sh
( CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m pytest -q tests/ops/test_launch.py > "$OUT/launch_tests.txt" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 490 python3 -m pytest -q -m gpu tests/ops/test_kda.py \
    -k "segmented or fp32 or long_memory or fast_launch" > "$OUT/gpu_tests.txt" 2>&1 ) &
p0=$!
( CUDA_VISIBLE_DEVICES=1 timeout 250 python3 scripts/kda_b1_repeat.py 12 > "$OUT/b1_repeat.txt" 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m pytest -q -m gpu tests/ops/test_kda.py \
    -k "bf16_gpu or causality or batch_invariance" > "$OUT/gpu_tier.txt" 2>&1 ) &
p1=$!
wait $p0 $p1
tail -2 "$OUT/launch_tests.txt"; tail -4 "$OUT/gpu_tests.txt"; tail -3 "$OUT/gpu_tier.txt"; grep -v Warning "$OUT/b1_repeat.txt" | tail -8
