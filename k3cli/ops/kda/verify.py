"""Kernel-vs-reference checks for the CLI (`k3 verify-equivalence` wraps `verify_kda`).

Every row compares one output or gradient of the Triton kernel against the fp32 torch reference
fed the same (rounded) inputs: relative RMS error, max abs error, the tolerance, pass/fail.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from k3cli.ops.kda.naive import (
    chunk_local_cumsum,
    naive_chunk_kda_varlen,
    naive_kda_gate,
    naive_recurrent_kda,
)
from k3cli.ops.kda.varlen import cu_seqlens_of

# relative RMS limits (the same numbers as tests/ops/test_kda.py)
TOL = {"o": 0.005, "ht": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dh0": 0.008,
       "dg": 0.02, "dbeta": 0.02, "g": 1e-5, "dg_raw": 0.008, "dA_log": 0.008, "ddt_bias": 0.008,
       "y": 0.005, "dx": 0.008, "dweight": 0.008}

# (B, T, H, G, K=V)
CHUNK_SHAPES = {
    "ci": [(1, 1, 1, 1, 16), (1, 63, 1, 2, 16), (2, 100, 2, 1, 32)],
    "full": [(2, 63, 1, 1, 16), (2, 1000, 4, 2, 64), (2, 2048, 16, 1, 128), (2, 1000, 16, 2, 128),
             (3, 2048, 4, 1, 64), (2, 63, 4, 2, 128), (2, 1000, 1, 2, 16)],
}
# (sequence lengths, H, G, K=V): chunk_kda with cu_seqlens, one flattened row; lengths on and off the chunk
VARLEN_SHAPES = {"ci": [((1, 15, 16, 17, 40), 1, 2, 16)],
                 "full": [((1, 63, 64, 65, 1000, 3000, 7, 2048), 16, 1, 128), ((5, 300, 129), 4, 2, 64),
                          ((2000, 1, 33), 8, 1, 16)]}
# (B, T, H, G, K=V): one to a few tokens per decode call
DECODE_SHAPES = {"ci": [(1, 1, 1, 1, 16), (2, 3, 2, 2, 32)],
                 "full": [(1, 1, 32, 1, 128), (32, 1, 32, 1, 128), (256, 1, 32, 1, 128), (4, 4, 16, 2, 64)]}
# (B, T, HV, K)
GATE_SHAPES = {"ci": [(1, 70, 2, 16), (2, 33, 3, 24)], "full": [(8, 2048, 16, 128), (2, 1000, 32, 64)]}

# (B, T, C, norm_dim, packed documents): short_conv, width 4
CONV_SHAPES = {"ci": [(1, 33, 24, 8, True), (2, 17, 20, 0, False)],
               "full": [(4, 2048, 1024, 128, True), (4, 2048, 1024, 0, False), (3, 1000, 96, 16, False)]}
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def _device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    raise RuntimeError("verify_kda needs a CUDA device or TRITON_INTERPRET=1 (set before Python starts)")


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ over all elements, in fp64 (the KDA tests' and verify rows' error)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _row(name, x, ref, tol):
    err = rel_rms(x, ref)
    return (name, err, (x.double() - ref.double()).abs().max().item(), tol, err <= tol)


def kda_inputs(B, T, H, G, K, V, dtype, device, seed=0):
    """L2-normalised q/k, g in (-5, 0), beta in (0, 1), random fp32 initial state."""
    gen = torch.Generator().manual_seed(seed)
    HV = H * G
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, HV, K, generator=gen) - 1.0)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    h0 = torch.randn(B, HV, K, V, generator=gen)
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), g.to(device),
            beta.to(device, dtype), h0.to(device))


def _grads(fn, q, k, v, g, beta, h0):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    gen = torch.Generator().manual_seed(123)
    do = torch.randn(o.shape, generator=gen).to(o)
    dht = torch.randn(ht.shape, generator=gen).to(ht)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), leaves)
    return dict(zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), (o.detach(), ht.detach(), *grads)))


def _recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=None):
    return naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state)


def verify_kda(kernel: str = "chunk_kda", shapes: str = "ci", dtype: str | torch.dtype = "bf16") -> list[tuple]:
    """Compare a KDA kernel against the fp32 reference on outputs and every gradient.

    Args:
        kernel: "chunk_kda" or "kda_gate".  shapes: "ci" (tiny) or "full".  dtype: input dtype.
    Returns:
        rows (name, rel_rms, max_abs, tol, passed), name = "<shape>/<output>".
    """
    from k3cli.ops.kda import chunk_kda, kda_gate
    dev = _device()
    dt = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    if dev == "cpu" and dt == torch.bfloat16:
        dt = torch.float32   # the Triton interpreter mis-handles bf16
    rows = []
    if kernel == "chunk_kda":
        for B, T, H, G, K in CHUNK_SHAPES[shapes]:
            inputs = kda_inputs(B, T, H, G, K, K, dt, dev)
            ref = _grads(naive_recurrent_kda, *[x.float() for x in inputs])
            out = _grads(chunk_kda, *inputs)
            tag = f"B{B}-T{T}-H{H}-G{G}-K{K}-{str(dt).split('.')[-1]}"
            rows += [_row(f"{tag}/{n}", out[n], ref[n], TOL[n]) for n in ref]
        for lens, H, G, K in VARLEN_SHAPES[shapes]:
            # N sequences in one row, each against the fp32 recurrence run on it alone
            cu = cu_seqlens_of(lens)
            q, k, v, g, beta, _ = kda_inputs(1, sum(lens), H, G, K, K, dt, dev)
            h0 = torch.randn(len(lens), H * G, K, K, generator=torch.Generator().manual_seed(1)).to(dev)
            inputs = (q, k, v, g, beta, h0)
            ref = _grads(lambda *a, cu=cu, **kw: naive_chunk_kda_varlen(*a, cu, **kw, fn=_recurrent),
                         *[x.float() for x in inputs])
            out = _grads(lambda *a, cu=cu, **kw: chunk_kda(*a, cu_seqlens=cu, **kw), *inputs)
            tag = f"varlen{len(lens)}-T{sum(lens)}-H{H}-G{G}-K{K}-{str(dt).split('.')[-1]}"
            rows += [_row(f"{tag}/{n}", out[n], ref[n], TOL[n]) for n in ref]
    elif kernel == "kda_gate":
        for B, T, HV, K in GATE_SHAPES[shapes]:
            gen = torch.Generator().manual_seed(0)
            g_raw = (torch.randn(B, T, HV, K, generator=gen) * 2).to(dev, dt)
            A_log = torch.randn(HV, generator=gen).to(dev)
            bias = torch.randn(HV, K, generator=gen).to(dev)
            do = torch.randn(B, T, HV, K, generator=gen).to(dev)
            res = []
            for fn in (lambda a, b, c: chunk_local_cumsum(naive_kda_gate(a.float(), b, c), 64),
                       lambda a, b, c: kda_gate(a, b, c, chunk_size=64)):
                leaves = [x.detach().clone().requires_grad_(True) for x in (g_raw, A_log, bias)]
                y = fn(*leaves)
                res.append((y.detach(), *torch.autograd.grad((y * do).sum(), leaves)))
            tag = f"B{B}-T{T}-HV{HV}-K{K}-{str(dt).split('.')[-1]}"
            for n, x, r in zip(("g", "dg_raw", "dA_log", "ddt_bias"), res[1], res[0]):
                rows.append(_row(f"{tag}/{n}", x, r, TOL[n]))
    elif kernel == "fused_recurrent_kda":
        from k3cli.ops.kda.fused_recurrent import fused_recurrent_kda
        # decode: a few tokens per call from a cached state; forward only (inference)
        for B, T, H, G, K in DECODE_SHAPES[shapes]:
            inputs = kda_inputs(B, T, H, G, K, K, dt, dev)
            with torch.no_grad():
                ref = naive_recurrent_kda(*[x.float() for x in inputs[:5]], initial_state=inputs[5],
                                          output_final_state=True)
                out = fused_recurrent_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True)
            tag = f"B{B}-T{T}-H{H}-G{G}-K{K}-{str(dt).split('.')[-1]}"
            rows += [_row(f"{tag}/{n}", x, r, TOL[n]) for n, x, r in zip(("o", "ht"), out, ref)]
    else:
        raise ValueError(f"verify_kda: unknown kernel {kernel!r}; valid: 'chunk_kda', 'kda_gate', "
                         "'fused_recurrent_kda'")
    return rows


def verify_short_conv(shapes: str = "ci", dtype: str | torch.dtype = "bf16") -> list[tuple]:
    """short_conv against its torch form in fp32 on the same (rounded) inputs: y, dx and dweight rows."""
    from k3cli.ops.kda.conv import document_positions, short_conv, short_conv_reference
    dev = _device()
    dt = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    if dev == "cpu" and dt == torch.bfloat16:
        dt = torch.float32   # the Triton interpreter mis-handles bf16
    rows = []
    for B, T, C, nd, docs in CONV_SHAPES[shapes]:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(B, T, C, generator=gen).to(dev, dt)
        w = (torch.randn(C, 4, generator=gen) * 0.5).to(dev)
        dy = torch.randn(B, T, C, generator=gen).to(dev, dt)
        pos = None
        if docs:   # documents start where a coin with probability 1/8 lands
            pos = document_positions(torch.rand(B, T, generator=gen) < 0.125).to(dev)
        res = []
        for fn, xin, dyin in ((short_conv_reference, x.float(), dy.float()), (short_conv, x, dy)):
            xl, wl = xin.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
            y = fn(xl, wl, pos, nd)
            res.append({"y": y.detach(), **dict(zip(("dx", "dweight"), torch.autograd.grad(y, (xl, wl), dyin)))})
        tag = f"B{B}-T{T}-C{C}-norm{nd}{'-docs' if docs else ''}-{str(dt).split('.')[-1]}"
        rows += [_row(f"{tag}/{n}", res[1][n], res[0][n], TOL[n]) for n in res[0]]
    return rows
