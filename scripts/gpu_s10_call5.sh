#!/usr/bin/env bash
# Session 10, call 5 (nvidia-h200-x2, carry .whl): B1 T16384 forward+backward with K_d^T read directly in the forward
# scan only (the new default: TUNING scan_kd_t on, rescan_kd_t off), in both scans ("kdt_all"), in neither ("nokdt").
# Call 4: both 4.873 ms, neither 4.800. Then the segmented / long-memory GPU tests on this default.
#   run(command="bash scripts/gpu_s10_call5.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=200)
set -uo pipefail
source scripts/gpu_env.sh
( CUDA_VISIBLE_DEVICES=0 timeout 180 python3 scripts/kda_b1_repeat.py 3 --fwd-bwd --no-fla --only=shipped,kdt_all,nokdt \
    > "$OUT/b1_fwd_bwd.txt" 2>&1 ) &
p0=$!
( CUDA_VISIBLE_DEVICES=1 timeout 180 python3 -m pytest -q -m gpu tests/ops/test_kda.py \
    -k "segmented or long_memory or fwd_bwd_bf16 or bf16_gpu" -p no:cacheprovider -rf > "$OUT/gpu_tests.txt" 2>&1 ) &
p1=$!
wait $p0 $p1
grep -v Warning "$OUT/b1_fwd_bwd.txt" | tail -4; tail -3 "$OUT/gpu_tests.txt"
