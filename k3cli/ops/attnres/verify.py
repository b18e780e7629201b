"""AttnRes kernels against the fp64 torch reference: outputs and every gradient (docs/math.md §7.6).

`verify_attnres(shapes, dtype)` returns rows (name, rel_rms, max_abs, tol, passed) for the CLI;
the tolerance table and the runners below are shared with the tests.
"""
from __future__ import annotations

import math

import torch

from k3cli.ops.attnres.block import attnres_merge, attnres_phase1
from k3cli.ops.attnres.fused import fused_attnres
from k3cli.ops.attnres.naive import naive_attnres, naive_attnres_merge, naive_attnres_phase1
from k3cli.ops.errors import max_abs_error, relative_rms_error

# The one tolerance table of AttnRes, for verify_attnres and the tests (tests/ops, tests/layers).
# TOL: relative RMS error against the fp64 reference, per output, for fp32 inputs; half inputs scale
# it by HALF_SCALE (their own rounding, 2^-11 fp16 / 2^-8 bf16, dominates the error).
TOL = {"h": 2e-6, "y": 2e-6, "m": 2e-6, "l": 2e-6, "o": 2e-6,
       "dsrc": 5e-6, "dpartial": 5e-6, "dquery": 2e-5, "dgain": 2e-5, "dnorm": 2e-5}
HALF_SCALE = {torch.float32: 1.0, torch.float64: 1.0, torch.float16: 500.0, torch.bfloat16: 4000.0}
# MIXER_TOL: scaled max error (k3cli.ops.errors.scaled_max_error) of whole mixes. "fp64": two torch forms
# of the same math in fp64 (rounding only); "fused": the mixer on the Triton kernels against the torch
# mixer, both fp32, through a stack of up to 31 sublayers (the error compounds with depth).
MIXER_TOL = {"fp64": 1e-12, "fused": 1e-4}


def tolerance(name: str, dtype: torch.dtype = torch.float32) -> float:
    """TOL for an output name, scaled by the input dtype's rounding. The name may carry a case prefix
    and a row index ("full n5 .../dsrc3" -> "dsrc")."""
    return TOL[name.split("/")[-1].rstrip("0123456789")] * HALF_SCALE[dtype]


def error_row(name: str, x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple:
    """(name, rel_rms, max_abs, tol, passed), rel_rms = k3cli.ops.errors.relative_rms_error (the absolute
    RMS where the reference is zero up to fp64 rounding); NaN never passes."""
    rel = relative_rms_error(x, ref)
    tol = tolerance(name, dtype)
    return name, rel, max_abs_error(x.double(), ref.double()), tol, bool(rel <= tol)     # NaN compares False


def make_inputs(n: int, B: int, T: int, D: int, S: int = 1, seed: int = 0, device="cpu"):
    """fp64 inputs on device: n sources of different scales, a partial, S queries whose scores
    spread over a few units (so the softmax is far from uniform), gains ~1, a norm weight ~1."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
    srcs = [torch.randn(B, T, D, generator=gen, dtype=torch.float64) * scales[i] for i in range(n)]
    partial = 1.5 * torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    query = 2.0 / math.sqrt(D) * torch.randn(S, D, generator=gen, dtype=torch.float64)
    gain = 1 + 0.2 * torch.randn(S, D, generator=gen, dtype=torch.float64)
    norm_weight = 1 + 0.2 * torch.randn(D, generator=gen, dtype=torch.float64)
    mv = lambda t: t.to(device)
    return [mv(s) for s in srcs], mv(partial), mv(query), mv(gain), mv(norm_weight)


def rounded(inputs, dtype):
    """The inputs rounded to dtype and held in fp64: the reference sees exactly what the kernel sees."""
    srcs, *rest = inputs
    return [s.to(dtype).double() for s in srcs], *[t.to(dtype).double() for t in rest]


def _leaves(tensors, dtype):
    return [t.detach().to(dtype).requires_grad_(True) for t in tensors]


def upstream_grads(outs: list[torch.Tensor], seed: int = 123) -> list[torch.Tensor]:
    """The fp64 gradients the runs feed to their outputs (in the order of `outs`), on the outputs' device."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device) for o in outs]


def _backprop(outs: list[torch.Tensor]) -> None:
    sum((o.double() * g).sum() for o, g in zip(outs, upstream_grads(outs))).backward()


def run_full(impl: str, inputs, dtype, stacked: bool = False, norm: bool = True, eps: float = 1e-6) -> dict:
    """Full form through impl ('triton' or 'naive'); returns outputs and every gradient."""
    srcs, _, query, gain, nw = inputs
    xs = _leaves(srcs, dtype)
    q, g, w = _leaves([query[0], gain[0], nw], dtype)
    fn = fused_attnres if impl == "triton" else naive_attnres
    out = fn(torch.stack(xs) if stacked else xs, q, g, eps, norm_weight=w if norm else None)
    outs = list(out) if isinstance(out, tuple) else [out]
    _backprop(outs)
    res = {"h": outs[0], "dquery": q.grad, "dgain": g.grad}
    if norm:
        res.update(y=outs[1], dnorm=w.grad)
    res.update({f"dsrc{i}": x.grad for i, x in enumerate(xs)})
    return res


def run_block(impl: str, inputs, dtype, stacked: bool = False, norm: bool = True, eps: float = 1e-6) -> dict:
    """Block form, two-phase: phase 1 over the n completed sources for S queries, then one merge
    per query (query 0 without the partial source, the others with it)."""
    srcs, partial, query, gain, nw = inputs
    xs = _leaves(srcs, dtype)
    p, q, g, w = _leaves([partial, query, gain, nw], dtype)
    phase1, merge = (attnres_phase1, attnres_merge) if impl == "triton" else (naive_attnres_phase1,
                                                                              naive_attnres_merge)
    m, l, o = phase1(torch.stack(xs) if stacked else xs, q, g, eps)
    res, outs = {"m": m.detach(), "l": l, "o": o}, []
    for r in range(q.shape[0]):
        out = merge(m[r], l[r], o[r], p if r > 0 else None, q[r], g[r], eps,
                    norm_weight=w if norm else None, out_dtype=dtype)
        out = list(out) if isinstance(out, tuple) else [out]
        res[f"h{r}"] = out[0]
        if norm:
            res[f"y{r}"] = out[1]
        outs += out
    _backprop(outs)
    res.update(dquery=q.grad, dgain=g.grad)
    if norm:
        res["dnorm"] = w.grad
    if q.shape[0] > 1:
        res["dpartial"] = p.grad
    res.update({f"dsrc{i}": x.grad for i, x in enumerate(xs)})
    return res


def compare(got: dict, ref: dict, dtype, prefix: str = "") -> list[tuple]:
    """Rows for every key of ref that got has (None gradients are skipped)."""
    return [error_row(f"{prefix}{k}", got[k], ref[k], dtype) for k in ref if k in got and got[k] is not None]


CASES = {
    # (form, n, S, B, T, D)
    "ci": [("full", 5, 1, 2, 9, 100), ("block", 3, 3, 2, 9, 48)],
    "full": [("full", 16, 1, 2, 1024, 4096), ("full", 9, 1, 1, 1000, 7168),
             ("block", 5, 4, 2, 512, 4096), ("block", 9, 3, 1, 777, 7168)],
}


def verify_attnres(shapes: str = "ci", dtype: torch.dtype = torch.float32, device: str | None = None):
    """Triton vs fp64 naive for every case of CASES[shapes]: rows (name, rel_rms, max_abs, tol, passed)."""
    if shapes not in CASES:
        raise ValueError(f"shapes: unknown '{shapes}'; valid: {', '.join(CASES)}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for form, n, S, B, T, D in CASES[shapes]:
        inputs = rounded(make_inputs(n, B, T, D, S, device=device), dtype)
        run = run_full if form == "full" else run_block
        got, ref = run("triton", inputs, dtype), run("naive", inputs, torch.float64)
        rows += compare(got, ref, dtype, prefix=f"{form} n{n} S{S} B{B} T{T} D{D}/")
    return rows
