"""Row gathers with a zero row past the end: y[i] = x[idx[i]] where idx[i] < len(x), else 0.

The varlen KDA path moves q, k, v, g, β and dO into its chunk-aligned layout this way (gaps read the zero
row) and the outputs and gradients back. One pass per tensor, with the cast of a gradient to its input's
dtype done on the store; torch's form (a copy of x with a zero row appended, then an index) takes two.
`gather_rows_reference` is that torch form, the oracle of the tests.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3cli.ops.launch import cdiv, fast_launch, next_pow2


def gather_rows_reference(x: Tensor, idx: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """x [R, ...], idx [N] int (values in [0, R]; R reads a zero row) -> [N, ...] in `dtype` (x's by default)."""
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[idx].to(dtype or x.dtype)


@fast_launch
@triton.jit
def _gather_rows_kernel(x, idx, y, R, N, F, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """One program per (BLOCK_R output rows, BLOCK_F features): rows whose index is R (or more) get zeros."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m_r, m_f = o_r < N, o_f < F
    src = tl.load(idx + o_r, mask=m_r, other=R).to(tl.int64)
    b_x = tl.load(x + src[:, None] * F + o_f[None, :], mask=(src < R)[:, None] & m_f[None, :], other=0.)
    tl.store(y + o_r.to(tl.int64)[:, None] * F + o_f[None, :], b_x.to(y.dtype.element_ty),
             mask=m_r[:, None] & m_f[None, :])


def gather_rows(x: Tensor, idx: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """As `gather_rows_reference`, by one Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1). x is made
    contiguous; idx must be an integer tensor on x's device."""
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64) or idx.device != x.device:
        raise ValueError(f"gather_rows: idx must be a 1-D int32/int64 tensor on {x.device}, got "
                         f"{tuple(idx.shape)} {idx.dtype} on {idx.device}")
    x = x.contiguous()
    R, N = x.shape[0], idx.shape[0]
    F = math.prod(x.shape[1:])
    y = torch.empty(N, *x.shape[1:], dtype=dtype or x.dtype, device=x.device)
    if N == 0 or F == 0:
        return y
    BLOCK_F = min(next_pow2(F), 512)
    BLOCK_R = max(1, 4096 // BLOCK_F)
    _gather_rows_kernel[(cdiv(N, BLOCK_R), cdiv(F, BLOCK_F))](x, idx, y, R, N, F, BLOCK_R=BLOCK_R,
                                                               BLOCK_F=BLOCK_F, num_warps=4)
    return y
