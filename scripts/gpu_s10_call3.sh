#!/usr/bin/env bash
# Session 10, call 3 (nvidia-h200-x2, carry .whl), on the new defaults (TUNING scan_kd_t on). Call 2 spent its time
# in fla's first calls (toy 62.7 + 137.6 s, B16 K32 80.2 + 165.2 s) and its GPU-tier process ran past 380 s.
#   GPU 0: `k3 bench-kernel --kernel chunk_kda --against fla --json` at B1 T16384 H16 K128, then B8 T2048 H16 K128;
#   GPU 1: the bf16 accuracy matrix, causality and batch invariance, then the segmented / fast-launch tests,
#          then B2 T8192 H16 K128 against fla as time allows.
#   run(command="bash scripts/gpu_s10_call3.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=590)
set -uo pipefail
source scripts/gpu_env.sh
( export CUDA_VISIBLE_DEVICES=0
  timeout 565 $BENCH --shape 1,16384,16,16,128 --shape 8,2048,16,16,128 > "$OUT/bench_gpu0.txt" 2>&1 ) &
p0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 320 python3 -m pytest -q -m gpu tests/ops/test_kda.py -k "bf16_gpu or causality or batch_invariance" \
    -p no:cacheprovider -rf > "$OUT/gpu_tier.txt" 2>&1
  timeout 120 python3 -m pytest -q -m gpu tests/ops/test_kda.py -k "segmented or fast_launch" \
    -p no:cacheprovider -rf > "$OUT/gpu_tests.txt" 2>&1
  timeout 120 $BENCH --shape 2,8192,16,16,128 > "$OUT/bench_gpu1.txt" 2>&1 ) &
p1=$!
wait $p0 $p1
tail -4 "$OUT/gpu_tier.txt"; tail -4 "$OUT/gpu_tests.txt"; grep -h "\[bench" "$OUT"/bench_gpu*.txt | grep -v compiling
