"""RMS and L2 normalisation over the last dim, in torch (docs/math.md §1, §2.1): shared by the
kernels' torch paths and the layers (whose RMSNorm module wraps `rms_norm`)."""
from __future__ import annotations

import torch

from k3cli.ops.precision import widen


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """RMS-normalise the last dim of x [..., D]; weight [D] or None (no gain). Returns x.dtype.

    fp32 for half inputs (the mean of squares underflows/overflows in bf16); fp64 stays fp64.
    """
    xf = widen(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last dim in fp32 (fp64 stays fp64), cast back to x.dtype.

    KDA's q / k normalisation (docs/math.md §2.1), shared by the layer and the kernels' torch paths; explicit
    dtypes so that under autocast q and k keep v's dtype (F.normalize's norm would promote them).
    """
    xf = widen(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
