#!/usr/bin/env bash
# Session 6, last device call: the chunk_kda GPU tier on the shipped defaults (fwd_segments "auto",
# bwd_overlap_scans on), then `k3 bench-kernel --shapes k3 --against fla` for what time is left (rows print
# as each shape finishes; fla compiles ~135 s per new head/key configuration).
#   run(command="bash scripts/gpu_s6_final.sh", carry=[".whl"], timeout_s=590)
set -uo pipefail
source scripts/gpu_env.sh
timeout 170 python3 -m pytest -q -m gpu tests/ops/test_kda.py -k test_chunk_kda_bf16_gpu -p no:cacheprovider 2>&1 \
  | grep -E "passed|failed|Error|assert" | tee "$OUT/gpu_tier_bf16.txt"
timeout 90 python3 -m pytest -q -m gpu tests/ops/test_kda.py -k "not test_chunk_kda_bf16_gpu" -p no:cacheprovider 2>&1 \
  | grep -E "passed|failed|Error|assert" | tee "$OUT/gpu_tier_rest.txt"
timeout 300 python3 -m k3cli.cli bench-kernel --kernel chunk_kda --shapes k3 --against fla --json 2>&1 \
  | grep -v Warning | tee "$OUT/bench_k3_fla.txt"
