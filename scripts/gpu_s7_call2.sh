#!/usr/bin/env bash
# Session 7, device call 2 (nvidia-h200-x2), on the session's new defaults:
#   GPU 0: `k3 bench-kernel --against fla` at the toy shape first (a fresh Triton cache: its first call is a real
#          compile + autotune), then B16 T2048 H8 K32, B8 T2048 H16 K128, B1 T16384 H16 K128;
#   GPU 1: the GPU tier (tests/ops/test_kda.py -m gpu), then the GVA shape B4 T4096 H8 HV16 K128.
#   run(command="bash scripts/gpu_s7_call2.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=595)
# Rows print as each shape finishes ([bench chunk_kda] lines), the JSON at the end of each process.
set -uo pipefail
source scripts/gpu_env.sh
( export CUDA_VISIBLE_DEVICES=0 TRITON_CACHE_DIR=$(mktemp -d)
  timeout 575 $BENCH --shape 8,2048,8,8,16 --shape 16,2048,8,8,32 --shape 8,2048,16,16,128 \
    --shape 1,16384,16,16,128 > "$OUT/bench_gpu0.txt" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 330 python3 -m pytest -q -m gpu tests/ops/test_kda.py -p no:cacheprovider -rf > "$OUT/gpu_tier.txt" 2>&1
  timeout 240 $BENCH --shape 4,4096,8,16,128 > "$OUT/bench_gpu1.txt" 2>&1 ) &
wait
tail -6 "$OUT/gpu_tier.txt"; grep -h "\[bench" "$OUT/bench_gpu0.txt" "$OUT/bench_gpu1.txt" | grep -v compiling
