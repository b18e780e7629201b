#!/usr/bin/env bash
# Session 4, device call 2: time the stage-1 block-pair score variants (TUNING fwd_intra_pairs) and the
# backward combinations built on call 1's winner (bwd_subchunk), bf16, against base in the same run.
set -uo pipefail
source scripts/gpu_env.sh
timeout 480 python3 scripts/kda_sweep.py base p1_split16 p2_split16 p2_split32 p2_split64 p2_split16_r128 \
  p2_split16_w4 p2_one16 p2_one16_bk32 p1_one16_bk32 p1_split32 bsub_store bsub_mkk_w8 bsub_w2 2>&1 \
  | tee "$OUT/sweep2.txt" | tail -16
