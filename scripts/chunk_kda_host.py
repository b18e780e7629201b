"""Is a chunk_kda timing the kernels' or the host's? Per shape and pass (forward, forward+backward): the
`k3 bench-kernel` figure (do_bench), the host's enqueue time per call, and the kernel time per call that
torch.profiler counts, with the kernel count, the largest kernels and the host calls with the most self time.
CUDA only.

    .venv/bin/python scripts/chunk_kda_host.py --shape 8,2048,8,8,16 --shape 16,2048,8,8,32
    .venv/bin/python scripts/chunk_kda_host.py --varlen     # bench-kernel's varlen row (16,384 tokens, 20 documents)
"""
from __future__ import annotations

import argparse
import functools

import torch
from torch.profiler import ProfilerActivity, profile

from k3cli.ops.kda import chunk_kda
from k3cli.ops.kda.bench import VARLEN_SHAPES, _fwd_bwd_fns, _inputs, host_ms, time_fn
from k3cli.ops.kda.varlen import cu_seqlens_of


def kernel_time(fn, calls: int = 20) -> tuple[float, float, list, list]:
    """Over `calls` calls: (kernel ms per call, kernels per call, [(kernel, calls, ms per call)] and
    [(host op or CUDA API call, calls, self ms per call)], each largest first). The host list says where an
    enqueue time beyond the kernels' goes (launches, stream and event calls, allocations, dispatch)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    ks = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.key != "cudaDeviceSynchronize"]

    def ranked(evs, total):
        return sorted(((e.key, e.count // calls, total(e) / calls / 1e3) for e in evs), key=lambda r: -r[2])
    return (sum(e.self_device_time_total for e in ks) / calls / 1e3, sum(e.count for e in ks) / calls,
            ranked(ks, lambda e: e.self_device_time_total), ranked(host, lambda e: e.self_cpu_time_total))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", default=[], help="B,T,H,HV,K (repeatable)")
    ap.add_argument("--varlen", action="store_true", help="also the varlen row of `k3 bench-kernel --shapes k3`")
    args = ap.parse_args()
    if not args.shape and not args.varlen:
        ap.error("give --shape and/or --varlen")
    if not torch.cuda.is_available():
        raise SystemExit("chunk_kda_host.py needs a CUDA device")
    device = torch.device("cuda")
    cases = [(tuple(int(x) for x in text.split(",")), None) for text in args.shape]
    if args.varlen:
        cases += [((1, sum(lens), H, H, K), lens) for lens, H, K in VARLEN_SHAPES["k3"]]
    for shape, lens in cases:
        op = chunk_kda if lens is None else functools.partial(chunk_kda, cu_seqlens=cu_seqlens_of(lens))
        fwd, fwd_bwd = _fwd_bwd_fns(op, _inputs(*shape, torch.bfloat16, device), device)
        for name, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
            for _ in range(3):   # compile and autotune outside the figures
                fn()
            bench, host = time_fn(fn, device)[0], host_ms(fn, device)
            busy, n, top, host_top = kernel_time(fn)
            print(f"{shape} {name}: do_bench {bench:.4f} ms, host enqueue {host:.4f} ms, "
                  f"kernel time {busy:.4f} ms in {n:.0f} kernels", flush=True)
            for key, count, ms in top[:12]:
                print(f"    kernel {key[:63]:<63} {count:3d} {ms:.4f}")
            for key, count, ms in host_top[:12]:   # self time under the profiler, which adds its own per event
                print(f"    host   {key[:63]:<63} {count:3d} {ms:.4f}")


if __name__ == "__main__":
    main()
