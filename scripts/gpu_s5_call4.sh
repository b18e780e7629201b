#!/usr/bin/env bash
# Session 5, device call 4: the chunk_kda GPU tier on the new defaults (fwd_scores "sub", backward warps
# 4 / 1, gradients stored in the input dtype without GVA), then the device time per kernel.
#   run(command="bash scripts/gpu_s5_call4.sh", timeout_s=330)
set -uo pipefail
source scripts/gpu_env.sh
timeout 200 python3 -m pytest -q -m gpu tests/ops/test_kda.py -k test_chunk_kda_bf16_gpu -p no:cacheprovider 2>&1 \
  | grep -E "passed|failed|Error|assert" | tee "$OUT/gpu_tier_bf16.txt"
timeout 80 python3 -m pytest -q -m gpu tests/ops/test_kda.py -k "not test_chunk_kda_bf16_gpu" -p no:cacheprovider 2>&1 \
  | grep -E "passed|failed|Error|assert" | tee "$OUT/gpu_tier_rest.txt"
timeout 40 python3 scripts/kda_kernel_times.py 2>&1 | grep -v Warn | head -14 | tee "$OUT/kernel_times.txt"
