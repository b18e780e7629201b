#!/usr/bin/env bash
# Session 5, device call 3: call 2's best stage-1 launches together (s5*), with fewer-warp backward
# variants, then the device time per kernel of s5 (which backward launch to work on).
#   run(command="bash scripts/gpu_s5_call3.sh", timeout_s=300)
set -uo pipefail
source scripts/gpu_env.sh
timeout 200 python3 scripts/kda_sweep.py base s5 s5_split s5_bk64 s5_pairs s5_bw4 s5_bw2 s5_bsw1 s5_bw4_k32 2>&1 \
  | tee "$OUT/sweep.txt" | tail -10
timeout 60 python3 scripts/kda_kernel_times.py --tuning \
  '{"fwd_intra_sub": true, "fwd_intra_sub_BK": 64, "fwd_intra_warps": 2, "fwd_intra_BK": 32}' 2>&1 | head -16 \
  | tee "$OUT/kernel_times.txt"
