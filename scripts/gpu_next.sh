#!/usr/bin/env bash
# The next session's first device call (~9 min, each step time-boxed): which chunk_kda variant wins at
# K = 128, and the GPU checks that session 2 could not run after its last changes.
# fla rides along as wheels (the device has no network); here, once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       -d .whl fla-core==0.6.0 einops
# then: run(command="bash scripts/gpu_next.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
OUT=${OUT:-/tmp/k3-gpu}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
# 1. fp32 decode-vs-forward with full-fp32 dots (failed at 1.4e-2 with TF32 in session 2), new variants' bf16 tests
timeout 120 python3 -m pytest -q -m gpu tests/models/test_decode.py tests/layers/test_kda_layer.py \
  "tests/ops/test_kda.py::test_chunk_kda_fp32_gpu_is_fp32_accurate" -p no:cacheprovider \
  --tb=line 2>&1 | tee "$OUT/gpu_tests.txt" | tail -5
# 2. variants (each checked against the fp32 reference before it is timed); one JSON line per variant
timeout 270 python3 scripts/kda_sweep.py base guess nospill fi_kb32 fi_kb16_w16 fi_kb16_r128 fi_split_kb32 fi_split_kb32_w16 bwd_split bwd_split_k32v32 bwd_split_k32v32_w16 c32 \
  c32_kb16_w4 gated_in bufs_in states_in combo 2>&1 | tee "$OUT/sweep.txt" | tail -14
# 3. per-stage times of the default path at the shape
timeout 50 python3 -c "from k3cli.ops.kda.bench import bench_stages; print(bench_stages((8, 2048, 16, 16, 128)))" \
  2>&1 | tee "$OUT/stages.txt"
# 4. host vs device time of a k3-toy step, AttnRes off vs block (issue 7: block was +21 %)
timeout 80 python3 scripts/profile_step.py 2>&1 | tee "$OUT/profile_step.txt" | grep "^== attnres"
# then, in a second call with the winner copied into chunk.TUNING:
#   timeout 540 python3 -m k3cli.cli bench-kernel --kernel chunk_kda --shapes k3 --against fla
