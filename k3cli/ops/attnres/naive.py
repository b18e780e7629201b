"""Pure-torch references for AttnRes (SPEC §5; the math, forward and backward, is in README.md).

Shapes: a source v_i is [B, T, D]; `sources` is a list of n such tensors or one stacked
[n, B, T, D] tensor; a query / gain is [D] (one sublayer) or [S, D] (a block's S sublayers).
All softmax math runs in fp32 (fp64 for fp64 inputs); outputs are cast back to the sources' dtype
except the phase-1 state (m, l, o), which stays in the working dtype.
"""
from __future__ import annotations

import torch

from k3cli.layers.norm import rms_norm


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    # fp64 inputs keep fp64 (tight identity tests); everything else runs in fp32
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _stack(sources: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    return sources if isinstance(sources, torch.Tensor) else torch.stack(list(sources))


def naive_attnres(sources, query, gain, eps: float = 1e-6, norm_weight=None, norm_eps: float = 1e-6,
                  return_weights: bool = False):
    """One depth mix (SPEC §5, full form).

    Args:
        sources: list of n tensors [B, T, D] or one [n, B, T, D].
        query, gain: [D]; the score of source i is (query ⊙ gain) · RMS(v_i).
        eps: RMS eps of the scores.
        norm_weight: [D] or None; if given, also return y = RMSNorm(h) · norm_weight (eps norm_eps).
        return_weights: also return α [n, B, T] (working dtype, sums to 1 over n).
    Returns:
        h [B, T, D] in the sources' dtype; then y (if norm_weight), then α (if return_weights).
    """
    v_all = _stack(sources)
    wd = _work_dtype(v_all)
    v = v_all.to(wd)
    s = torch.einsum("d,nbtd->nbt", (query * gain).to(wd), rms_norm(v, None, eps))    # (n, B, T)
    alpha = s.softmax(0)
    h = torch.einsum("nbt,nbtd->btd", alpha, v)                                # (B, T, D)
    out = [h.to(v_all.dtype)]
    if norm_weight is not None:
        out.append(rms_norm(h, norm_weight, norm_eps).to(v_all.dtype))
    if return_weights:
        out.append(alpha)
    return out[0] if len(out) == 1 else tuple(out)


def naive_attnres_phase1(sources, queries, gains, eps: float = 1e-6):
    """Block form, phase 1: all S queries of a block against its n completed sources at once.

    Args:
        sources: list of n tensors [B, T, D] or one [n, B, T, D] (b_0 and the completed block sums).
        queries, gains: [S, D].
    Returns:
        online-softmax state per query, working dtype: m [S, B, T] (max score),
        l [S, B, T] (Σ_i exp(s_i − m)), o [S, B, T, D] (Σ_i exp(s_i − m) · v_i, unnormalised).
    """
    v_all = _stack(sources)
    wd = _work_dtype(v_all)
    v = v_all.to(wd)
    s = torch.einsum("qd,nbtd->qnbt", (queries * gains).to(wd), rms_norm(v, None, eps))  # (S, n, B, T)
    m = s.amax(1)                                                               # (S, B, T)
    p = (s - m[:, None]).exp()
    return m, p.sum(1), torch.einsum("qnbt,nbtd->qbtd", p, v)


def naive_attnres_merge(m, l, o, partial, query, gain, eps: float = 1e-6, norm_weight=None,
                        norm_eps: float = 1e-6, out_dtype: torch.dtype | None = None):
    """Block form, phase 2: merge the block's running partial sum into one query's phase-1 state.

    Args:
        m, l: [B, T]; o: [B, T, D] — one query's phase-1 state.
        partial: [B, T, D] or None (the first sublayer of a block has no partial source).
        query, gain: [D].
        norm_weight: [D] or None; if given, also return y = RMSNorm(h) · norm_weight.
        out_dtype: dtype of h (and y); default o's dtype.
    Returns:
        h [B, T, D] (and y).
    """
    wd = o.dtype
    if partial is None:
        h = o / l[..., None]
    else:
        p = partial.to(wd)
        s = torch.einsum("d,btd->bt", (query * gain).to(wd), rms_norm(p, None, eps))       # (B, T)
        m_new = torch.maximum(m, s)
        a, b = (m - m_new).exp(), (s - m_new).exp()
        h = (o * a[..., None] + b[..., None] * p) / (l * a + b)[..., None]
    out_dtype = wd if out_dtype is None else out_dtype
    if norm_weight is None:
        return h.to(out_dtype)
    return h.to(out_dtype), rms_norm(h, norm_weight, norm_eps).to(out_dtype)


def naive_attnres_block(blocks, partial, query, gain, eps: float = 1e-6):
    """Block form in one softmax (the definition two-phase must equal): sources are the completed
    blocks [n, B, T, D] (or list) plus the partial sum [B, T, D] (or None). Returns h [B, T, D]."""
    srcs = list(blocks) + ([] if partial is None else [partial])
    return naive_attnres(srcs, query, gain, eps)
