#!/usr/bin/env bash
# Session 7, device call 1 (nvidia-h200-x2): the GPU tier on GPU 0, then a sweep there; another sweep on GPU 1.
#   run(command="bash scripts/gpu_s7_call1.sh", kind="nvidia-h200-x2", timeout_s=590)
# Sweep rows: accuracy against the fp32 reference (B2 T1000 H4 HV8 K=V=128 bf16) and fwd / fwd+bwd ms at
# B8 T2048 H16 K128 and B1 T16384 H16 K128 (scripts/kda_sweep.py). 16-bit scan variants come last in their
# list: an illegal memory access would end that process.
set -uo pipefail
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$OUT/gpus.txt"
( export CUDA_VISIBLE_DEVICES=0
  timeout 230 python3 -m pytest -q -m gpu tests/ops/test_kda.py -p no:cacheprovider > "$OUT/gpu_tier.txt" 2>&1
  timeout 330 python3 scripts/kda_sweep.py base kg scan16 kg_scan16 scan16_aqk16 kg_scan16_aqk16 \
    > "$OUT/sweep_gpu0.txt" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 560 python3 scripts/kda_sweep.py base sub_s2 pp pp_s2 pp_s3 pp_w2_s2 kg_scan16_pp_s2 \
    > "$OUT/sweep_gpu1.txt" 2>&1 ) &
wait
tail -5 "$OUT/gpu_tier.txt"; grep -v Warning "$OUT/sweep_gpu0.txt" | tail -9; grep -v Warning "$OUT/sweep_gpu1.txt" | tail -10
