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

from k3cli.ops.kda.naive import chunk_layout, naive_chunk_kda, solve_wu

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
                    chunk_size=64, reach_checked=False):
    """Same arguments, returns and gradients as `naive_chunk_kda` (up to rounding).

    `reach_checked=True`: the caller guarantees the reach bound (`covers_gate` of its gate), so the
    data-dependent check and fallback are skipped and the call traces into one compiled graph."""
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
    S = q.new_zeros(B, HV, K, V, dtype=wd) if initial_state is None else initial_state.to(wd)
    states = []
    # unbind, not [:, :, i]: a select's backward zero-fills a full-size gradient per chunk
    for m_i, r_i in zip(M.unbind(2), R.unbind(2)):
        states.append(S)
        S = torch.baddbmm(r_i.reshape(-1, K, V), m_i.reshape(-1, K, K), S.reshape(-1, K, V)).view(B, HV, K, V)
    o = P @ torch.stack(states, dim=2) + Aqk @ U                           # (B, HV, n, C, V)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * C, HV, V)[:, :T]
    return o.to(v.dtype if v.dtype != wd else wd), (S if output_final_state else None)


def torch_chunk_kda_varlen(q, k, v, g, beta, cu_seqlens, scale=None, initial_state=None, output_final_state=False,
                           chunk_size=64, reach_checked=False):
    """`torch_chunk_kda` over the sequences cu_seqlens cuts the B = 1 row into, batched: each non-empty sequence
    becomes a row of a [N, L_max] batch, zero-padded at its end. A padding token (q = k = v = 0, β = 0, g = 0)
    neither writes nor decays the state, so outputs and final states are each sequence's alone (checked
    against the per-sequence oracle `naive_chunk_kda_varlen`). Returns (o [1, total_T, HV, V], final states
    [N, HV, K, V] or None); empty sequences keep their initial state."""
    cu = cu_seqlens.to("cpu", torch.long)
    lens = cu[1:] - cu[:-1]
    N, HV, K, V = len(lens), v.shape[2], q.shape[-1], v.shape[-1]
    live = torch.nonzero(lens > 0).flatten()
    L = int(lens.max())
    # token j of live sequence i sits at row i, column j of the batch
    row = torch.repeat_interleave(torch.arange(len(live)), lens[live])
    col = torch.arange(int(cu[-1])) - cu[:-1][live][row]
    pos = (row * L + col).to(q.device)

    def batch(x):
        out = x.new_zeros(len(live) * L, *x.shape[2:])
        return out.index_copy(0, pos, x[0]).view(len(live), L, *x.shape[2:])
    h0 = None if initial_state is None else initial_state[live.to(initial_state.device)]
    o, ht = torch_chunk_kda(*(batch(x) for x in (q, k, v, g, beta)), scale=scale, initial_state=h0,
                            output_final_state=output_final_state, chunk_size=chunk_size,
                            reach_checked=reach_checked)
    o = o.reshape(len(live) * L, HV, V)[pos][None]
    if not output_final_state:
        return o, None
    states = (torch.zeros(N, HV, K, V, dtype=ht.dtype, device=ht.device) if initial_state is None
              else initial_state.to(ht.dtype).clone())
    return o, states.index_copy(0, live.to(ht.device), ht)
