"""The working precision of the torch paths: fp64 inputs stay fp64 (the identity tests' tight references),
everything else (fp32, bf16, fp16) computes in fp32."""
from __future__ import annotations

import torch


def work_dtype(*xs: torch.Tensor | torch.dtype | None) -> torch.dtype:
    """fp64 if any of xs (tensors or dtypes; None is skipped) is fp64, else fp32."""
    for x in xs:   # a plain loop: torch.compile traces it without a generator
        if x is not None and (x if isinstance(x, torch.dtype) else x.dtype) == torch.float64:
            return torch.float64
    return torch.float32


def widen(x: torch.Tensor) -> torch.Tensor:
    """x in its working precision (fp64 stays as it is, anything else as fp32)."""
    return x if x.dtype == torch.float64 else x.float()
