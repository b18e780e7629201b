#!/usr/bin/env bash
# The next session's first device call (~8 min; each step time-boxed, printing as it goes):
#   run(command="bash scripts/gpu_next.sh", carry=[".whl"], timeout_s=600)
# (.whl: fla-core 0.6.0 and einops wheels, fetched once on the CPU machine with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl fla-core==0.6.0 einops)
# 1. the chunk_kda GPU tier on session 4's committed defaults (bwd_subchunk, 2 warps), which session 4
#    could not rerun (its last run had dot16_bwd on: 6/7 bf16 cases, then K16 T1000 failed on dg);
# 2. the untimed stage-1 block-pair scores (TUNING fwd_intra_pairs) against base and session 3's defaults.
# Then scripts/gpu_next2.sh: fla's forward+backward in the same process as ours.
set -uo pipefail
source scripts/gpu_env.sh
timeout 200 python3 -m pytest -q -m gpu tests/ops/test_kda.py -k test_chunk_kda_bf16_gpu -p no:cacheprovider 2>&1 \
  | grep -E "passed|failed|Error|assert" | tee "$OUT/gpu_tier_bf16.txt"
timeout 120 python3 -m pytest -q -m gpu tests/ops/test_kda.py -k "not test_chunk_kda_bf16_gpu" -p no:cacheprovider 2>&1 \
  | grep -E "passed|failed|Error|assert" | tee "$OUT/gpu_tier_rest.txt"
timeout 90 python3 scripts/kda_stage1_parts.py 2>&1 | tee "$OUT/stage1_parts.txt"
timeout 170 python3 scripts/kda_sweep.py base s3_defaults pairs pairs_w8 pairs_w2 pairs_store 2>&1 \
  | tee "$OUT/sweep.txt" | tail -8
