"""`k3 bench-kernel --kernel short_conv`: the fused short conv against its torch form in the same run.

The torch form is `short_conv_reference` (the shifted-row sum, SiLU and the per-head L2 norm), timed eagerly and,
on CUDA, under torch.compile (how a compiled model without the kernel runs it). bf16 on CUDA, fp32 on CPU (the
interpreter: a smoke test only). GB/s counts reading x and writing y once.
"""
from __future__ import annotations

import torch

from k3cli.ops.kda.bench import _first_call, copy_ceiling_gbps, time_fn
from k3cli.ops.kda.conv import document_positions, short_conv, short_conv_reference

# (B, T, C, norm_dim, documents): "k3" is k3-0.5b's q / k (norm over heads of 128) and v at its B16 T4096 step,
# then q with packed documents; "toy" k3-toy's q at B512 T256
SHAPES = {"ci": [(1, 40, 24, 8, True)],
          "toy": [(512, 256, 128, 16, False)],
          "k3": [(16, 4096, 1024, 128, False), (16, 4096, 1024, 0, False), (16, 4096, 1024, 128, True)]}
WIDTH = 4


def _positions(B, T, mean_len, device):
    """Each token's position in its document; documents of about `mean_len` tokens."""
    gen = torch.Generator().manual_seed(0)
    return document_positions(torch.rand(B, T, generator=gen) < 1 / mean_len).to(device)


def _fns(fn, x, w, pos, nd, dy):
    def fwd():
        with torch.no_grad():
            return fn(x, w, pos, nd)

    def fwd_bwd():
        return torch.autograd.grad(fn(x, w, pos, nd), (x, w), dy)
    return fwd, fwd_bwd


def bench_short_conv(shapes: str = "k3", on_row=None) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ceiling = copy_ceiling_gbps(device)
    compiled = torch.compile(short_conv_reference) if device.type == "cuda" else None
    rows = []
    for B, T, C, nd, docs in SHAPES[shapes]:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(B, T, C, generator=gen).to(device, dtype).requires_grad_()
        w = (torch.randn(C, WIDTH, generator=gen) * 0.5).to(device).requires_grad_()
        dy = torch.randn(B, T, C, generator=gen).to(device, dtype)
        pos = _positions(B, T, min(T, 512), device) if docs else None
        row = {"kernel": "short_conv", "B": B, "T": T, "C": C, "W": WIDTH, "norm_dim": nd, "documents": docs,
               "dtype": str(dtype)}
        fwd, fwd_bwd = _fns(short_conv, x, w, pos, nd, dy)
        row["first_call_s"] = _first_call(fwd_bwd, device)
        row["fwd_ms"] = time_fn(fwd, device)[0]
        row["fwd_bwd_ms"] = time_fn(fwd_bwd, device)[0]
        row["fwd_GBps"] = 2 * x.numel() * x.element_size() / (row["fwd_ms"] * 1e-3) / 1e9
        row["fwd_frac_copy"] = row["fwd_GBps"] / ceiling
        rf, rfb = _fns(short_conv_reference, x, w, pos, nd, dy)
        row["torch_fwd_ms"] = time_fn(rf, device, reps=3)[0]
        row["torch_fwd_bwd_ms"] = time_fn(rfb, device, reps=3)[0]
        row["compiled_fwd_ms"] = row["compiled_fwd_bwd_ms"] = None
        if compiled is not None:
            cf, cfb = _fns(compiled, x, w, pos, nd, dy)
            cfb()
            row["compiled_fwd_ms"] = time_fn(cf, device)[0]
            row["compiled_fwd_bwd_ms"] = time_fn(cfb, device)[0]
        for key in ("torch", "compiled"):
            for p in ("fwd", "fwd_bwd"):
                ref = row[f"{key}_{p}_ms"]
                row[f"vs_{key}_{p}"] = None if ref is None else ref / row[f"{p}_ms"]
        rows.append(row)
        if on_row is not None:
            on_row(row)
        del x, dy
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
