"""Triton AttnRes, block form: `attnres_phase1` and `attnres_merge` (forward + backward).

Phase 1 reuses the full form's forward kernel with one program per (query, token tile), queries
fastest, so the S programs of a tile re-read its sources from L2 rather than from memory.
Phase-1 backward runs one program per (source, token tile), walking the S queries; the query
gradient is a reduction over sources and tokens and runs as a small split-K matmul (`dw_kernel`).
The merge (phase 2) is one pass over the partial source and the phase-1 state.
Custom ops `k3::attnres_phase1`, `k3::attnres_merge` and their `_bwd` (README.md, "Custom ops").
Derivations: README.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3cli.ops.attnres.fused import (
    INTERPRET,
    MAX_D,
    ROW_OPTIONS,
    Sources,
    _configs,
    _dh_tile,
    _prune_by_registers,
    _rms_score,
    _src_ptr,
    attnres_fwd_kernel,
    block_d,
    check_eps,
    check_sources,
    check_vector,
    dense,
    num_programs,
    reference_sources,
    source_count_shape,
    source_grads,
    stacked_grad,
    w_tilde,
    w_tilde_grads,
)
from k3cli.ops.checks import FLOATS, InputTypeError, check_tensor, dtype_names
from k3cli.ops.custom import absent, reference_vjp, triton_runs


@triton.autotune(configs=_configs(ROW_OPTIONS), key=["D", "USE_TABLE"],
                 prune_configs_by={"early_config_prune": _prune_by_registers})
@triton.jit
def phase1_bwd_kernel(x, ptrs, wt, m, do, dl, dx, c,
                      M, D, n, S, stride_n, eps,
                      USE_TABLE: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Program (i, i_t): source i, tokens of tile i_t, all S queries. Writes dx[i] and
    c[q, i, t] = ds_{q,i,t} · r_{i,t} (the coefficient of v_i in dw̃_q)."""
    i, i_t = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_t, m_d = o_t < M, o_d < D
    m_td = m_t[:, None] & m_d[None, :]
    o_td = o_t.to(tl.int64)[:, None] * D + o_d[None, :]
    b_v = tl.load(_src_ptr(x, ptrs, i, stride_n, USE_TABLE) + o_td, mask=m_td, other=0.).to(tl.float32)
    b_dv = tl.zeros([BT, BD], tl.float32)
    j = S * 0
    while j < S:
        b_w = tl.load(wt + j * D + o_d, mask=m_d, other=0.)
        b_r, b_s = _rms_score(b_v, b_w, m_t, D, eps)
        b_m = tl.load(m + j * M + o_t, mask=m_t, other=0.)
        b_e = tl.where(m_t, tl.exp(b_s - b_m), 0.)
        b_do = tl.load(do + j.to(tl.int64) * M * D + o_td, mask=m_td, other=0.)
        b_dl = tl.load(dl + j * M + o_t, mask=m_t, other=0.)
        b_dsr = b_e * (b_dl + tl.sum(b_do * b_v, 1)) * b_r
        b_dv += b_e[:, None] * b_do + b_dsr[:, None] * (b_w[None, :] - (b_s * b_r / D)[:, None] * b_v)
        tl.store(c + (j * n + i).to(tl.int64) * M + o_t, b_dsr, mask=m_t)
        j += 1
    tl.store(dx + i.to(tl.int64) * M * D + o_td, b_dv.to(dx.dtype.element_ty), mask=m_td)


@triton.jit
def dw_kernel(x, ptrs, c, part, M, D, n, S, stride_n,
              USE_TABLE: tl.constexpr, SP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
              PRECISION: tl.constexpr):
    """part[i_s, q, d] = Σ over sources i and this split's tokens t of c[q, i, t] · v_i[t, d]."""
    i_d, i_s, n_s = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    o_d = i_d * BD + tl.arange(0, BD)
    o_q = tl.arange(0, SP)
    m_d, m_q = o_d < D, o_q < S
    acc = tl.zeros([SP, BD], tl.float32)
    i = n * 0
    while i < n:
        base = _src_ptr(x, ptrs, i, stride_n, USE_TABLE)
        t0 = i_s * BT
        while t0 < M:
            o_t = t0 + tl.arange(0, BT)
            m_t = o_t < M
            b_c = tl.load(c + (o_q[:, None] * n + i).to(tl.int64) * M + o_t[None, :],
                          mask=m_q[:, None] & m_t[None, :], other=0.)
            b_v = tl.load(base + o_t.to(tl.int64)[:, None] * D + o_d[None, :],
                          mask=m_t[:, None] & m_d[None, :], other=0.).to(tl.float32)
            acc += tl.dot(b_c, b_v, input_precision=PRECISION)
            t0 += n_s * BT
        i += 1
    tl.store(part + (i_s * S + o_q[:, None]).to(tl.int64) * D + o_d[None, :], acc,
             mask=m_q[:, None] & m_d[None, :])


@triton.jit
def merge_fwd_kernel(o, l, m, p, wt, h, y, nw, stat, M, D, eps, norm_eps,
                     HAS_PARTIAL: tl.constexpr, HAS_NORM: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """h = (a·o + b·p) / (a·l + b) with a = e^{m − m'}, b = e^{s_p − m'}, m' = max(m, s_p); without
    a partial h = o / l. stat rows: A = a / Z (scale of o), α_p = b / Z (0 without a partial), rstd of h
    (0 without the norm)."""
    i_t = tl.program_id(0)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_t, m_d = o_t < M, o_d < D
    m_td = m_t[:, None] & m_d[None, :]
    o_td = o_t.to(tl.int64)[:, None] * D + o_d[None, :]
    b_o = tl.load(o + o_td, mask=m_td, other=0.).to(tl.float32)
    b_l = tl.load(l + o_t, mask=m_t, other=1.).to(tl.float32)
    if HAS_PARTIAL:
        b_m = tl.load(m + o_t, mask=m_t, other=0.).to(tl.float32)
        b_p = tl.load(p + o_td, mask=m_td, other=0.).to(tl.float32)
        b_w = tl.load(wt + o_d, mask=m_d, other=0.)
        _, b_s = _rms_score(b_p, b_w, m_t, D, eps)
        b_mn = tl.maximum(b_m, b_s)
        b_a, b_b = tl.exp(b_m - b_mn), tl.exp(b_s - b_mn)
        b_z = b_l * b_a + b_b
        b_A, b_alpha = b_a / b_z, b_b / b_z
        b_h = b_o * b_A[:, None] + b_alpha[:, None] * b_p
        tl.store(stat + M + o_t, b_alpha, mask=m_t)
    else:
        b_A = 1. / b_l
        b_h = b_o * b_A[:, None]
        # every stat row is written (zeros where unused): the op's outputs are defined values
        tl.store(stat + M + o_t, tl.zeros([BT], tl.float32), mask=m_t)
    tl.store(stat + o_t, b_A, mask=m_t)
    tl.store(h + o_td, b_h.to(h.dtype.element_ty), mask=m_td)
    if HAS_NORM:
        b_rh = tl.rsqrt(tl.sum(b_h * b_h, 1) / D + norm_eps)
        b_nw = tl.load(nw + o_d, mask=m_d, other=0.).to(tl.float32)
        tl.store(y + o_td, (b_h * b_rh[:, None] * b_nw[None, :]).to(y.dtype.element_ty), mask=m_td)
        tl.store(stat + 2 * M + o_t, b_rh, mask=m_t)
    else:
        tl.store(stat + 2 * M + o_t, tl.zeros([BT], tl.float32), mask=m_t)


@triton.jit
def merge_bwd_kernel(p, wt, h, dh, dy, nw, stat, do, dl, dp, dw_part, dnw_part, M, D, eps,
                     HAS_PARTIAL: tl.constexpr, HAS_NORM: tl.constexpr, HAS_DH: tl.constexpr,
                     HAS_DY: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Grid-stride over token tiles: do = A·dh, dl = −A·(dh·h), dp, and partial dw̃ / dnw rows."""
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_w = tl.load(wt + o_d, mask=m_d, other=0.)
    acc_dw = tl.zeros([BD], tl.float32)
    acc_dnw = tl.zeros([BD], tl.float32)
    n_tiles = tl.cdiv(M, BT)
    i_t = i_p
    while i_t < n_tiles:
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < M
        m_td = m_t[:, None] & m_d[None, :]
        o_td = o_t.to(tl.int64)[:, None] * D + o_d[None, :]
        b_h, b_dh, b_dnw = _dh_tile(h, dh, dy, nw, stat + 2 * M, o_td, o_t, o_d, m_t, m_td, m_d, D, HAS_NORM,
                                    HAS_DH, HAS_DY, BT, BD)
        acc_dnw += b_dnw
        b_delta = tl.sum(b_dh * b_h, 1)
        b_A = tl.load(stat + o_t, mask=m_t, other=0.)
        tl.store(do + o_td, b_A[:, None] * b_dh, mask=m_td)
        tl.store(dl + o_t, -b_A * b_delta, mask=m_t)
        if HAS_PARTIAL:
            b_alpha = tl.load(stat + M + o_t, mask=m_t, other=0.)
            b_p = tl.load(p + o_td, mask=m_td, other=0.).to(tl.float32)
            b_r, b_s = _rms_score(b_p, b_w, m_t, D, eps)
            b_dsr = b_alpha * (tl.sum(b_dh * b_p, 1) - b_delta) * b_r
            b_dp = b_alpha[:, None] * b_dh + b_dsr[:, None] * (b_w[None, :] - (b_s * b_r / D)[:, None] * b_p)
            tl.store(dp + o_td, b_dp.to(dp.dtype.element_ty), mask=m_td)
            acc_dw += tl.sum(b_dsr[:, None] * b_p, 0)
        i_t += n_p
    tl.store(dw_part + i_p * D + o_d, acc_dw, mask=m_d)
    tl.store(dnw_part + i_p * D + o_d, acc_dnw, mask=m_d)


def _row_launch(D: int) -> dict:
    """BT and num_warps for the untuned row kernels (merge): one token, ~8 fp32 values per thread
    (the backward holds ~6 row arrays; ptxas: no spills at BD = 4096 with 16 warps)."""
    BD = block_d(D)
    if INTERPRET:
        return {"BT": 16, "BD": BD, "num_warps": 4}
    return {"BT": 1, "BD": BD, "num_warps": max(1, min(32, BD // 256))}


# ------------------------------------------------------------------ host launchers
def phase1_fwd(src: Sources, wt: torch.Tensor, eps: float):
    """-> m, l [S, B, T], o [S, B, T, D], all fp32."""
    x, M, D, S = src.x, src.M, src.D, wt.shape[0]
    o = torch.empty((S, *src.shape), dtype=torch.float32, device=x.device)
    m = torch.empty((S, *src.shape[:2]), dtype=torch.float32, device=x.device)
    l = torch.empty_like(m)
    grid = lambda meta: (S, triton.cdiv(M, meta["BT"]))
    attnres_fwd_kernel[grid](x, src.table, wt, o, o, wt, m, l, m, M, D, src.n, src.stride_n, eps, 0.,
                             USE_TABLE=not src.stacked, NORMALIZE=False, HAS_NORM=False, BD=block_d(D))
    return m, l, o


def phase1_bwd(src: Sources, wt, m, do, dl, eps: float):
    """-> dx [n, B, T, D] (sources' dtype), dw̃ [S, D] fp32."""
    x, M, D, S, n = src.x, src.M, src.D, wt.shape[0], src.n
    dx = torch.empty((n, *src.shape), dtype=x.dtype, device=x.device)
    c = torch.empty(S, n, M, dtype=torch.float32, device=x.device)
    grid = lambda meta: (n, triton.cdiv(M, meta["BT"]))
    phase1_bwd_kernel[grid](x, src.table, wt, m, do, dl, dx, c, M, D, n, S, src.stride_n, eps,
                            USE_TABLE=not src.stacked, BD=block_d(D))
    SP = max(16, triton.next_power_of_2(S))
    BDW = 64 if INTERPRET else 128
    splits = num_programs(M, x.device)
    part = torch.empty(splits, S, D, dtype=torch.float32, device=x.device)
    # tf32 for half-precision sources (their own rounding dominates); exact fp32 otherwise
    precision = "tf32" if x.dtype in (torch.float16, torch.bfloat16) else "ieee"
    dw_kernel[(triton.cdiv(D, BDW), splits)](x, src.table, c, part, M, D, n, S, src.stride_n,
                                            USE_TABLE=not src.stacked, SP=SP, BT=32, BD=BDW,
                                            PRECISION=precision, num_warps=4)
    return dx, part.sum(0)


def _phase1_reference(srcs, wt, eps: float, m=None):
    from k3cli.ops.attnres.naive import naive_attnres_phase1
    return tuple(t.float().contiguous() for t in naive_attnres_phase1(reference_sources(srcs), wt, None, eps, m=m))


@torch.library.custom_op("k3::attnres_phase1", mutates_args=(), device_types=("cuda", "cpu"))
def attnres_phase1_op(sources: list[Tensor], queries: Tensor, gains: Tensor | None,
                      eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """`attnres_phase1` on checked inputs: (m, l, o), all fp32; `sources` as k3::fused_attnres's."""
    wt = w_tilde(queries, gains)
    if triton_runs(queries.device):
        return phase1_fwd(Sources(sources), wt, eps)
    return _phase1_reference(sources, wt, eps)


@attnres_phase1_op.register_fake
def _(sources, queries, gains, eps):
    _, shape = source_count_shape(sources)
    S, dev = queries.shape[0], queries.device
    m = torch.empty((S, *shape[:2]), dtype=torch.float32, device=dev)
    return m, torch.empty_like(m), torch.empty((S, *shape), dtype=torch.float32, device=dev)


@torch.library.custom_op("k3::attnres_phase1_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def attnres_phase1_bwd_op(sources: list[Tensor], queries: Tensor, gains: Tensor | None, m: Tensor, dl: Tensor,
                          do: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """k3::attnres_phase1's backward with m held fixed (README.md): (dx [n, B, T, D] in the sources' dtype,
    dw̃ [S, D] fp32)."""
    wt = w_tilde(queries, gains)
    if triton_runs(queries.device):
        return phase1_bwd(Sources(sources), wt, m, do, dl, eps)
    dsrc, dwt = reference_vjp(lambda s, w: _phase1_reference(s, w, eps, m=m)[1:], (reference_sources(sources), wt),
                              (dl, do))
    return stacked_grad(sources, dsrc if isinstance(dsrc, list) else [dsrc]), dwt


@attnres_phase1_bwd_op.register_fake
def _(sources, queries, gains, m, dl, do, eps):
    n, shape = source_count_shape(sources)
    return (torch.empty((n, *shape), dtype=sources[0].dtype, device=queries.device),
            torch.empty(queries.shape, dtype=torch.float32, device=queries.device))


def _phase1_setup_context(ctx, inputs, output):
    sources, queries, gains, eps = inputs
    # m is a stabiliser: holding it fixed is exact, as every later use (the merge) is invariant to it
    ctx.mark_non_differentiable(output[0])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(queries, gains, output[0], *sources)
    ctx.eps, ctx.D = eps, source_count_shape(sources)[1][-1]


def _phase1_backward(ctx, dm, dl, do):
    queries, gains, m, *sources = ctx.saved_tensors
    dl = torch.zeros_like(m) if dl is None else dl.float().contiguous()
    do = torch.zeros(m.shape + (ctx.D,), dtype=torch.float32, device=m.device) if do is None \
        else do.float().contiguous()
    dx, dwt = attnres_phase1_bwd_op(sources, queries, gains, m, dl, do, ctx.eps)
    dq, dg = w_tilde_grads(dwt, queries, gains)
    return source_grads(sources, dx), dq, dg, None


attnres_phase1_op.register_autograd(_phase1_backward, setup_context=_phase1_setup_context)


def attnres_phase1(sources, queries: torch.Tensor, gains: torch.Tensor, eps: float = 1e-6):
    """Block form, phase 1: S queries against the n completed sources (same math as
    `naive_attnres_phase1`), through the custom op `k3::attnres_phase1`.

    Args:
        sources: list of n tensors [B, T, D] or one stacked [n, B, T, D] (b_0 and the completed
            block sums); 1 ≤ n ≤ 32.
        queries, gains: [S, D]; gains None: queries are w̃ = queries ⊙ gains already.
    Returns:
        m [S, B, T] (non-differentiable), l [S, B, T], o [S, B, T, D] (unnormalised), all fp32.
    """
    op = "attnres_phase1"
    srcs, shape = check_sources(sources, op)
    D = shape[-1]
    check_tensor(op, "queries", queries, 2, srcs[0].device, ref="the sources")
    if queries.shape[0] == 0 or queries.shape[1] != D:
        raise ValueError(f"{op}: queries shape {tuple(queries.shape)} must be (S, D) with S >= 1, D = {D}")
    check_vector(op, "gains", gains, tuple(queries.shape), srcs[0].device)   # None: queries are w̃
    check_eps(op, eps=eps)
    return attnres_phase1_op(srcs, queries, gains, float(eps))


def _merge_forward(m, l, o, partial, query, gain, norm_weight, eps: float, norm_eps: float, out_dtype):
    M, D = l.numel(), o.shape[-1]
    wt = w_tilde(query, gain)
    l, o, m = l.contiguous(), o.contiguous(), m.contiguous()
    partial, norm_weight = dense(partial), dense(norm_weight)
    h = torch.empty(o.shape, dtype=out_dtype, device=o.device)
    y = torch.empty_like(h) if norm_weight is not None else None
    stat = torch.empty(3, M, dtype=torch.float32, device=o.device)
    launch = _row_launch(D)
    merge_fwd_kernel[(triton.cdiv(M, launch["BT"]),)](
        o, l, m, o if partial is None else partial, wt, h, h if y is None else y,
        wt if norm_weight is None else norm_weight, stat, M, D, eps, norm_eps,
        HAS_PARTIAL=partial is not None, HAS_NORM=norm_weight is not None, **launch)
    return h, y, stat


def _merge_backward(partial, query, gain, norm_weight, h, stat, dh, dy, eps: float):
    M, D = stat.shape[1], h.shape[-1]
    wt = w_tilde(query, gain)
    partial, norm_weight = dense(partial), dense(norm_weight)
    G = num_programs(M, h.device)
    do = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    dl = torch.empty(h.shape[:-1], dtype=torch.float32, device=h.device)
    dp = torch.empty_like(partial) if partial is not None else None
    dw_part = torch.empty(G, D, dtype=torch.float32, device=h.device)
    dnw_part = torch.empty(G, D, dtype=torch.float32, device=h.device)
    if dh is None and dy is None:
        dh = torch.zeros_like(h)
    merge_bwd_kernel[(G,)](
        h if partial is None else partial, wt, h, h if dh is None else dh.contiguous(),
        h if dy is None else dy.contiguous(), wt if norm_weight is None else norm_weight, stat,
        do, dl, do if dp is None else dp, dw_part, dnw_part, M, D, eps,
        HAS_PARTIAL=partial is not None, HAS_NORM=norm_weight is not None, HAS_DH=dh is not None,
        HAS_DY=dy is not None, **_row_launch(D))
    return dl, do, dp, dw_part.sum(0), dnw_part.sum(0) if norm_weight is not None else None


def _merge_reference(m, l, o, partial, wt, norm_weight, eps: float, norm_eps: float, out_dtype):
    from k3cli.ops.attnres.naive import naive_attnres_merge
    out = naive_attnres_merge(m, l, o, partial, wt, None, eps, norm_weight=norm_weight, norm_eps=norm_eps,
                              out_dtype=out_dtype)
    return (out, None) if norm_weight is None else out


@torch.library.custom_op("k3::attnres_merge", mutates_args=(), device_types=("cuda", "cpu"))
def attnres_merge_op(m: Tensor, l: Tensor, o: Tensor, partial: Tensor | None, query: Tensor, gain: Tensor | None,
                     norm_weight: Tensor | None, eps: float, norm_eps: float,
                     out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """`attnres_merge` on checked inputs: (h, y, stat); y an empty fp32 tensor without norm_weight, stat
    [3, B*T] fp32 (A, α_p, rstd of h) for the Triton backward, empty on the torch reference path."""
    if triton_runs(o.device):
        h, y, stat = _merge_forward(m, l, o, partial, query, gain, norm_weight, eps, norm_eps, out_dtype)
    else:
        (h, y), stat = _merge_reference(m, l, o, partial, w_tilde(query, gain), norm_weight, eps, norm_eps,
                                        out_dtype), None
    return (*(absent(o) if t is None else t.contiguous() for t in (h, y)), absent(o) if stat is None else stat)


@attnres_merge_op.register_fake
def _(m, l, o, partial, query, gain, norm_weight, eps, norm_eps, out_dtype):
    h = torch.empty(o.shape, dtype=out_dtype, device=o.device)
    y = absent(o) if norm_weight is None else torch.empty_like(h)
    stat = torch.empty(3, l.numel(), dtype=torch.float32, device=o.device) if triton_runs(o.device) else absent(o)
    return h, y, stat


@torch.library.custom_op("k3::attnres_merge_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def attnres_merge_bwd_op(m: Tensor | None, l: Tensor | None, o: Tensor | None, partial: Tensor | None,
                         query: Tensor, gain: Tensor | None, norm_weight: Tensor | None, h: Tensor,
                         stat: Tensor | None, dh: Tensor | None, dy: Tensor | None, eps: float, norm_eps: float,
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """k3::attnres_merge's backward: (dl, do, d partial, dw̃ [D], dnw [D]), fp32 but d partial (partial's
    dtype); d partial and dnw empty fp32 tensors without partial / norm_weight, dw̃ meaningless without
    partial (the merge then does not read w̃). The Triton backward reads h and stat, the torch reference
    m, l, o (the forward saves only what its own path needs: None for the others)."""
    if stat is not None:
        dl, do, dp, dwt, dnw = _merge_backward(partial, query, gain, norm_weight, h, stat, dh, dy, eps)
    else:
        dl, do, dp, dwt, dnw = reference_vjp(
            lambda l, o, p, w, nw: _merge_reference(m, l, o, p, w, nw, eps, norm_eps, h.dtype),
            (l, o, partial, w_tilde(query, gain), norm_weight), (dh, dy))
        dnw = None if dnw is None else dnw.float()
    return dl, do, absent(h) if dp is None else dp, dwt, absent(h) if dnw is None else dnw


@attnres_merge_bwd_op.register_fake
def _(m, l, o, partial, query, gain, norm_weight, h, stat, dh, dy, eps, norm_eps):
    D = h.shape[-1]
    vec = torch.empty(D, dtype=torch.float32, device=h.device)
    return (torch.empty(h.shape[:-1], dtype=torch.float32, device=h.device),
            torch.empty(h.shape, dtype=torch.float32, device=h.device),
            absent(h) if partial is None else torch.empty(partial.shape, dtype=partial.dtype, device=h.device),
            vec, absent(h) if norm_weight is None else torch.empty_like(vec))


def _merge_setup_context(ctx, inputs, output):
    m, l, o, partial, query, gain, norm_weight, eps, norm_eps, _ = inputs
    h, y, stat = output
    ctx.mark_non_differentiable(stat, *(() if norm_weight is not None else (y,)))
    ctx.set_materialize_grads(False)
    if triton_runs(o.device):
        m = l = o = None   # the kernels' backward reads h and stat: o is not kept alive
    else:
        stat = None
    ctx.save_for_backward(m, l, o, partial, query, gain, norm_weight, h, stat)
    ctx.eps, ctx.norm_eps = eps, norm_eps


def _merge_backward_autograd(ctx, dh, dy, _):
    m, l, o, partial, query, gain, norm_weight, h, stat = ctx.saved_tensors
    dy = dy if norm_weight is not None else None
    dl, do, dp, dwt, dnw = attnres_merge_bwd_op(m, l, o, partial, query, gain, norm_weight, h, stat, dh, dy,
                                                ctx.eps, ctx.norm_eps)
    # without a partial the merge does not depend on w̃
    dq, dg = w_tilde_grads(dwt, query, gain) if partial is not None else (None, None)
    return (None, dl, do, None if partial is None else dp, dq, dg,
            None if norm_weight is None else dnw.to(norm_weight.dtype), None, None, None)


attnres_merge_op.register_autograd(_merge_backward_autograd, setup_context=_merge_setup_context)


def attnres_merge(m: torch.Tensor, l: torch.Tensor, o: torch.Tensor, partial: torch.Tensor | None,
                  query: torch.Tensor, gain: torch.Tensor, eps: float = 1e-6,
                  norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                  out_dtype: torch.dtype | None = None):
    """Block form, phase 2: merge the block's partial sum into one query's phase-1 state and
    normalise (same math as `naive_attnres_merge`), through the custom op `k3::attnres_merge`.

    Args:
        m, l: [B, T] fp32; o: [B, T, D] fp32 — one query's slice of `attnres_phase1`'s output.
        partial: [B, T, D] or None (first sublayer of a block).
        query, gain: [D]; gain None: query is w̃ already.
        norm_weight: [D] or None; if given, also return y = RMSNorm(h) · norm_weight (eps norm_eps).
        out_dtype: dtype of h (and y); default o's dtype (fp32). Pass the model dtype to halve the write.
    Returns:
        h [B, T, D], and y if norm_weight is given.
    """
    op = "attnres_merge"
    f32 = (torch.float32,)   # attnres_phase1's outputs
    check_tensor(op, "o", o, 3, dtypes=f32)
    B, T, D = o.shape
    check_tensor(op, "m", m, 2, o.device, f32, (B, T), ref="o")
    check_tensor(op, "l", l, 2, o.device, f32, (B, T), ref="o")
    if 0 in o.shape:
        raise ValueError(f"{op}: o shape {tuple(o.shape)} is empty: B, T, D must be >= 1 (empty inputs are "
                         "rejected)")
    if D > MAX_D:
        raise ValueError(f"{op}: o: D = {D} > {MAX_D} (the row must fit in registers)")
    check_vector(op, "partial", partial, (B, T, D), o.device)
    if query is None:
        raise ValueError(f"{op}: query is required")
    for name, t in (("query", query), ("gain", gain), ("norm_weight", norm_weight)):
        check_vector(op, name, t, (D,), o.device)
    check_eps(op, eps=eps, norm_eps=norm_eps)
    out_dtype = o.dtype if out_dtype is None else out_dtype
    if out_dtype not in FLOATS:
        raise InputTypeError(f"{op}: out_dtype {out_dtype} not in [{dtype_names(FLOATS)}]")
    h, y, _ = attnres_merge_op(m, l, o, partial, query, gain, norm_weight, float(eps), float(norm_eps), out_dtype)
    return h if norm_weight is None else (h, y)
