"""Chunked KDA in torch for CPU training: `naive_chunk_kda`'s algebra with matmul intra-chunk scores.

The reference forms exp(Γ_i − Γ_j) for every pair (i, j) and key channel of a sub-chunk ([C, C, K]
tensors); here, as in the Triton kernels (docs/math.md §2.2), each 16-row sub-chunk of queries is
anchored at c = Γ of its first row, so the scores become one matmul (q ⊙ exp(Γ − c)) (k ⊙ exp(c − Γ))ᵀ;
the anchor depends on no later token, so outputs stay causal bit for bit. The chunk recurrence is
one batched matmul per chunk (S ← M S + R; M, R and the outputs' state-free parts are batched over
all chunks). At k3-toy's
shapes (B 8, T 256, H 8, K = V = 16, chunk 16) forward+backward took 125 → 18 ms on 2 CPU cores.
The anchoring is exact algebra while c − Γ stays below `MAX_REACH` inside a sub-chunk, which the
lower-bound gate guarantees (15 steps of g > −5); beyond it the call runs `naive_chunk_kda`, which
stays the test oracle (tests/ops/test_torch_chunk.py).
"""
from __future__ import annotations

import torch

from k3cli.ops.kda.naive import chunk_layout, naive_chunk_kda, naive_chunk_kda_varlen, solve_wu
from k3cli.ops.kda.varlen import lay_out, varlen_layout

SUB = 16  # query sub-chunk of the anchored scores, the reference's exact-block size
# largest c − Γ_j inside a sub-chunk: key factors and masked score products stay <= K·e^80, in fp32
MAX_REACH = 80.0


def sub_chunk(chunk_size: int) -> int:
    """Rows per anchored query sub-chunk: 16 where the chunk splits into them, else the whole chunk."""
    return SUB if chunk_size % SUB == 0 else chunk_size


def covers_gate(lower_bound: float, chunk_size: int) -> bool:
    """Whether every gate g > lower_bound keeps this chunk size on the fast path (no fallback)."""
    return -lower_bound * (sub_chunk(chunk_size) - 1) <= MAX_REACH


def torch_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    chunk_size=64, reach_checked=False, ctab=None):
    """Same arguments, returns and gradients as `naive_chunk_kda` (up to rounding).

    `reach_checked=True`: the caller guarantees the reach bound (`covers_gate` of its gate), so the
    data-dependent check and fallback are skipped and the call traces into one compiled graph.
    `ctab` (CPU, one entry per chunk, varlen.py): B = 1 inputs in the chunk-aligned layout of several
    sequences; the state restarts from initial_state[seq] (or zeros) at each sequence's first chunk, and the
    final state is a dict {seq: its end state}. Then, where the reach check fails, returns None."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C = chunk_size
    scale = K ** -0.5 if scale is None else scale
    wd, n, q_, k_, v_, b_, G, gam = chunk_layout(q, k, v, g, beta, initial_state, C)
    sub = sub_chunk(C)
    ns = C // sub
    # anchors: Γ at the first row of each query sub-chunk
    c = G[..., ::sub, :]                                                   # (B, HV, n, ns, K)
    c_rows = c.repeat_interleave(sub, dim=-2) if ns > 1 else c             # (B, HV, n, C | 1, K)
    if not reach_checked and not (c_rows.detach() - G.detach()).abs().amax() <= MAX_REACH:  # also NaN
        if ctab is not None:
            return None
        return naive_chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, chunk_size=chunk_size)
    e_q = (G - c_rows).exp()                                               # (B, HV, n, C, K)
    idx = torch.arange(C, device=q.device)
    if ns == 1:
        e_k = (c - G).exp()                                                # (B, HV, n, C, K)
        kk = k_ * e_k
        Mqk = (q_ * e_q) @ kk.transpose(-1, -2)                            # (B, HV, n, C, C)
        Mkk = (k_ * e_q) @ kk.transpose(-1, -2)
    else:
        # keys after a sub-chunk are masked: their exponent is zeroed so nothing overflows
        last = (torch.arange(ns, device=q.device) + 1) * sub                # (ns,)
        seen = idx[None, :] < last[:, None]                                 # (ns, C)
        e_k = torch.where(seen[..., None], c[..., :, None, :] - G[..., None, :, :], 0.0).exp()
        kk = k_[..., None, :, :] * e_k                                     # (B, HV, n, ns, C, K)
        lead = q_.shape[:-2]
        Mqk = ((q_ * e_q).reshape(*lead, ns, sub, K) @ kk.transpose(-1, -2)).reshape(*lead, C, C)
        Mkk = ((k_ * e_q).reshape(*lead, ns, sub, K) @ kk.transpose(-1, -2)).reshape(*lead, C, C)
    Aqk = torch.where(idx[:, None] >= idx[None, :], scale * Mqk, 0.0)
    Akk = torch.where(idx[:, None] > idx[None, :], Mkk, 0.0) * b_
    W, U = solve_wu(Akk, b_, k_, v_, G)
    qg = scale * q_ * G.exp()
    kd_t = (k_ * (gam - G).exp()).transpose(-1, -2)                        # (B, HV, n, K, C)
    # everything but the state is batched over chunks: o_i = P_i S_i + Aqk_i U_i and
    # S_{i+1} = M_i S_i + R_i, so the sequential part is one batched matmul per chunk
    P = qg - Aqk @ W                                                       # (B, HV, n, C, K)
    M = torch.diag_embed(gam.squeeze(-2).exp()) - kd_t @ W                 # (B, HV, n, K, K)
    R = kd_t @ U                                                           # (B, HV, n, K, V)
    zero = q.new_zeros(B, HV, K, V, dtype=wd)
    S = zero if initial_state is None or ctab is not None else initial_state.to(wd)
    states, ends = [], {}
    flags = None if ctab is None else ctab.tolist()
    # unbind, not [:, :, i]: a select's backward zero-fills a full-size gradient per chunk
    for i, (m_i, r_i) in enumerate(zip(M.unbind(2), R.unbind(2))):
        if flags is not None and flags[i] & 1:   # a sequence's first chunk: its own start state
            S = zero if initial_state is None else initial_state[flags[i] >> 2][None].to(wd)
        states.append(S)
        S = torch.baddbmm(r_i.reshape(-1, K, V), m_i.reshape(-1, K, K), S.reshape(-1, K, V)).view(B, HV, K, V)
        if flags is not None and flags[i] & 2:
            ends[flags[i] >> 2] = S[0]
    if flags is not None:
        S = ends
    o = P @ torch.stack(states, dim=2) + Aqk @ U                           # (B, HV, n, C, V)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * C, HV, V)[:, :T]
    return o.to(v.dtype if v.dtype != wd else wd), (S if output_final_state else None)


def torch_chunk_kda_varlen(q, k, v, g, beta, cu_seqlens, scale=None, initial_state=None, output_final_state=False,
                           chunk_size=64, reach_checked=False):
    """`torch_chunk_kda` over the sequences cu_seqlens cuts the B = 1 row into, in the chunk-aligned layout the
    kernels use (varlen.py): zero gaps so that each sequence starts on a chunk, the state restarting at each
    sequence's first chunk. Outputs and final states are each sequence's alone (checked against the
    per-sequence oracle `naive_chunk_kda_varlen`, which it falls back to where the reach check fails).
    Returns (o [1, total_T, HV, V], final states [N, HV, K, V] or None); empty sequences keep their initial
    state."""
    lay = varlen_layout(cu_seqlens, chunk_size, q.device)
    out = torch_chunk_kda(*(lay_out(x, lay) for x in (q, k, v, g, beta)), scale=scale, initial_state=initial_state,
                          output_final_state=True, chunk_size=chunk_size, reach_checked=reach_checked, ctab=lay.ctab)
    if out is None:
        return naive_chunk_kda_varlen(q, k, v, g, beta, cu_seqlens, scale, initial_state, output_final_state,
                                      chunk_size)
    o, ends = out
    o = o[:, lay.dst.to(o.device)]
    if not output_final_state:
        return o, None
    HV, K, V = v.shape[2], q.shape[-1], v.shape[-1]
    dt = next(iter(ends.values())).dtype if ends else torch.float32
    start = torch.zeros(lay.n_seq, HV, K, V, device=v.device) if initial_state is None else initial_state
    return o, torch.stack([ends[i] if i in ends else start[i].to(dt) for i in range(lay.n_seq)])
