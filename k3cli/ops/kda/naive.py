"""Pure-torch references for Kimi Delta Attention (docs/math.md §2; derivation in README.md).

Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] log-decay (<= 0); beta [B, T, HV];
state [B, HV, K, V] fp32; HV = G * H, value head hv reads q/k head hv // G.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3cli.ops.precision import widen, work_dtype


def _expand_groups(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[B, T, H, K] -> [B, T, HV, K]; autograd sums the G copies back (GVA)."""
    g = hv // x.shape[2]
    return x if g == 1 else x.repeat_interleave(g, dim=2)


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """Token-by-token KDA recurrence (docs/math.md §2.1), the definition every kernel is tested against.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] log-decay; beta: [B, T, HV].
        scale: query scale, default K ** -0.5.
        initial_state: [B, HV, K, V] or None (zeros).
    Returns:
        o [B, T, HV, V] in v.dtype, final state [B, HV, K, V] (fp32, fp64 for fp64 inputs) or None.
    """
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    wd = work_dtype(q, k, v, g, beta, initial_state)
    q, k = _expand_groups(q, HV).to(wd), _expand_groups(k, HV).to(wd)
    v, g, beta = v.to(wd), g.to(wd), beta.to(wd)
    S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(wd)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]                                   # (B, HV, K, V)
        p = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * (v[:, t] - p))
        outs.append(torch.einsum("bhkv,bhk->bhv", S, scale * q[:, t]))
    o = torch.stack(outs, dim=1) if T > 0 else v.new_zeros(B, 0, HV, V)
    return o.to(v.dtype if v.dtype != wd else wd), (S if output_final_state else None)


def chunk_local_cumsum(g: torch.Tensor, chunk_size: int, reverse: bool = False) -> torch.Tensor:
    """Inclusive cumsum of g [B, T, ...] along T, restarting every chunk_size tokens (fp32)."""
    B, T = g.shape[:2]
    n = -(-T // chunk_size)
    pad = n * chunk_size - T
    x = widen(g)
    x = F.pad(x, (0, 0) * (g.dim() - 2) + (0, pad)).view(B, n, chunk_size, *g.shape[2:])
    if reverse:
        x = x.flip(2).cumsum(2).flip(2)
    else:
        x = x.cumsum(2)
    return x.reshape(B, n * chunk_size, *g.shape[2:])[:, :T]


def naive_kda_gate(g_raw, A_log, dt_bias=None, lower_bound=-5.0):
    """Lower-bound gate (docs/math.md §2.3): L * sigmoid(exp(A_log) * (g_raw + dt_bias)) in fp32
    (fp64 when any input is fp64, like the other references here); lower_bound None: the softplus gate.

    Args: g_raw [B, T, HV, K]; A_log [HV]; dt_bias [HV, K] or None.  Returns g [B, T, HV, K].
    """
    if lower_bound is None:
        return naive_kda_softplus_gate(g_raw, A_log, dt_bias)
    wd = work_dtype(g_raw, A_log, dt_bias)
    x = g_raw.to(wd)
    if dt_bias is not None:
        x = x + dt_bias.to(wd)
    return lower_bound * torch.sigmoid(A_log.to(wd).exp()[:, None] * x)


def naive_kda_softplus_gate(g_raw, A_log, dt_bias=None):
    """Softplus gate (Kimi Linear's, docs/math.md §2.3): −exp(A_log) * softplus(g_raw + dt_bias) in fp32
    (fp64 when any input is fp64). No lower bound: one step may decay by far more than e^−5.

    Args: g_raw [B, T, HV, K]; A_log [HV]; dt_bias [HV, K] or None.  Returns g [B, T, HV, K].
    """
    wd = work_dtype(g_raw, A_log, dt_bias)
    x = g_raw.to(wd)
    if dt_bias is not None:
        x = x + dt_bias.to(wd)
    return -A_log.to(wd).exp()[:, None] * torch.nn.functional.softplus(x)


def _intra_scores(a, b, G, sub):
    """M[i, j] = sum_d a_id b_jd exp(G_id - G_jd) for j <= i inside each chunk, else 0.

    a, b, G: [..., C, K]. Blocks strictly below the diagonal use the factorisation
    exp(G_i - c) * exp(c - G_j) with c = G at the first row of the query sub-chunk (both factors
    <= 1); the diagonal sub-blocks use exact pairwise differences (safe for any g).
    """
    C, K = a.shape[-2:]
    ns = C // sub
    lead = a.shape[:-2]
    idx = torch.arange(C, device=a.device)
    # anchors: G at the first row of each query sub-chunk, broadcast to that sub-chunk's rows
    c = G[..., ::sub, :]                                                   # (..., ns, K)
    c_rows = c.repeat_interleave(sub, dim=-2)                              # (..., C, K)
    a_sc = a * (G - c_rows).exp()                                          # query side, <= 1
    # key side for every anchor: exp(c_s - G_j), only used where j precedes sub-chunk s
    before = idx[None, :] < (torch.arange(ns, device=a.device) * sub)[:, None]   # (ns, C)
    expo = torch.where(before[..., None], c[..., :, None, :] - G[..., None, :, :], 0.0)
    b_sc = b[..., None, :, :] * expo.exp()                                 # (..., ns, C, K)
    a_blk = a_sc.reshape(*lead, ns, sub, K)
    off = torch.einsum("...sik,...sjk->...sij", a_blk, b_sc)               # (..., ns, sub, C)
    off = torch.where(before[:, None, :], off, 0.0).reshape(*lead, C, C)
    # diagonal sub-blocks: exact exp(G_i - G_j) for j <= i in the same sub-chunk
    Gb = G.reshape(*lead, ns, sub, K)
    tri = torch.tril(torch.ones(sub, sub, dtype=torch.bool, device=a.device))
    d = torch.where(tri[..., None], Gb[..., :, None, :] - Gb[..., None, :, :], 0.0)
    diag = torch.einsum("...sik,...sjk,...sijk->...sij", a.reshape(*lead, ns, sub, K),
                        b.reshape(*lead, ns, sub, K), d.exp())
    diag = torch.where(tri, diag, 0.0)
    return off + _scatter_diag(diag)


def _scatter_diag(diag):
    """[..., ns, sub, sub] diagonal blocks -> [..., C, C] block-diagonal matrix."""
    *lead, ns, sub, _ = diag.shape
    eye = torch.eye(ns, dtype=diag.dtype, device=diag.device)
    full = diag[..., :, :, None, :] * eye[:, None, :, None]                 # (..., ns, sub, ns, sub)
    return full.reshape(*lead, ns * sub, ns * sub)


def chunk_layout(q, k, v, g, beta, initial_state, C: int):
    """The chunked form's inputs: (work dtype, chunks n, q, k, v, beta as (B, HV, n, C, X) in the work dtype
    with the tail zero-padded, Γ = chunk-local cumsum of g, γ = Γ's last row (B, HV, n, 1, K))."""
    B, T = q.shape[:2]
    HV = v.shape[2]
    wd = work_dtype(q, k, v, g, beta, initial_state)
    n = max(1, -(-T // C))
    pad = n * C - T

    def prep(x):                                                           # (B, T, HV, X) -> (B, HV, n, C, X)
        x = F.pad(x.to(wd), (0, 0, 0, 0, 0, pad))
        return x.view(B, n, C, HV, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q_, k_ = prep(_expand_groups(q, HV)), prep(_expand_groups(k, HV))
    v_, g_ = prep(v), prep(g)
    b_ = prep(beta[..., None])                                             # (B, HV, n, C, 1)
    G = g_.cumsum(-2)                                                      # Γ, (B, HV, n, C, K)
    return wd, n, q_, k_, v_, b_, G, G[..., -1:, :]


def solve_wu(Akk, b_, k_, v_, G):
    """W = (I + Akk)^-1 diag(β) (K ⊙ e^Γ) and U = (I + Akk)^-1 diag(β) V per chunk, (B, HV, n, C, K | V)."""
    B, HV, n, C, K = k_.shape
    V = v_.shape[-1]
    eye = torch.eye(C, dtype=k_.dtype, device=k_.device)
    rhs = torch.cat([b_ * k_ * G.exp(), b_ * v_], dim=-1)                  # (B, HV, n, C, K+V)
    # a flat batch of 2-D systems is much faster on CPU than the 5-D batched call
    WU = torch.linalg.solve_triangular((eye + Akk).reshape(-1, C, C), rhs.reshape(-1, C, K + V),
                                       upper=False, unitriangular=True).view(B, HV, n, C, K + V)
    return WU[..., :K], WU[..., K:]


def naive_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    chunk_size=64):
    """Chunked KDA in torch (docs/math.md §2.2): parallel inside chunks, sequential only over chunk states.

    Same arguments and returns as `naive_recurrent_kda`; differentiable by autograd. Any T
    (the tail is zero-padded: g = 0, k = 0, beta = 0 leave the state unchanged), any chunk size.
    """
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C = chunk_size
    scale = K ** -0.5 if scale is None else scale
    wd, n, q_, k_, v_, b_, G, gam = chunk_layout(q, k, v, g, beta, initial_state, C)
    sub = 16 if C % 16 == 0 else C
    idx = torch.arange(C, device=q.device)
    Mqk = _intra_scores(q_, k_, G, sub)
    Mkk = _intra_scores(k_, k_, G, sub)
    Aqk = scale * Mqk
    Akk = torch.where(idx[:, None] > idx[None, :], Mkk, 0.0) * b_
    W, U = solve_wu(Akk, b_, k_, v_, G)
    qg = scale * q_ * G.exp()
    kd = k_ * (gam - G).exp()
    S = q.new_zeros(B, HV, K, V, dtype=wd) if initial_state is None else initial_state.to(wd)
    outs = []
    for i in range(n):
        vn = U[:, :, i] - W[:, :, i] @ S                                   # (B, HV, C, V)
        outs.append(qg[:, :, i] @ S + Aqk[:, :, i] @ vn)
        S = gam[:, :, i].transpose(-1, -2).exp() * S + kd[:, :, i].transpose(-1, -2) @ vn
    o = torch.stack(outs, dim=2).permute(0, 2, 3, 1, 4).reshape(B, n * C, HV, V)[:, :T]
    return o.to(v.dtype if v.dtype != wd else wd), (S if output_final_state else None)


def naive_chunk_kda_varlen(q, k, v, g, beta, cu_seqlens, scale=None, initial_state=None, output_final_state=False,
                           chunk_size=64, fn=None):
    """The varlen oracle: `fn` (default naive_chunk_kda; any chunked KDA of the same signature) on each sequence
    alone, in turn.
    q .. beta [1, total_T, ...]; cu_seqlens [N + 1]; initial_state [N, HV, K, V] or None. Returns (o, final
    states [N, HV, K, V] or None)."""
    fn = fn or naive_chunk_kda
    cu = [int(x) for x in cu_seqlens.tolist()]
    outs, states = [], []
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        h0 = None if initial_state is None else initial_state[i:i + 1]
        if a == b:   # an empty sequence: its final state is its initial state
            states.append(torch.zeros(1, *v.shape[2:3], q.shape[-1], v.shape[-1], dtype=torch.float32,
                                      device=v.device) if h0 is None else h0)
            continue
        o, ht = fn(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale=scale, initial_state=h0,
                   output_final_state=True, chunk_size=chunk_size)
        outs.append(o)
        states.append(ht)
    return torch.cat(outs, 1), torch.cat(states) if output_final_state else None
