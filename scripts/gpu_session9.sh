#!/usr/bin/env bash
# Session 9's closing device call (nvidia-h200-x2, carry [".whl"], timeout 590), both GPUs at once:
#   GPU 0: `k3 bench-kernel --against fla` at the toy, B1 T16384 and B8 T2048 shapes (forward, fwd+bwd, host column);
#   GPU 1: the B1 forward repeated next to fla's with TUNING fast_launch on and off, then the bf16 GPU tier's
#          accuracy matrix, causality and batch-invariance tests on the shipped defaults.
set -uo pipefail
source scripts/gpu_env.sh
CUDA_VISIBLE_DEVICES=0 timeout 560 python3 -m k3cli.cli bench-kernel --kernel chunk_kda --shape 8,2048,8,8,16 \
  --shape 1,16384,16,16,128 --shape 8,2048,16,16,128 --against fla --json > "$OUT/bench.txt" 2>&1 &
( CUDA_VISIBLE_DEVICES=1 timeout 200 python3 scripts/kda_b1_repeat.py 8 > "$OUT/b1_repeat.txt" 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 340 python3 -m pytest -q -m gpu tests/ops/test_kda.py \
    -k "bf16_gpu or causality or batch_invariance" > "$OUT/gpu_tier.txt" 2>&1 ) &
wait
grep -v Warning "$OUT/b1_repeat.txt" | tail -16; tail -4 "$OUT/gpu_tier.txt"; grep -h "\[bench" "$OUT/bench.txt" | grep -v compiling | tail -20
