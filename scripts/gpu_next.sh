#!/usr/bin/env bash
# The next session's device call (nvidia-h200-x2; session 7 spent its device time, notes/session7_gpu.md):
#   run(command="bash scripts/gpu_next.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=590)
#   GPU 0: the whole GPU tier on the shipped defaults (session 7 ran it before fwd_segments_priority was on);
#   GPU 1: `k3 bench-kernel --against fla` at B1 T16384 H16 K128 three times in one process (its forward with
#          the overlapped ranges moved between 1.19 and 1.60 ms across session 7's runs; fla 1.19-1.32), then B8,
#          then the forward scan's launch configs at B1 (scripts/kda_scan_configs.py).
# Rows print to stderr as each shape finishes ([bench chunk_kda] lines), the JSON at the end.
set -uo pipefail
source scripts/gpu_env.sh
( export CUDA_VISIBLE_DEVICES=0
  timeout 560 python3 -m pytest -q -m gpu tests/ops/test_kda.py -p no:cacheprovider -rf > "$OUT/gpu_tier.txt" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 440 python3 -m k3cli.cli bench-kernel --kernel chunk_kda --shape 1,16384,16,16,128 \
    --shape 1,16384,16,16,128 --shape 1,16384,16,16,128 --shape 8,2048,16,16,128 --against fla --json \
    > "$OUT/bench_b1.txt" 2>&1
  # the forward scan per launch config at B1, incl. BV 64 at 4 / 16 warps (not among the autotuner's configs)
  timeout 120 python3 scripts/kda_scan_configs.py 1,16384,16,16,128 > "$OUT/scan_configs_b1.txt" 2>&1 ) &
wait
tail -5 "$OUT/gpu_tier.txt"; grep -h "\[bench" "$OUT/bench_b1.txt" | grep -v compiling; cat "$OUT/scan_configs_b1.txt"
