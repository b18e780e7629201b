#!/usr/bin/env bash
# Session 7, device call 4 (nvidia-h200-x2): the B1 T16384 H16 K128 forward, the one acceptance figure still
# below fla (call 3: 1.546 ms against 1.323 with 4 chunk ranges overlapping stage 1 and the scan).
#   GPU 0: scripts/kda_sweep.py at B1 only, fla in the same process, the overlap variants (ranges, scans on a
#          high-priority stream);
#   GPU 1: the GPU tests of the segmented / overlapped paths (bit-equal to one range, incl. the new high-priority
#          scan stream) and the long-memory test, then `k3 bench-kernel` at B1 with fwd_segments 0 against fla.
#   run(command="bash scripts/gpu_s7_call4.sh", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=360)
# (sweep entries as they were at commit 02f04b2: "base" had fwd_segments_priority off, now the "noprio" entry)
set -uo pipefail
source scripts/gpu_env.sh
( export CUDA_VISIBLE_DEVICES=0 SWEEP_LAST_SHAPE=1
  timeout 340 python3 scripts/kda_sweep.py base seg0 prio seg2 seg2_prio seg8_prio fla > "$OUT/sweep_b1.txt" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 130 python3 -m pytest -q -m gpu tests/ops/test_kda.py -k "segmented or long_memory" -p no:cacheprovider \
    -rf > "$OUT/gpu_tests.txt" 2>&1
  timeout 200 python3 -c "import sys; from k3cli.ops.kda import chunk; chunk.TUNING['fwd_segments'] = 0; \
from k3cli.cli import app; sys.argv[0] = 'k3'; app()" bench-kernel --kernel chunk_kda --shape 1,16384,16,16,128 \
    --against fla --json > "$OUT/bench_b1_seg0.txt" 2>&1 ) &
wait
tail -4 "$OUT/gpu_tests.txt"; grep -h "\[bench" "$OUT/bench_b1_seg0.txt" | grep -v compiling; grep -v Warning "$OUT/sweep_b1.txt" | tail -9
