#!/usr/bin/env bash
# Session-2 second device call: chunk_kda variant sweep (K=128), AttnRes vs fla, k3-toy train step off vs block.
set -uo pipefail
OUT=${OUT:-/tmp/k3-gpu}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 K3_CACHE_DIR=/tmp/k3cache
timeout 260 python3 scripts/kda_sweep.py 2>&1 | tee "$OUT/sweep.txt"
timeout 150 python3 -m k3cli.cli bench-kernel --kernel attnres --shapes k3 --against fla 2>&1 | tee "$OUT/bench_attnres.txt"
for mb in 8 32; do for mode in off block; do
  timeout 70 python3 -m k3cli.cli train --preset k3-toy --attnres $mode --steps 100 --device cuda --out /tmp/k3-$mode-$mb \
    --set train.log_every=20 --set train.eval_every=1000 --set train.ckpt_every=1000 \
    --set train.micro_batch_size=$mb --set train.global_batch_size=$mb 2>&1 | grep -v "^\s*$" | tee "$OUT/train_${mode}_$mb.txt" | tail -4
done; done
