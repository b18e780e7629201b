"""AttnRes timings: Triton vs the torch naive form, the copy ceiling, and fla when importable.

`bench_attnres(shapes, against_fla)` returns one row dict per shape (the CLI prints them).
GPU: `triton.testing.do_bench` medians (its warm-up excluded), spread = p80 − p20.
CPU: time.perf_counter over five calls after a warm-up call; under TRITON_INTERPRET=1 one call (spread 0).
Effective GB/s counts the sources read once plus h written once: the forward's memory floor.
"""
from __future__ import annotations

import math
import statistics
import time

import torch

from k3cli.ops.attnres.block import attnres_merge, attnres_phase1
from k3cli.ops.attnres.fused import INTERPRET, fused_attnres
from k3cli.ops.attnres.naive import naive_attnres, naive_attnres_merge, naive_attnres_phase1

# (sources L, tokens N, D); "k3" are the BENCHMARKS.md AttnRes rows
SHAPES = {"ci": [(4, 64, 100), (8, 32, 256)],
          "k3": [(8, 8192, 2048), (16, 8192, 4096), (9, 16384, 7168)]}
# fla fused_attnres forward ms on H200 (BENCHMARKS.md), keyed like SHAPES
FLA_REFERENCE_MS = {(8, 8192, 2048): 0.211, (16, 8192, 4096): 0.339, (9, 16384, 7168): 0.711}
# block-form rows: S queries of one block step (phase 1 + S merges) against L completed sources
BLOCK_S = 4


def _time(fn, device) -> tuple[float, float]:
    """(median ms, spread ms) of fn()."""
    if device.type == "cuda":
        from triton.testing import do_bench
        med, lo, hi = do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
        return med, hi - lo
    if not INTERPRET:
        fn()
    samples = []
    # the interpreter's times say nothing of a GPU and it compiles nothing: one run exercises the path
    for _ in range(1 if INTERPRET else 5):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), max(samples) - min(samples)


def _fla():
    try:
        from fla.ops.attnres import fused_attnres as fla_fused_attnres
    except ImportError:   # fla absent or without AttnRes: the comparison is skipped
        return None
    return fla_fused_attnres


def _fwd_bwd(fn, leaves, dh):
    def step():
        for t in leaves:
            t.grad = None
        out = fn()
        out.backward(dh)
    return step


def bench_attnres(shapes: str = "ci", against_fla: bool = False, device: str | None = None,
                  dtype: torch.dtype | None = None, on_row=None) -> list[dict]:
    """Rows: full form forward / forward+backward (stacked buffer and pointer-table list),
    block form (phase 1 + BLOCK_S merges), the torch naive form and the copy ceiling, same run.
    `on_row(row)` is called as each row finishes."""
    if shapes not in SHAPES:
        raise ValueError(f"shapes: unknown '{shapes}'; valid: {', '.join(SHAPES)}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cuda" and not INTERPRET:
        raise RuntimeError("bench_attnres: the Triton kernels need CUDA or TRITON_INTERPRET=1")
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    fla = _fla() if against_fla else None
    rows = []
    for L, N, D in SHAPES[shapes]:
        for row in _bench_shape(L, N, D, dtype, dev, fla):
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def _bench_shape(L: int, N: int, D: int, dtype, dev, fla) -> list[dict]:
    gen = torch.Generator(device=dev).manual_seed(0)
    stacked = torch.randn(L, 1, N, D, device=dev, dtype=dtype, generator=gen)
    listed = [stacked[i].clone() for i in range(L)]
    query = (2.0 / math.sqrt(D)) * torch.randn(D, device=dev, generator=gen)
    gain = torch.ones(D, device=dev)
    dh = torch.randn(1, N, D, device=dev, dtype=dtype, generator=gen)
    elt = stacked.element_size()
    io = (L + 1) * N * D * elt
    src, dst = torch.empty(L * N * D, device=dev, dtype=dtype), torch.empty(L * N * D, device=dev, dtype=dtype)
    copy_ms, _ = _time(lambda: dst.copy_(src), dev)
    copy_gbps = 2 * L * N * D * elt / copy_ms / 1e6
    src = dst = None

    row = {"form": "full", "L": L, "N": N, "D": D, "dtype": str(dtype).replace("torch.", ""),
           "copy_GBps": copy_gbps}
    row["fwd_ms"], row["fwd_spread_ms"] = _time(lambda: fused_attnres(stacked, query, gain), dev)
    row["fwd_list_ms"], _ = _time(lambda: fused_attnres(listed, query, gain), dev)
    row["naive_fwd_ms"], _ = _time(lambda: naive_attnres(stacked, query, gain), dev)
    leaves = [t.requires_grad_(True) for t in listed] + [query.requires_grad_(True), gain.requires_grad_(True)]
    row["fwdbwd_ms"], row["fwdbwd_spread_ms"] = _time(
        _fwd_bwd(lambda: fused_attnres(listed, query, gain), leaves, dh), dev)
    row["naive_fwdbwd_ms"], _ = _time(_fwd_bwd(lambda: naive_attnres(listed, query, gain), leaves, dh), dev)
    for t in leaves:
        t.requires_grad_(False).grad = None
    row["fwd_GBps"] = io / row["fwd_ms"] / 1e6
    row["fwd_frac_copy"] = row["fwd_GBps"] / copy_gbps
    # backward floor: read sources, h, dh; write every source gradient
    row["fwdbwd_GBps"] = (io + (2 * L + 2) * N * D * elt) / row["fwdbwd_ms"] / 1e6
    row["vs_naive_fwd"] = row["naive_fwd_ms"] / row["fwd_ms"]
    row["vs_naive_fwdbwd"] = row["naive_fwdbwd_ms"] / row["fwdbwd_ms"]
    ref = FLA_REFERENCE_MS.get((L, N, D))
    row["fla_ref_fwd_ms"] = ref
    row["vs_fla_ref_fwd"] = ref / row["fwd_ms"] if ref else None
    row["fla_fwd_ms"] = None
    if fla is not None:
        try:
            # fla 0.6: fused_attnres(query, residuals, rms_weight, ...): the gain is its rms_weight
            row["fla_fwd_ms"], _ = _time(lambda: fla(query, listed, gain), dev)
        except (TypeError, ValueError, RuntimeError) as e:   # unknown fla signature: report it
            row["fla_error"] = f"{type(e).__name__}: {e}"[:200]
    return [row, _bench_block(listed, dh, L, N, D, dtype, gen, dev, copy_gbps)]


def _bench_block(listed, dh, L, N, D, dtype, gen, dev, copy_gbps) -> dict:
    """One block step: phase 1 of BLOCK_S queries over the L completed sources, then BLOCK_S merges
    (the first without, the others with the partial sum); forward+backward through all outputs."""
    S = BLOCK_S
    queries = (2.0 / math.sqrt(D)) * torch.randn(S, D, device=dev, generator=gen)
    gains = torch.ones(S, D, device=dev)
    partial = torch.randn(1, N, D, device=dev, dtype=dtype, generator=gen)

    def step(phase1, merge):
        def run():
            m, l, o = (t.unbind(0) for t in phase1(listed, queries, gains))   # as the model's mixer does
            hs = [merge(m[r], l[r], o[r], partial if r else None, queries[r], gains[r], out_dtype=dtype)
                  for r in range(S)]
            return torch.stack(hs).sum(0)
        return run

    row = {"form": f"block S={S}", "L": L, "N": N, "D": D, "dtype": str(dtype).replace("torch.", ""),
           "copy_GBps": copy_gbps}
    row["fwd_ms"], row["fwd_spread_ms"] = _time(step(attnres_phase1, attnres_merge), dev)
    row["naive_fwd_ms"], _ = _time(step(naive_attnres_phase1, naive_attnres_merge), dev)
    leaves = listed + [queries.requires_grad_(True), gains.requires_grad_(True), partial.requires_grad_(True)]
    for t in listed:
        t.requires_grad_(True)
    row["fwdbwd_ms"], row["fwdbwd_spread_ms"] = _time(_fwd_bwd(step(attnres_phase1, attnres_merge), leaves, dh), dev)
    row["naive_fwdbwd_ms"], _ = _time(_fwd_bwd(step(naive_attnres_phase1, naive_attnres_merge), leaves, dh), dev)
    for t in leaves:
        t.requires_grad_(False).grad = None
    elt = listed[0].element_size()
    # phase 1 floor: sources once, o/m/l written (fp32); merges: o read, partial read, h written
    io = L * N * D * elt + S * N * D * 4 + S * N * D * (4 + 2 * elt)
    row["fwd_GBps"] = io / row["fwd_ms"] / 1e6
    row["fwd_frac_copy"] = row["fwd_GBps"] / copy_gbps
    row["vs_naive_fwd"] = row["naive_fwd_ms"] / row["fwd_ms"]
    row["vs_naive_fwdbwd"] = row["naive_fwdbwd_ms"] / row["fwdbwd_ms"]
    return row


def format_rows(rows: list[dict]) -> str:
    keys = ["form", "L", "N", "D", "fwd_ms", "fwd_spread_ms", "fwd_list_ms", "fwd_GBps", "fwd_frac_copy",
            "copy_GBps", "naive_fwd_ms", "vs_naive_fwd", "fwdbwd_ms", "naive_fwdbwd_ms", "vs_naive_fwdbwd",
            "fla_ref_fwd_ms", "vs_fla_ref_fwd", "fla_fwd_ms"]
    def fmt(v):
        return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
    lines = [" | ".join(keys)]
    lines += [" | ".join(fmt(r.get(k)) for k in keys) for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys
    print(format_rows(bench_attnres(sys.argv[1] if len(sys.argv) > 1 else "ci", against_fla=True)))
