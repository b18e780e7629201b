#!/usr/bin/env bash
# Session 4, device call 4: call 3's 16-bit-operand variants hit an illegal memory access that poisoned
# the process (every later variant failed). One process per variant, B8 T2048 only; a crash is rerun
# with CUDA_LAUNCH_BLOCKING=1 to name the kernel.
set -uo pipefail
source scripts/gpu_env.sh
export SWEEP_FIRST_SHAPE=1
for v in d16_intra d16_bwd d16_state bsub_store_w2 bpairs_store; do
  if ! timeout 40 python3 scripts/kda_sweep.py $v > "$OUT/c4_$v.txt" 2>&1; then
    echo "$v failed"; CUDA_LAUNCH_BLOCKING=1 timeout 30 python3 scripts/kda_sweep.py $v 2>&1 | grep -v CUDAEvent \
      | grep -E "k3cli|Error" | head -8
  fi
  grep -v CUDAEvent "$OUT/c4_$v.txt" | tail -1
done
