#!/usr/bin/env bash
# Session-2 first device call: profile the K=128 chunk_kda kernels, then the peer tables (fla in the same run).
set -uo pipefail
OUT=${OUT:-/tmp/k3-gpu}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv
python3 -c "import fla, torch, triton; print('fla', fla.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python3 scripts/kda_profile_target.py 8 2048 16 16 128 2>&1 | grep regs | sort -u | tee "$OUT/regs.txt"
timeout 150 ncu --clock-control none --kernel-name regex:"_kda_(fwd|bwd)_intra" --launch-skip 4 --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis python3 scripts/kda_profile_target.py 8 2048 16 16 128 > "$OUT/ncu.txt" 2>&1
grep -E "_kda_|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Memory Throughput|Compute \(SM\)|DRAM Throughput|Local|Stall|Block Limit|Waves" "$OUT/ncu.txt" | head -120
timeout 300 python3 -m k3cli.cli bench-kernel --kernel chunk_kda --shapes k3 --against fla 2>&1 | tee "$OUT/bench_chunk_kda.txt"
timeout 60 python3 -m k3cli.cli bench-kernel --kernel decode --shapes k3 --against fla 2>&1 | tee "$OUT/bench_decode_kernel.txt"
timeout 80 python3 -m k3cli.cli bench-kernel --kernel attnres --shapes k3 --against fla 2>&1 | tee "$OUT/bench_attnres.txt"
