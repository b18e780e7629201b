"""The language-model loss without the [N, V] fp32 logits: cross-entropy of `h @ wᵀ` computed over chunks of
tokens, each chunk's logits made, reduced and dropped; the backward makes them again, chunk by chunk.

    loss = mean over tokens t with labels[t] != ignore_index of  logsumexp(z_t) − z_t[labels[t]],   z_t = w h_t

d loss / d z_t = (softmax(z_t) − onehot(labels[t])) / n for the n counted tokens, so dh_t = (dz_t) w and
dw = Σ_t dz_tᵀ h_t. Peak memory holds one chunk's fp32 logits ([chunk, V]) instead of all N of them; the
matmuls run in the inputs' dtype, the softmax and the sums in fp32 (fp64 for fp64 inputs), as
`F.cross_entropy(F.linear(h, w).float(), labels)` does. `linear_cross_entropy_reference` is that reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# one chunk's fp32 logits stay below this many bytes (256 MiB: 2,048 tokens at a 32,768 vocabulary)
CHUNK_BYTES = 2**28


def linear_cross_entropy_reference(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                                   ignore_index: int = -100) -> torch.Tensor:
    """h [N, D], w [V, D], labels [N] -> mean cross-entropy over the counted tokens (full logits)."""
    z = F.linear(h, w)
    return F.cross_entropy(z if z.dtype == torch.float64 else z.float(), labels, ignore_index=ignore_index)


def _rows(n: int, vocab: int) -> int:
    return max(1, min(n, CHUNK_BYTES // (4 * vocab)))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, labels, ignore_index, rows):
        wd = torch.float64 if h.dtype == torch.float64 else torch.float32
        counted = labels != ignore_index
        n = counted.sum()
        total = torch.zeros((), dtype=wd, device=h.device)
        for s in range(0, h.shape[0], rows):
            z = (h[s:s + rows] @ w.T).to(wd)                                       # (rows, V)
            y = labels[s:s + rows]
            c = counted[s:s + rows]
            picked = z.gather(1, torch.where(c, y, 0)[:, None]).squeeze(1)
            total = total + ((torch.logsumexp(z, 1) - picked) * c).sum()
        ctx.save_for_backward(h, w, labels, n)
        ctx.ignore_index, ctx.rows = ignore_index, rows
        return total / n

    @staticmethod
    def backward(ctx, grad):
        h, w, labels, n = ctx.saved_tensors
        wd = torch.float64 if h.dtype == torch.float64 else torch.float32
        counted = labels != ctx.ignore_index
        scale = grad.to(wd) / n
        dh = torch.empty_like(h)
        dw = torch.zeros(w.shape, dtype=wd, device=w.device)
        for s in range(0, h.shape[0], ctx.rows):
            hs = h[s:s + ctx.rows]
            z = (hs @ w.T).to(wd)
            y = labels[s:s + ctx.rows]
            c = counted[s:s + ctx.rows]
            dz = torch.softmax(z, 1)
            dz.scatter_add_(1, torch.where(c, y, 0)[:, None], -torch.ones_like(dz[:, :1]))
            dz = dz * (c[:, None] * scale)                                         # (rows, V)
            dh[s:s + ctx.rows] = (dz.to(h.dtype) @ w).to(h.dtype)
            dw += dz.T @ hs.to(wd)
        return dh, dw.to(w.dtype), None, None, None


def linear_cross_entropy(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                         rows: int | None = None) -> torch.Tensor:
    """h [N, D], w [V, D], labels [N] (long) -> the mean cross-entropy of `h @ wᵀ` over tokens whose label is
    not `ignore_index`, in chunks of `rows` tokens (default: as many as CHUNK_BYTES of fp32 logits hold)."""
    if h.dim() != 2 or w.dim() != 2 or h.shape[1] != w.shape[1] or labels.shape != h.shape[:1]:
        raise ValueError(f"linear_cross_entropy: h [N, D], w [V, D], labels [N]; got {tuple(h.shape)}, "
                         f"{tuple(w.shape)}, {tuple(labels.shape)}")
    return _LinearCrossEntropy.apply(h, w, labels, ignore_index, rows or _rows(h.shape[0], w.shape[0]))
