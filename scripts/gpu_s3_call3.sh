#!/usr/bin/env bash
# Session 3, device call 3: the rest of the GPU test tier, k3-toy step off / full / block after the
# AttnRes host-path trims, the chunk_kda acceptance shapes against fla (same run), stage-1 parts.
#   run(command="bash scripts/gpu_s3_call3.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
source scripts/gpu_env.sh
timeout 60 python3 scripts/time_k3_toy.py --device cuda --optim --batch 8 --repeats 30 2>&1 | tee "$OUT/step_b8.txt" | tail -5
timeout 150 python3 -m pytest -v -m gpu tests/ops/test_attnres.py tests/models tests/layers/test_kda_layer.py \
  tests/ops/test_fused_recurrent.py tests/test_checkpoint.py -p no:cacheprovider --tb=short 2>&1 | tee "$OUT/gpu_tests.txt" \
  | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -30
timeout 210 python3 -m k3cli.cli bench-kernel --kernel chunk_kda --against fla --shape 8,2048,8,8,16 \
  --shape 8,2048,16,16,128 --shape 1,16384,16,16,128 2>&1 | tee "$OUT/kda_bench.txt" | tail -22
timeout 45 python3 scripts/kda_stage1_parts.py 2>&1 | tee "$OUT/stage1_parts.txt"
