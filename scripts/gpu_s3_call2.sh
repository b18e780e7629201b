#!/usr/bin/env bash
# Session 3, device call 2: GPU test tier after the 2-byte buffer default and the fused pre-norms;
# k3-toy step off / full / block; AttnRes vs fla; where stage 1 of chunk_kda spends its time.
#   run(command="bash scripts/gpu_s3_call2.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
source scripts/gpu_env.sh
timeout 230 python3 -m pytest -v -m gpu tests/ops/test_kda.py tests/layers/test_attnres.py tests/ops/test_attnres.py \
  tests/models tests/layers/test_kda_layer.py -p no:cacheprovider --tb=short 2>&1 | tee "$OUT/gpu_tests.txt" \
  | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -40
timeout 100 python3 scripts/time_k3_toy.py --device cuda --optim --batch 8 --repeats 20 2>&1 | tee "$OUT/step_b8.txt" | tail -5
timeout 60 python3 scripts/time_k3_toy.py --device cuda --optim --batch 32 --repeats 10 2>&1 | tee "$OUT/step_b32.txt" | tail -5
timeout 120 python3 -m k3cli.cli bench-kernel --kernel attnres --shapes k3 --against fla 2>&1 | tee "$OUT/attnres_bench.txt" | tail -14
timeout 60 python3 scripts/kda_stage1_parts.py 2>&1 | tee "$OUT/stage1_parts.txt"
