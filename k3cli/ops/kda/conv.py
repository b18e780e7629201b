"""KDA's short conv (docs/math.md §2.4): depthwise causal conv of width W ≤ 4, SiLU, and optionally the L2 norm over
each head's channels, one pass forward and two backward (README.md §10 has the math).

    a[t, c] = Σ_{j<W} w[c, W−1−j] · x[t−j, c]      (a tap only inside the sequence, and with `pos` inside the
    s = a · σ(a)                                     token's document: pos[t] ≥ j)
    y = s / sqrt(Σ_{c ∈ head} s² + eps)             (norm_dim > 0; else y = s)

The backward recomputes a, s and y from x: the first kernel forms da and the weight gradient's per-program
partial sums (reduced in torch: deterministic, no atomics), the second dx = Σ_j w[c, W−1−j] · da[t+j].
Custom ops `k3::short_conv` / `k3::short_conv_bwd`, called eagerly without the dispatcher as the other KDA ops.
`short_conv_reference` is the torch form (the oracle of the tests, and the op on CPU without the interpreter).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from k3cli.ops.checks import FLOATS, InputTypeError, check_number, check_tensor
from k3cli.ops.custom import eager_function, reference_vjp, triton_runs
from k3cli.ops.launch import cdiv, next_pow2
from k3cli.ops.precision import widen

_BT = 32          # rows per tile
_BT_DA = 32       # rows per tile of the backward's first kernel
_WARPS_DA = 4
_BC = 128         # channels per tile without the norm (with it, one head)
_PROGRAMS = 1024  # the backward's first kernel loops over tiles until about this many programs remain


def document_positions(starts: Tensor) -> Tensor:
    """starts [B, T] bool (True where a document begins; each row's first token begins one) -> each token's
    position in its document, [B, T] long: the `pos` that short_conv takes."""
    B, T = starts.shape
    t = torch.arange(T, device=starts.device).expand(B, T)
    return t - torch.cummax(torch.where(starts, t, 0), dim=1).values


def short_conv_reference(x: Tensor, weight: Tensor, pos: Tensor | None = None, norm_dim: int = 0,
                         eps: float = 1e-6) -> Tensor:
    """The torch form: a sum of shifted rows in fp32 (fp64 stays fp64), SiLU, the optional per-head L2 norm,
    cast to x's dtype. x [B, T, C]; weight [C, W]; pos [B, T] int or None; norm_dim divides C (0: no norm)."""
    B, T, C = x.shape
    W = weight.shape[-1]
    xf = widen(x)
    w = weight.to(xf.dtype)
    a = xf * w[:, W - 1]
    for j in range(1, W):
        tap = F.pad(xf, (0, 0, j, 0))[:, :T] * w[:, W - 1 - j]                  # x_{t−j}, zeros before 0
        a = a + (tap if pos is None else tap * (pos >= j).unsqueeze(-1).to(a.dtype))
    s = F.silu(a)
    if norm_dim:
        sh = s.view(B, T, C // norm_dim, norm_dim)
        s = (sh * torch.rsqrt(sh.pow(2).sum(-1, keepdim=True) + eps)).view(B, T, C)
    return s.to(x.dtype)


@triton.jit
def _conv_tile(x, w, b_pos, i_b, o_t, o_c, m_c, T, C, W: tl.constexpr, HAS_POS: tl.constexpr):
    """a for rows o_t (fp32 [BT, BC]): the W taps, each masked to the sequence (and the document)."""
    b_a = tl.zeros([o_t.shape[0], o_c.shape[0]], dtype=tl.float32)
    for j in tl.static_range(W):
        m_t = (o_t - j >= 0) & (o_t < T)
        if HAS_POS:
            m_t = m_t & (b_pos >= j)
        p = (i_b * T + o_t - j).to(tl.int64)[:, None] * C + o_c[None, :]
        b_x = tl.load(x + p, mask=m_t[:, None] & m_c[None, :], other=0.).to(tl.float32)
        b_a += b_x * tl.load(w + o_c * W + (W - 1 - j), mask=m_c, other=0.).to(tl.float32)[None, :]
    return b_a


@triton.jit
def _short_conv_fwd_kernel(x, w, pos, y, T, C, eps, G: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                           BC: tl.constexpr, HAS_POS: tl.constexpr, NORM: tl.constexpr):
    """One program per (BT rows, one group of G channels, sequence)."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT)
    o_g = tl.arange(0, BC)
    o_c = i_c * G + o_g
    m_c = (o_g < G) & (o_c < C)
    b_pos = tl.load(pos + i_b * T + o_t, mask=o_t < T, other=0) if HAS_POS else 0
    b_a = _conv_tile(x, w, b_pos, i_b, o_t, o_c, m_c, T, C, W, HAS_POS)
    b_s = b_a * tl.sigmoid(b_a)
    if NORM:
        b_s = b_s * tl.rsqrt(tl.sum(b_s * b_s, 1) + eps)[:, None]
    p = (i_b * T + o_t).to(tl.int64)[:, None] * C + o_c[None, :]
    tl.store(y + p, b_s.to(y.dtype.element_ty), mask=(o_t < T)[:, None] & m_c[None, :])


@triton.jit
def _short_conv_bwd_da_kernel(x, w, pos, dy, da, dw_part, T, C, eps, STEPS: tl.constexpr, G: tl.constexpr, W: tl.constexpr,
                              BT: tl.constexpr, BC: tl.constexpr, HAS_POS: tl.constexpr,
                              NORM: tl.constexpr):
    """One program per (STEPS · BT rows, one group, sequence): da for its rows, and its partial sum of dw."""
    i_blk, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_g = tl.arange(0, BC)
    o_c = i_c * G + o_g
    m_c = (o_g < G) & (o_c < C)
    # one [BT, BC] accumulator per tap, summed over rows once at the end: a row sum per tap and tile
    # (a cross-thread reduction) made this kernel 1.5x slower
    acc0 = tl.zeros([BT, BC], dtype=tl.float32)
    acc1 = tl.zeros([BT, BC], dtype=tl.float32)
    acc2 = tl.zeros([BT, BC], dtype=tl.float32)
    acc3 = tl.zeros([BT, BC], dtype=tl.float32)
    for i in range(STEPS):
        o_t = (i_blk * STEPS + i) * BT + tl.arange(0, BT)
        m = (o_t < T)[:, None] & m_c[None, :]
        b_pos = tl.load(pos + i_b * T + o_t, mask=o_t < T, other=0) if HAS_POS else 0
        b_a = _conv_tile(x, w, b_pos, i_b, o_t, o_c, m_c, T, C, W, HAS_POS)
        b_sig = tl.sigmoid(b_a)
        p = (i_b * T + o_t).to(tl.int64)[:, None] * C + o_c[None, :]
        b_ds = tl.load(dy + p, mask=m, other=0.).to(tl.float32)
        if NORM:
            b_s = b_a * b_sig
            b_r = tl.rsqrt(tl.sum(b_s * b_s, 1) + eps)
            b_y = b_s * b_r[:, None]
            # d/ds of s · r: r · (dy − y ⟨dy, y⟩)
            b_ds = (b_ds - b_y * tl.sum(b_ds * b_y, 1)[:, None]) * b_r[:, None]
        b_da = tl.where(m, b_ds * b_sig * (1. + b_a * (1. - b_sig)), 0.)
        tl.store(da + p, b_da.to(da.dtype.element_ty), mask=m)
        for j in tl.static_range(W):
            m_t = (o_t - j >= 0) & (o_t < T)
            if HAS_POS:
                m_t = m_t & (b_pos >= j)
            b_x = tl.load(x + p - j * C, mask=m_t[:, None] & m_c[None, :], other=0.).to(tl.float32)
            if j == 0:
                acc0 += b_da * b_x
            elif j == 1:
                acc1 += b_da * b_x
            elif j == 2:
                acc2 += b_da * b_x
            else:
                acc3 += b_da * b_x
    # tap j multiplies x[t − j], weight column W − 1 − j
    base = dw_part + ((i_b * tl.num_programs(0) + i_blk).to(tl.int64) * C + o_c) * W + W - 1
    tl.store(base, tl.sum(acc0, 0), mask=m_c)
    if W > 1:
        tl.store(base - 1, tl.sum(acc1, 0), mask=m_c)
    if W > 2:
        tl.store(base - 2, tl.sum(acc2, 0), mask=m_c)
    if W > 3:
        tl.store(base - 3, tl.sum(acc3, 0), mask=m_c)


@triton.jit
def _short_conv_bwd_dx_kernel(da, w, pos, dx, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                              HAS_POS: tl.constexpr):
    """One program per (BT rows, BC channels, sequence): dx[t] = Σ_j w[:, W−1−j] · da[t+j] where tap j of row
    t + j was inside the document."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    b_dx = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        m_t = o_t + j < T
        if HAS_POS:
            m_t = m_t & (tl.load(pos + i_b * T + o_t + j, mask=m_t, other=0) >= j)
        p = (i_b * T + o_t + j).to(tl.int64)[:, None] * C + o_c[None, :]
        b_da = tl.load(da + p, mask=m_t[:, None] & m_c[None, :], other=0.).to(tl.float32)
        b_dx += b_da * tl.load(w + o_c * W + (W - 1 - j), mask=m_c, other=0.).to(tl.float32)[None, :]
    p = (i_b * T + o_t).to(tl.int64)[:, None] * C + o_c[None, :]
    tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=(o_t < T)[:, None] & m_c[None, :])


def _groups(C: int, norm_dim: int) -> tuple[int, int]:
    """(channels per program G, its power-of-2 tile BC): one head with the norm, else _BC channels."""
    if norm_dim:
        return norm_dim, next_pow2(norm_dim)
    BC = min(_BC, next_pow2(C))
    return BC, BC


def _forward(x: Tensor, weight: Tensor, pos: Tensor | None, norm_dim: int, eps: float) -> Tensor:
    x = x.contiguous()
    B, T, C = x.shape
    y = torch.empty_like(x)
    if y.numel() == 0:
        return y
    G, BC = _groups(C, norm_dim)
    _short_conv_fwd_kernel[(cdiv(T, _BT), cdiv(C, G), B)](
        x, weight.contiguous(), pos, y, T, C, eps, G=G, W=weight.shape[-1], BT=_BT, BC=BC,
        HAS_POS=pos is not None, NORM=bool(norm_dim), num_warps=4)
    return y


def _backward(x: Tensor, weight: Tensor, pos: Tensor | None, dy: Tensor, norm_dim: int,
              eps: float) -> tuple[Tensor, Tensor]:
    x, weight, dy = x.contiguous(), weight.contiguous(), dy.contiguous()
    B, T, C = x.shape
    W = weight.shape[-1]
    if x.numel() == 0:
        return torch.empty_like(x), torch.zeros_like(weight)
    G, BC = _groups(C, norm_dim)
    NC, NT = cdiv(C, G), cdiv(T, _BT_DA)
    steps = max(1, min(8, NT * NC * B // _PROGRAMS))
    NB = cdiv(NT, steps)
    da = torch.empty_like(x)
    dw_part = torch.empty(B * NB, C, W, device=x.device, dtype=torch.float32)
    _short_conv_bwd_da_kernel[(NB, NC, B)](x, weight, pos, dy, da, dw_part, T, C, eps, STEPS=steps, G=G, W=W,
                                           BT=_BT_DA, BC=BC, HAS_POS=pos is not None,
                                           NORM=bool(norm_dim), num_warps=_WARPS_DA)
    dx = torch.empty_like(x)
    BCX = _groups(C, 0)[1]
    _short_conv_bwd_dx_kernel[(cdiv(T, _BT), cdiv(C, BCX), B)](da, weight, pos, dx, T, C, W=W, BT=_BT, BC=BCX,
                                                      HAS_POS=pos is not None, num_warps=4)
    return dx, dw_part.sum(0).to(weight.dtype)


def _impl(x, weight, pos, norm_dim, eps):
    if triton_runs(x.device) and x.dtype != torch.float64:
        return _forward(x, weight, pos, norm_dim, eps)
    return short_conv_reference(x, weight, pos, norm_dim, eps)


def _bwd_impl(x, weight, pos, dy, norm_dim, eps):
    if triton_runs(x.device) and x.dtype != torch.float64:
        return _backward(x, weight, pos, dy, norm_dim, eps)
    return tuple(reference_vjp(lambda a, b: short_conv_reference(a, b, pos, norm_dim, eps), (x, weight), (dy,)))


@torch.library.custom_op("k3::short_conv", mutates_args=(), device_types=("cuda", "cpu"))
def short_conv_op(x: Tensor, weight: Tensor, pos: Tensor | None, norm_dim: int, eps: float) -> Tensor:
    """`short_conv` on checked inputs: [B, T, C] in x's dtype."""
    return _impl(x, weight, pos, norm_dim, eps)


@short_conv_op.register_fake
def _(x, weight, pos, norm_dim, eps):
    return torch.empty(x.shape, device=x.device, dtype=x.dtype)


@torch.library.custom_op("k3::short_conv_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def short_conv_bwd_op(x: Tensor, weight: Tensor, pos: Tensor | None, dy: Tensor, norm_dim: int,
                      eps: float) -> tuple[Tensor, Tensor]:
    """k3::short_conv's backward: (dx, dweight)."""
    return _bwd_impl(x, weight, pos, dy, norm_dim, eps)


@short_conv_bwd_op.register_fake
def _(x, weight, pos, dy, norm_dim, eps):
    return (torch.empty(x.shape, device=x.device, dtype=x.dtype),
            torch.empty(weight.shape, device=weight.device, dtype=weight.dtype))


def _setup_context(ctx, inputs, output):
    x, weight, pos, norm_dim, eps = inputs
    ctx.save_for_backward(x, weight, pos)
    ctx.norm_dim, ctx.eps = norm_dim, eps


def _autograd_backward(ctx, dy, bwd=None):
    """The backward of k3::short_conv (through its backward op) and of _ShortConv (`bwd`)."""
    x, weight, pos = ctx.saved_tensors
    dx, dw = (bwd or short_conv_bwd_op)(x, weight, pos, dy, ctx.norm_dim, ctx.eps)
    return dx, dw, None, None, None


short_conv_op.register_autograd(_autograd_backward, setup_context=_setup_context)
_ShortConv = eager_function("_ShortConv", _impl, _setup_context, _autograd_backward, _bwd_impl)


def short_conv(x: Tensor, weight: Tensor, pos: Tensor | None = None, norm_dim: int = 0, eps: float = 1e-6) -> Tensor:
    """Depthwise causal conv + SiLU (+ per-head L2 norm), fused.

    Args:
        x: [B, T, C] (fp32 / fp16 / bf16; fp64 runs the torch form).
        weight: [C, W] taps, the last one multiplying x[t] (nn.Conv1d's [C, 1, W] weight without its middle dim).
        pos: [B, T] int32/int64, each token's position in its document (packed rows), or None (one sequence per
            row); a tap reaching before the document's start reads zero.
        norm_dim: 0, or the head size: y is L2-normalised over each run of norm_dim channels (divides C).
        eps: added to the sum of squares under the norm's square root.
    Returns:
        [B, T, C] in x's dtype.
    """
    floats = (*FLOATS, torch.float64)
    check_tensor("short_conv", "x", x, 3, dtypes=floats)
    B, T, C = x.shape
    check_tensor("short_conv", "weight", weight, 2, x.device, floats, ref="x")
    if weight.shape[0] != C or not 1 <= weight.shape[1] <= 4:
        raise ValueError(f"short_conv: weight shape {tuple(weight.shape)} must be [C={C}, W] with 1 <= W <= 4")
    if pos is not None:
        check_tensor("short_conv", "pos", pos, 2, x.device, (torch.int32, torch.int64), shape=(B, T), ref="x")
    if isinstance(norm_dim, bool) or not isinstance(norm_dim, int):
        raise InputTypeError(f"short_conv: norm_dim must be an int, got {type(norm_dim).__name__}")
    if norm_dim < 0 or (norm_dim and C % norm_dim):
        raise ValueError(f"short_conv: norm_dim={norm_dim} must be 0 or divide C={C}")
    check_number("short_conv", "eps", eps, 0.0)
    pos = None if pos is None else pos.contiguous()
    conv = short_conv_op if torch.compiler.is_compiling() else _ShortConv.apply
    return conv(x, weight, pos, norm_dim, float(eps))
