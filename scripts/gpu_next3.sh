#!/usr/bin/env bash
# A later device call: the 16-bit backward operands. Session 4 measured dot16_bwd=True 8 % faster at
# K = 128 but dg 0.029 (> 0.02) at B2 T1000 H1 G2 K16. "narrow" keeps the anchored score products at
# TF32 (untimed). First the failing case under each setting, then the timings.
#   run(command="bash scripts/gpu_next3.sh", carry=[".whl"], timeout_s=420)
set -uo pipefail
source scripts/gpu_env.sh
timeout 60 python3 - <<'PY' 2>&1 | tee "$OUT/dot16_k16.txt"
import sys, torch
sys.path.insert(0, "tests/ops")
from test_kda import make_inputs, run_with_grads, rel_rms
from k3cli.ops.kda import chunk as C, chunk_kda
from k3cli.ops.kda.naive import naive_recurrent_kda
x = make_inputs(2, 1000, 1, 2, 16, 16, dtype=torch.bfloat16, device="cuda")
ref = run_with_grads(naive_recurrent_kda, *[t.float() for t in x])
base = dict(C.TUNING)
for t in ({}, {"dot16_bwd": True}, {"dot16_bwd": "narrow"}):
    C.TUNING.clear(); C.TUNING.update(base); C.TUNING.update(t)
    o = run_with_grads(chunk_kda, *x)
    print(t, {n: round(rel_rms(o[n], ref[n]), 5) for n in ref}, flush=True)
PY
timeout 150 python3 scripts/kda_sweep.py base d16_bwd_only d16n_bwd 2>&1 | tee "$OUT/sweep_dot16.txt" | tail -4
# where the device time goes, per kernel, with the defaults and with the stage-1 pairs
timeout 60 python3 scripts/kda_kernel_times.py 2>&1 | head -16 | tee "$OUT/kernel_times.txt"
timeout 60 python3 scripts/kda_kernel_times.py --tuning '{"fwd_scores": "pairs"}' 2>&1 | head -16 \
  | tee -a "$OUT/kernel_times.txt"
