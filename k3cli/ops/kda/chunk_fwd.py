"""Forward stages of the Triton chunked KDA (docs/math.md §2.2; derivation in README.md).

Stage 1, for each chunk range [n0, n1) (one range unless `chunk.plan` cuts the sequence into several):
  1a. `_kda_fwd_gamma_kernel`, per (chunk, batch*value-head, 64 key columns): Γ = chunk-local cumsum g
     into an fp32 buffer, the scans' gated operands Q e^Γ, K e^(γ-Γ), e^γ, and β K e^Γ into the W buffer;
  1b. `_kda_fwd_scores_kernel`, per (chunk x 16-row query sub-chunk, batch*value-head), or for K > 64
     per (chunk x 16 x 16 block pair, batch*value-head) (PER_PAIR): the anchored intra-chunk score blocks
     of Aqk and Akk from that Γ;
  1c. `_kda_fwd_tail_kernel`: Tm = (I + Akk)^-1 by fp32 block forward substitution, W (in place of
     β K e^Γ) and U.
Stage 2, `_kda_fwd_state_kernel`, one program per (value block, batch*value-head), sequential over
chunks: Vn = U - W S, O = scale (Q e^Γ) S + Aqk Vn, S <- e^γ S + (K e^(γ-Γ))^T Vn.
Intermediates live in a [B*HV, NT*BT, ...] layout padded to whole chunks (padded rows are zeros). With packed
sequences (GATHER, README.md §9) the same kernels run on the chunk-aligned layout but read the inputs and
store O at the token rows its map names, so the forward copies nothing.
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


# The sequential state scans trade parallelism (B*HV*V/BV programs) for work per program: BV 16 suits few
# long sequences (B1 T16384 H16 K=V=128 scan 0.548 ms at BV 16, 4 warps, 2 stages against 0.868 at BV 64,
# 8 warps), BV 64 many; the autotuner times them all, and prune_state_configs drops what cannot fit.
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
    16-bit dot operands unless the scan reads K_d^T as a tile (KD_T): with the register transpose, 32-wide
    tiles have hit illegal memory accesses on the H200 (Triton 3.6 wgmma); `fits(config, BV)` may drop more."""
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
def _blk(p, i, j, BT: tl.constexpr, BC: tl.constexpr):
    """Pointers to block (i, j) of size BC x BC inside a row-major [BT, BT] matrix at p."""
    o_c = tl.arange(0, BC)
    return p + (i * BC + o_c)[:, None] * BT + (j * BC + o_c)[None, :]


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """The non-solve products: PREC "bf16" / "fp16" rounds both (fp32) operands to that 16-bit type, fp32
    accumulation (the forward scans of 16-bit inputs); else fp32 operands at tl.dot input precision PREC."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _mm(a, b):
    # block products of the solve stay in full fp32 (docs/math.md §2.2 numerics)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _inverse16(b_a, BC: tl.constexpr):
    """(I + A)^-1 for one strictly lower BC x BC block (BC = 16): with P = -A nilpotent,
    Σ_{m<16} P^m = (I + P)(I + P^2)(I + P^4)(I + P^8) — six fp32 dots instead of a 16-step
    row loop whose cross-warp reductions dominated the kernel (0.48 ms at the toy shape)."""
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
def _token_rows(rows, i_b, t0, o_t, T, GATHER: tl.constexpr):
    """The input rows (int64) of positions t0 + o_t of sequence i_b, and which are real tokens: i_b*T + t0 + o_t
    below T; with GATHER (B = 1, varlen), `rows[t0 + o_t]`, a gap's -1 masked, so inputs are read in place."""
    if GATHER:
        r = tl.load(rows + t0 + o_t, mask=(t0 + o_t) < T, other=-1)
        return r.to(tl.int64), r >= 0
    else:
        # scalar offsets first: the form the kernels' H200 figures were measured with
        return (i_b * T + t0 + o_t).to(tl.int64), (t0 + o_t) < T


@triton.jit
def _head_rows(x, r, m_t, i_h, o_k, H: tl.constexpr, K: tl.constexpr):
    """Token rows r (real where m_t, `_token_rows`), columns o_k of head i_h of a [B, T, H, K] tensor, fp32,
    zeros in the other rows and past K."""
    m = m_t[:, None] & (o_k < K)[None, :]
    row = r * (H * K) + i_h * K
    return tl.load(x + row[:, None] + o_k[None, :], mask=m, other=0.).to(tl.float32)


@triton.jit
def _load_rows_qkg(q, k, g, r, m_t, i_h, i_hv, i_k, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                   BK: tl.constexpr):
    """Token rows r (real where m_t), key columns [i_k*BK, (i_k+1)*BK): q, k fp32 (head i_h) and g fp32
    (head i_hv); zeros in the other rows and past K."""
    o_k = i_k * BK + tl.arange(0, BK)
    return (_head_rows(q, r, m_t, i_h, o_k, H, K), _head_rows(k, r, m_t, i_h, o_k, H, K),
            _head_rows(g, r, m_t, i_hv, o_k, HV, K))


@triton.jit
def _load_chunk_qkg(q, k, g, r, m_t, i_h, i_hv, i_k, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                    BK: tl.constexpr):
    """A chunk's token rows r (real where m_t): q, k [BT, BK] fp32 of head i_h and Γ = chunk-local cumsum of
    g [BT, BK] fp32 of head i_hv, key columns [i_k*BK, (i_k+1)*BK)."""
    b_q, b_k, b_g = _load_rows_qkg(q, k, g, r, m_t, i_h, i_hv, i_k, H, HV, K, BK)
    return b_q, b_k, tl.cumsum(b_g, 0)


@triton.jit
def _subchunk_rows(q, k, g, i_b, i_h, i_hv, i_n, c, i_k, T, H: tl.constexpr, HV: tl.constexpr,
                   K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """Rows of sub-chunk c of chunk i_n of sequence i_b (`_load_rows_qkg` of [BC, BK]): q, k, g, no cumsum."""
    r, m_t = _token_rows(None, i_b, 0, i_n * BT + c * BC + tl.arange(0, BC), T, False)
    return _load_rows_qkg(q, k, g, r, m_t, i_h, i_hv, i_k, H, HV, K, BK)


@triton.jit
def _store_u(v, u, b_tm, b_beta, r_t, m_t, i_hv, base, HV: tl.constexpr, V: tl.constexpr,
             BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """U = Tm diag(β) V for one chunk (v's token rows r_t, real where m_t), one BV-column block at a time."""
    o_t = tl.arange(0, BT)
    for i_v in range((V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_v = v + r_t[:, None] * (HV * V) + i_hv * V + o_v[None, :]
        b_v = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32)
        b_u = _dot(b_tm, b_v * b_beta[:, None], PREC)
        tl.store(u + (base + o_t)[:, None] * V + o_v[None, :], b_u.to(u.dtype.element_ty), mask=m_v[None, :])


# chunk counts (NT, N0, N1, L) follow each batch's documents under packing: unspecialised, else the first
# batch whose count changes divisibility by 16 (Triton specialises on it) compiles each kernel again mid-run
@fast_launch
@triton.jit(do_not_specialize=["NT", "N0"])
def _kda_fwd_gamma_kernel(q, k, g, beta, rows, gc, qg, kd, eg, w, scale, T, NT, N0, H: tl.constexpr,
                          HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                          GATHER: tl.constexpr):
    """Stage 1a, one program per (chunk N0 + i, batch*value-head, BK key columns): Γ = chunk-local cumsum of
    g into the fp32 `gc` buffer, the state scans' gated operands scale·Q e^Γ, K e^(γ-Γ), e^γ, and β K e^Γ into
    the W buffer, which the tail reads (and overwrites with W) instead of reading k and g again."""
    i_n, i_bh, i_k = tl.program_id(0) + N0, tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    r_t, m_t = _token_rows(rows, i_b, 0, i_n * BT + o_t, T, GATHER)
    b_q, b_k, b_G = _load_chunk_qkg(q, k, g, r_t, m_t, i_h, i_hv, i_k, H, HV, K, BK)
    base = i_bh.to(tl.int64) * NT * BT + i_n * BT
    p_rk = (base + o_t)[:, None] * K + o_k[None, :]
    b_gam = tl.sum(tl.where(o_t[:, None] == BT - 1, b_G, 0.), 0)
    tl.store(gc + p_rk, b_G, mask=m_k[None, :])
    tl.store(qg + p_rk, (b_q * tl.exp(b_G) * scale).to(qg.dtype.element_ty), mask=m_k[None, :])
    tl.store(kd + p_rk, (b_k * tl.exp(b_gam[None, :] - b_G)).to(kd.dtype.element_ty), mask=m_k[None, :])
    tl.store(eg + (i_bh * NT + i_n).to(tl.int64) * K + o_k, tl.exp(b_gam), mask=m_k)
    # formed again rather than kept live across the stores: keeping it cost 104 B of spill (sm_90, K = 128)
    r_t, m_t = _token_rows(rows, i_b, i_n * BT, o_t, T, GATHER)
    b_beta = tl.load(beta + r_t * HV + i_hv, mask=m_t, other=0.)
    b_x = b_k * tl.exp(b_G) * b_beta.to(tl.float32)[:, None]
    tl.store(w + p_rk, b_x.to(w.dtype.element_ty), mask=m_k[None, :])


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


@triton.jit
def _score_pair(q_h, k_h, gc_n, rows, a, c, t_a, t_c, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, GATHER: tl.constexpr):
    """The raw BC x BC products of query sub-chunk a (token rows from t_a) with key sub-chunk c (from t_c)
    of one chunk, over BK-column key blocks, from the stored Γ (`gc_n`: this chunk's [BT, K] rows),
    anchored at Γ of sub-chunk a's first row A, so that no factor depends on a later token and every
    exponent of a pair below the diagonal is <= 0:
    q·k: Σ_d (q_id e^(Γ_id - A_d)) (k_jd e^(A_d - Γ_jd)), and the same with k_i for q_i.
    GATHER: q and k rows through `rows` (`_token_rows`), by pointer tiles instead of block pointers."""
    b_sq = tl.zeros([BC, BC], dtype=tl.float32)
    b_sk = tl.zeros([BC, BC], dtype=tl.float32)
    if GATHER:
        # sub-chunk a's rows read here again, not passed in: passing them spilled differently (ptxas, sm_90)
        o_c = tl.arange(0, BC)
        r_a, m_a = _token_rows(rows, 0, t_a, o_c, T, True)
        r_c, m_c = _token_rows(rows, 0, t_c, o_c, T, True)
    for i_k in range((K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_A = tl.load(gc_n + a * BC * K + o_k, mask=o_k < K, other=0.)
        p_ga = tl.make_block_ptr(gc_n, (BT, K), (K, 1), (a * BC, i_k * BK), (BC, BK), (1, 0))
        b_e = tl.exp(tl.load(p_ga, boundary_check=(1,), padding_option="zero") - b_A[None, :])
        p_gt = tl.make_block_ptr(gc_n, (K, BT), (1, K), (i_k * BK, c * BC), (BK, BC), (0, 1))
        if GATHER:
            m_k = o_k < K
            m_ak = m_a[:, None] & m_k[None, :]
            b_kt = tl.load(k_h + r_c[None, :] * (H * K) + o_k[:, None], mask=m_k[:, None] & m_c[None, :],
                           other=0.).to(tl.float32)
            b_kt *= tl.exp(b_A[:, None] - tl.load(p_gt, boundary_check=(0,), padding_option="zero"))
            b_qa = tl.load(q_h + r_a[:, None] * (H * K) + o_k[None, :], mask=m_ak, other=0.).to(tl.float32)
            b_ka = tl.load(k_h + r_a[:, None] * (H * K) + o_k[None, :], mask=m_ak, other=0.).to(tl.float32)
        else:
            # the key side loaded transposed, [BK, BC]
            p_kt = tl.make_block_ptr(k_h, (K, T), (1, H * K), (i_k * BK, t_c), (BK, BC), (0, 1))
            b_kt = tl.load(p_kt, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
            b_kt *= tl.exp(b_A[:, None] - tl.load(p_gt, boundary_check=(0,), padding_option="zero"))
            p_q = tl.make_block_ptr(q_h, (T, K), (H * K, 1), (t_a, i_k * BK), (BC, BK), (1, 0))
            p_k = tl.make_block_ptr(k_h, (T, K), (H * K, 1), (t_a, i_k * BK), (BC, BK), (1, 0))
            b_qa = tl.load(p_q, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
            b_ka = tl.load(p_k, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        b_sq += _dot(b_qa * b_e, b_kt, PREC)
        b_sk += _dot(b_ka * b_e, b_kt, PREC)
    return b_sq, b_sk


@triton.jit
def _score_diag(q_h, k_h, gc_n, rows, a, t_a, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, BK: tl.constexpr, GATHER: tl.constexpr):
    """`_score_pair` of sub-chunk a with itself, pair by pair: Σ_d q_id k_jd e^(Γ_id - Γ_jd) with every
    exponent <= 0 for j <= i (rows i < j hold garbage the stores mask), exact for any decay, where the
    anchored key factors e^(A - Γ_j) overflow once a step decays below -5 (README.md "Exponents")."""
    b_sq = tl.zeros([BC, BC], dtype=tl.float32)
    b_sk = tl.zeros([BC, BC], dtype=tl.float32)
    o_c = tl.arange(0, BC)
    if GATHER:
        r_a, m_a = _token_rows(rows, 0, t_a, o_c, T, True)
    for i_k in range((K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        p_ga = tl.make_block_ptr(gc_n, (BT, K), (K, 1), (a * BC, i_k * BK), (BC, BK), (1, 0))
        b_G = tl.load(p_ga, boundary_check=(1,), padding_option="zero")
        if GATHER:
            m_ak = m_a[:, None] & (o_k < K)[None, :]
            b_qa = tl.load(q_h + r_a[:, None] * (H * K) + o_k[None, :], mask=m_ak, other=0.).to(tl.float32)
            b_ka = tl.load(k_h + r_a[:, None] * (H * K) + o_k[None, :], mask=m_ak, other=0.).to(tl.float32)
        else:
            p_q = tl.make_block_ptr(q_h, (T, K), (H * K, 1), (t_a, i_k * BK), (BC, BK), (1, 0))
            p_k = tl.make_block_ptr(k_h, (T, K), (H * K, 1), (t_a, i_k * BK), (BC, BK), (1, 0))
            b_qa = tl.load(p_q, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
            b_ka = tl.load(p_k, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        for j in range(BC):
            sel = o_c == j
            b_kj = tl.sum(tl.where(sel[:, None], b_ka, 0.), 0)
            b_Gj = tl.sum(tl.where(sel[:, None], b_G, 0.), 0)
            b_e = tl.exp(tl.minimum(b_G - b_Gj[None, :], 0.)) * b_kj[None, :]
            b_sq += tl.where(sel[None, :], tl.sum(b_qa * b_e, 1)[:, None], 0.)
            b_sk += tl.where(sel[None, :], tl.sum(b_ka * b_e, 1)[:, None], 0.)
    return b_sq, b_sk


@triton.jit
def _scores(q_h, k_h, gc_n, rows, a, c, t_a, t_c, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
            BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, GATHER: tl.constexpr, EXACT: tl.constexpr):
    """The raw products of block (a, c): anchored (`_score_pair`), or with EXACT the diagonal one pair by
    pair (`_score_diag`). Once per program only: this branch inside the per-sub-chunk loop faulted on CUDA."""
    if EXACT:
        if c == a:
            b_sq, b_sk = _score_diag(q_h, k_h, gc_n, rows, a, t_a, T, H, K, BT, BC, BK, GATHER)
        else:
            b_sq, b_sk = _score_pair(q_h, k_h, gc_n, rows, a, c, t_a, t_c, T, H, K, BT, BC, BK, PREC, GATHER)
    else:
        b_sq, b_sk = _score_pair(q_h, k_h, gc_n, rows, a, c, t_a, t_c, T, H, K, BT, BC, BK, PREC, GATHER)
    return b_sq, b_sk


@fast_launch
@triton.jit(do_not_specialize=["NT", "N0"])
def _kda_fwd_scores_kernel(q, k, gc, beta, rows, aqk, tm, mkk, scale, T, NT, N0, H: tl.constexpr,
                           HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                           PREC: tl.constexpr, STORE_MKK: tl.constexpr, PER_PAIR: tl.constexpr,
                           GATHER: tl.constexpr, EXACT: tl.constexpr):
    """Stage 1b, one program per (chunk x query sub-chunk a, batch*value-head): the BC x BC score blocks
    (a, c) of rows [a*BC, (a+1)*BC), c <= a (`_score_pair`). Writes scale·Aqk (j <= i) to aqk, β_i Akk
    (j < i) to tm, raw Akk to mkk with STORE_MKK, and zeros in the blocks c > a. PER_PAIR: one program per
    (chunk x block pair (a, c), c <= a) instead, NC(NC+1)/2 per chunk, each one block (the diagonal one also
    writes row a's zero blocks): balanced programs, and a key-block loop the compiler may pipeline. EXACT:
    the diagonal blocks pair by pair (`_score_diag`), for a decay without a lower bound."""
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
    r_i, m_i = _token_rows(rows, i_b, i_n * BT, i_row, T, GATHER)
    base = i_bh.to(tl.int64) * NT * BT + i_n * BT
    b_beta = tl.load(beta + r_i * HV + i_hv, mask=m_i, other=0.)
    b_beta = b_beta.to(tl.float32)
    # scalar bases and block pointers (64-bit pointer tiles cost two registers per element)
    q_h = q + (i_b.to(tl.int64) * T * H + i_h) * K
    k_h = k + (i_b.to(tl.int64) * T * H + i_h) * K
    gc_n = gc + base * K
    t_a = i_n * BT + a * BC
    p_row = (base + i_row)[:, None] * BT
    # runtime loops (not unrolled: unrolled, the compiler kept every pair's tiles live, 255 registers)
    # EXACT per sub-chunk: the diagonal block after the anchored loop (a branch inside it faulted on CUDA)
    if PER_PAIR:
        c = c_first
        j_col = c * BC + o_c
        b_sq, b_sk = _scores(q_h, k_h, gc_n, rows, a, c, t_a, i_n * BT + c * BC, T, H, K, BT, BC, BK, PREC, GATHER,
                             EXACT)
        _store_score_block(aqk, tm, mkk, p_row + j_col[None, :], i_row, j_col, b_sq, b_sk, b_beta, scale, STORE_MKK)
        # the diagonal block's program also writes the zero blocks right of it (none when the chunk is one
        # sub-chunk; the loop left in for NC = 1 crashes Triton's coalesce pass)
        if NC > 1:
            if c == a:
                _store_zero_blocks(aqk, tm, mkk, p_row, i_row, a + 1, o_c, b_beta, scale, NC, BC, STORE_MKK)
    else:
        c = c_first
        c_end = a + 1
        if EXACT:
            c_end = a
        if NC > 1 or not EXACT:   # (an empty loop crashes Triton's coalesce pass)
            while c < c_end:
                j_col = c * BC + o_c
                b_sq, b_sk = _score_pair(q_h, k_h, gc_n, rows, a, c, t_a, i_n * BT + c * BC, T, H, K, BT, BC, BK,
                                         PREC, GATHER)
                _store_score_block(aqk, tm, mkk, p_row + j_col[None, :], i_row, j_col, b_sq, b_sk, b_beta, scale,
                                   STORE_MKK)
                c += 1
        if EXACT:
            j_col = a * BC + o_c
            b_sq, b_sk = _score_diag(q_h, k_h, gc_n, rows, a, t_a, T, H, K, BT, BC, BK, GATHER)
            _store_score_block(aqk, tm, mkk, p_row + j_col[None, :], i_row, j_col, b_sq, b_sk, b_beta, scale,
                               STORE_MKK)
            c += 1
        if NC > 1:   # (one sub-chunk has none, and an empty loop crashes the coalesce pass)
            _store_zero_blocks(aqk, tm, mkk, p_row, i_row, c, o_c, b_beta, scale, NC, BC, STORE_MKK)


@fast_launch
@triton.jit(do_not_specialize=["NT", "N0"])
def _kda_fwd_tail_kernel(v, beta, rows, w, u, tm, T, NT, N0, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         PREC: tl.constexpr, GATHER: tl.constexpr):
    """Stage 1c, one program per (chunk N0 + i, batch*value-head): the solve Tm = (I + Akk)^-1 in place of
    the tm buffer, then W = Tm (β K e^Γ) in place of the W buffer (BK columns at a time) and U = Tm diag(β) V."""
    i_n, i_bh = tl.program_id(0) + N0, tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    o_t = tl.arange(0, BT)
    r_t, m_t = _token_rows(rows, i_b, i_n * BT, o_t, T, GATHER)
    base = i_bh.to(tl.int64) * NT * BT + i_n * BT
    b_beta = tl.load(beta + r_t * HV + i_hv, mask=m_t, other=0.)
    b_beta = b_beta.to(tl.float32)
    tl.debug_barrier()
    b_tm = _unit_lower_inverse(tm + base * BT, BT, BC)
    for i_k in range((K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_w = w + (base + o_t)[:, None] * K + o_k[None, :]
        b_x = tl.load(p_w, mask=m_k[None, :], other=0.).to(tl.float32)
        b_w = _dot(b_tm, b_x, PREC)
        tl.store(p_w, b_w.to(w.dtype.element_ty), mask=m_k[None, :])
    _store_u(v, u, b_tm, b_beta, r_t, m_t, i_hv, base, HV, V, BT, BV, PREC)


@triton.jit
def _kda_fwd_state_step(qg, kd, eg, w, u, aqk, o, h, vn, rows, b_s, i_b, i_hv, i_bh, i_v, i_n, T, NT,
                        HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        STORE_O: tl.constexpr, STORE_H: tl.constexpr, PREC: tl.constexpr, KD_T: tl.constexpr,
                        GATHER: tl.constexpr):
    """One chunk of the state scan: emit O (to its token rows, `_token_rows`) (and S, Vn for the backward),
    return the next S. KD_T: read K_d^T as a [BK, BT] tile straight from memory instead of transposing the
    loaded [BT, BK] tile."""
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
        r_t, m_t = _token_rows(rows, i_b, i_n * BT, o_t, T, GATHER)
        p_o = o + r_t[:, None] * (HV * V) + i_hv * V + o_v[None, :]
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


@triton.jit
def _varlen_bounds(seqs, i_p):
    """Variable-length scans: row i_p's (sequence, first chunk, end chunk) of `seqs` [N, 3]."""
    return tl.load(seqs + 3 * i_p), tl.load(seqs + 3 * i_p + 1), tl.load(seqs + 3 * i_p + 2)


MAX_GRID_Z = 65535   # CUDA's gridDim.z limit: a packed batch cut at every token has B·T sequences


def seq_launches(n: int) -> list[tuple[int, int]]:
    """(first row, rows) of each launch of a per-sequence scan over n rows of `seqs`: at most MAX_GRID_Z
    programs along grid z per launch."""
    return [(p0, min(MAX_GRID_Z, n - p0)) for p0 in range(0, n, MAX_GRID_Z)]


@fast_launch
@triton.autotune(
    configs=pick_configs(STATE_CONFIGS),
    key=["BK", "BT", "NBH", "V", "PREC", "KD_T"],
    prune_configs_by={"early_config_prune": prune_state_configs},
)
@triton.jit(do_not_specialize=["NT", "N0", "N1", "L"])
def _kda_fwd_state_kernel(qg, kd, eg, w, u, aqk, o, h0, ht, h, vn, seqs, rows, P0, T, NT, NBH, N0, N1, L,
                          SEG_STRIDE, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_O: tl.constexpr,
                          STORE_H: tl.constexpr, INTERPRET: tl.constexpr, PREC: tl.constexpr,
                          KD_T: tl.constexpr, VARLEN: tl.constexpr, GATHER: tl.constexpr):
    """The state scan over chunks [N0, N1) from h0 (or zeros), storing the end state to ht. VARLEN (B = 1):
    program_id(2) scans the chunks of one sequence, row P0 + program_id(2) of `seqs`, from and to its block of
    h0 and ht [N, HV, K, V]; GATHER: O goes to the token rows `rows` names (`_token_rows`)."""
    i_v, i_bh, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    # Without VARLEN the bounds and offsets keep the form of the kernel the H200 figures were measured on: a
    # run of L chunks per program_id(2) (always 0 there: L = N1 - N0, SEG_STRIDE = 0). ptxas allocates a
    # plain [N0, N1) loop differently (K=V=128, BV 64, 8 warps: 128 B of spill instead of 16).
    if VARLEN:
        i_s, n0, n1 = _varlen_bounds(seqs, P0 + i_p)
        seg = i_s.to(tl.int64) * HV * K * V
    else:
        seg = i_p.to(tl.int64) * SEG_STRIDE
    if USE_H0:
        h0 += seg
    b_s, p_state, m_kv = _scan_start(h0, i_bh, i_v, K, V, BK, BV, USE_H0)
    if not VARLEN:
        n0 = N0 + i_p * L
        n1 = tl.minimum(n0 + L, N1)
    if INTERPRET:
        # the interpreter cannot take a runtime bound in range() with numpy >= 2.4
        i_n = n0
        while i_n < n1:
            b_s = _kda_fwd_state_step(qg, kd, eg, w, u, aqk, o, h, vn, rows, b_s, i_b, i_hv, i_bh, i_v, i_n, T,
                                      NT, HV, K, V, BT, BK, BV, STORE_O, STORE_H, PREC, KD_T, GATHER)
            i_n += 1
    else:
        for i_n in range(n0, n1):
            b_s = _kda_fwd_state_step(qg, kd, eg, w, u, aqk, o, h, vn, rows, b_s, i_b, i_hv, i_bh, i_v, i_n, T,
                                      NT, HV, K, V, BT, BK, BV, STORE_O, STORE_H, PREC, KD_T, GATHER)
    if STORE_HT:
        if VARLEN:
            tl.store(ht + seg + p_state, b_s, mask=m_kv)   # an empty sequence stores its start state
        elif n1 == N1:
            tl.store(ht + p_state, b_s, mask=m_kv)


class Intra(NamedTuple):
    """Stage-1 buffers, all [B*HV, NT*BT, X] (eg: [B*HV, NT, K]); dtypes as `chunk.plan` picks them."""
    w: torch.Tensor      # Tm diag(β) (K ⊙ e^Γ)
    u: torch.Tensor      # Tm diag(β) V
    qg: torch.Tensor     # scale · Q ⊙ e^Γ
    kd: torch.Tensor     # K ⊙ e^(γ - Γ)
    eg: torch.Tensor     # e^γ per chunk
    aqk: torch.Tensor    # scale-weighted causal scores, lower incl. diagonal
    tm: torch.Tensor     # (I + Akk)^-1
    mkk: torch.Tensor | None   # raw Mkk (strictly lower, no β), kept for the backward's dβ term
    gc: torch.Tensor | None    # Γ, fp32, read by the score launch only (dropped after the forward)


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


# Stage-1 launch shapes: small programs, many per SM (forward 1.684 -> 1.083 ms at B8 T2048 H16 K=V=128,
# H200 bf16, against one program per chunk doing all of stage 1).
GAMMA_BK, GAMMA_WARPS = 64, 4      # 0.145 ms against 0.190 with 32 key columns at that shape
SCORES_BK, SCORES_WARPS = 64, 1    # one key block per step of the score launch
TAIL_BK, TAIL_WARPS = 32, 2


def intra_buffers(B: int, T: int, HV: int, K: int, V: int, chunk_size: int, plan, store_mkk: bool,
                  device) -> Intra:
    """Stage 1's buffers, unfilled (also the fake implementation's outputs: one layout for both)."""
    BT = chunk_size
    rows = (B * HV, cdiv(T, BT) * BT)
    tm = torch.empty(*rows, BT, device=device, dtype=torch.float32)
    return Intra(w=torch.empty(*rows, K, device=device, dtype=plan.inter_dtype),
                 u=torch.empty(*rows, V, device=device, dtype=plan.inter_dtype),
                 qg=torch.empty(*rows, K, device=device, dtype=plan.gated_dtype),
                 kd=torch.empty(*rows, K, device=device, dtype=plan.gated_dtype),
                 eg=torch.empty(B * HV, cdiv(T, BT), K, device=device, dtype=torch.float32),
                 aqk=torch.empty(*rows, BT, device=device, dtype=plan.aqk_dtype),
                 tm=tm, mkk=torch.empty_like(tm) if store_mkk else None,
                 gc=torch.empty(*rows, K, device=device, dtype=torch.float32))


def kda_fwd_intra(q, k, v, g, beta, scale: float, chunk_size: int, plan, store_mkk: bool,
                  ranges: list[tuple[int, int]] | None = None, on_range=None, rows=None) -> Intra:
    """Launch stage 1 for chunk range after range (`ranges`, default all chunks), calling `on_range(n0, n1)`
    after each. Buffer dtypes, dot precision and the score launch's form come from `plan` (chunk.Plan);
    `store_mkk` keeps the raw Mkk for the backward. With `rows` (int32 [T'] on the device, varlen.VarlenLayout's
    `tok`), the inputs are one flattened row [1, total_T, ...] read in place, position t of the T'-long
    layout being token rows[t] (-1: a gap)."""
    B, T, H, K = q.shape
    if rows is not None:
        T = rows.numel()
    HV, V = v.shape[2], v.shape[3]
    BT = chunk_size
    NT = cdiv(T, BT)
    it = intra_buffers(B, T, HV, K, V, chunk_size, plan, store_mkk, q.device)
    w, u, qg, kd, eg, aqk, tm, mkk, gc = it
    BK = max(16, next_pow2(K))
    BV = min(64, max(16, next_pow2(V)))
    BC = min(16, BT)
    NC = BT // BC
    BKg = min(BK, GAMMA_BK)
    mkk_arg = tm if mkk is None else mkk   # any fp32 buffer when STORE_MKK is off (never written)
    for n0, n1 in ranges or [(0, NT)]:
        n = n1 - n0
        _kda_fwd_gamma_kernel[(n, B * HV, cdiv(K, BKg))](
            q, k, g, beta, rows, gc, qg, kd, eg, w, scale, T, NT, n0, H=H, HV=HV, K=K, BT=BT, BK=BKg,
            GATHER=rows is not None, num_warps=GAMMA_WARPS, num_stages=1)
        _kda_fwd_scores_kernel[(n * (NC * (NC + 1) // 2 if plan.per_pair else NC), B * HV)](
            q, k, gc, beta, rows, aqk, tm, mkk_arg, scale, T, NT, n0, H=H, HV=HV, K=K, BT=BT, BC=BC,
            BK=min(BK, SCORES_BK), PREC=plan.prec, STORE_MKK=store_mkk, PER_PAIR=plan.per_pair,
            GATHER=rows is not None, EXACT=not plan.bounded, num_warps=SCORES_WARPS, num_stages=plan.score_stages)
        _kda_fwd_tail_kernel[(n, B * HV)](
            v, beta, rows, w, u, tm, T, NT, n0, HV=HV, K=K, V=V, BT=BT, BC=BC, BK=min(BK, TAIL_BK), BV=BV,
            PREC=plan.prec, GATHER=rows is not None, num_warps=TAIL_WARPS, num_stages=1)
        if on_range is not None:
            on_range(n0, n1)
    return it


def kda_fwd_state(it: Intra, B: int, T: int, HV: int, chunk_size: int, initial_state, precision: str,
                  o_dtype: torch.dtype | None = None, output_final_state: bool = False,
                  ranges: list[tuple[int, int]] | None = None, on_range=None, seqs=None, n_run: int | None = None,
                  rows=None, n_tokens: int | None = None):
    """Launch stage 2, one launch per chunk range (`ranges`, default all chunks; `on_range(n0, n1)` is called
    before each), each starting from the previous one's end state. With `o_dtype` the scan forms O; without
    it (the backward's re-scan) it stores the chunk start states S_n and pseudo-values Vn instead.
    Returns (o [B,T,HV,V] or None, final state [B,HV,K,V] fp32 or None, S_n [B*HV,NT,K,V] fp32 or None,
    Vn [B*HV,NT*BT,V] fp32 or None). With `seqs` (int32 [N, 3], B = 1, varlen.VarlenLayout) the chunks hold N
    sequences, scanned in parallel: initial_state and the final state are [N, HV, K, V], `ranges` must be None;
    its first `n_run` rows (default all) are the sequences with chunks (the rest are empty: they only store
    their start state, so they get programs only with `output_final_state`). With `rows` (as `kda_fwd_intra`'s)
    O is [1, n_tokens, HV, V], each position stored to its token row (gaps dropped)."""
    K, V = it.w.shape[-1], it.u.shape[-1]
    BT = chunk_size
    NT = cdiv(T, BT)
    dev = it.w.device
    store_o = o_dtype is not None
    o_len = T if rows is None else n_tokens
    o = torch.empty(B, o_len, HV, V, device=dev, dtype=o_dtype) if store_o else None
    n_seq = 1 if seqs is None else len(seqs)
    ht = torch.empty(B * n_seq, HV, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    pieces = seq_launches(n_seq if output_final_state or n_run is None else n_run)
    h = None if store_o else torch.empty(B * HV, NT, K, V, device=dev, dtype=torch.float32)
    vn = None if store_o else torch.empty(B * HV, NT * BT, V, device=dev, dtype=torch.float32)
    ranges = ranges or [(0, NT)]
    # two fp32 carries, alternating, so that the autotuner's repeated launches of a range see its start state
    carry = [torch.empty(B, HV, K, V, device=dev, dtype=torch.float32) for _ in range(2)] if len(ranges) > 1 else []
    s_in, streams = initial_state, []
    for i, (n0, n1) in enumerate(ranges):
        s_out = ht if i == len(ranges) - 1 else carry[i % 2]
        if on_range is not None:
            on_range(n0, n1)
        # the forward scan loads K_d^T as a tile (scan alone 0.548 against 0.868 ms at B1 T16384 H16 K=V=128);
        # the re-scan keeps the register transpose (fwd+bwd 4.624 against 4.826 ms with the tile)
        for p0, n_p in pieces:
            # the autotuner key counts the table's rows (fixed for a batch shape), not the launched (data-dependent)
            _kda_fwd_state_kernel[lambda meta, n_p=n_p: (cdiv(V, meta["BV"]), B * HV, n_p)](
                it.qg, it.kd, it.eg, it.w, it.u, it.aqk, o, s_in, s_out, h, vn, seqs, rows, p0, T, NT,
                next_pow2(B * HV * n_seq), n0, n1, n1 - n0, 0, HV=HV, K=K, V=V, BT=BT, BK=max(16, next_pow2(K)),
                USE_H0=s_in is not None, STORE_HT=s_out is not None, STORE_O=store_o, STORE_H=not store_o,
                INTERPRET=interpreting(it.w), PREC=precision, KD_T=store_o, VARLEN=seqs is not None,
                GATHER=rows is not None)
        if carry and dev.type == "cuda" and torch.cuda.current_stream(dev) not in streams:
            streams.append(torch.cuda.current_stream(dev))
        s_in = s_out
    # the scans may have run on a side stream (on_range switched to it): keep the carries from reuse until
    # that stream's work is done
    for t in carry:
        for stream in streams:
            t.record_stream(stream)
    return o, ht, h, vn
