#!/usr/bin/env bash
# The next session's second device call: ours and fla-core 0.6.0 at the three shapes in one
# process (fla's forward+backward compiles take ~135 s per shape; session 5's run took 454 s in all).
# Copy the TUNING winner of gpu_next.sh in first, so "ours" is what ships.
#   run(command="bash scripts/gpu_next2.sh", carry=[".whl"], timeout_s=560)
set -uo pipefail
source scripts/gpu_env.sh
timeout 540 python3 scripts/kda_vs_fla.py 2>&1 | grep -v Warning | tee "$OUT/vs_fla.txt"
