#!/usr/bin/env bash
# Session 4, last device call (a record: it ran with dot16_bwd on, which was then made opt-in after
# the K16 dg failure it found): the GPU test tier of chunk_kda, then chunk_kda against fla at the
# issue's three shapes in one process. Results in notes/session4_gpu.md.
set -uo pipefail
source scripts/gpu_env.sh
timeout 180 python3 -m pytest -q -m gpu tests/ops/test_kda.py -x 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
timeout 290 python3 scripts/kda_vs_fla.py 2>&1 | grep -v Warning | tee "$OUT/vs_fla.txt"
