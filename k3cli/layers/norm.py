"""RMSNorm (docs/math.md §1): y = x / sqrt(mean(x²) + eps) · weight, computed in fp32 and cast back.

The functions live in k3cli.ops.norm (the kernels' references use them too); re-exported here.
"""
from __future__ import annotations

import torch
from torch import nn

from k3cli.ops.norm import l2norm, rms_norm

__all__ = ["RMSNorm", "l2norm", "rms_norm"]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learnable gain [D] (initialised to 1)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D]."""
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
