#!/usr/bin/env bash
# The next session's device call (session 10 spent its device time, notes/session10_gpu.md):
#   run(command="bash scripts/gpu_next.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=590)
# What session 10 did not run on a GPU on the shipped defaults (TUNING scan_kd_t on, rescan_kd_t off). On a fresh
# machine fla's first call takes ~200-245 s per new shape (session 10), hence one bench shape per GPU.
# GPU 0: tests/ops/test_launch.py, then the fp32 tests and the direct-launch (fast_launch) bit-equality test (the
#        rest of the tier ran on these defaults in session 10, call 5), then B4 T4096 H32 against fla.
# GPU 1: B8 T2048 H16 against fla (the table's fwd+bwd column ran with rescan_kd_t on), then the B1 forward
#        repeated next to fla, then its forward+backward.
set -uo pipefail
source scripts/gpu_env.sh
( export CUDA_VISIBLE_DEVICES=0
  timeout 40 python3 -m pytest -q tests/ops/test_launch.py > "$OUT/launch_tests.txt" 2>&1
  timeout 300 python3 -m pytest -q -m gpu tests/ops/test_kda.py -p no:cacheprovider -rf -k "fp32 or fast_launch" \
    > "$OUT/gpu_tests.txt" 2>&1
  timeout 230 $BENCH --shape 4,4096,32,32,128 > "$OUT/bench_gpu0.txt" 2>&1 ) &
p0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 300 $BENCH --shape 8,2048,16,16,128 > "$OUT/bench_gpu1.txt" 2>&1
  timeout 130 python3 scripts/kda_b1_repeat.py 4 --only=shipped,nokdt > "$OUT/b1_repeat.txt" 2>&1
  timeout 130 python3 scripts/kda_b1_repeat.py 3 --fwd-bwd --only=shipped,nokdt > "$OUT/b1_fwd_bwd.txt" 2>&1 ) &
p1=$!
wait $p0 $p1
tail -2 "$OUT/launch_tests.txt"; tail -4 "$OUT/gpu_tests.txt"; grep -h "fwd_ms=" "$OUT"/bench_gpu*.txt
grep -v Warning "$OUT/b1_repeat.txt" | tail -3; grep -v Warning "$OUT/b1_fwd_bwd.txt" | tail -3
