#!/usr/bin/env bash
# Session 10, call 2 (nvidia-h200-x4, carry .whl), on the new defaults (TUNING scan_kd_t on: the scans read K_d^T
# directly and the autotuner may pick 32- / 16-column value blocks with 16-bit operands):
#   GPUs 0-2: `k3 bench-kernel --kernel chunk_kda --against fla --json` over the nine `k3` shapes, three per GPU
#             (GPU 0 starts with the toy shape on a fresh Triton cache: its first call is a real compile + autotune);
#             GPU 0 then repeats the B1 T16384 forward next to fla (shipped against one range);
#   GPU 3:    the whole GPU tier of tests/ops/test_kda.py and tests/ops/test_launch.py.
#   run(command="bash scripts/gpu_s10_call2.sh", kind="nvidia-h200-x4", carry=[".whl"], timeout_s=590)
set -uo pipefail
source scripts/gpu_env.sh
BENCH="python3 -m k3cli.cli bench-kernel --kernel chunk_kda --against fla --json"
( export CUDA_VISIBLE_DEVICES=0 TRITON_CACHE_DIR=$(mktemp -d)
  timeout 400 $BENCH --shape 8,2048,8,8,16 --shape 16,2048,8,8,32 --shape 8,2048,16,16,128 > "$OUT/bench_gpu0.txt" 2>&1
  timeout 150 python3 scripts/kda_b1_repeat.py 6 --only=shipped,seg0 > "$OUT/b1_repeat.txt" 2>&1 ) &
p0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 560 $BENCH --shape 1,16384,16,16,128 --shape 2,8192,16,16,128 --shape 4,4096,16,16,128 \
    > "$OUT/bench_gpu1.txt" 2>&1 ) &
p1=$!
( export CUDA_VISIBLE_DEVICES=2
  timeout 560 $BENCH --shape 1,32768,32,32,128 --shape 4,4096,32,32,128 --shape 4,4096,8,16,128 \
    > "$OUT/bench_gpu2.txt" 2>&1 ) &
p2=$!
( export CUDA_VISIBLE_DEVICES=3
  timeout 560 python3 -m pytest -q -m gpu tests/ops/test_kda.py tests/ops/test_launch.py -p no:cacheprovider -rf \
    > "$OUT/gpu_tier.txt" 2>&1 ) &
p3=$!
wait $p0 $p1 $p2 $p3
tail -6 "$OUT/gpu_tier.txt"; grep -h "\[bench" "$OUT"/bench_gpu*.txt | grep -v compiling
grep -v Warning "$OUT/b1_repeat.txt" | tail -4
