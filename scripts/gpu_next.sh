#!/usr/bin/env bash
# The next session's device calls: the rest of `k3 bench-kernel --shapes k3 --against fla` (session 6 reached
# the first four of its nine shapes in one 560 s call: fla compiles ~135 s per new head/key configuration).
#   run(command="bash scripts/gpu_next.sh 1", carry=[".whl"], timeout_s=590)   # H32 K128 shapes, GVA H8 HV16
#   run(command="bash scripts/gpu_next.sh 2", carry=[".whl"], timeout_s=590)   # the toy shape, K32
#   run(command="bash scripts/gpu_next.sh 3", timeout_s=520)   # GPU tier incl. the long-memory tests, then the
#        sweep of the untimed forward options: score launch per block pair / pipelined, 16-bit scan operands
# Rows print to stderr as each shape finishes ([bench chunk_kda] lines), the JSON at the end.
set -uo pipefail
source scripts/gpu_env.sh
case "${1:-1}" in
  1) shapes=(--shape 1,32768,32,32,128 --shape 4,4096,32,32,128 --shape 4,4096,8,16,128) ;;
  2) shapes=(--shape 8,2048,8,8,16 --shape 16,2048,8,8,32) ;;
  3) timeout 170 python3 -m pytest -q -m gpu tests/ops/test_kda.py -p no:cacheprovider 2>&1 | tail -4 \
       | tee "$OUT/gpu_tier.txt"
     # last, in case the 16-bit operands still hit an illegal memory access (it ends the process)
     timeout 330 python3 scripts/kda_sweep.py base pp pp_s2 pp_s3 pp_w2_s2 sub_s2 scan16 scan16_store 2>&1 \
       | tee "$OUT/sweep_s6.txt" | tail -10
     exit 0 ;;
  *) echo "usage: gpu_next.sh 1|2|3" >&2; exit 2 ;;
esac
timeout 570 python3 -m k3cli.cli bench-kernel --kernel chunk_kda "${shapes[@]}" --against fla --json 2>&1 \
  | grep -v Warning | tee "$OUT/bench_k3_fla_part$1.txt"
