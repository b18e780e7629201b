#!/usr/bin/env bash
# Session 5, device call 5: ours and fla (fla-core 0.6.0 wheel carried in .whl) in one process at the
# issue's three shapes: ours fwd and fwd+bwd, then fla's forwards, then fla's forward+backward passes
# (its backward compiles for minutes; a time-boxed run keeps every row printed before the limit).
#   run(command="bash scripts/gpu_s5_call5.sh", carry=[".whl"], timeout_s=560)
set -uo pipefail
source scripts/gpu_env.sh
timeout 540 python3 scripts/kda_vs_fla.py 2>&1 | grep -v Warning | tee "$OUT/vs_fla.txt"
