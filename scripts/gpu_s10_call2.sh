#!/usr/bin/env bash
# Session 10, call 2 (nvidia-h200-x2, carry .whl), on the new defaults (TUNING scan_kd_t on: the scans read K_d^T
# directly and the autotuner may pick 32- / 16-column value blocks with 16-bit operands):
#   GPU 0: `k3 bench-kernel --kernel chunk_kda --against fla --json` at the toy shape first (a fresh Triton cache:
#          its first call is a real compile + autotune), then B16 T2048 H8 K32, B8 T2048 H16 K128, B1 T16384 H16 K128;
#   GPU 1: the whole GPU tier (tests/ops/test_kda.py, test_launch.py), then the GVA shape B4 T4096 H8 HV16 K128.
#   run(command="bash scripts/gpu_s10_call2.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=590)
# The other four `k3` shapes: scripts/gpu_s10_call3.sh.
set -uo pipefail
source scripts/gpu_env.sh
( export CUDA_VISIBLE_DEVICES=0 TRITON_CACHE_DIR=$(mktemp -d)
  timeout 575 $BENCH --shape 8,2048,8,8,16 --shape 16,2048,8,8,32 --shape 8,2048,16,16,128 \
    --shape 1,16384,16,16,128 > "$OUT/bench_gpu0.txt" 2>&1 ) &
p0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 380 python3 -m pytest -q -m gpu tests/ops/test_kda.py tests/ops/test_launch.py -p no:cacheprovider -rf \
    > "$OUT/gpu_tier.txt" 2>&1
  timeout 190 $BENCH --shape 4,4096,8,16,128 > "$OUT/bench_gpu1.txt" 2>&1 ) &
p1=$!
wait $p0 $p1
tail -6 "$OUT/gpu_tier.txt"; grep -h "\[bench" "$OUT"/bench_gpu*.txt | grep -v compiling
