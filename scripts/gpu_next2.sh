#!/usr/bin/env bash
# The next session's second device call: `k3 bench-kernel --kernel chunk_kda --shapes k3 --against fla`, the
# issue's full table (rows print as each shape finishes; fla's first forward+backward compile took ~135 s
# per new head/key configuration in session 5, later shapes of the same configuration ~2 s). Copy the
# TUNING winner of gpu_next.sh in first, so "ours" is what ships.
#   run(command="bash scripts/gpu_next2.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
source scripts/gpu_env.sh
timeout 580 python3 -m k3cli.cli bench-kernel --kernel chunk_kda --shapes k3 --against fla --json 2>&1 \
  | grep -v Warning | tee "$OUT/bench_k3_fla.txt"
