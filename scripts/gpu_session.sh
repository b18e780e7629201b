#!/usr/bin/env bash
# Session 1's plan for the GPU measurements issues 5-7 owed (session 2 ran them in gpu_call1-3.sh;
# results in notes/session2_gpu.md). Start the next session from gpu_next.sh instead.
#
# Before the call, here (CPU machine), fetch the optional peer so it is timed in the same run:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       -d .whl fla-core==0.6.0 einops
# then: run(command="bash scripts/gpu_session.sh", carry=[".whl"], timeout_s=600)
# Results land in $OUT (logs and JSON). Each step is time-boxed so one slow step cannot eat the call.
set -uo pipefail
OUT=${OUT:-/tmp/k3-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
k3() { python3 -m k3cli.cli "$@"; }
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"

# issue 5 + 7 + 6: kernel tables against fla in the same run (bf16)
timeout 240 k3 bench-kernel --kernel chunk_kda --shapes k3 --against fla 2>&1 | tee "$OUT/bench_chunk_kda.txt"
timeout 90 k3 bench-kernel --kernel attnres --shapes k3 --against fla 2>&1 | tee "$OUT/bench_attnres.txt"
timeout 60 k3 bench-kernel --kernel decode --shapes k3 --against fla 2>&1 | tee "$OUT/bench_decode_kernel.txt"
# issue 6: per-token decode latency of k3-toy with and without the cache
timeout 90 python3 scripts/bench_decode.py --device cuda 2>&1 | tee "$OUT/bench_decode_model.txt"
# issue 7: k3-toy training step, AttnRes off vs block, bf16 autocast, same data
for mode in off block; do
  timeout 90 k3 train --preset k3-toy --attnres $mode --steps 60 --device cuda --out /tmp/k3-step-$mode \
    --set train.log_every=20 --set train.eval_every=0 --set train.ckpt_every=0 2>&1 | tee "$OUT/train_$mode.txt"
done
# accuracy tiers (bf16 full shapes), last so the timings above are not skipped if these run long
timeout 240 python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu_tests.txt"
