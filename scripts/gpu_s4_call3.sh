#!/usr/bin/env bash
# Session 4, device call 3: 16-bit dot operands (TUNING dot16_*) and block-pair backward score gradients
# (bwd_pairs) on top of call 2's best (bwd_subchunk + fwd_store_states); then stage medians of the best.
set -uo pipefail
source scripts/gpu_env.sh
timeout 330 python3 scripts/kda_sweep.py base bsub_store d16_all d16_intra d16_state d16_bwd d16_all_kb32 \
  bsub_store_w2 bpairs_store bpairs16_store bpairs_store_w8 2>&1 | tee "$OUT/sweep3.txt" | tail -13
timeout 90 python3 - <<'PY' 2>&1 | tee "$OUT/stages3.txt"
from k3cli.ops.kda import chunk as C
from k3cli.ops.kda.bench import bench_stages
base = dict(C.TUNING)
for name, t in (("bsub_store", {"bwd_subchunk": True, "fwd_store_states": True}),
                ("d16_all", {"bwd_subchunk": True, "fwd_store_states": True, "dot16_intra": True,
                             "dot16_state": True, "dot16_bwd": True})):
    C.TUNING.clear(); C.TUNING.update(base); C.TUNING.update(t)
    r = bench_stages((8, 2048, 16, 16, 128))
    print(name, {k: round(v, 3) for k, v in r.items()}, flush=True)
PY
