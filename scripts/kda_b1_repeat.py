"""The B1 T16384 H16 K=V=128 forward, repeated in one process next to fla's (CUDA, bf16).

    python scripts/kda_b1_repeat.py [ROUNDS] [--fwd-bwd] [--no-fla] [--host] [--ranges=8,12] [--only=shipped,kdt]
    # default 8 rounds, forward only; --only: these of the variants below

--ranges=N,M,...: instead of the variants below, the shipped defaults against TUNING fwd_segments N, M, ...

--host: instead, three samples each of the host time to enqueue one call (20 calls back to back) against the
wall time per call once the device has finished them (launch-bound or not).

Its overlapped ranges (chunk.TUNING fwd_segments "auto", fwd_segments_priority) moved between 1.19 and
1.85 ms across `k3 bench-kernel` rows of one process (session 8), where fla's stayed at 1.18-1.21. Each
round times, with triton.testing.do_bench: fla, the shipped defaults, Triton's own launch path ("nofast",
TUNING fast_launch off), one range ("seg0"), 8 ranges ("seg8"), and 4 and 8 ranges with each range's scan
enqueued right after its stage 1 ("inter4", "inter8": TUNING fwd_segments_interleave), and the scan reading K_d^T
directly, which lets the autotuner try 32- and 16-column value blocks ("kdt", "kdt8", "kdt_inter8": TUNING scan_kd_t; on by default since session 10, "nokdt" off;
"kdt_all" also in the backward's re-scan, TUNING rescan_kd_t). Half-way, the torch reference's forward and backward
run once (as between `bench-kernel` rows), to see whether what it leaves in the allocator moves the figures.
Each figure is followed by the host's time to enqueue one call, measured right after (bench.host_ms): near
the figure, the round was launch-bound.
"""
from __future__ import annotations

import statistics
import sys

import torch
import triton

from k3cli.ops.kda import chunk as chunk_mod
from k3cli.ops.kda import chunk_kda
from k3cli.ops.kda.bench import _fla_chunk_kda, _fwd_bwd_fns, _inputs, enqueue_samples, host_ms
from k3cli.ops.kda.naive import naive_chunk_kda

VARIANTS = {"shipped": {}, "nofast": {"fast_launch": False}, "seg0": {"fwd_segments": 0},
            "seg8": {"fwd_segments": 8}, "inter4": {"fwd_segments_interleave": True},
            "inter8": {"fwd_segments": 8, "fwd_segments_interleave": True},
            "kdt": {"scan_kd_t": True}, "nokdt": {"scan_kd_t": False}, "kdt_all": {"rescan_kd_t": True}, "kdt8": {"scan_kd_t": True, "fwd_segments": 8},
            "kdt_inter8": {"scan_kd_t": True, "fwd_segments": 8, "fwd_segments_interleave": True}}


def main() -> None:
    pos = [a for a in sys.argv[1:] if not a.startswith("--")]
    rounds = max(1, int(pos[0])) if pos else 8
    which = 1 if "--fwd-bwd" in sys.argv else 0   # _fwd_bwd_fns: (fwd, fwd_bwd)
    dev = torch.device("cuda")
    args = _inputs(1, 16384, 16, 16, 128, torch.bfloat16, dev)
    fns = {}
    fla = None if "--no-fla" in sys.argv else _fla_chunk_kda()
    if fla is not None:
        fns["fla"] = (_fwd_bwd_fns(lambda *a: fla(*a), args, dev)[which], None)
    base = dict(chunk_mod.TUNING)
    variants = VARIANTS
    ranges = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--ranges=")]
    if ranges:
        variants = {"shipped": {}, **{f"seg{n}": {"fwd_segments": int(n)} for n in ranges[0].split(",")}}
    only = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--only=")]
    if only:
        variants = {n: VARIANTS[n] for n in only[0].split(",")}
    for name, over in variants.items():
        fns[name] = (_fwd_bwd_fns(chunk_kda, args, dev)[which], over)
    if "--host" in sys.argv:
        # host time to enqueue one call (no synchronisation inside; 20 calls stay below the launch queue's depth),
        # against the wall time per call once the device has finished them
        for name, (fn, over) in fns.items():
            chunk_mod.set_tuning(base, over)
            for host, wall in enqueue_samples(fn, dev):
                print(f"{name:8s} host enqueue {host:.3f} ms/call, wall {wall:.3f} ms/call", flush=True)
        return
    times = {n: [] for n in fns}
    for r in range(rounds):
        if r == rounds // 2:
            leaves = [a.detach().float().clone().requires_grad_(True) for a in args]
            o = naive_chunk_kda(*leaves)[0]
            torch.autograd.grad(o.sum(), leaves)
            del o, leaves
            print("(torch reference forward + backward ran here)", flush=True)
        row = []
        for name, (fn, over) in fns.items():
            chunk_mod.set_tuning(base, over)
            fn()   # compile / autotune on the first round
            t = triton.testing.do_bench(fn)
            times[name].append(t)
            # the host's enqueue time right after, to tell a launch-bound round from a device-bound one
            row.append(f"{name} {t:.3f} (host {host_ms(fn, dev):.3f})")
        print(f"round {r}: " + ", ".join(row), flush=True)
    chunk_mod.set_tuning(base)
    for name, ts in times.items():
        print(f"{name:8s} median {statistics.median(ts):.3f} min {min(ts):.3f} max {max(ts):.3f} ms")


if __name__ == "__main__":
    main()
