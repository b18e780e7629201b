#!/usr/bin/env bash
# The next session's device call (nvidia-h200; session 8 spent its device time, notes/session8_gpu.md):
#   run(command="bash scripts/gpu_next.sh", kind="nvidia-h200", carry=[".whl"], timeout_s=590)
# 1. Whether the B1 T16384 forward's slow mode (1.56-1.85 ms against ~1.19) is launch-bound: each round's
#    do_bench figure next to the host's enqueue time measured right after (scripts/kda_b1_repeat.py, with fla).
# 2. `k3 bench-kernel` at the toy, B1 and B8 shapes with its new host-enqueue column (not yet run on a GPU).
# Rows print as they finish; fla's first calls at B1 take ~84 s (forward) and ~170 s (forward+backward).
set -uo pipefail
source scripts/gpu_env.sh
timeout 300 python3 scripts/kda_b1_repeat.py 12 > "$OUT/b1_repeat_host.txt" 2>&1
timeout 250 python3 -m k3cli.cli bench-kernel --kernel chunk_kda --shape 8,2048,8,8,16 --shape 1,16384,16,16,128 \
  --shape 8,2048,16,16,128 --json > "$OUT/bench_host.txt" 2>&1
grep -v Warning "$OUT/b1_repeat_host.txt" | tail -20; grep -h "\[bench" "$OUT/bench_host.txt" | grep -v compiling
