#!/usr/bin/env bash
# Session-2 third device call: k3-toy step time (issue 7), decode latency (issue 6), GPU test tier, chunk_kda sweep.
set -uo pipefail
OUT=${OUT:-/tmp/k3-gpu}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
for b in 8 32; do timeout 50 python3 scripts/time_k3_toy.py --device cuda --batch $b --optim 2>&1 | tee "$OUT/step_b$b.txt" | tail -4; done
timeout 70 python3 scripts/bench_decode.py --device cuda 2>&1 | tee "$OUT/decode_model.txt" | tail -14
timeout 200 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
timeout 150 python3 scripts/kda_sweep.py 2>&1 | tee "$OUT/sweep.txt" | tail -14
