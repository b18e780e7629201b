#!/usr/bin/env bash
# Session 5, device call 2: stage-1 launches per warps / key block (scripts/kda_stage1_sub.py), then the
# sweep of the fewer-warp block-pair scores and the per-sub-chunk scores from a stored Γ.
#   run(command="bash scripts/gpu_s5_call2.sh", timeout_s=420)
set -uo pipefail
source scripts/gpu_env.sh
timeout 100 python3 scripts/kda_stage1_sub.py 2>&1 | tee "$OUT/stage1_sub.txt"
timeout 290 python3 scripts/kda_sweep.py base pairs_w2 pairs_w1 pairs_w2_split pairs_w1_split pairs_w2_split_bk32 \
  sub sub_w2 sub_bk16 sub_split sub_split_bk32 pairs_w2_w4 2>&1 | tee "$OUT/sweep.txt" | tail -14
