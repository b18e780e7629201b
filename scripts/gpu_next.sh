#!/usr/bin/env bash
# The next session's first device call (~8 min; each step time-boxed, printing as it goes):
#   run(command="bash scripts/gpu_next.sh", timeout_s=560)
# Session 5 left these untimed on a GPU (all opt-in, interpreter-tested):
#   fwd_segments (stage 1 on a side stream overlapping the scan: aimed at B1 T16384, forward 0.85x fla),
#   bwd_overlap_scans (the backward's re-scan concurrent with the reverse scan: aimed at B1 T16384),
#   bwd_stored_gamma (the backward reads the forward's Γ), bwd_subchunk_BK 16 / 64, and the defaults after
#   the dg-dtype fix.
# 1. the GPU tier's new segmented-forward exactness test and causality (stream order on a real GPU);
# 2. the sweep: defaults against those options, both K = 128 shapes.
set -uo pipefail
source scripts/gpu_env.sh
timeout 120 python3 -m pytest -q -m gpu tests/ops/test_kda.py -k "segmented or causality" -p no:cacheprovider 2>&1 \
  | grep -E "passed|failed|Error|assert" | tee "$OUT/gpu_tier_seg.txt"
timeout 330 python3 scripts/kda_sweep.py base seg2 seg4 seg8 ovl seg4_ovl sgamma store_states bsub_bk16 bsub_bk64_w2 2>&1 \
  | tee "$OUT/sweep.txt" | tail -8
# 3. a quick screen (B8 T2048 only) of smaller launch changes
SWEEP_FIRST_SHAPE=1 timeout 60 python3 scripts/kda_sweep.py base tail_w1 tail_split bi_k32v64 2>&1 \
  | tee "$OUT/sweep_quick.txt" | tail -5
