"""Backward stages of the Triton chunked KDA (derivation in README.md, "Backward").

Given the forward's saved stage-1 buffers (W, U, Q e^Γ, K e^(γ-Γ), e^γ, Aqk, Tm, and the raw Mkk when
stored) and the per-chunk start states S_n and pseudo-values Vn (recomputed by re-running the forward
state scan with STORE_H, or kept by the forward with chunk.TUNING fwd_store_states):
  1. `_kda_bwd_state_kernel`, sequential over chunks in reverse per (value block, batch*head):
     dVn = Aqk^T dO + (K e^(γ-Γ)) dS',  dS = e^γ dS' + scale (Q e^Γ)^T dO - W^T dVn; stores dS' per
     chunk, dVn and dh0.
  2. The per-chunk gradients dq, dk, dv, dβ, dg. Default (chunk.TUNING bwd_subchunk): three launches —
     `_kda_bwd_vside_kernel` once per chunk for the key-independent V reductions,
     `_kda_bwd_scores_subchunk_kernel` for the intra-chunk score gradients per (chunk, 16-row
     sub-chunk, key block), then `_kda_bwd_kside_kernel` per key block, with dβ's Mkk term from the
     forward's stored Mkk. Alternatives: the same without the sub-chunk launch (bwd_split; the key side
     then loops over sub-chunks itself), or one `_kda_bwd_intra_kernel` per (chunk, batch*head, key
     block) redoing the V reductions in every key block. All end in `_bwd_key_side`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3cli.ops.kda.chunk_fwd import (
    STATE_CONFIGS,
    Intra,
    _anchored_factors,
    _dot,
    _dot_wide,
    _head_rows,
    _intra_scores,
    _load_chunk_qkg,
    _scan_start,
    _subchunk_rows,
    interpreting,
    pick_configs,
    prune_state_configs,
)
from k3cli.ops.launch import cdiv, fast_launch, next_pow2


@triton.jit
def _kda_bwd_state_step(qg, kd, eg, w, aqk, do, dh, dvn, b_ds, i_b, i_hv, i_bh, i_v, i_n, T, NT,
                        HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_t = (i_n * BT + o_t) < T
    row = (i_bh * NT * BT + i_n * BT + o_t).to(tl.int64)
    p_rk = row[:, None] * K + o_k[None, :]
    b_a = tl.load(aqk + row[:, None] * BT + o_t[None, :]).to(tl.float32)
    p_do = do + (i_b * T + i_n * BT + o_t).to(tl.int64)[:, None] * (HV * V) + i_hv * V + o_v[None, :]
    b_do = tl.load(p_do, mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32)
    p_dh = dh + (i_bh * NT + i_n).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    tl.store(p_dh, b_ds.to(dh.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
    b_kd = tl.load(kd + p_rk, mask=m_k[None, :], other=0.).to(tl.float32)
    b_dvn = _dot(tl.trans(b_a), b_do, PREC) + _dot(b_kd, b_ds, PREC)
    tl.store(dvn + row[:, None] * V + o_v[None, :], b_dvn, mask=m_v[None, :])
    b_eg = tl.load(eg + (i_bh * NT + i_n).to(tl.int64) * K + o_k, mask=m_k, other=0.)
    b_qg = tl.load(qg + p_rk, mask=m_k[None, :], other=0.).to(tl.float32)
    b_ds = b_ds * b_eg[:, None] + _dot(tl.trans(b_qg), b_do, PREC)
    b_w = tl.load(w + p_rk, mask=m_k[None, :], other=0.).to(tl.float32)
    return b_ds - _dot(tl.trans(b_w), b_dvn, PREC)


@fast_launch
@triton.autotune(
    configs=pick_configs(STATE_CONFIGS),
    key=["BK", "BT", "NBH", "V", "PREC"],
    prune_configs_by={"early_config_prune": prune_state_configs},
)
@triton.jit
def _kda_bwd_state_kernel(qg, kd, eg, w, aqk, do, dht, dh, dvn, dh0, T, NT, NBH,
                          HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, INTERPRET: tl.constexpr,
                          PREC: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    b_ds, p_state, m_kv = _scan_start(dht, i_bh, i_v, K, V, BK, BV, USE_DHT)
    if INTERPRET:
        # the interpreter cannot take a runtime bound in range() with numpy >= 2.4
        i_r = 0
        while i_r < NT:
            b_ds = _kda_bwd_state_step(qg, kd, eg, w, aqk, do, dh, dvn, b_ds, i_b, i_hv, i_bh, i_v,
                                       NT - 1 - i_r, T, NT, HV, K, V, BT, BK, BV, PREC)
            i_r += 1
    else:
        for i_r in range(NT):
            b_ds = _kda_bwd_state_step(qg, kd, eg, w, aqk, do, dh, dvn, b_ds, i_b, i_hv, i_bh, i_v,
                                       NT - 1 - i_r, T, NT, HV, K, V, BT, BK, BV, PREC)
    if STORE_DH0:
        tl.store(dh0 + p_state, b_ds, mask=m_kv)


@triton.jit
def _chunk_qkG(q, k, g, gc, i_b, i_h, i_hv, i_n, i_k, T, NT, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr, GC: tl.constexpr):
    """q, k [BT, BK] fp32 and Γ of chunk i_n, key columns [i_k*BK, (i_k+1)*BK): Γ read from the stored
    `gc` with GC, else the cumsum of g (`_load_chunk_qkg`)."""
    if GC:
        o_t = tl.arange(0, BT)
        o_k = i_k * BK + tl.arange(0, BK)
        b_q = _head_rows(q, i_b, i_h, i_n * BT + o_t, o_k, T, H, K)
        b_k = _head_rows(k, i_b, i_h, i_n * BT + o_t, o_k, T, H, K)
        row = ((i_b * HV + i_hv) * NT * BT + i_n * BT + o_t).to(tl.int64)
        b_G = tl.load(gc + row[:, None] * K + o_k[None, :], mask=(o_k < K)[None, :], other=0.)
    else:
        b_q, b_k, b_G = _load_chunk_qkg(q, k, g, i_b, i_h, i_hv, i_n, i_k, T, H, HV, K, BT, BK)
    return b_q, b_k, b_G


@triton.jit
def _bwd_key_side(q, k, g, mkk, dq, dk, dg, dbeta, b_dqg, b_dkd, b_dx, b_dgam, b_daqk, b_dakk, b_dbeta, b_beta,
                  scale, i_b, i_h, i_hv, i_n, i_k, slot, T, NT, NBT, H: tl.constexpr, HV: tl.constexpr,
                  K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                  STORED_MKK: tl.constexpr, dqs, dks, dgs, SCORES_DONE: tl.constexpr, gc, GC: tl.constexpr):
    """The key-block part of the per-chunk backward, after the reductions over V: from d(Q e^Γ) (b_dqg,
    unscaled), d(K e^(γ-Γ)) (b_dkd), minus d(β K e^Γ) (b_dx), Σ_v S dS (b_dgam), dO Vn^T (b_daqk) and
    dY Vn^T (b_dakk), both unmasked, to dq, dk, dg and this block's dβ share (stored in dβ slot `slot`);
    the Mkk term of dβ recomputes this key block's partial Mkk, or with STORED_MKK reads the forward's
    stored Mkk (`mkk`) in key block 0. SCORES_DONE: the intra-chunk score gradients were computed by
    `_kda_bwd_scores_subchunk_kernel` into dqs, dks, dgs ([B, T, HV, K] fp32) and are added here.
    q, k, Γ are loaded only here, to keep them out of the V loop's registers; with GC, Γ is read from the
    forward's stored Γ (`gc`, [B*HV, NT*BT, K] fp32; chunk.TUNING bwd_stored_gamma) instead of a cumsum."""
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_t = (i_n * BT + o_t) < T
    m_k = o_k < K
    tok = (i_b * T + i_n * BT + o_t).to(tl.int64)
    # raw-score gradients: Aqk = scale * Mqk (j <= i), Akk = β_i Mkk (j < i)
    if STORED_MKK:
        # the dβ term from the forward's stored Mkk (all key dims), in key block 0 only, before q, k,
        # Γ are loaded
        b_dakk = -tl.where(o_t[:, None] > o_t[None, :], b_dakk, 0.)
        p_tt = ((i_b * HV + i_hv) * NT * BT + i_n * BT + o_t).to(tl.int64)[:, None] * BT + o_t[None, :]
        b_dbeta += tl.sum(b_dakk * tl.load(mkk + p_tt, mask=(o_t[:, None] >= 0) & (i_k == 0), other=0.), 1)
    b_q, b_k, b_G = _chunk_qkG(q, k, g, gc, i_b, i_h, i_hv, i_n, i_k, T, NT, H, HV, K, BT, BK, GC)
    b_gam = tl.sum(tl.where(o_t[:, None] == BT - 1, b_G, 0.), 0)
    b_eg = tl.exp(b_G)
    b_kg = b_k * b_eg
    b_kd = b_k * tl.exp(b_gam[None, :] - b_G)
    b_dqg = b_dqg * scale
    # X = β K e^Γ
    b_dbeta -= tl.sum(b_dx * b_kg, 1)
    b_dkg = -b_dx * b_beta[:, None]
    b_dq = b_dqg * b_eg
    b_dk = b_dkg * b_eg + b_dkd * tl.exp(b_gam[None, :] - b_G)
    b_dG = b_dkg * b_kg - b_dkd * b_kd + b_dqg * b_q * b_eg
    b_dgam = b_dgam * tl.exp(b_gam) + tl.sum(b_dkd * b_kd, 0)

    if not STORED_MKK:
        # Mkk is a sum over key dims: this key block's share of dβ uses this block's partial Mkk
        _, b_mkk = _intra_scores(b_q, b_k, b_G, BT, BC, PREC)
    b_dmq = tl.where(o_t[:, None] >= o_t[None, :], b_daqk, 0.) * scale
    if not STORED_MKK:
        b_dakk = -tl.where(o_t[:, None] > o_t[None, :], b_dakk, 0.)
        b_dbeta += tl.sum(b_dakk * b_mkk, 1)
    b_dmk = b_dakk * b_beta[:, None]
    if SCORES_DONE:
        p_s = tok[:, None] * (HV * K) + i_hv * K + o_k[None, :]
        m_s = m_t[:, None] & m_k[None, :]
        b_dq += tl.load(dqs + p_s, mask=m_s, other=0.)
        b_dk += tl.load(dks + p_s, mask=m_s, other=0.)
        b_dG += tl.load(dgs + p_s, mask=m_s, other=0.)
    NA: tl.constexpr = 0 if SCORES_DONE else BT // BC   # the sub-chunk loop, unless done elsewhere
    for a in range(NA):
        e_q, e_k, m_a, m_up = _anchored_factors(b_G, a, BT, BC)
        b_qa = tl.where(m_a[:, None], b_q * e_q, 0.)
        b_ka = tl.where(m_a[:, None], b_k * e_q, 0.)
        b_kb = tl.where(m_up[:, None], b_k * e_k, 0.)
        b_dmq_a = tl.where(m_a[:, None], b_dmq, 0.)
        b_dmk_a = tl.where(m_a[:, None], b_dmk, 0.)
        # query-side (rows of sub-chunk a) and key-side (rows before its end) gradients
        b_dq_r = e_q * _dot_wide(b_dmq_a, b_kb, PREC)
        b_dk_r = e_q * _dot_wide(b_dmk_a, b_kb, PREC)
        b_dk_c = tl.where(m_up[:, None], e_k, 0.) * (_dot_wide(tl.trans(b_dmq_a), b_qa, PREC) + _dot_wide(tl.trans(b_dmk_a), b_ka, PREC))
        b_dq += b_dq_r
        b_dk += b_dk_r + b_dk_c
        b_dG += b_q * b_dq_r + b_k * (b_dk_r - b_dk_c)

    # g enters through Γ (inclusive cumsum) and γ = Γ[-1] = Σ g:  dg_i = Σ_{j>=i} dΓ_j + dγ
    b_dg = tl.cumsum(b_dG, 0, reverse=True) + b_dgam[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    p_hk = tok[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    tl.store(dq + p_hk, b_dq, mask=m_tk)
    tl.store(dk + p_hk, b_dk, mask=m_tk)
    tl.store(dg + p_hk, b_dg, mask=m_tk)
    tl.store(dbeta + slot.to(tl.int64) * NBT * HV + tok * HV + i_hv, b_dbeta, mask=m_t)


@fast_launch
@triton.jit
def _kda_bwd_intra_kernel(q, k, v, g, beta, tm, mkk, h, dh, do, vn, dvn, dq, dk, dv, dg, dbeta, scale, T, NT, NBT,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          PREC: tl.constexpr, STORED_MKK: tl.constexpr):
    i_n, i_bh, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    # the key-independent V-side terms (dv, the v part of dβ) come from the first key block only
    first = i_k == 0
    m_t = (i_n * BT + o_t) < T
    m_k = o_k < K
    tok = (i_b * T + i_n * BT + o_t).to(tl.int64)
    b_beta = tl.load(beta + tok * HV + i_hv, mask=m_t, other=0.).to(tl.float32)
    row = (i_bh * NT * BT + i_n * BT + o_t).to(tl.int64)
    b_tm = tl.load(tm + row[:, None] * BT + o_t[None, :])
    p_s = (i_bh * NT + i_n).to(tl.int64) * K * V + o_k[:, None] * V

    # reductions over V, one value block at a time
    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)      # d(Q e^Γ) without the scale
    b_dkd = tl.zeros([BT, BK], dtype=tl.float32)      # d(K e^(γ-Γ))
    b_dx = tl.zeros([BT, BK], dtype=tl.float32)       # minus d(β K e^Γ)
    b_dakk = tl.zeros([BT, BT], dtype=tl.float32)     # minus d(Akk)
    b_daqk = tl.zeros([BT, BT], dtype=tl.float32)     # d(Aqk)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    b_dgam = tl.zeros([BK], dtype=tl.float32)
    for i_v in range((V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_s = tl.load(h + p_s + o_v[None, :], mask=m_kv, other=0.).to(tl.float32)
        b_ds = tl.load(dh + p_s + o_v[None, :], mask=m_kv, other=0.).to(tl.float32)
        b_vn = tl.load(vn + row[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.)
        b_dvn = tl.load(dvn + row[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.)
        p_io = tok[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        b_do = tl.load(do + p_io, mask=m_tv, other=0.).to(tl.float32)
        b_v = tl.load(v + p_io, mask=m_tv, other=0.).to(tl.float32)
        b_dqg += _dot(b_do, tl.trans(b_s), PREC)
        b_dkd += _dot(b_vn, tl.trans(b_ds), PREC)
        b_daqk += _dot(b_do, tl.trans(b_vn), PREC)
        b_dgam += tl.sum(b_s * b_ds, 1)
        # Y = β V, X = β K e^Γ:  dY = Tm^T dVn,  dX = -dY S^T,  d(I + Akk) = -dY Vn^T
        b_dy = _dot(tl.trans(b_tm), b_dvn, PREC)
        b_dx += _dot(b_dy, tl.trans(b_s), PREC)
        b_dakk += _dot(b_dy, tl.trans(b_vn), PREC)
        b_dbeta += tl.where(first, tl.sum(b_dy * b_v, 1), 0.)
        tl.store(dv + p_io, (b_dy * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv & first)

    _bwd_key_side(q, k, g, mkk, dq, dk, dg, dbeta, b_dqg, b_dkd, b_dx, b_dgam, b_daqk, b_dakk, b_dbeta, b_beta,
                  scale, i_b, i_h, i_hv, i_n, i_k, i_k, T, NT, NBT, H, HV, K, BT, BC, BK, PREC, STORED_MKK,
                  dq, dq, dq, False, dq, False)


@fast_launch
@triton.jit
def _kda_bwd_vside_kernel(v, beta, tm, do, vn, dvn, dv, dy, dqk, dkk, dbeta_v, T, NT,
                          HV: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                          PREC: tl.constexpr):
    """Split backward, part 1, one program per (chunk, batch*head): the key-independent reductions
    over V that the single kernel repeats in every key block — dO Vn^T, dY = Tm^T dVn, dY Vn^T (stored
    unmasked, fp32), dv = β dY, the v part of dβ (into dbeta_v [B*T, HV]) — and dY itself for part 2."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    o_t = tl.arange(0, BT)
    m_t = (i_n * BT + o_t) < T
    tok = (i_b * T + i_n * BT + o_t).to(tl.int64)
    row = (i_bh * NT * BT + i_n * BT + o_t).to(tl.int64)
    b_beta = tl.load(beta + tok * HV + i_hv, mask=m_t, other=0.).to(tl.float32)
    b_tm = tl.load(tm + row[:, None] * BT + o_t[None, :])
    b_dqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dkk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_v in range((V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        p_rv = row[:, None] * V + o_v[None, :]
        b_vn = tl.load(vn + p_rv, mask=m_v[None, :], other=0.)
        b_dvn = tl.load(dvn + p_rv, mask=m_v[None, :], other=0.)
        p_io = tok[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        b_do = tl.load(do + p_io, mask=m_tv, other=0.).to(tl.float32)
        b_v = tl.load(v + p_io, mask=m_tv, other=0.).to(tl.float32)
        b_dqk += _dot(b_do, tl.trans(b_vn), PREC)
        b_dy = _dot(tl.trans(b_tm), b_dvn, PREC)
        b_dkk += _dot(b_dy, tl.trans(b_vn), PREC)
        b_dbeta += tl.sum(b_dy * b_v, 1)
        tl.store(dv + p_io, (b_dy * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        tl.store(dy + p_rv, b_dy, mask=m_v[None, :])
    p_tt = row[:, None] * BT + o_t[None, :]
    tl.store(dqk + p_tt, b_dqk)
    tl.store(dkk + p_tt, b_dkk)
    tl.store(dbeta_v + tok * HV + i_hv, b_dbeta, mask=m_t)


@fast_launch
@triton.jit
def _kda_bwd_kside_kernel(q, k, g, gc, beta, mkk, h, dh, do, vn, dy, dqk, dkk, dqs, dks, dgs, dq, dk, dg, dbeta,
                          scale, T, NT, NBT,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          PREC: tl.constexpr, STORED_MKK: tl.constexpr, GC: tl.constexpr,
                          SCORES_DONE: tl.constexpr):
    """Split backward, part 2, one program per (chunk, batch*head, key block): the key-dependent
    reductions over V (dO S^T, Vn dS^T, dY S^T, Σ S dS), then `_bwd_key_side` with part 1's dO Vn^T
    and dY Vn^T."""
    i_n, i_bh, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_t = (i_n * BT + o_t) < T
    m_k = o_k < K
    tok = (i_b * T + i_n * BT + o_t).to(tl.int64)
    row = (i_bh * NT * BT + i_n * BT + o_t).to(tl.int64)
    p_s = (i_bh * NT + i_n).to(tl.int64) * K * V + o_k[:, None] * V
    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkd = tl.zeros([BT, BK], dtype=tl.float32)
    b_dx = tl.zeros([BT, BK], dtype=tl.float32)
    b_dgam = tl.zeros([BK], dtype=tl.float32)
    for i_v in range((V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_kv = m_k[:, None] & m_v[None, :]
        b_s = tl.load(h + p_s + o_v[None, :], mask=m_kv, other=0.).to(tl.float32)
        b_ds = tl.load(dh + p_s + o_v[None, :], mask=m_kv, other=0.).to(tl.float32)
        p_rv = row[:, None] * V + o_v[None, :]
        b_vn = tl.load(vn + p_rv, mask=m_v[None, :], other=0.)
        b_dy = tl.load(dy + p_rv, mask=m_v[None, :], other=0.)
        b_do = tl.load(do + tok[:, None] * (HV * V) + i_hv * V + o_v[None, :],
                       mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32)
        b_dqg += _dot(b_do, tl.trans(b_s), PREC)
        b_dkd += _dot(b_vn, tl.trans(b_ds), PREC)
        b_dx += _dot(b_dy, tl.trans(b_s), PREC)
        b_dgam += tl.sum(b_s * b_ds, 1)
    p_tt = row[:, None] * BT + o_t[None, :]
    b_daqk = tl.load(dqk + p_tt)
    b_dakk = tl.load(dkk + p_tt)
    b_beta = tl.load(beta + tok * HV + i_hv, mask=m_t, other=0.).to(tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    _bwd_key_side(q, k, g, mkk, dq, dk, dg, dbeta, b_dqg, b_dkd, b_dx, b_dgam, b_daqk, b_dakk, b_dbeta, b_beta,
                  scale, i_b, i_h, i_hv, i_n, i_k, i_k, T, NT, NBT, H, HV, K, BT, BC, BK, PREC, STORED_MKK,
                  dqs, dks, dgs, SCORES_DONE, gc, GC)


@triton.jit
def _dm_blocks(dqk, dkk, p_blk, i_row, j_col, b_beta_rows, scale):
    """Blocks of the masked score gradients: dMq = scale·dAqk (j <= i) and dMk = -β_i dAkk (j < i)
    from the unmasked dO Vn^T (dqk) and dY Vn^T (dkk); the masks change only a diagonal block."""
    b_dmq = tl.load(dqk + p_blk)
    b_dmk = tl.load(dkk + p_blk)
    b_dmq = tl.where(i_row[:, None] >= j_col[None, :], b_dmq, 0.) * scale
    b_dmk = -tl.where(i_row[:, None] > j_col[None, :], b_dmk, 0.) * b_beta_rows[:, None]
    return b_dmq, b_dmk


@fast_launch
@triton.jit
def _kda_bwd_scores_subchunk_kernel(q, k, g, gc, beta, dqk, dkk, dqs, dks, dgs, scale, T, NT,
                                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                                    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                                    GC: tl.constexpr):
    """The intra-chunk score gradients of the per-chunk backward, one program per (chunk, sub-chunk b,
    batch*value-head, key block), [BC, BK] tiles: for the rows of b
      as queries (key sub-chunks c <= b, anchor Γ at b's first row):
        dq_r = e_q Σ_c dMq[b, c] (K_c e_k),   dk_r = e_q Σ_c dMk[b, c] (K_c e_k)
      as keys (query sub-chunks a >= b, anchor Γ at a's first row):
        dk_c = Σ_a e^(Γ_a0 - Γ_b) ⊙ (dMq[a, b]^T (Q_a e_q^a) + dMk[a, b]^T (K_a e_q^a))
    stored as dqs = dq_r, dks = dk_r + dk_c, dgs = q ⊙ dq_r + k ⊙ (dk_r - dk_c) (dΓ before its reverse
    cumsum), which `_kda_bwd_kside_kernel` (SCORES_DONE) adds — the same sums `_bwd_key_side`'s
    sub-chunk loop forms over masked [BT, BK] tiles. GC: Γ read from the forward's stored Γ (`gc`) instead
    of prefix sums and cumsums of g."""
    i_nb, i_bh, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NC: tl.constexpr = BT // BC
    i_n, b = i_nb // NC, i_nb % NC
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_c = tl.arange(0, BC)
    base = (i_bh * NT * BT + i_n * BT).to(tl.int64)
    o_kk = i_k * BK + tl.arange(0, BK)
    # Γ of sub-chunk b's rows (prefix from the earlier sub-chunks, or stored) and its anchor
    b_qb, b_kb, b_gb = _subchunk_rows(q, k, g, i_b, i_h, i_hv, i_n, b, i_k, T, H, HV, K, BT, BC, BK)
    if GC:
        b_Gb = tl.load(gc + (base + b * BC + o_c)[:, None] * K + o_kk[None, :], mask=(o_kk < K)[None, :], other=0.)
    else:
        b_pre = tl.zeros([BK], dtype=tl.float32)
        for c in tl.static_range(NC):
            if c < b:
                _, _, b_gc = _subchunk_rows(q, k, g, i_b, i_h, i_hv, i_n, c, i_k, T, H, HV, K, BT, BC, BK)
                b_pre += tl.sum(b_gc, 0)
        b_Gb = b_pre[None, :] + tl.cumsum(b_gb, 0)
    b_anc_b = tl.sum(tl.where(o_c[:, None] == 0, b_Gb, 0.), 0)
    i_rb = b * BC + o_c
    m_b = (i_n * BT + i_rb) < T
    b_beta_b = tl.load(beta + (i_b * T + i_n * BT + i_rb).to(tl.int64) * HV + i_hv, mask=m_b, other=0.)
    b_beta_b = b_beta_b.to(tl.float32)
    acc_q = tl.zeros([BC, BK], dtype=tl.float32)
    acc_kr = tl.zeros([BC, BK], dtype=tl.float32)
    acc_kc = tl.zeros([BC, BK], dtype=tl.float32)
    b_run = tl.zeros([BK], dtype=tl.float32)
    for c in tl.static_range(NC):
        b_qc, b_kc, b_gc = _subchunk_rows(q, k, g, i_b, i_h, i_hv, i_n, c, i_k, T, H, HV, K, BT, BC, BK)
        if GC:
            b_Gc = tl.load(gc + (base + c * BC + o_c)[:, None] * K + o_kk[None, :], mask=(o_kk < K)[None, :],
                           other=0.)
        else:
            b_Gc = b_run[None, :] + tl.cumsum(b_gc, 0)
            b_run += tl.sum(b_gc, 0)
        i_rc = c * BC + o_c
        if c <= b:
            # rows of b as queries against the keys of sub-chunk c
            b_dmq, b_dmk = _dm_blocks(dqk, dkk, (base + i_rb)[:, None] * BT + i_rc[None, :], i_rb, i_rc,
                                      b_beta_b, scale)
            b_ke = b_kc * tl.exp(b_anc_b[None, :] - b_Gc)
            acc_q += _dot_wide(b_dmq, b_ke, PREC)
            acc_kr += _dot_wide(b_dmk, b_ke, PREC)
        if c >= b:
            # rows of b as keys for the queries of sub-chunk c
            m_c = (i_n * BT + i_rc) < T
            b_beta_c = tl.load(beta + (i_b * T + i_n * BT + i_rc).to(tl.int64) * HV + i_hv, mask=m_c, other=0.)
            b_dmq, b_dmk = _dm_blocks(dqk, dkk, (base + i_rc)[:, None] * BT + i_rb[None, :], i_rc, i_rb,
                                      b_beta_c.to(tl.float32), scale)
            b_anc_c = tl.sum(tl.where(o_c[:, None] == 0, b_Gc, 0.), 0)
            e_qc = tl.exp(b_Gc - b_anc_c[None, :])
            b_t = _dot_wide(tl.trans(b_dmq), b_qc * e_qc, PREC) + \
                _dot_wide(tl.trans(b_dmk), b_kc * e_qc, PREC)
            acc_kc += tl.exp(b_anc_c[None, :] - b_Gb) * b_t
    e_qb = tl.exp(b_Gb - b_anc_b[None, :])
    b_dq_r = e_qb * acc_q
    b_dk_r = e_qb * acc_kr
    o_k = i_k * BK + tl.arange(0, BK)
    m_bk = m_b[:, None] & (o_k < K)[None, :]
    p_hk = (i_b * T + i_n * BT + i_rb).to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    tl.store(dqs + p_hk, b_dq_r, mask=m_bk)
    tl.store(dks + p_hk, b_dk_r + acc_kc, mask=m_bk)
    tl.store(dgs + p_hk, b_qb * b_dq_r + b_kb * (b_dk_r - acc_kc), mask=m_bk)


def kda_bwd_state(it: Intra, do, dht, B: int, T: int, HV: int, chunk_size: int, need_dh0: bool,
                  dh_dtype: torch.dtype = torch.float32, precision: str = "tf32"):
    """Launch the reverse scan. Returns dh [B*HV, NT, K, V] (grad of each chunk's END state),
    dVn [B*HV, Tp, V] fp32, dh0 [B, HV, K, V] fp32 or None."""
    K, V = it.w.shape[-1], it.u.shape[-1]
    BT = chunk_size
    NT = cdiv(T, BT)
    BK = max(16, next_pow2(K))
    dev = do.device
    dh = torch.empty(B * HV, NT, K, V, device=dev, dtype=dh_dtype)
    dvn = torch.empty(B * HV, NT * BT, V, device=dev, dtype=torch.float32)
    dh0 = torch.empty(B, HV, K, V, device=dev, dtype=torch.float32) if need_dh0 else None
    _kda_bwd_state_kernel[lambda meta: (cdiv(V, meta["BV"]), B * HV)](
        it.qg, it.kd, it.eg, it.w, it.aqk, do, dht, dh, dvn, dh0, T, NT, next_pow2(B * HV),
        HV=HV, K=K, V=V, BT=BT, BK=BK, USE_DHT=dht is not None, STORE_DH0=need_dh0, INTERPRET=interpreting(do),
        PREC=precision)
    return dh, dvn, dh0


def kda_bwd_intra(q, k, v, g, beta, tm, mkk, h, dh, do, vn, dvn, scale: float, chunk_size: int,
                  BK: int | None = None, BV: int | None = None, num_warps: int = 8, precision: str = "tf32",
                  split: bool = False, subchunk: bool = False, subchunk_warps: int = 4,
                  grad_dtype: torch.dtype = torch.float32, gc: torch.Tensor | None = None,
                  dg_dtype: torch.dtype = torch.float32, subchunk_key_block: int = 32):
    """Launch the per-chunk gradient kernel(s). Returns dq, dk [B, T, HV, K] fp32 (per value head),
    dv [B, T, HV, V] (v.dtype), dg [B, T, HV, K] fp32, dbeta [B, T, HV] fp32. `split`: two launches
    (`_kda_bwd_vside_kernel` once per chunk, then `_kda_bwd_kside_kernel` per key block) instead of
    one kernel that redoes the key-independent V reductions in every key block. `mkk`: the forward's
    stored Mkk or None. `subchunk` (with `split` and a stored `mkk`): the intra-chunk score gradients
    come from `_kda_bwd_scores_subchunk_kernel` (`subchunk_warps` warps, key blocks of
    `subchunk_key_block` columns) between the two launches.
    `grad_dtype`: the dtype dq, dk are stored in (accumulation stays fp32): the inputs' dtype when no GVA
    group sum follows, which saves a conversion pass over each; `dg_dtype` likewise for dg (g's dtype:
    dg is per value head, and an fp32 g keeps an fp32 dg). `gc`: the forward's stored Γ
    ([B*HV, NT*BT, K] fp32), read by the split backward's kernels instead of cumsums of g."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    NT = cdiv(T, BT)
    # key blocks of <= 64 columns: at K = 128 one program holding all key columns spilled ~4 KB of
    # registers per thread (ptxas -v, sm_90a) and took 6.4 ms at B8 T2048 H16 (run 2)
    BK = BK or min(64, max(16, next_pow2(K)))
    NK = cdiv(K, BK)
    # BV 32 at K = 128 spills less (ptxas) but ran slower on the H200 (4.07 vs 3.86 ms, runs 4 / 3)
    BV = BV or min(64, max(16, next_pow2(V)))
    dev = q.device
    dq = torch.empty(B, T, HV, K, device=dev, dtype=grad_dtype)
    dk = torch.empty_like(dq)
    dg = torch.empty(B, T, HV, K, device=dev, dtype=dg_dtype)
    dv = torch.empty_like(v)
    if split:
        dbeta = torch.empty(NK + 1, B, T, HV, device=dev, dtype=torch.float32)
        Tp = NT * BT
        dy = torch.empty(B * HV, Tp, V, device=dev, dtype=torch.float32)
        dqk = torch.empty(B * HV, Tp, BT, device=dev, dtype=torch.float32)
        dkk = torch.empty_like(dqk)
        _kda_bwd_vside_kernel[(NT, B * HV)](
            v, beta, tm, do, vn, dvn, dv, dy, dqk, dkk, dbeta[NK], T, NT, HV=HV, V=V, BT=BT, BV=BV,
            PREC=precision, num_warps=num_warps, num_stages=1)
        scores_done = subchunk and mkk is not None
        if scores_done:
            # the score gradients per (chunk, 16-row sub-chunk, key block) in [16, BKS] tiles
            BC = min(16, BT)
            BKS = min(max(16, next_pow2(K)), subchunk_key_block)
            dqs, dks, dgs = (torch.empty(B, T, HV, K, device=dev, dtype=torch.float32) for _ in range(3))
            _kda_bwd_scores_subchunk_kernel[(NT * (BT // BC), B * HV, cdiv(K, BKS))](
                q, k, g, dq if gc is None else gc, beta, dqk, dkk, dqs, dks, dgs, scale, T, NT, H=H, HV=HV, K=K,
                BT=BT, BC=BC, BK=BKS, PREC=precision, GC=gc is not None, num_warps=subchunk_warps, num_stages=1)
        else:
            dqs = dks = dgs = dq   # unused
        _kda_bwd_kside_kernel[(NT, B * HV, NK)](
            q, k, g, dq if gc is None else gc, beta, tm if mkk is None else mkk, h, dh, do, vn, dy, dqk, dkk, dqs, dks, dgs, dq, dk, dg, dbeta,
            scale, T, NT, B * T, H=H, HV=HV, K=K, V=V, BT=BT, BC=min(16, BT), BK=BK, BV=BV, PREC=precision,
            STORED_MKK=mkk is not None, SCORES_DONE=scores_done, GC=gc is not None, num_warps=num_warps,
            num_stages=1)
        return dq, dk, dv, dg, dbeta.sum(0)
    dbeta = torch.empty(NK, B, T, HV, device=dev, dtype=torch.float32)
    _kda_bwd_intra_kernel[(NT, B * HV, NK)](
        q, k, v, g, beta, tm, tm if mkk is None else mkk, h, dh, do, vn, dvn, dq, dk, dv, dg, dbeta, scale, T, NT,
        B * T, H=H, HV=HV, K=K,
        V=V, BT=BT, BC=min(16, BT), BK=BK, BV=BV, PREC=precision, STORED_MKK=mkk is not None,
        num_warps=num_warps, num_stages=1)
    return dq, dk, dv, dg, dbeta.sum(0)
