#!/usr/bin/env bash
# The next session's first device call (~9 min, each step time-boxed and printing as it goes).
# fla rides along as wheels (the device has no network); here, once:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl fla-core==0.6.0 einops
# then: run(command="bash scripts/gpu_next.sh", carry=[".whl"], timeout_s=600)
# Session 3 learnt: fla's fwd+bwd compiles for more than 100 s per new shape, so one fla shape per
# step; `k3 bench-kernel` prints a line after each phase of a shape.
set -uo pipefail
source scripts/gpu_env.sh
# Triton's compile + autotune cache (fla's kernels included: fla caches its autotune results there) in
# an ignored repo folder, so a later call can carry it instead of recompiling: after this call,
#   mkdir -p .tcache && tar xzf /work/.device/N/tcache.tgz  (then carry [".whl", ".tcache"])
export TRITON_CACHE_DIR=$PWD/.tcache
mkdir -p "$TRITON_CACHE_DIR"
# 1. session 3's untimed variants (stage-1 scores per 16-row sub-chunk; stored Mkk for the backward's dβ;
#    backward score gradients per 16-row sub-chunk), bf16 states, and the old fp32 buffers
timeout 330 python3 scripts/kda_sweep.py base fi_subchunk fi_subchunk_w4 fi_subchunk_kb32 bwd_mkk \
  bwd_subchunk bwd_subchunk_k32v32 bwd_subchunk_k32v32_w8 both_subchunk store_states all_s3 states_in_s3 \
  fp32_bufs 2>&1 \
  | tee "$OUT/sweep.txt" | tail -12
# 2. the acceptance shapes against fla, one shape per step (fla fwd+bwd needs > 100 s to compile)
for s in 8,2048,16,16,128 1,16384,16,16,128; do
  timeout 170 python3 -m k3cli.cli bench-kernel --kernel chunk_kda --against fla --shape $s 2>&1 \
    | tee "$OUT/kda_$s.txt" | grep "^\[bench"
done
# then copy a winner into chunk.TUNING, rerun the GPU tier (pytest -m gpu, ~4 min: split it), and the
# toy shape: bench-kernel --kernel chunk_kda --against fla --shape 8,2048,8,8,16
# ship the cache back when it fits what a later call can carry (64 MiB with the wheels)
if [ "$(du -sm .tcache | cut -f1)" -lt 55 ]; then tar czf "$OUT/tcache.tgz" .tcache; else du -sh .tcache; fi
