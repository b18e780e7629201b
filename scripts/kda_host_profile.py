"""Where the host's time goes when chunk_kda's forward is enqueued (CUDA, bf16).

    python scripts/kda_host_profile.py [B,T,H,HV,K ...]   # default 1,16384,16,16,128

For each shape and each variant (the shipped defaults; Triton's own launch path "nofast"; one range "seg0";
2, 6, 8 ranges): do_bench's device time and the host's time to enqueue one call (bench.host_ms); for the
first two, cProfile over 40 calls enqueued back to back (no synchronisation inside), top entries by own
time. First, the launch path's building blocks measured alone: an empty Triton launch with 20 tensor
arguments (through Triton's path and through launch.FastLaunch), torch.empty, an event record, a stream switch.
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch
import triton
import triton.language as tl

from k3cli.ops import launch
from k3cli.ops.kda import chunk as chunk_mod
from k3cli.ops.kda import chunk_kda
from k3cli.ops.kda.bench import _fwd_bwd_fns, _inputs, host_ms

VARIANTS = {"shipped": {}, "nofast": {"fast_launch": False}, "seg0": {"fwd_segments": 0},
            "seg0-nofast": {"fwd_segments": 0, "fast_launch": False}, "seg2": {"fwd_segments": 2},
            "seg6": {"fwd_segments": 6}, "seg8": {"fwd_segments": 8}}
PROFILED = ("shipped", "nofast")


@triton.jit
def _empty_kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19,
                  T, NT, N0, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    pass


def _per_call_us(fn, n: int = 2000) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def building_blocks(dev) -> None:
    xs = [torch.empty(64, device=dev) for _ in range(20)]
    side = torch.cuda.Stream(device=dev)
    main = torch.cuda.current_stream(dev)
    fast = launch.FastLaunch(_empty_kernel)
    rows = {
        "empty Triton launch, 20 tensors + 3 ints": lambda: _empty_kernel[(4, 16)](*xs, 1000, 16, 0, K=128, V=128,
                                                                                      BT=64),
        "the same through launch.FastLaunch": lambda: fast[(4, 16)](*xs, 1000, 16, 0, K=128, V=128, BT=64),
        "torch.empty [16384*16*128] bf16": lambda: torch.empty(16384 * 16 * 128, device=dev, dtype=torch.bfloat16),
        "stream.record_event()": lambda: main.record_event(),
        "set_stream(side) + set_stream(main)": lambda: (torch.cuda.set_stream(side), torch.cuda.set_stream(main)),
        "side.wait_event(ev)": (lambda ev=main.record_event(): side.wait_event(ev)),
    }
    for name, fn in rows.items():
        print(f"  {name:45s} {_per_call_us(fn):7.1f} us/call", flush=True)


def _profile(shape, dev, base: dict) -> None:
    args = _inputs(*shape, torch.bfloat16, dev)
    fwd, _ = _fwd_bwd_fns(chunk_kda, args, dev)
    for name, over in VARIANTS.items():
        chunk_mod.set_tuning(base, over)
        fwd()
        torch.cuda.synchronize()
        dev_ms = triton.testing.do_bench(fwd)
        print(f"\n== {shape} {name}: device {dev_ms:.3f} ms, host enqueue {host_ms(fwd, dev):.3f} ms/call",
              flush=True)
        if name not in PROFILED:
            continue
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(40):
            fwd()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main() -> None:
    shapes = [tuple(int(x) for x in a.split(",")) for a in sys.argv[1:]] or [(1, 16384, 16, 16, 128)]
    dev = torch.device("cuda")
    base = dict(chunk_mod.TUNING)
    print("building blocks (host time per call):", flush=True)
    building_blocks(dev)
    try:
        for shape in shapes:
            _profile(shape, dev, base)
    finally:
        chunk_mod.set_tuning(base)

if __name__ == "__main__":
    main()
