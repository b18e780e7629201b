"""Device time per kernel of one chunk_kda forward+backward (CUDA, bf16), from the torch profiler.

    python scripts/kda_kernel_times.py [B,T,H,HV,K] [--tuning '{"fwd_scores": "pairs"}'] [--steps 10]

Runs the forward+backward `--steps` times after a warm-up and prints, per kernel name, the mean device
time per step and its share: which launch of stage 1, the scans or the per-chunk backward to work on.
chunk.TUNING as shipped, updated by --tuning (JSON).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from k3cli.ops.kda import chunk as chunk_mod
from k3cli.ops.kda import chunk_kda
from k3cli.ops.kda.bench import _fwd_bwd_fns, _inputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="8,2048,16,16,128")
    ap.add_argument("--tuning", default="{}")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    over = json.loads(args.tuning)
    chunk_mod.check_tuning(over)
    chunk_mod.TUNING.update(over)
    dev = torch.device("cuda")
    _, fwd_bwd = _fwd_bwd_fns(chunk_kda, _inputs(*shape, torch.bfloat16, dev), dev)
    for _ in range(3):
        fwd_bwd()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            fwd_bwd()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] += ev.device_time / args.steps / 1000.0   # µs -> ms per step
    total = sum(per.values())
    print(f"{shape} tuning {over}: {total:.3f} ms device time per fwd+bwd step")
    for name, ms in sorted(per.items(), key=lambda x: -x[1]):
        print(f"  {ms:8.3f} ms  {100 * ms / total:5.1f} %  {name[:90]}")


if __name__ == "__main__":
    main()
