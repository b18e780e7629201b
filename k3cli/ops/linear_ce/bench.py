"""Timings and peak memory of the language-model loss for `k3 bench-kernel --kernel linear_ce`: cross-entropy of
`h @ wᵀ` forward and backward (dh, dw), per implementation, all on the same inputs in the same run:

- torch: `F.cross_entropy(F.linear(h, w).float(), labels)`, the full [N, V] logits (what the model computes now);
- ours: `linear_cross_entropy`, chunked over tokens (k3cli/ops/linear_ce);
- liger: Liger-Kernel's fused linear cross-entropy, cce: cut-cross-entropy's, each when it is installed (on
  CUDA; a peer that fails is reported in its row's `*_error`).

CUDA runs bf16 h and w; the CPU (interpreter runs) fp32, as a smoke test only. Peak memory is what one
forward+backward adds to what the inputs hold (CUDA only).
"""
from __future__ import annotations

import torch

from k3cli.ops.linear_ce import linear_cross_entropy, linear_cross_entropy_reference

# (N tokens, D hidden, V vocabulary): "k3" is k3-0.5b at B16 T4096 and at B4 T4096; "toy" k3-toy at B32 T256
SHAPES = {"ci": [(300, 64, 1000)], "toy": [(8192, 256, 4096)], "k3": [(65536, 1024, 32768), (16384, 1024, 32768)]}
IGNORE = -100


def _peers(device) -> dict:
    """The installed peer implementations, (h, w, labels) -> mean loss: CUDA libraries, on CUDA only."""
    out = {}
    if device.type != "cuda":
        return out
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        out["liger"] = lambda h, w, y: liger_fused_linear_cross_entropy(h, w, y, ignore_index=IGNORE)
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        out["cce"] = lambda h, w, y: cce(h, w, y, ignore_index=IGNORE)
    except ImportError:
        pass
    return out


def _inputs(N: int, D: int, V: int, dtype, device):
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(N, D, generator=gen) / D ** 0.5).to(device, dtype)
    w = (torch.randn(V, D, generator=gen) / D ** 0.5).to(device, dtype)
    y = torch.randint(0, V, (N,), generator=gen)
    y[torch.rand(N, generator=gen) < 0.02] = IGNORE   # a few positions without a target, as padding leaves
    return h, w, y.to(device)


def _measure(fn, h, w, y, device) -> tuple[float, float | None, float]:
    """(fwd+bwd ms, peak GiB added by one pass or None off CUDA, the loss)."""
    from k3cli.ops.kda.bench import time_fn

    h, w = h.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def step():
        loss = fn(h, w, y)
        torch.autograd.grad(loss, (h, w))
        return loss

    loss = float(step().detach())   # warm-up (compiles Triton kernels) and the value
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return time_fn(step, device)[0], peak, loss


def bench_linear_ce(shapes: str = "k3", on_row=None) -> list[dict]:
    """One row per (N, D, V): each implementation's fwd+bwd ms, peak GiB and loss, and its ratio to torch's."""
    if shapes not in SHAPES:
        raise ValueError(f"bench_linear_ce: unknown shape set {shapes!r}; valid: {sorted(SHAPES)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    impls = {"torch": linear_cross_entropy_reference, "ours": linear_cross_entropy, **_peers(device)}
    rows = []
    for N, D, V in SHAPES[shapes]:
        h, w, y = _inputs(N, D, V, dtype, device)
        row = {"kernel": "linear_ce", "N": N, "D": D, "V": V, "dtype": str(dtype)}
        for name in ("torch", "ours", "liger", "cce"):
            row[f"{name}_ms"] = row[f"{name}_peak_gib"] = row[f"{name}_loss"] = None
            if name not in impls:
                continue
            try:
                row[f"{name}_ms"], row[f"{name}_peak_gib"], row[f"{name}_loss"] = _measure(impls[name], h, w, y, device)
            except torch.OutOfMemoryError:
                row[f"{name}_ms"] = float("nan")
            except Exception as e:  # a peer library that fails here is reported, not fatal to the others
                if name in ("torch", "ours"):
                    raise
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for name in ("ours", "liger", "cce"):
            ok = row[f"{name}_ms"] and row["torch_ms"]
            row[f"{name}_vs_torch"] = row["torch_ms"] / row[f"{name}_ms"] if ok else None
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
