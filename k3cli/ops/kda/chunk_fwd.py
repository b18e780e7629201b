"""Forward stages of the Triton chunked KDA (SPEC §2.2; derivation in README.md).

Two launches:
  1. `_kda_fwd_intra_kernel`, one program per (chunk, batch*value-head): Γ = cumsum g, the anchored
     intra-chunk scores Aqk and Akk, Tm = (I + Akk)^-1 by fp32 forward substitution, W and U.
  2. `_kda_fwd_state_kernel`, one program per (value block, batch*value-head), sequential over
     chunks: Vn = U - W S, O = scale (Q e^Γ) S + Aqk Vn, S <- e^γ S + (K e^(γ-Γ))^T Vn.
Intermediates live in a [B*HV, NT*BT, ...] layout padded to whole chunks (padded rows are zeros).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting(x: torch.Tensor | None = None) -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" or (x is not None and x.device.type != "cuda")


def pick_configs(gpu_configs: list[triton.Config]) -> list[triton.Config]:
    """The interpreter gets exactly one config (autotuning there is meaningless and slow)."""
    return gpu_configs[:1] if os.environ.get("TRITON_INTERPRET") == "1" else gpu_configs


# sequential state scans: value-block width trades parallelism (B*HV*V/BV programs) for per-program work
STATE_CONFIGS = [triton.Config({"BV": bv}, num_warps=nw, num_stages=2) for bv, nw in ((64, 8), (32, 4), (32, 8), (64, 4))]


def prune_state_configs(configs, named_args, **kwargs):
    """Clamp BV to the padded value width (V = 16 needs no 64-wide blocks) and drop duplicates."""
    V = named_args.get("V", kwargs.get("V"))
    cap = max(16, triton.next_power_of_2(V))
    out, seen = [], set()
    for c in configs:
        key = (min(c.kwargs["BV"], cap), c.num_warps, c.num_stages)
        if key not in seen:
            seen.add(key)
            out.append(triton.Config({"BV": key[0]}, num_warps=key[1], num_stages=key[2]))
    return out


@triton.jit
def _anchored_factors(b_G, a, BT: tl.constexpr, BC: tl.constexpr):
    """For query sub-chunk a (rows [a*BC, (a+1)*BC)), anchored at its FIRST row c = Γ[a*BC]:
    e_q = exp(Γ_i - c) on the sub-chunk's rows (<= 1), e_k = exp(c - Γ_j) on rows j < (a+1)*BC
    (<= 1 before the sub-chunk, <= exp(15*|g|max) inside it); other rows get exp(0)."""
    o_t = tl.arange(0, BT)
    b_c = tl.sum(tl.where(o_t[:, None] == a * BC, b_G, 0.), 0)
    m_a = (o_t >= a * BC) & (o_t < (a + 1) * BC)
    m_up = o_t < (a + 1) * BC
    e_q = tl.exp(tl.where(m_a[:, None], b_G - b_c[None, :], 0.))
    e_k = tl.exp(tl.where(m_up[:, None], b_c[None, :] - b_G, 0.))
    return e_q, e_k, m_a, m_up


@triton.jit
def _intra_scores(b_q, b_k, b_G, BT: tl.constexpr, BC: tl.constexpr):
    """Mqk[i,j] = Σ_d q_id k_jd exp(Γ_id - Γ_jd), Mkk likewise with k for q; j <= i (unmasked above)."""
    b_mqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_mkk = tl.zeros([BT, BT], dtype=tl.float32)
    for a in range(BT // BC):
        e_q, e_k, m_a, m_up = _anchored_factors(b_G, a, BT, BC)
        b_qa = tl.where(m_a[:, None], b_q * e_q, 0.)
        b_ka = tl.where(m_a[:, None], b_k * e_q, 0.)
        b_kb = tl.where(m_up[:, None], b_k * e_k, 0.)
        b_mqk += tl.dot(b_qa, tl.trans(b_kb))
        b_mkk += tl.dot(b_ka, tl.trans(b_kb))
    return b_mqk, b_mkk


@triton.jit
def _blk(p, i, j, BT: tl.constexpr, BC: tl.constexpr):
    """Pointers to block (i, j) of size BC x BC inside a row-major [BT, BT] matrix at p."""
    o_c = tl.arange(0, BC)
    return p + (i * BC + o_c)[:, None] * BT + (j * BC + o_c)[None, :]


@triton.jit
def _diag_block_inverse(p, BT: tl.constexpr, BC: tl.constexpr):
    """In place: every BC x BC diagonal block A_ii of the strictly lower matrix at p becomes
    (I + A_ii)^-1, by fp32 forward substitution on all blocks at once (one row per step):
    X[r,:] = e_r - Σ_{m<r} A[r,m] X[m,:]."""
    NS: tl.constexpr = BT // BC
    o_s = tl.arange(0, NS)
    o_c = tl.arange(0, BC)
    ptr = p + (o_s[:, None, None] * BC + o_c[None, :, None]) * BT + o_s[:, None, None] * BC + o_c[None, None, :]
    b_a = tl.load(ptr)                                                     # (NS, BC, BC)
    b_x = tl.zeros([NS, BC, BC], dtype=tl.float32)
    for r in tl.static_range(BC):
        b_ar = tl.sum(tl.where(o_c[None, :, None] == r, b_a, 0.), 1)       # (NS, BC): row r
        b_xr = tl.where(o_c[None, :] == r, 1., 0.) - tl.sum(b_ar[:, :, None] * b_x, 1)
        b_x = tl.where(o_c[None, :, None] == r, b_xr[:, None, :], b_x)
    tl.store(ptr, b_x)


@triton.jit
def _mm(a, b):
    # block products of the solve stay in full fp32 (SPEC §2.2 numerics)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _unit_lower_inverse(p, b_akk, BT: tl.constexpr, BC: tl.constexpr):
    """(I + Akk)^-1 for strictly lower Akk [BT, BT], using p (this chunk's [BT, BT] slot of the Tm
    buffer) as scratch: invert the BC x BC diagonal blocks, then block forward substitution
    T_ij = -T_ii Σ_{j<=m<i} A_im T_mj. Returns the full inverse (also left at p)."""
    NS: tl.constexpr = BT // BC
    o_t = tl.arange(0, BT)
    tl.store(p + o_t[:, None] * BT + o_t[None, :], b_akk)
    tl.debug_barrier()
    _diag_block_inverse(p, BT, BC)
    tl.debug_barrier()
    if NS > 1:
        d0 = tl.load(_blk(p, 0, 0, BT, BC))
        d1 = tl.load(_blk(p, 1, 1, BT, BC))
        a10 = tl.load(_blk(p, 1, 0, BT, BC))
        t10 = -_mm(d1, _mm(a10, d0))
        tl.store(_blk(p, 1, 0, BT, BC), t10)
        if NS > 2:
            d2 = tl.load(_blk(p, 2, 2, BT, BC))
            d3 = tl.load(_blk(p, 3, 3, BT, BC))
            a20 = tl.load(_blk(p, 2, 0, BT, BC))
            a21 = tl.load(_blk(p, 2, 1, BT, BC))
            a30 = tl.load(_blk(p, 3, 0, BT, BC))
            a31 = tl.load(_blk(p, 3, 1, BT, BC))
            a32 = tl.load(_blk(p, 3, 2, BT, BC))
            t21 = -_mm(d2, _mm(a21, d1))
            t20 = -_mm(d2, _mm(a20, d0) + _mm(a21, t10))
            t32 = -_mm(d3, _mm(a32, d2))
            t31 = -_mm(d3, _mm(a31, d1) + _mm(a32, t21))
            t30 = -_mm(d3, _mm(a30, d0) + _mm(a31, t10) + _mm(a32, t20))
            tl.store(_blk(p, 2, 0, BT, BC), t20)
            tl.store(_blk(p, 2, 1, BT, BC), t21)
            tl.store(_blk(p, 3, 0, BT, BC), t30)
            tl.store(_blk(p, 3, 1, BT, BC), t31)
            tl.store(_blk(p, 3, 2, BT, BC), t32)
        tl.debug_barrier()
    return tl.load(p + o_t[:, None] * BT + o_t[None, :])


@triton.jit
def _load_chunk_qkg(q, k, g, i_b, i_h, i_hv, i_n, T, H: tl.constexpr, HV: tl.constexpr,
                    K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """q, k [BT, BK] fp32 of head i_h and Γ = chunk-local cumsum of g [BT, BK] fp32 of head i_hv."""
    o_t = i_n * BT + tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m = (o_t < T)[:, None] & (o_k < K)[None, :]
    row_qk = (i_b * T + o_t).to(tl.int64) * (H * K) + i_h * K
    row_g = (i_b * T + o_t).to(tl.int64) * (HV * K) + i_hv * K
    b_q = tl.load(q + row_qk[:, None] + o_k[None, :], mask=m, other=0.).to(tl.float32)
    b_k = tl.load(k + row_qk[:, None] + o_k[None, :], mask=m, other=0.).to(tl.float32)
    b_g = tl.load(g + row_g[:, None] + o_k[None, :], mask=m, other=0.).to(tl.float32)
    return b_q, b_k, tl.cumsum(b_g, 0)


@triton.jit
def _kda_fwd_intra_kernel(q, k, v, g, beta, w, u, aqk, tm, scale, T, NT,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_t = (i_n * BT + o_t) < T
    b_q, b_k, b_G = _load_chunk_qkg(q, k, g, i_b, i_h, i_hv, i_n, T, H, HV, K, BT, BK)
    b_beta = tl.load(beta + (i_b * T + i_n * BT + o_t).to(tl.int64) * HV + i_hv, mask=m_t, other=0.)
    b_beta = b_beta.to(tl.float32)

    b_mqk, b_mkk = _intra_scores(b_q, b_k, b_G, BT, BC)
    b_aqk = tl.where(o_t[:, None] >= o_t[None, :], b_mqk, 0.) * scale
    b_akk = tl.where(o_t[:, None] > o_t[None, :], b_mkk, 0.) * b_beta[:, None]
    # buffers are [B*HV, NT*BT, X]; rows past T hold zeros computed from masked loads
    row = (i_bh * NT * BT + i_n * BT + o_t).to(tl.int64)
    tl.store(aqk + row[:, None] * BT + o_t[None, :], b_aqk)
    b_tm = _unit_lower_inverse(tm + (i_bh * NT * BT + i_n * BT).to(tl.int64) * BT, b_akk, BT, BC)
    b_w = tl.dot(b_tm, b_k * tl.exp(b_G) * b_beta[:, None])
    tl.store(w + row[:, None] * K + o_k[None, :], b_w.to(w.dtype.element_ty), mask=(o_k < K)[None, :])
    for i_v in range((V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_v = v + (i_b * T + i_n * BT + o_t).to(tl.int64)[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        b_v = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32)
        b_u = tl.dot(b_tm, b_v * b_beta[:, None])
        tl.store(u + row[:, None] * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=m_v[None, :])


@triton.jit
def _kda_fwd_state_step(q, k, g, w, u, aqk, o, h, vn, b_s, scale, i_b, i_h, i_hv, i_bh, i_v, i_n, T, NT,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        STORE_O: tl.constexpr, STORE_H: tl.constexpr):
    """One chunk of the state scan: emit O (and S, Vn for the backward), return the next S."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    b_q, b_k, b_G = _load_chunk_qkg(q, k, g, i_b, i_h, i_hv, i_n, T, H, HV, K, BT, BK)
    b_gam = tl.sum(tl.where(o_t[:, None] == BT - 1, b_G, 0.), 0)
    row = (i_bh * NT * BT + i_n * BT + o_t).to(tl.int64)
    b_w = tl.load(w + row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.).to(tl.float32)
    b_u = tl.load(u + row[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.).to(tl.float32)
    if STORE_H:
        p_h = h + (i_bh * NT + i_n).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_h, b_s, mask=m_k[:, None] & m_v[None, :])
    b_vn = b_u - tl.dot(b_w, b_s)
    if STORE_H:
        tl.store(vn + row[:, None] * V + o_v[None, :], b_vn, mask=m_v[None, :])
    if STORE_O:
        b_a = tl.load(aqk + row[:, None] * BT + o_t[None, :])
        b_o = tl.dot(b_q * tl.exp(b_G) * scale, b_s) + tl.dot(b_a, b_vn)
        m_t = (i_n * BT + o_t) < T
        p_o = o + (i_b * T + i_n * BT + o_t).to(tl.int64)[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
    b_kd = b_k * tl.exp(b_gam[None, :] - b_G)
    return b_s * tl.exp(b_gam)[:, None] + tl.dot(tl.trans(b_kd), b_vn)


@triton.autotune(
    configs=pick_configs(STATE_CONFIGS),
    key=["BK", "BT", "NBH", "V"],
    prune_configs_by={"early_config_prune": prune_state_configs},
)
@triton.jit
def _kda_fwd_state_kernel(q, k, g, w, u, aqk, o, h0, ht, h, vn, scale, T, NT, NBH,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_O: tl.constexpr,
                          STORE_H: tl.constexpr, INTERPRET: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    p_state = i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_s += tl.load(h0 + p_state, mask=m_kv, other=0.)
    if INTERPRET:
        # the interpreter cannot take a runtime bound in range() with numpy >= 2.4
        i_n = 0
        while i_n < NT:
            b_s = _kda_fwd_state_step(q, k, g, w, u, aqk, o, h, vn, b_s, scale, i_b, i_h, i_hv, i_bh, i_v,
                                      i_n, T, NT, H, HV, K, V, BT, BK, BV, STORE_O, STORE_H)
            i_n += 1
    else:
        for i_n in range(NT):
            b_s = _kda_fwd_state_step(q, k, g, w, u, aqk, o, h, vn, b_s, scale, i_b, i_h, i_hv, i_bh, i_v,
                                      i_n, T, NT, H, HV, K, V, BT, BK, BV, STORE_O, STORE_H)
    if STORE_HT:
        tl.store(ht + p_state, b_s, mask=m_kv)


def kda_fwd_intra(q, k, v, g, beta, scale: float, chunk_size: int, inter_dtype: torch.dtype):
    """Launch stage 1. Returns W [B*HV, Tp, K], U [B*HV, Tp, V], Aqk and Tm [B*HV, Tp, BT] (fp32)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    NT = triton.cdiv(T, BT)
    BK = max(16, triton.next_power_of_2(K))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    w = torch.empty(B * HV, NT * BT, K, device=q.device, dtype=inter_dtype)
    u = torch.empty(B * HV, NT * BT, V, device=q.device, dtype=inter_dtype)
    aqk = torch.empty(B * HV, NT * BT, BT, device=q.device, dtype=torch.float32)
    tm = torch.empty_like(aqk)
    _kda_fwd_intra_kernel[(NT, B * HV)](
        q, k, v, g, beta, w, u, aqk, tm, scale, T, NT, H=H, HV=HV, K=K, V=V, BT=BT, BC=min(16, BT),
        BK=BK, BV=BV, num_warps=8, num_stages=1)
    return w, u, aqk, tm


def kda_fwd_state(q, k, g, w, u, aqk, scale: float, chunk_size: int, initial_state, out_dtype,
                  output_final_state: bool, store_o: bool = True, store_h: bool = False):
    """Launch stage 2. Returns (o [B,T,HV,V] or None, final state or None, h [B*HV,NT,K,V] or None,
    Vn [B*HV,Tp,V] fp32 or None)."""
    B, T, H, K = q.shape
    HV = g.shape[2]
    V = u.shape[-1]
    BT = chunk_size
    NT = triton.cdiv(T, BT)
    BK = max(16, triton.next_power_of_2(K))
    dev = q.device
    o = torch.empty(B, T, HV, V, device=dev, dtype=out_dtype) if store_o else None
    ht = torch.empty(B, HV, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    h = torch.empty(B * HV, NT, K, V, device=dev, dtype=torch.float32) if store_h else None
    vn = torch.empty(B * HV, NT * BT, V, device=dev, dtype=torch.float32) if store_h else None
    _kda_fwd_state_kernel[lambda meta: (triton.cdiv(V, meta["BV"]), B * HV)](
        q, k, g, w, u, aqk, o, initial_state, ht, h, vn, scale, T, NT, triton.next_power_of_2(B * HV),
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK,
        USE_H0=initial_state is not None, STORE_HT=output_final_state, STORE_O=store_o, STORE_H=store_h,
        INTERPRET=interpreting(q))
    return o, ht, h, vn
