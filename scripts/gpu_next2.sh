#!/usr/bin/env bash
# The next session's second device call: ours and fla at B8 T2048 H16 K=V=128 in one process, fla's
# forward+backward included (its compile took > 100 s per new shape in sessions 3-4, so one shape and a
# long limit). Copy the TUNING winner of gpu_next.sh in first, so "ours" is what ships.
#   run(command="bash scripts/gpu_next2.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
source scripts/gpu_env.sh
timeout 560 python3 scripts/kda_vs_fla.py 8,2048,16,16,128 2>&1 | grep -v Warning | tee "$OUT/vs_fla.txt"
