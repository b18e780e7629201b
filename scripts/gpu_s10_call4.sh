#!/usr/bin/env bash
# Session 10, call 4 (nvidia-h200-x2, carry .whl), on the new defaults (TUNING scan_kd_t on):
#   GPU 0: the B1 T16384 row against fla once more (call 3's ran next to the GPU tests, host 1.10 ms per 1.08 ms
#          forward), then the B1 forward repeated next to fla, shipped against scan_kd_t off ("nokdt"), then the same
#          for forward+backward (call 3: 5.152 ms, session 9: 4.795);
#   GPU 1: the other four `k3` shapes against fla (B4 T4096 H16, B1 T32768 H32, B4 T4096 H32, GVA B4 H8 HV16).
#   run(command="bash scripts/gpu_s10_call4.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=540)
set -uo pipefail
source scripts/gpu_env.sh
( export CUDA_VISIBLE_DEVICES=0
  timeout 200 $BENCH --shape 1,16384,16,16,128 > "$OUT/bench_gpu0.txt" 2>&1
  timeout 150 python3 scripts/kda_b1_repeat.py 5 --only=shipped,nokdt > "$OUT/b1_repeat.txt" 2>&1
  timeout 140 python3 scripts/kda_b1_repeat.py 3 --fwd-bwd --only=shipped,nokdt > "$OUT/b1_fwd_bwd.txt" 2>&1 ) &
p0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 500 $BENCH --shape 4,4096,16,16,128 --shape 4,4096,8,16,128 --shape 4,4096,32,32,128 \
    --shape 1,32768,32,32,128 > "$OUT/bench_gpu1.txt" 2>&1 ) &
p1=$!
wait $p0 $p1
grep -h "\[bench" "$OUT"/bench_gpu*.txt | grep -v compiling | grep "fwd_ms="
grep -v Warning "$OUT/b1_repeat.txt" | tail -3; grep -v Warning "$OUT/b1_fwd_bwd.txt" | tail -3
