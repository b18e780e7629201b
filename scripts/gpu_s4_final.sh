#!/usr/bin/env bash
# Session 4, last device call: the GPU test tier of chunk_kda with the new defaults (bwd_subchunk,
# dot16_bwd), then chunk_kda against fla at the three shapes in one process.
set -uo pipefail
source scripts/gpu_env.sh
timeout 180 python3 -m pytest -q -m gpu tests/ops/test_kda.py -x 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
timeout 290 python3 scripts/kda_vs_fla.py 2>&1 | grep -v Warning | tee "$OUT/vs_fla.txt"
