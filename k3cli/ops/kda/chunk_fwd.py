"""Forward stages of the Triton chunked KDA (SPEC §2.2; derivation in README.md).

Four launches by default (chunk.TUNING fwd_scores "sub"):
  1a. `_kda_fwd_gamma_kernel`, per (chunk, batch*value-head, 64 key columns): Γ = chunk-local cumsum g
     into an fp32 buffer, the gated operands Q e^Γ, K e^(γ-Γ), e^γ, and β K e^Γ into the W buffer (KG);
  1b. `_kda_fwd_scores_sub_kernel`, per (chunk x 16-row query sub-chunk, batch*value-head), or for K > 64
     per (chunk x 16 x 16 block pair, batch*value-head) (PER_PAIR): the anchored intra-chunk score blocks
     of Aqk and Akk from that Γ;
  1c. `_kda_fwd_intra_kblock_kernel` PART 4: Tm = (I + Akk)^-1 by fp32 forward substitution, W (in place
     of β K e^Γ) and U.
     Alternatives: `_kda_fwd_scores_pairs_kernel` for 1a-1b ("pairs"), or `_kda_fwd_intra_kernel` /
     `_kda_fwd_intra_kblock_kernel` doing all of stage 1 per chunk ("chunk"), in one launch or three.
  2. `_kda_fwd_state_kernel`, one program per (value block, batch*value-head), sequential over
     chunks: Vn = U - W S, O = scale (Q e^Γ) S + Aqk Vn, S <- e^γ S + (K e^(γ-Γ))^T Vn.
Intermediates live in a [B*HV, NT*BT, ...] layout padded to whole chunks (padded rows are zeros).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from k3cli.ops.launch import cdiv, fast_launch, next_pow2


def interpreting(x: torch.Tensor | None = None) -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" or (x is not None and x.device.type != "cuda")


def pick_configs(gpu_configs: list[triton.Config]) -> list[triton.Config]:
    """The interpreter gets exactly one config (autotuning there is meaningless and slow)."""
    return gpu_configs[:1] if os.environ.get("TRITON_INTERPRET") == "1" else gpu_configs


# sequential state scans: value-block width trades parallelism (B*HV*V/BV programs) for per-program
# work (BV 16 for few long sequences: at B1 T16384 H16 K=V=128 the forward scan alone took 0.548 ms at BV 16,
# 4 warps, 2 stages against 0.868 at BV 64, 8 warps, 2 stages; session 10). At K = 128 with TF32 operands BV 64
# spills (255 registers + 232 B stack at 8 warps with the register transpose, session 2, scripts/ptxas_report.py),
# BV 32 does not. With bf16 dots at one stage (session 10, `ptxas_report.py 128 --prec bf16 --only fwd_state`,
# its buffers fp32 where the shipped K = 128 path stores them 2-byte) BV 64 spills at 4 and 8 warps either
# way, BV 32 at 4 warps, BV 16 not. The autotuner times them all. Two pipeline
# stages (the next chunk's tiles loaded while this one computes) need the per-chunk [BT, K] operand
# tiles twice in shared memory: at K = 128 that fits when W, Q e^Γ, K e^(γ-Γ) are stored 2-byte
# (TUNING inter_dtype / gated_dtype "input"; with only W 2-byte, for BV 16); prune_state_configs
# estimates each config's bytes and drops what cannot fit.
STATE_CONFIGS = [triton.Config({"BV": bv}, num_warps=nw, num_stages=ns)
                 for bv, nw, ns in ((64, 8, 1), (32, 8, 1), (32, 4, 1), (16, 4, 1), (32, 8, 2), (16, 4, 2),
                                    (64, 8, 2), (64, 4, 2), (32, 4, 2))]
_SHARED_BYTES = 220 * 1024   # of the H100/H200's 227 KB per block, with room for the compiler's own


def _stage_bytes(named_args, BT: int, BK: int, BV: int) -> int:
    """Shared-memory bytes one pipeline stage of a state scan holds: its [BT, BK] operand tiles (W,
    K e^(γ-Γ), and Q e^Γ where the kernel reads it) at their stored width, [BT, BV] fp32 tiles, Aqk."""
    kt = sum(named_args[n].element_size() for n in ("w", "kd", "qg")
             if isinstance(named_args.get(n), torch.Tensor))
    at = named_args["aqk"].element_size() if isinstance(named_args.get("aqk"), torch.Tensor) else 4
    return BT * BK * (kt or 12) + 2 * BT * BV * 4 + BT * BT * at


def _bv_configs(configs, named_args, kwargs, fits=None):
    """Configs with BV clamped to the padded value width, duplicates dropped, and BV < 64 dropped for
    16-bit dot operands unless the scan reads K_d^T directly (KD_T, chunk.TUNING scan_kd_t): with the register
    transpose they hit an illegal memory access at BV 32 on the H200 in sessions 4 and 6 (Triton 3.6 wgmma with
    N = 32 tiles; not reproduced in session 10, where BV 32 and 64 ran with the transpose and BV 16-64 with KD_T;
    BV 16 with the transpose was not run); `fits(config, BV)` may drop more."""
    V = named_args.get("V", kwargs.get("V"))
    cap = max(16, next_pow2(V))
    narrow = named_args.get("PREC", kwargs.get("PREC")) in ("bf16", "fp16") and not interpreting()
    min_bv = 64 if narrow and not named_args.get("KD_T", kwargs.get("KD_T")) else 16
    out, seen = [], set()
    for c in configs:
        key = (min(c.kwargs["BV"], cap), c.num_warps, c.num_stages)
        if key in seen or key[0] < min_bv or (fits is not None and not fits(c, key[0])):
            continue
        seen.add(key)
        out.append(triton.Config({"BV": key[0]}, num_warps=key[1], num_stages=key[2]))
    return out


def prune_state_configs(configs, named_args, **kwargs):
    """`_bv_configs`, less the pipelined configs whose stages cannot fit in shared memory."""
    BK, BT = (named_args.get(n, kwargs.get(n)) for n in ("BK", "BT"))
    return _bv_configs(configs, named_args, kwargs, lambda c, bv: c.num_stages == 1 or
                       c.num_stages * _stage_bytes(named_args, BT, BK, bv) <= _SHARED_BYTES)


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
def _intra_scores(b_q, b_k, b_G, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """Mqk[i,j] = Σ_d q_id k_jd exp(Γ_id - Γ_jd), Mkk likewise with k for q; j <= i (unmasked above)."""
    b_mqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_mkk = tl.zeros([BT, BT], dtype=tl.float32)
    for a in range(BT // BC):
        e_q, e_k, m_a, m_up = _anchored_factors(b_G, a, BT, BC)
        b_qa = tl.where(m_a[:, None], b_q * e_q, 0.)
        b_ka = tl.where(m_a[:, None], b_k * e_q, 0.)
        b_kb = tl.where(m_up[:, None], b_k * e_k, 0.)
        b_mqk += _dot_wide(b_qa, tl.trans(b_kb), PREC)
        b_mkk += _dot_wide(b_ka, tl.trans(b_kb), PREC)
    return b_mqk, b_mkk


@triton.jit
def _blk(p, i, j, BT: tl.constexpr, BC: tl.constexpr):
    """Pointers to block (i, j) of size BC x BC inside a row-major [BT, BT] matrix at p."""
    o_c = tl.arange(0, BC)
    return p + (i * BC + o_c)[:, None] * BT + (j * BC + o_c)[None, :]


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """The non-solve products: PREC "bf16" / "fp16" (and their "narrow" forms "bf16n" / "fp16n") rounds
    both (fp32) operands to that 16-bit type, fp32 accumulation (chunk.TUNING dot16_bwd); else fp32
    operands at tl.dot input precision PREC."""
    if PREC == "bf16" or PREC == "bf16n":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "fp16" or PREC == "fp16n":
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _dot_wide(a, b, PREC: tl.constexpr):
    """`_dot` for the anchored score products and their gradients: an anchored operand spans
    e^(-(BC-1) |g|max) .. e^((BC-1) |g|max) (e^±75 at lower_bound -5), beyond fp16's range, so "fp16"
    stays fp32 (TF32) here; bf16 has fp32's range. The narrow forms keep all of these at TF32."""
    if PREC == "fp16" or PREC == "bf16n" or PREC == "fp16n":
        return tl.dot(a, b, input_precision="tf32")
    else:
        return _dot(a, b, PREC)


@triton.jit
def _mm(a, b):
    # block products of the solve stay in full fp32 (SPEC §2.2 numerics)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _inverse16(b_a, BC: tl.constexpr):
    """(I + A)^-1 for one strictly lower BC x BC block (BC = 16): with P = -A nilpotent,
    Σ_{m<16} P^m = (I + P)(I + P^2)(I + P^4)(I + P^8) — six fp32 dots instead of a 16-step
    row loop whose cross-warp reductions dominated the kernel (run 2: 0.48 ms at the toy shape)."""
    o_c = tl.arange(0, BC)
    b_p1 = -b_a
    b_p2 = _mm(b_p1, b_p1)
    b_p4 = _mm(b_p2, b_p2)
    b_p8 = _mm(b_p4, b_p4)
    b_x = tl.where(o_c[:, None] == o_c[None, :], 1., 0.) + b_p1
    b_x += _mm(b_x, b_p2)
    b_x += _mm(b_x, b_p4)
    b_x += _mm(b_x, b_p8)
    return b_x


@triton.jit
def _unit_lower_inverse(p, BT: tl.constexpr, BC: tl.constexpr):
    """(I + Akk)^-1 in place, for the strictly lower Akk [BT, BT] already stored at p (this chunk's
    slot of the Tm buffer; the caller puts a barrier after writing it): invert the BC x BC diagonal
    blocks, then block forward substitution T_ij = -T_ii Σ_{j<=m<i} A_im T_mj. Returns the inverse."""
    NS: tl.constexpr = BT // BC
    o_t = tl.arange(0, BT)
    d0 = _inverse16(tl.load(_blk(p, 0, 0, BT, BC)), BC)
    if NS > 1:
        d1 = _inverse16(tl.load(_blk(p, 1, 1, BT, BC)), BC)
        a10 = tl.load(_blk(p, 1, 0, BT, BC))
        t10 = -_mm(d1, _mm(a10, d0))
        if NS > 2:
            d2 = _inverse16(tl.load(_blk(p, 2, 2, BT, BC)), BC)
            d3 = _inverse16(tl.load(_blk(p, 3, 3, BT, BC)), BC)
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
    tl.debug_barrier()
    tl.store(_blk(p, 0, 0, BT, BC), d0)
    if NS > 1:
        tl.store(_blk(p, 1, 1, BT, BC), d1)
        tl.store(_blk(p, 1, 0, BT, BC), t10)
        if NS > 2:
            tl.store(_blk(p, 2, 2, BT, BC), d2)
            tl.store(_blk(p, 3, 3, BT, BC), d3)
            tl.store(_blk(p, 2, 0, BT, BC), t20)
            tl.store(_blk(p, 2, 1, BT, BC), t21)
            tl.store(_blk(p, 3, 0, BT, BC), t30)
            tl.store(_blk(p, 3, 1, BT, BC), t31)
            tl.store(_blk(p, 3, 2, BT, BC), t32)
    tl.debug_barrier()
    return tl.load(p + o_t[:, None] * BT + o_t[None, :])


@triton.jit
def _head_rows(x, i_b, i_h, o_t, o_k, T, H: tl.constexpr, K: tl.constexpr):
    """Token rows o_t, columns o_k of head i_h of sequence i_b of a [B, T, H, K] tensor, fp32, zeros past
    T and K."""
    m = (o_t < T)[:, None] & (o_k < K)[None, :]
    row = (i_b * T + o_t).to(tl.int64) * (H * K) + i_h * K
    return tl.load(x + row[:, None] + o_k[None, :], mask=m, other=0.).to(tl.float32)


@triton.jit
def _load_rows_qkg(q, k, g, i_b, i_h, i_hv, o_t, i_k, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                   BK: tl.constexpr):
    """Token rows o_t of sequence i_b, key columns [i_k*BK, (i_k+1)*BK): q, k fp32 (head i_h) and
    g fp32 (head i_hv); zeros past T and past K."""
    o_k = i_k * BK + tl.arange(0, BK)
    return (_head_rows(q, i_b, i_h, o_t, o_k, T, H, K), _head_rows(k, i_b, i_h, o_t, o_k, T, H, K),
            _head_rows(g, i_b, i_hv, o_t, o_k, T, HV, K))


@triton.jit
def _load_chunk_qkg(q, k, g, i_b, i_h, i_hv, i_n, i_k, T, H: tl.constexpr, HV: tl.constexpr,
                    K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """q, k [BT, BK] fp32 of head i_h and Γ = chunk-local cumsum of g [BT, BK] fp32 of head i_hv,
    key columns [i_k*BK, (i_k+1)*BK)."""
    b_q, b_k, b_g = _load_rows_qkg(q, k, g, i_b, i_h, i_hv, i_n * BT + tl.arange(0, BT), i_k, T, H, HV, K, BK)
    return b_q, b_k, tl.cumsum(b_g, 0)


@triton.jit
def _subchunk_rows(q, k, g, i_b, i_h, i_hv, i_n, c, i_k, T, H: tl.constexpr, HV: tl.constexpr,
                   K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """Rows of sub-chunk c of chunk i_n (`_load_rows_qkg` of [BC, BK]): q, k, g, no cumsum."""
    return _load_rows_qkg(q, k, g, i_b, i_h, i_hv, i_n * BT + c * BC + tl.arange(0, BC), i_k, T, H, HV, K, BK)


@triton.jit
def _store_u(v, u, b_tm, b_beta, i_b, i_hv, i_n, base, T, HV: tl.constexpr, V: tl.constexpr,
             BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """U = Tm diag(β) V for one chunk, one BV-column block at a time."""
    o_t = tl.arange(0, BT)
    m_t = (i_n * BT + o_t) < T
    for i_v in range((V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_v = v + (i_b * T + i_n * BT + o_t).to(tl.int64)[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        b_v = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32)
        b_u = _dot(b_tm, b_v * b_beta[:, None], PREC)
        tl.store(u + (base + o_t)[:, None] * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=m_v[None, :])


@fast_launch
@triton.jit
def _kda_fwd_intra_kernel(q, k, v, g, beta, w, u, qg, kd, eg, aqk, tm, mkk, scale, T, NT,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          PREC: tl.constexpr, STORE_MKK: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_t = (i_n * BT + o_t) < T
    m_k = o_k < K
    b_q, b_k, b_G = _load_chunk_qkg(q, k, g, i_b, i_h, i_hv, i_n, 0, T, H, HV, K, BT, BK)
    # buffers are [B*HV, NT*BT, X]; rows past T hold zeros computed from masked loads
    base = i_bh.to(tl.int64) * NT * BT + i_n * BT
    p_rk = (base + o_t)[:, None] * K + o_k[None, :]
    # Γ goes through the qg buffer so that each query sub-chunk reads back exactly its own rows
    tl.store(qg + p_rk, b_G, mask=m_k[None, :])
    tl.debug_barrier()
    # scores one BC-row query sub-chunk at a time ([BC, BT] products, not masked [BT, BT] ones)
    for a in range(BT // BC):
        o_i = a * BC + tl.arange(0, BC)
        m_i = (i_n * BT + o_i) < T
        tok_i = (i_b * T + i_n * BT + o_i).to(tl.int64)
        m_ik = m_i[:, None] & m_k[None, :]
        p_qk = tok_i[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_qa = tl.load(q + p_qk, mask=m_ik, other=0.).to(tl.float32)
        b_ka = tl.load(k + p_qk, mask=m_ik, other=0.).to(tl.float32)
        b_Ga = tl.load(qg + (base + o_i)[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.)
        # anchor: Γ at the sub-chunk's FIRST row (depends on no later token)
        b_c = tl.sum(tl.where(o_i[:, None] == a * BC, b_Ga, 0.), 0)
        e_q = tl.exp(b_Ga - b_c[None, :])
        m_up = o_t < (a + 1) * BC
        b_kb = tl.where(m_up[:, None], b_k * tl.exp(tl.where(m_up[:, None], b_c[None, :] - b_G, 0.)), 0.)
        b_sq = _dot_wide(b_qa * e_q, tl.trans(b_kb), PREC)
        b_sk = _dot_wide(b_ka * e_q, tl.trans(b_kb), PREC)
        b_beta_a = tl.load(beta + tok_i * HV + i_hv, mask=m_i, other=0.).to(tl.float32)
        p_ia = (base + o_i)[:, None] * BT + o_t[None, :]
        tl.store(aqk + p_ia, (tl.where(o_i[:, None] >= o_t[None, :], b_sq, 0.) * scale).to(aqk.dtype.element_ty))
        b_sk = tl.where(o_i[:, None] > o_t[None, :], b_sk, 0.)
        if STORE_MKK:
            tl.store(mkk + p_ia, b_sk)
        tl.store(tm + p_ia, b_sk * b_beta_a[:, None])
    tl.debug_barrier()
    b_tm = _unit_lower_inverse(tm + base * BT, BT, BC)
    b_beta = tl.load(beta + (i_b * T + i_n * BT + o_t).to(tl.int64) * HV + i_hv, mask=m_t, other=0.)
    b_beta = b_beta.to(tl.float32)
    # the gated operands of the state scans, so those sequential kernels do no exp / cumsum work
    b_eg = tl.exp(b_G)
    b_gam = tl.sum(tl.where(o_t[:, None] == BT - 1, b_G, 0.), 0)
    tl.store(qg + p_rk, (b_q * b_eg * scale).to(qg.dtype.element_ty), mask=m_k[None, :])
    tl.store(kd + p_rk, (b_k * tl.exp(b_gam[None, :] - b_G)).to(kd.dtype.element_ty), mask=m_k[None, :])
    tl.store(eg + (i_bh * NT + i_n).to(tl.int64) * K + o_k, tl.exp(b_gam), mask=m_k)
    b_w = _dot(b_tm, b_k * b_eg * b_beta[:, None], PREC)
    tl.store(w + p_rk, b_w.to(w.dtype.element_ty), mask=m_k[None, :])
    _store_u(v, u, b_tm, b_beta, i_b, i_hv, i_n, base, T, HV, V, BT, BV, PREC)


@triton.jit
def _store_score_block(aqk, tm, mkk, p_blk, i_row, j_col, b_sq, b_sk, b_beta, scale, STORE_MKK: tl.constexpr):
    """One BC x BC block (rows i_row, columns j_col) of stage 1's score buffers from the raw products
    b_sq (q·k) and b_sk (k·k): scale·Aqk (j <= i) into aqk, β_i·Akk (j < i) into tm, raw Akk into mkk
    with STORE_MKK. p_blk: the block's offsets in a [.., BT] row-major buffer."""
    b_sk = tl.where(i_row[:, None] > j_col[None, :], b_sk, 0.)
    tl.store(aqk + p_blk, (tl.where(i_row[:, None] >= j_col[None, :], b_sq, 0.) * scale).to(aqk.dtype.element_ty))
    if STORE_MKK:
        tl.store(mkk + p_blk, b_sk)
    tl.store(tm + p_blk, b_sk * b_beta[:, None])


@fast_launch
@triton.jit
def _kda_fwd_scores_pairs_kernel(q, k, g, beta, qg, kd, eg, aqk, tm, mkk, scale, T, NT,
                                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                                 BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                                 STORE_MKK: tl.constexpr):
    """Stage-1 scores only, one program per (chunk, batch*value-head), whole-K [BC, BK] tiles: each
    needed BC x BC block pair (a, c), c <= a, once — Aqk = scale·Σ_d (q_a e^(Γ_a - A_a)) (k_c e^(A_a - Γ_c))
    and Akk likewise with k_a — anchored at A_a = Γ at sub-chunk a's first row (the factors as in
    `_anchored_factors`). Γ of a sub-chunk is its cumsum plus a running sum of the earlier sub-chunks
    (added in order, so it depends on no later token). Writes scale·Aqk (j <= i), β_i Akk (j < i) into tm
    and, with STORE_MKK, raw Mkk, zeros above the diagonal blocks; and the scans' gated operands
    Q e^Γ, K e^(γ-Γ), e^γ. The solve and W, U follow as PART 4 of `_kda_fwd_intra_kblock_kernel`."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    NC: tl.constexpr = BT // BC
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    base = i_bh.to(tl.int64) * NT * BT + i_n * BT
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    # runtime loops (not unrolled): unrolled, the compiler kept many [BC, BK] tiles live (255 registers)
    # γ, the whole chunk's sum, for K e^(γ-Γ) and e^γ
    b_gam = tl.zeros([BK], dtype=tl.float32)
    c = i_n * 0
    while c < NC:
        _, _, b_gc = _subchunk_rows(q, k, g, i_b, i_h, i_hv, i_n, c, 0, T, H, HV, K, BT, BC, BK)
        b_gam += tl.sum(b_gc, 0)
        c += 1
    tl.store(eg + (i_bh * NT + i_n).to(tl.int64) * K + o_k, tl.exp(b_gam), mask=m_k)
    b_pre_a = tl.zeros([BK], dtype=tl.float32)
    a = i_n * 0
    while a < NC:
        i_row = a * BC + o_c
        m_i = (i_n * BT + i_row) < T
        b_beta = tl.load(beta + (i_b * T + i_n * BT + i_row).to(tl.int64) * HV + i_hv, mask=m_i, other=0.)
        b_beta = b_beta.to(tl.float32)
        b_q, b_k, b_ga = _subchunk_rows(q, k, g, i_b, i_h, i_hv, i_n, a, 0, T, H, HV, K, BT, BC, BK)
        b_Ga = b_pre_a[None, :] + tl.cumsum(b_ga, 0)
        b_anchor = tl.sum(tl.where(o_c[:, None] == 0, b_Ga, 0.), 0)
        p_rk = (base + i_row)[:, None] * K + o_k[None, :]
        tl.store(qg + p_rk, (b_q * tl.exp(b_Ga) * scale).to(qg.dtype.element_ty), mask=m_k[None, :])
        tl.store(kd + p_rk, (b_k * tl.exp(b_gam[None, :] - b_Ga)).to(kd.dtype.element_ty), mask=m_k[None, :])
        b_e = tl.exp(b_Ga - b_anchor[None, :])
        b_qa = b_q * b_e
        b_ka = b_k * b_e
        p_row = (base + i_row)[:, None] * BT
        b_pre_c = tl.zeros([BK], dtype=tl.float32)
        c = a * 0
        while c <= a:
            j_col = c * BC + o_c
            _, b_kc, b_gc = _subchunk_rows(q, k, g, i_b, i_h, i_hv, i_n, c, 0, T, H, HV, K, BT, BC, BK)
            b_Gc = b_pre_c[None, :] + tl.cumsum(b_gc, 0)
            b_pre_c += tl.sum(b_gc, 0)
            b_kt = tl.trans(b_kc * tl.exp(b_anchor[None, :] - b_Gc))
            _store_score_block(aqk, tm, mkk, p_row + j_col[None, :], i_row, j_col, _dot_wide(b_qa, b_kt, PREC),
                               _dot_wide(b_ka, b_kt, PREC), b_beta, scale, STORE_MKK)
            c += 1
        _store_zero_blocks(aqk, tm, mkk, p_row, i_row, c, o_c, b_beta, scale, NC, BC, STORE_MKK)
        b_pre_a += tl.sum(b_ga, 0)
        a += 1


@fast_launch
@triton.jit
def _kda_fwd_gamma_kernel(q, k, g, beta, gc, qg, kd, eg, w, scale, T, NT, N0, H: tl.constexpr, HV: tl.constexpr,
                          K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, KG: tl.constexpr = False):
    """Stage 1a (chunk.TUNING fwd_scores "sub"), one program per (chunk, batch*value-head, BK key columns):
    Γ = chunk-local cumsum of g into the fp32 `gc` buffer, and the state scans' gated operands
    scale·Q e^Γ, K e^(γ-Γ), e^γ. Chunks from N0 on (a segment of the sequence: chunk.TUNING fwd_segments).
    KG (chunk.TUNING fwd_tail_kg): also β K e^Γ into the W buffer, which the tail then reads (and overwrites
    with W = Tm β K e^Γ) instead of reading k and g again and re-forming Γ."""
    i_n, i_bh, i_k = tl.program_id(0) + N0, tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    b_q, b_k, b_G = _load_chunk_qkg(q, k, g, i_b, i_h, i_hv, i_n, i_k, T, H, HV, K, BT, BK)
    base = i_bh.to(tl.int64) * NT * BT + i_n * BT
    p_rk = (base + o_t)[:, None] * K + o_k[None, :]
    b_gam = tl.sum(tl.where(o_t[:, None] == BT - 1, b_G, 0.), 0)
    tl.store(gc + p_rk, b_G, mask=m_k[None, :])
    tl.store(qg + p_rk, (b_q * tl.exp(b_G) * scale).to(qg.dtype.element_ty), mask=m_k[None, :])
    tl.store(kd + p_rk, (b_k * tl.exp(b_gam[None, :] - b_G)).to(kd.dtype.element_ty), mask=m_k[None, :])
    tl.store(eg + (i_bh * NT + i_n).to(tl.int64) * K + o_k, tl.exp(b_gam), mask=m_k)
    if KG:
        m_t = (i_n * BT + o_t) < T
        b_beta = tl.load(beta + (i_b * T + i_n * BT + o_t).to(tl.int64) * HV + i_hv, mask=m_t, other=0.)
        b_x = b_k * tl.exp(b_G) * b_beta.to(tl.float32)[:, None]
        tl.store(w + p_rk, b_x.to(w.dtype.element_ty), mask=m_k[None, :])


@triton.jit
def _score_pair(q_h, k_h, gc_n, a, c, t_a, t_c, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """The raw BC x BC products of query sub-chunk a (token rows from t_a) with key sub-chunk c (from t_c)
    of one chunk, over BK-column key blocks, from the stored Γ (`gc_n`: this chunk's [BT, K] rows),
    anchored at Γ of sub-chunk a's first row A (as `_anchored_factors`):
    q·k: Σ_d (q_id e^(Γ_id - A_d)) (k_jd e^(A_d - Γ_jd)), and the same with k_i for q_i."""
    b_sq = tl.zeros([BC, BC], dtype=tl.float32)
    b_sk = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range((K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_A = tl.load(gc_n + a * BC * K + o_k, mask=o_k < K, other=0.)
        p_ga = tl.make_block_ptr(gc_n, (BT, K), (K, 1), (a * BC, i_k * BK), (BC, BK), (1, 0))
        b_e = tl.exp(tl.load(p_ga, boundary_check=(1,), padding_option="zero") - b_A[None, :])
        # the key side loaded transposed, [BK, BC]
        p_kt = tl.make_block_ptr(k_h, (K, T), (1, H * K), (i_k * BK, t_c), (BK, BC), (0, 1))
        p_gt = tl.make_block_ptr(gc_n, (K, BT), (1, K), (i_k * BK, c * BC), (BK, BC), (0, 1))
        b_kt = tl.load(p_kt, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        b_kt *= tl.exp(b_A[:, None] - tl.load(p_gt, boundary_check=(0,), padding_option="zero"))
        p_q = tl.make_block_ptr(q_h, (T, K), (H * K, 1), (t_a, i_k * BK), (BC, BK), (1, 0))
        p_k = tl.make_block_ptr(k_h, (T, K), (H * K, 1), (t_a, i_k * BK), (BC, BK), (1, 0))
        b_qa = tl.load(p_q, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        b_ka = tl.load(p_k, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        b_sq += _dot_wide(b_qa * b_e, b_kt, PREC)
        b_sk += _dot_wide(b_ka * b_e, b_kt, PREC)
    return b_sq, b_sk


@fast_launch
@triton.jit
def _kda_fwd_scores_sub_kernel(q, k, gc, beta, aqk, tm, mkk, scale, T, NT, N0, H: tl.constexpr, HV: tl.constexpr,
                               K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                               PREC: tl.constexpr, STORE_MKK: tl.constexpr, PER_PAIR: tl.constexpr = False):
    """Stage 1b (chunk.TUNING fwd_scores "sub"), one program per (chunk x query sub-chunk a, batch*value-head):
    the BC x BC score blocks (a, c) of rows [a*BC, (a+1)*BC), c <= a (`_score_pair`). Writes scale·Aqk
    (j <= i) to aqk, β_i Akk (j < i) to tm, raw Akk to mkk with STORE_MKK, and zeros in the blocks c > a.
    PER_PAIR (chunk.TUNING fwd_scores_per_pair): one program per (chunk x block pair (a, c), c <= a) instead,
    NC(NC+1)/2 per chunk, each one block (the diagonal one also writes row a's zero blocks): the same
    products, balanced programs, and a key-block loop the compiler may pipeline."""
    i_np, i_bh = tl.program_id(0), tl.program_id(1)
    NC: tl.constexpr = BT // BC
    if PER_PAIR:
        NP: tl.constexpr = NC * (NC + 1) // 2
        i_n, p = i_np // NP + N0, i_np % NP
        a = p * 0
        for r in tl.static_range(1, NC):
            a += (p >= r * (r + 1) // 2).to(tl.int32)
        c_first = p - a * (a + 1) // 2
    else:
        i_n, a = i_np // NC + N0, i_np % NC
        c_first = a * 0
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_c = tl.arange(0, BC)
    i_row = a * BC + o_c
    m_i = (i_n * BT + i_row) < T
    base = i_bh.to(tl.int64) * NT * BT + i_n * BT
    b_beta = tl.load(beta + (i_b * T + i_n * BT + i_row).to(tl.int64) * HV + i_hv, mask=m_i, other=0.)
    b_beta = b_beta.to(tl.float32)
    # scalar bases and block pointers (64-bit pointer tiles cost two registers per element)
    q_h = q + (i_b.to(tl.int64) * T * H + i_h) * K
    k_h = k + (i_b.to(tl.int64) * T * H + i_h) * K
    gc_n = gc + base * K
    t_a = i_n * BT + a * BC
    p_row = (base + i_row)[:, None] * BT
    # runtime loops (not unrolled: unrolled, the compiler kept every pair's tiles live, 255 registers)
    if PER_PAIR:
        c = c_first
        j_col = c * BC + o_c
        b_sq, b_sk = _score_pair(q_h, k_h, gc_n, a, c, t_a, i_n * BT + c * BC, T, H, K, BT, BC, BK, PREC)
        _store_score_block(aqk, tm, mkk, p_row + j_col[None, :], i_row, j_col, b_sq, b_sk, b_beta, scale, STORE_MKK)
        # the diagonal block's program also writes the zero blocks right of it (none when the chunk is one
        # sub-chunk; the loop left in for NC = 1 crashed Triton's coalesce pass, as in session 3)
        if NC > 1:
            if c == a:
                _store_zero_blocks(aqk, tm, mkk, p_row, i_row, a + 1, o_c, b_beta, scale, NC, BC, STORE_MKK)
    else:
        c = c_first
        while c <= a:
            j_col = c * BC + o_c
            b_sq, b_sk = _score_pair(q_h, k_h, gc_n, a, c, t_a, i_n * BT + c * BC, T, H, K, BT, BC, BK, PREC)
            _store_score_block(aqk, tm, mkk, p_row + j_col[None, :], i_row, j_col, b_sq, b_sk, b_beta, scale,
                               STORE_MKK)
            c += 1
        _store_zero_blocks(aqk, tm, mkk, p_row, i_row, c, o_c, b_beta, scale, NC, BC, STORE_MKK)


@triton.jit
def _store_zero_blocks(aqk, tm, mkk, p_row, i_row, c, o_c, b_beta, scale, NC: tl.constexpr, BC: tl.constexpr,
                       STORE_MKK: tl.constexpr):
    """Zeros in the score blocks c, c+1, .., NC-1 of query rows i_row (right of the diagonal)."""
    b_zero = tl.zeros([BC, BC], dtype=tl.float32)
    while c < NC:
        j_col = c * BC + o_c
        _store_score_block(aqk, tm, mkk, p_row + j_col[None, :], i_row, j_col, b_zero, b_zero, b_beta, scale,
                           STORE_MKK)
        c += 1


@fast_launch
@triton.jit
def _kda_fwd_intra_kblock_kernel(q, k, v, g, beta, w, u, qg, kd, eg, aqk, tm, mkk, scale, T, NT,
                                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                                 BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                 PREC: tl.constexpr, PART: tl.constexpr, STORE_MKK: tl.constexpr, N0=0,
                                 KG: tl.constexpr = False):
    """Stage 1 with the key dimension walked in BK-column blocks: the same outputs as
    `_kda_fwd_intra_kernel`, but no program holds more than [BT, BK] of q, k, Γ at a time (at K = 128
    the whole-K kernel sat at 255 registers, 1 block per SM and spilled; ncu, notes/session2_gpu.md).
    Scores accumulate over key blocks (they are sums over key dims); Γ is re-derived per block.
    PART 0 does everything; 1, 2, 3 are the scores (+ gated operands), the solve of the Tm buffer in
    place, and W, U — three launches in that order give the same result with smaller programs. PART 4 is
    the solve then W, U, after `_kda_fwd_scores_pairs_kernel` (chunk.TUNING fwd_scores "pairs") or the
    sub-chunk scores; N0: the first chunk (a segment of the sequence, chunk.TUNING fwd_segments).
    KG (PART 3, 4): the W buffer already holds β K e^Γ (`_kda_fwd_gamma_kernel`), read in place of k, g."""
    i_n, i_bh = tl.program_id(0) + N0, tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    m_t = (i_n * BT + o_t) < T
    base = i_bh.to(tl.int64) * NT * BT + i_n * BT
    p_tt = (base + o_t)[:, None] * BT + o_t[None, :]
    if PART != 2:
        b_beta = tl.load(beta + (i_b * T + i_n * BT + o_t).to(tl.int64) * HV + i_hv, mask=m_t, other=0.)
        b_beta = b_beta.to(tl.float32)
    if PART == 0 or PART == 1:
        b_mqk = tl.zeros([BT, BT], dtype=tl.float32)
        b_mkk = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range((K + BK - 1) // BK):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_q, b_k, b_G = _load_chunk_qkg(q, k, g, i_b, i_h, i_hv, i_n, i_k, T, H, HV, K, BT, BK)
            b_sq, b_sk = _intra_scores(b_q, b_k, b_G, BT, BC, PREC)
            b_mqk += b_sq
            b_mkk += b_sk
            # the gated operands of the state scans for these key columns
            b_gam = tl.sum(tl.where(o_t[:, None] == BT - 1, b_G, 0.), 0)
            p_rk = (base + o_t)[:, None] * K + o_k[None, :]
            tl.store(qg + p_rk, (b_q * tl.exp(b_G) * scale).to(qg.dtype.element_ty), mask=m_k[None, :])
            tl.store(kd + p_rk, (b_k * tl.exp(b_gam[None, :] - b_G)).to(kd.dtype.element_ty), mask=m_k[None, :])
            tl.store(eg + (i_bh * NT + i_n).to(tl.int64) * K + o_k, tl.exp(b_gam), mask=m_k)
        tl.store(aqk + p_tt, (tl.where(o_t[:, None] >= o_t[None, :], b_mqk, 0.) * scale).to(aqk.dtype.element_ty))
        b_mkk = tl.where(o_t[:, None] > o_t[None, :], b_mkk, 0.)
        if STORE_MKK:
            tl.store(mkk + p_tt, b_mkk)
        tl.store(tm + p_tt, b_mkk * b_beta[:, None])
    if PART == 0 or PART == 4:
        tl.debug_barrier()
        b_tm = _unit_lower_inverse(tm + base * BT, BT, BC)
    if PART == 2:
        _unit_lower_inverse(tm + base * BT, BT, BC)
    if PART == 3:
        b_tm = tl.load(tm + p_tt)
    if PART == 0 or PART == 3 or PART == 4:
        for i_k in range((K + BK - 1) // BK):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            p_w = w + (base + o_t)[:, None] * K + o_k[None, :]
            if KG:
                b_x = tl.load(p_w, mask=m_k[None, :], other=0.).to(tl.float32)
            else:
                _, b_k, b_G = _load_chunk_qkg(q, k, g, i_b, i_h, i_hv, i_n, i_k, T, H, HV, K, BT, BK)
                b_x = b_k * tl.exp(b_G) * b_beta[:, None]
            b_w = _dot(b_tm, b_x, PREC)
            tl.store(p_w, b_w.to(w.dtype.element_ty), mask=m_k[None, :])
        _store_u(v, u, b_tm, b_beta, i_b, i_hv, i_n, base, T, HV, V, BT, BV, PREC)


@triton.jit
def _kda_fwd_state_step(qg, kd, eg, w, u, aqk, o, h, vn, b_s, i_b, i_hv, i_bh, i_v, i_n, T, NT,
                        HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        STORE_O: tl.constexpr, STORE_H: tl.constexpr, PREC: tl.constexpr, KD_T: tl.constexpr):
    """One chunk of the state scan: emit O (and S, Vn for the backward), return the next S. KD_T: read
    K_d^T as a [BK, BT] tile straight from memory instead of transposing the loaded [BT, BK] tile."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    row = (i_bh * NT * BT + i_n * BT + o_t).to(tl.int64)
    p_rk = row[:, None] * K + o_k[None, :]
    b_w = tl.load(w + p_rk, mask=m_k[None, :], other=0.).to(tl.float32)
    b_u = tl.load(u + row[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.).to(tl.float32)
    if STORE_H:
        p_h = h + (i_bh * NT + i_n).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_h, b_s.to(h.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
    b_vn = b_u - _dot(b_w, b_s, PREC)
    if STORE_H:
        tl.store(vn + row[:, None] * V + o_v[None, :], b_vn, mask=m_v[None, :])
    if STORE_O:
        b_qg = tl.load(qg + p_rk, mask=m_k[None, :], other=0.).to(tl.float32)
        b_a = tl.load(aqk + row[:, None] * BT + o_t[None, :]).to(tl.float32)
        b_o = _dot(b_qg, b_s, PREC) + _dot(b_a, b_vn, PREC)
        m_t = (i_n * BT + o_t) < T
        p_o = o + (i_b * T + i_n * BT + o_t).to(tl.int64)[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
    if KD_T:
        b_kdt = tl.load(kd + row[None, :] * K + o_k[:, None], mask=m_k[:, None], other=0.).to(tl.float32)
    else:
        b_kdt = tl.trans(tl.load(kd + p_rk, mask=m_k[None, :], other=0.).to(tl.float32))
    b_eg = tl.load(eg + (i_bh * NT + i_n).to(tl.int64) * K + o_k, mask=m_k, other=0.)
    return b_s * b_eg[:, None] + _dot(b_kdt, b_vn, PREC)


@triton.jit
def _scan_start(s0, i_bh, i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                USE_S0: tl.constexpr):
    """A state scan's [BK, BV] fp32 carry for (batch*head i_bh, value block i_v): s0's block when
    USE_S0, else zeros; with its offsets and mask into any [B*HV, K, V] state tensor."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    p_state = i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_S0:
        b_s += tl.load(s0 + p_state, mask=m_kv, other=0.)
    return b_s, p_state, m_kv


@fast_launch
@triton.autotune(
    configs=pick_configs(STATE_CONFIGS),
    key=["BK", "BT", "NBH", "V", "PREC", "KD_T"],
    prune_configs_by={"early_config_prune": prune_state_configs},
)
@triton.jit
def _kda_fwd_state_kernel(qg, kd, eg, w, u, aqk, o, h0, ht, h, vn, T, NT, NBH, N0, N1, L, SEG_STRIDE,
                          HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_O: tl.constexpr,
                          STORE_H: tl.constexpr, INTERPRET: tl.constexpr, PREC: tl.constexpr,
                          KD_T: tl.constexpr):
    """The state scan over chunks [N0, N1), cut into runs of L chunks, one per program_id(2) (the
    parallel scan of chunk.TUNING fwd_scan_parallel; one run covering all when it is off). Run i_p starts
    from h0's block i_p (SEG_STRIDE elements apart: the start states that `scan_run_starts` computed
    from `_kda_fwd_seg_summary_kernel`'s run maps); the last run stores the final state to ht."""
    i_v, i_bh, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    if USE_H0:
        h0 += i_p.to(tl.int64) * SEG_STRIDE
    b_s, p_state, m_kv = _scan_start(h0, i_bh, i_v, K, V, BK, BV, USE_H0)
    n0 = N0 + i_p * L
    n1 = tl.minimum(n0 + L, N1)
    if INTERPRET:
        # the interpreter cannot take a runtime bound in range() with numpy >= 2.4
        i_n = n0
        while i_n < n1:
            b_s = _kda_fwd_state_step(qg, kd, eg, w, u, aqk, o, h, vn, b_s, i_b, i_hv, i_bh, i_v, i_n, T, NT,
                                      HV, K, V, BT, BK, BV, STORE_O, STORE_H, PREC, KD_T)
            i_n += 1
    else:
        for i_n in range(n0, n1):
            b_s = _kda_fwd_state_step(qg, kd, eg, w, u, aqk, o, h, vn, b_s, i_b, i_hv, i_bh, i_v, i_n, T, NT,
                                      HV, K, V, BT, BK, BV, STORE_O, STORE_H, PREC, KD_T)
    if STORE_HT:
        if n1 == N1:
            tl.store(ht + p_state, b_s, mask=m_kv)


@triton.jit
def _carry_step(kd, eg, w, u, b_s, i_bh, i_n, o_c, m_u, NT, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                BK: tl.constexpr, PREC: tl.constexpr):
    """One chunk of a scan that only carries the state: S' = diag(e^γ) S + K_d^T (U - W S), U's columns o_c
    (zeros where m_u is off)."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    row = (i_bh * NT * BT + i_n * BT + o_t).to(tl.int64)
    p_rk = row[:, None] * K + o_k[None, :]
    b_w = tl.load(w + p_rk, mask=m_k[None, :], other=0.).to(tl.float32)
    b_u = tl.load(u + row[:, None] * V + o_c[None, :], mask=m_u[None, :], other=0.).to(tl.float32)
    b_vn = b_u - _dot(b_w, b_s, PREC)
    b_kd = tl.load(kd + p_rk, mask=m_k[None, :], other=0.).to(tl.float32)
    b_eg = tl.load(eg + (i_bh * NT + i_n).to(tl.int64) * K + o_k, mask=m_k, other=0.)
    return b_s * b_eg[:, None] + _dot(tl.trans(b_kd), b_vn, PREC)


@fast_launch
@triton.autotune(
    configs=pick_configs(STATE_CONFIGS),
    key=["BK", "BT", "NBH", "V", "PREC"],
    prune_configs_by={"early_config_prune": prune_state_configs},
)
@triton.jit
def _kda_fwd_seg_summary_kernel(kd, eg, w, u, m, e, NT, NBH, L, SEG_STRIDE_M, SEG_STRIDE_E,
                                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                                BV: tl.constexpr, INTERPRET: tl.constexpr, PREC: tl.constexpr):
    """Phase 1 of the parallel scan (chunk.TUNING fwd_scan_parallel): for run i_p (chunks [i_p*L, (i_p+1)*L)),
    the affine map the run applies to its start state, S_end = M S_start + E. The scan step is affine,
    S' = diag(e^γ) S + K_d^T (U - W S), so E is the run scanned from S = 0, and column j of M the run
    scanned from the unit vector e_j with U = 0. Program i_c < cdiv(V, BV) scans E's columns
    [i_c*BV, ...), the others M's; m [runs, B*HV, K, K], e [runs, B*HV, K, V], fp32."""
    i_c, i_bh, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NV = (V + BV - 1) // BV
    is_m = i_c >= NV
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    if is_m:
        o_c = (i_c - NV) * BV + tl.arange(0, BV)
        b_s = tl.where(o_k[:, None] == o_c[None, :], 1., 0.)
        m_c = o_c < K
    else:
        o_c = i_c * BV + tl.arange(0, BV)
        b_s = tl.zeros([BK, BV], dtype=tl.float32)
        m_c = o_c < V
    m_u = m_c & (i_c < NV)   # M's columns scan with U = 0: a load with no lane on
    n0 = i_p * L
    n1 = tl.minimum(n0 + L, NT)
    if INTERPRET:
        i_n = n0
        while i_n < n1:
            b_s = _carry_step(kd, eg, w, u, b_s, i_bh, i_n, o_c, m_u, NT, K, V, BT, BK, PREC)
            i_n += 1
    else:
        for i_n in range(n0, n1):
            b_s = _carry_step(kd, eg, w, u, b_s, i_bh, i_n, o_c, m_u, NT, K, V, BT, BK, PREC)
    if is_m:
        p_out = m + i_p.to(tl.int64) * SEG_STRIDE_M + i_bh.to(tl.int64) * K * K + o_k[:, None] * K + o_c[None, :]
    else:
        p_out = e + i_p.to(tl.int64) * SEG_STRIDE_E + i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_c[None, :]
    tl.store(p_out, b_s, mask=m_k[:, None] & m_c[None, :])


# the output launch of TUNING fwd_output "split": one program per (value block, chunk, batch*head), so
# parallel over chunks; the autotuner picks the value block and warps
O_CONFIGS = [triton.Config({"BV": bv}, num_warps=nw, num_stages=ns)
             for bv, nw, ns in ((64, 4, 2), (32, 4, 2), (64, 8, 2), (32, 2, 2), (128, 8, 2), (64, 4, 1))]


def prune_o_configs(configs, named_args, **kwargs):
    return _bv_configs(configs, named_args, kwargs)


@fast_launch
@triton.autotune(
    configs=pick_configs(O_CONFIGS),
    key=["BK", "BT", "NPROG", "V", "PREC"],
    prune_configs_by={"early_config_prune": prune_o_configs},
)
@triton.jit
def _kda_fwd_o_kernel(qg, aqk, h, vn, o, T, NT, NPROG, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """O of chunk i_n from the stored chunk-start state S_n and pseudo-values Vn: the scan's output
    term (Q e^Γ) S_n + Aqk Vn, here outside the sequential scan (TUNING fwd_output "split")."""
    i_n, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    row = (i_bh * NT * BT + i_n * BT + o_t).to(tl.int64)
    b_qg = tl.load(qg + row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.).to(tl.float32)
    p_h = h + (i_bh * NT + i_n).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.).to(tl.float32)
    b_a = tl.load(aqk + row[:, None] * BT + o_t[None, :]).to(tl.float32)
    b_vn = tl.load(vn + row[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.)
    b_o = _dot(b_qg, b_s, PREC) + _dot(b_a, b_vn, PREC)
    m_t = (i_n * BT + o_t) < T
    p_o = o + (i_b * T + i_n * BT + o_t).to(tl.int64)[:, None] * (HV * V) + i_hv * V + o_v[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


class Intra(NamedTuple):
    """Stage-1 buffers, all [B*HV, NT*BT, X] (eg: [B*HV, NT, K]); W, U in `inter_dtype`, qg, kd in `gated_dtype`,
    aqk in `aqk_dtype`, the rest fp32."""
    w: torch.Tensor      # Tm diag(β) (K ⊙ e^Γ)
    u: torch.Tensor      # Tm diag(β) V
    qg: torch.Tensor     # scale · Q ⊙ e^Γ
    kd: torch.Tensor     # K ⊙ e^(γ - Γ)
    eg: torch.Tensor     # e^γ per chunk
    aqk: torch.Tensor    # scale-weighted causal scores, lower incl. diagonal
    tm: torch.Tensor     # (I + Akk)^-1
    mkk: torch.Tensor | None   # raw Mkk (strictly lower, no β) when stored: the backward's dβ term without
                               # recomputing scores (chunk.TUNING bwd_stored_mkk)
    gc: torch.Tensor | None = None   # Γ, fp32, from the "sub" stage 1 (the caller may drop it)


def torch_allows_tf32() -> bool:
    """Whether the user let torch run fp32 matmuls in TF32: the new `fp32_precision` settings
    (torch >= 2.9; "none" defers to the global one) first, then the legacy `allow_tf32`, whose
    read raises when the two APIs were mixed."""
    for prec in (getattr(torch.backends.cuda.matmul, "fp32_precision", None),
                 getattr(torch.backends, "fp32_precision", None)):
        if prec not in (None, "none"):
            return prec == "tf32"
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        return False


def dot_precision(dtype: torch.dtype, operands16: bool | str = False) -> str:
    """`tl.dot` input precision for the non-solve products. fp32 inputs: "tf32x3" (three TF32
    products, about fp32 accuracy on the tensor cores; plain TF32 put a whole fp32 model's chunked
    forward 1.4e-2 (scaled) away from its exact-fp32 decode on the H200, and "ieee" spills at
    K = 128 per scripts/ptxas_report.py), unless torch allows TF32 matmuls. bf16/fp16 inputs: "tf32"
    (they carry less precision than TF32 already), or with `operands16` "bf16" / "fp16": both operands
    rounded to the input dtype (chunk.TUNING dot16_bwd), and with operands16="narrow" "bf16n" / "fp16n":
    the same except the anchored score products (`_dot_wide`). The solve is always "ieee" (`_mm`)."""
    if operands16 and dtype in (torch.bfloat16, torch.float16):
        return ("bf16" if dtype == torch.bfloat16 else "fp16") + ("n" if operands16 == "narrow" else "")
    return "tf32x3" if dtype == torch.float32 and not torch_allows_tf32() else "tf32"


def kda_fwd_intra(q, k, v, g, beta, scale: float, chunk_size: int, inter_dtype: torch.dtype,
                  gated_dtype: torch.dtype = torch.float32, num_warps: int = 8, precision: str = "tf32",
                  key_block: int | None = None, maxnreg: int | None = None, split: bool = False,
                  store_mkk: bool = False, pairs: bool = False, pairs_warps: int = 4, sub: bool = False,
                  sub_warps: int = 1, sub_key_block: int = 64, tail_warps: int = 2,
                  tail_key_block: int | None = 32, segments: list[tuple[int, int]] | None = None,
                  on_segment=None, sub_per_pair: bool = False, sub_stages: int = 1, sub_kg: bool = False,
                  aqk_dtype: torch.dtype = torch.float32) -> Intra:
    """Launch stage 1 (one program per chunk and batch*value-head). W, U are stored in `inter_dtype`,
    Q e^Γ and K e^(γ-Γ) in `gated_dtype`, scale·Aqk in `aqk_dtype`; everything else fp32. `precision`: see dot_precision.
    `key_block` (16, 32, 64): walk the key dim in blocks of that many columns when K is wider
    (`_kda_fwd_intra_kblock_kernel`, also used for a non-fp32 `gated_dtype`); None: whole-K tiles.
    `maxnreg`: per-thread register cap (ptxas .maxnreg; 128 at 8 warps = two blocks per SM).
    `split`: three launches (scores, solve, W/U) of the key-blocked kernel instead of one; with `pairs`
    or `sub`: the solve and W, U as two launches after their scores (the "tail": `tail_warps` warps, key
    blocks of `tail_key_block` columns, None = whole K).
    `store_mkk`: also keep the raw Mkk (Intra.mkk, else None) for the backward's dβ term.
    `pairs`: the scores and gated operands from `_kda_fwd_scores_pairs_kernel` (`pairs_warps` warps),
    then the solve and W, U as one launch of the key-blocked kernel (PART 4).
    `sub`: Γ into an fp32 buffer with the gated operands (`_kda_fwd_gamma_kernel`), the scores per
    (chunk, 16-row query sub-chunk) from it (`_kda_fwd_scores_sub_kernel`, `sub_warps` warps, key blocks of
    `sub_key_block` columns; `sub_per_pair`: per 16 x 16 block pair instead; `sub_stages`: its pipeline
    stages; `sub_kg`: the Γ launch also stores β K e^Γ into the W buffer for the tail, chunk.TUNING
    fwd_tail_kg), then the solve and W, U (PART 4): small programs, many per SM.
    `segments` (with `sub`): launch stage 1 one chunk range [n0, n1) after another, calling
    `on_segment(n0, n1, "start")` before each and `on_segment(n0, n1, "done", it)` after (chunk_kda's
    segmented forward switches CUDA streams and records events there, and may enqueue that range's scan)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    NT = cdiv(T, BT)
    BK = max(16, next_pow2(K))
    BV = min(64, max(16, next_pow2(V)))
    dev = q.device
    w = torch.empty(B * HV, NT * BT, K, device=dev, dtype=inter_dtype)
    u = torch.empty(B * HV, NT * BT, V, device=dev, dtype=inter_dtype)
    qg = torch.empty(B * HV, NT * BT, K, device=dev, dtype=gated_dtype)
    kd = torch.empty_like(qg)
    eg = torch.empty(B * HV, NT, K, device=dev, dtype=torch.float32)
    aqk = torch.empty(B * HV, NT * BT, BT, device=dev, dtype=aqk_dtype)
    tm = torch.empty(B * HV, NT * BT, BT, device=dev, dtype=torch.float32)
    # raw Mkk for a backward that reads it instead of recomputing scores (chunk.TUNING bwd_stored_mkk)
    mkk = torch.empty_like(tm) if store_mkk else None
    if key_block is not None and key_block not in (16, 32, 64):
        raise ValueError(f"kda_fwd_intra: key_block={key_block} must be 16, 32 or 64")
    # the whole-K kernel passes Γ through the qg buffer, which must then be fp32
    opts = {"num_warps": num_warps, "num_stages": 1, **({} if maxnreg is None else {"maxnreg": maxnreg})}
    mkk_arg = tm if mkk is None else mkk   # any fp32 buffer when STORE_MKK is off (never written)
    args = (q, k, v, g, beta, w, u, qg, kd, eg, aqk, tm, mkk_arg, scale, T, NT)
    opts["STORE_MKK"] = store_mkk
    gc = torch.empty(B * HV, NT * BT, K, device=dev, dtype=torch.float32) if sub else None
    it = Intra(w, u, qg, kd, eg, aqk, tm, mkk, gc)
    if sub:
        for n0, n1 in segments or [(0, NT)]:
            if on_segment is not None:
                on_segment(n0, n1, "start")
            launch_intra_sub(it, q, k, v, g, beta, scale, BT, n0, n1, precision, split, sub_warps, sub_key_block,
                             tail_warps, tail_key_block, maxnreg, per_pair=sub_per_pair, sub_stages=sub_stages,
                             kg=sub_kg)
            if on_segment is not None:
                on_segment(n0, n1, "done", it)
        return it
    if segments is not None:
        raise ValueError("kda_fwd_intra: segments need the sub-chunk stage 1 (sub=True)")
    if pairs:
        _kda_fwd_scores_pairs_kernel[(NT, B * HV)](
            q, k, g, beta, qg, kd, eg, aqk, tm, mkk_arg, scale, T, NT, H=H, HV=HV, K=K, BT=BT, BC=min(16, BT),
            BK=BK, PREC=precision, STORE_MKK=store_mkk, num_warps=pairs_warps, num_stages=1)
        launch_intra_tail(it, q, k, v, g, beta, scale, BT, 0, NT, precision, split, tail_warps, tail_key_block,
                          maxnreg)
    elif (key_block is not None and key_block < BK) or gated_dtype != torch.float32 or split:
        BK = min(BK, key_block or BK)
        for part in (1, 2, 3) if split else (0,):
            _kda_fwd_intra_kblock_kernel[(NT, B * HV)](
                *args, H=H, HV=HV, K=K, V=V, BT=BT, BC=min(16, BT), BK=BK, BV=BV, PREC=precision, PART=part, **opts)
    else:
        _kda_fwd_intra_kernel[(NT, B * HV)](
            *args, H=H, HV=HV, K=K, V=V, BT=BT, BC=min(16, BT), BK=BK, BV=BV, PREC=precision, **opts)
    return it


def launch_intra_sub(it: Intra, q, k, v, g, beta, scale: float, BT: int, n0: int, n1: int, precision: str,
                     split: bool = False, sub_warps: int = 1, sub_key_block: int | None = 64, tail_warps: int = 2,
                     tail_key_block: int | None = 32, maxnreg: int | None = None, per_pair: bool = False,
                     sub_stages: int = 1, kg: bool = False) -> None:
    """The sub-chunk stage 1 (Γ + gated operands, scores, then the solve and W, U) for chunks [n0, n1)
    into the buffers of `it` (which must hold a Γ buffer). `per_pair`, `sub_stages`: the scores launch's
    programs per block pair and its pipeline stages (chunk.TUNING fwd_scores_per_pair / _stages); `kg`:
    β K e^Γ from the Γ launch through the W buffer to the tail (chunk.TUNING fwd_tail_kg)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    NT = it.eg.shape[1]
    n = n1 - n0
    BK = max(16, next_pow2(K))
    BC = min(16, BT)
    store_mkk = it.mkk is not None
    mkk_arg = it.tm if it.mkk is None else it.mkk   # any fp32 buffer when STORE_MKK is off (never written)
    # 64 key columns at 4 warps: 0.145 ms against 0.190 with 32 (H200, B8 T2048 H16 K128, session 5)
    BKg = min(BK, 64)
    _kda_fwd_gamma_kernel[(n, B * HV, cdiv(K, BKg))](
        q, k, g, beta, it.gc, it.qg, it.kd, it.eg, it.w, scale, T, NT, n0, H=H, HV=HV, K=K, BT=BT, BK=BKg, KG=kg,
        num_warps=4, num_stages=1)
    NC = BT // BC
    _kda_fwd_scores_sub_kernel[(n * (NC * (NC + 1) // 2 if per_pair else NC), B * HV)](
        q, k, it.gc, beta, it.aqk, it.tm, mkk_arg, scale, T, NT, n0, H=H, HV=HV, K=K, BT=BT, BC=BC,
        BK=min(BK, sub_key_block or BK), PREC=precision, STORE_MKK=store_mkk, PER_PAIR=per_pair,
        num_warps=sub_warps, num_stages=sub_stages)
    launch_intra_tail(it, q, k, v, g, beta, scale, BT, n0, n1, precision, split, tail_warps, tail_key_block,
                      maxnreg, kg=kg)


def launch_intra_tail(it: Intra, q, k, v, g, beta, scale: float, BT: int, n0: int, n1: int, precision: str,
                      split: bool = False, tail_warps: int = 2, tail_key_block: int | None = 32,
                      maxnreg: int | None = None, kg: bool = False) -> None:
    """After the "pairs" or "sub" scores: the solve of the Tm buffer, then W and U, for chunks [n0, n1), in
    one launch (PART 4) or, with `split`, two (PART 2, 3) of `_kda_fwd_intra_kblock_kernel`. `kg`: the W
    buffer holds β K e^Γ already (the "sub" Γ launch with kg)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BK = max(16, next_pow2(K))
    BV = min(64, max(16, next_pow2(V)))
    mkk_arg = it.tm if it.mkk is None else it.mkk
    tail = {"num_warps": tail_warps, "num_stages": 1, **({} if maxnreg is None else {"maxnreg": maxnreg})}
    for part in (2, 3) if split else (4,):
        _kda_fwd_intra_kblock_kernel[(n1 - n0, B * HV)](
            q, k, v, g, beta, it.w, it.u, it.qg, it.kd, it.eg, it.aqk, it.tm, mkk_arg, scale, T, it.eg.shape[1],
            H=H, HV=HV, K=K, V=V, BT=BT, BC=min(16, BT), BK=min(BK, tail_key_block or BK), BV=BV, PREC=precision,
            PART=part, STORE_MKK=it.mkk is not None, N0=n0, KG=kg, **tail)


def parallel_runs(NT: int, n: int) -> tuple[int, int]:
    """TUNING fwd_scan_parallel: (runs, chunks per run) for n requested runs of an NT-chunk scan, no run
    empty; (1, NT) when off."""
    if n < 2 or NT < 2:
        return 1, NT
    L = cdiv(NT, min(n, NT))
    return cdiv(NT, L), L


def scan_run_starts(it: Intra, B: int, HV: int, chunk_size: int, initial_state, runs: int, L: int,
                    precision: str = "tf32") -> torch.Tensor:
    """Phases 1 and 2 of the parallel scan: each run's affine map S_end = M S_start + E in parallel
    (`_kda_fwd_seg_summary_kernel`), then the start state of every run, S_0 = the initial state (or 0),
    S_(p+1) = M_p S_p + E_p in fp32 (torch baddbmm, runs - 1 small batched products). [runs, B*HV, K, V]."""
    K, V = it.w.shape[-1], it.u.shape[-1]
    NT = it.eg.shape[1]
    NBH = B * HV
    dev = it.w.device
    m = torch.empty(runs - 1, NBH, K, K, device=dev, dtype=torch.float32)
    e = torch.empty(runs - 1, NBH, K, V, device=dev, dtype=torch.float32)
    _kda_fwd_seg_summary_kernel[lambda meta: (cdiv(V, meta["BV"]) + cdiv(K, meta["BV"]), NBH, runs - 1)](
        it.kd, it.eg, it.w, it.u, m, e, NT, next_pow2(NBH * (runs - 1)), L, NBH * K * K, NBH * K * V,
        K=K, V=V, BT=chunk_size, BK=max(16, next_pow2(K)), INTERPRET=interpreting(it.w), PREC=precision)
    starts = torch.empty(runs, NBH, K, V, device=dev, dtype=torch.float32)
    if initial_state is None:
        starts[0].zero_()
    else:
        starts[0].copy_(initial_state.reshape(NBH, K, V))
    for p in range(1, runs):
        torch.baddbmm(e[p - 1], m[p - 1], starts[p - 1], out=starts[p])
    return starts


class StateScan:
    """Stage 2 as its launches: the buffers are allocated here, `launch(i)` enqueues the scan of the i-th chunk
    range (or the parallel scan's one launch), `finish()` returns (o, final state, h, Vn) as kda_fwd_state.
    chunk_kda's interleaved segmented forward (chunk.TUNING fwd_segments_interleave) enqueues range i's scan
    right after range i's stage 1 instead of after all of stage 1."""

    def __init__(self, it: Intra, B: int, T: int, HV: int, chunk_size: int, initial_state, out_dtype,
                 output_final_state: bool, store_o: bool = True, store_h: bool = False,
                 h_dtype: torch.dtype = torch.float32, precision: str = "tf32", segments=None, parallel: int = 0,
                 kd_t: bool = False):
        K, V = it.w.shape[-1], it.u.shape[-1]
        BT = chunk_size
        NT = cdiv(T, BT)
        dev = it.w.device
        self.it, self.B, self.T, self.HV, self.BT, self.NT, self.K, self.V = it, B, T, HV, BT, NT, K, V
        self.dev, self.precision, self.store_o, self.store_h, self.kd_t = dev, precision, store_o, store_h, kd_t
        self.o = torch.empty(B, T, HV, V, device=dev, dtype=out_dtype) if store_o else None
        self.ht = ht = torch.empty(B, HV, K, V, device=dev, dtype=torch.float32) if output_final_state else None
        self.h = torch.empty(B * HV, NT, K, V, device=dev, dtype=h_dtype) if store_h else None
        self.vn = torch.empty(B * HV, NT * BT, V, device=dev, dtype=torch.float32) if store_h else None
        runs, L = parallel_runs(NT, parallel)
        self.carry = [None, None]
        self.streams = []   # the CUDA streams the launches ran on (for the carry buffers' record_stream)
        if runs > 1:
            if segments:
                raise ValueError("kda_fwd_state: parallel runs and sequential segments do not combine")
            # one launch: `runs` programs per (value block, head), each from its start state
            starts = scan_run_starts(it, B, HV, BT, initial_state, runs, L, precision)
            self.launches = [(0, NT, starts, ht, runs, L, B * HV * K * V)]
        else:
            # one launch per segment, the carry alternating between two fp32 buffers
            segments = segments or [(0, NT)]
            if len(segments) > 1:
                self.carry = [torch.empty(B, HV, K, V, device=dev, dtype=torch.float32) for _ in range(2)]
            self.launches, s_in = [], initial_state
            for i, (n0, n1) in enumerate(segments):
                s_out = ht if i == len(segments) - 1 else self.carry[i % 2]
                self.launches.append((n0, n1, s_in, s_out, 1, n1 - n0, 0))
                s_in = s_out

    def launch(self, i: int, on_segment=None) -> None:
        """Enqueue launch i, calling `on_segment(n0, n1, "start")` first (chunk_kda's stream switch)."""
        n0, n1, s_in, s_out, nrun, run_len, stride = self.launches[i]
        it, B, HV, V = self.it, self.B, self.HV, self.V
        if on_segment is not None:
            on_segment(n0, n1, "start")
        _kda_fwd_state_kernel[lambda meta: (cdiv(V, meta["BV"]), B * HV, nrun)](
            it.qg, it.kd, it.eg, it.w, it.u, it.aqk, self.o, s_in, s_out, self.h, self.vn, self.T, self.NT,
            next_pow2(B * HV * nrun), n0, n1, run_len, stride, HV=HV, K=self.K, V=V, BT=self.BT,
            BK=max(16, next_pow2(self.K)), USE_H0=s_in is not None, STORE_HT=s_out is not None,
            STORE_O=self.store_o, STORE_H=self.store_h, INTERPRET=interpreting(it.w), PREC=self.precision,
            KD_T=self.kd_t)
        if self.dev.type == "cuda" and self.carry[0] is not None:
            stream = torch.cuda.current_stream(self.dev)
            if stream not in self.streams:
                self.streams.append(stream)

    def finish(self):
        # with chunk.TUNING fwd_segments_priority the scans ran on a side stream (on_segment switched to it), and
        # the carry buffers, made on the allocating stream, are freed on return: keep them from reuse until
        # that stream's work is done
        for t in self.carry:
            for stream in self.streams if t is not None else ():
                t.record_stream(stream)
        return self.o, self.ht, self.h, self.vn


def kda_fwd_state(it: Intra, B: int, T: int, HV: int, chunk_size: int, initial_state, out_dtype,
                  output_final_state: bool, store_o: bool = True, store_h: bool = False,
                  h_dtype: torch.dtype = torch.float32, precision: str = "tf32", segments=None, on_segment=None,
                  parallel: int = 0, kd_t: bool = False):
    """Launch stage 2. Returns (o [B,T,HV,V] or None, final state or None, h [B*HV,NT,K,V] or None,
    Vn [B*HV,Tp,V] fp32 or None). `segments`: scan chunk range [n0, n1) after range, each starting from
    the previous one's end state (two fp32 carry buffers, alternating, so that the autotuner's repeated
    launches of one range read an unchanged start state), calling `on_segment(n0, n1, "start")` before
    each launch. `parallel` (>= 2; not with `segments`): the parallel scan, that many runs of chunks
    scanned at once from start states computed first (`scan_run_starts`)."""
    scan = StateScan(it, B, T, HV, chunk_size, initial_state, out_dtype, output_final_state, store_o, store_h,
                     h_dtype, precision, segments, parallel, kd_t)
    for i in range(len(scan.launches)):
        scan.launch(i, on_segment)
    return scan.finish()


def kda_fwd_o(it: Intra, h: torch.Tensor, vn: torch.Tensor, B: int, T: int, HV: int, chunk_size: int,
              out_dtype, precision: str = "tf32") -> torch.Tensor:
    """O [B, T, HV, V] from stage 1's Q e^Γ, Aqk and the scan's stored S_n, Vn (TUNING fwd_output "split")."""
    K, V = it.w.shape[-1], it.u.shape[-1]
    NT = cdiv(T, chunk_size)
    o = torch.empty(B, T, HV, V, device=it.w.device, dtype=out_dtype)
    # chunks on grid axis 0 (axes 1, 2 stop at 65535)
    _kda_fwd_o_kernel[lambda meta: (NT, cdiv(V, meta["BV"]), B * HV)](
        it.qg, it.aqk, h, vn, o, T, NT, next_pow2(NT * B * HV), HV=HV, K=K, V=V, BT=chunk_size,
        BK=max(16, next_pow2(K)), PREC=precision)
    return o
