"""Pure-torch AttnRes (docs/math.md §5; the forward and backward math is in README.md): the reference
the Triton kernels are tested against, and the torch path of the model's AttnRes mixer.

Shapes: a source v_i is [B, T, D]; `sources` is a list of n such tensors or one stacked
[n, B, T, D] tensor; a query / gain is [D] (one sublayer) or [S, D] (a block's S sublayers).
gain None: `query` is w̃ = query ⊙ gain already. `keys`: `source_keys(sources)` if already computed
(the mixer caches them: each source is a key for every later sublayer).
All softmax math runs in fp32 (fp64 for fp64 inputs); outputs are cast back to the sources' dtype
except the phase-1 state (m, l, o), which stays in the working dtype.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from k3cli.ops.norm import rms_norm
from k3cli.ops.precision import widen, work_dtype


def _fp32_math(fn):
    """Run fn with autocast off: scores and softmax stay fp32 (autocast would run the matvecs in bf16)."""
    @functools.wraps(fn)
    def wrapper(first, *args, **kwargs):
        dev = (first[0] if isinstance(first, (list, tuple)) else first).device.type
        with torch.autocast(dev, enabled=False):
            return fn(first, *args, **kwargs)
    return wrapper


def source_keys(sources: Sequence[torch.Tensor], eps: float = 1e-6) -> list[torch.Tensor]:
    """1 / sqrt(mean(v²) + eps) per token [B, T] for each source [B, T, D], in the working dtype: the score
    w̃ · RMS(v) is (w̃ · v) times it, so the normalised source RMS(v) is never formed, nor kept for the backward."""
    return [torch.rsqrt(widen(v).pow(2).mean(-1) + eps) for v in sources]


def _score(v: torch.Tensor, inv_rms: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """w̃ · RMS(v) for one source v [B, T, D] from its key (`source_keys`, [B, T]): against w [D] -> [B, T],
    or against S rows wᵀ [D, S] -> [B, T, S]."""
    s = v.to(w.dtype) @ w
    return s * (inv_rms if w.dim() == 1 else inv_rms[..., None])


@_fp32_math
def _w_tilde(query: torch.Tensor, gain: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The scoring vector(s) w̃ = query ⊙ gain in `dtype`; gain None: query is w̃ already."""
    return (query if gain is None else query * gain).to(dtype)


def naive_attnres(sources, query, gain, eps: float = 1e-6, *, norm_weight=None, norm_eps: float = 1e-6,
                  keys: Sequence[torch.Tensor] | None = None, return_weights: bool = False):
    """One depth mix (full form): h = Σ_i softmax_i(w̃ · RMS(v_i)) v_i.

    Args:
        sources: list of n tensors [B, T, D] or one [n, B, T, D].
        query, gain: [D]; the score of source i is (query ⊙ gain) · RMS(v_i).
        eps: RMS eps of the scores.
        norm_weight: [D] or None; if given, also return y = RMSNorm(h) · norm_weight (eps norm_eps).
        keys: `source_keys(sources, eps)`, or None to compute them.
        return_weights: also return α [n, B, T] (working dtype, sums to 1 over n).
    Returns:
        h [B, T, D] in the sources' dtype; then y (if norm_weight), then α (if return_weights).
    """
    wd = work_dtype(sources[0])
    keys = source_keys(sources, eps) if keys is None else keys
    w = _w_tilde(query, gain, wd)
    # a matvec per source and an accumulated weighted sum: einsum over [N, B, T, D] lowers to
    # B·T tiny bmms and was ~4× slower on CPU for k3-toy
    s = torch.stack([_score(v, r, w) for v, r in zip(sources, keys)])                   # (n, B, T)
    alpha = s.softmax(0)
    h = sum(alpha[i, ..., None] * v.to(wd) for i, v in enumerate(sources))              # (B, T, D)
    out = [h.to(sources[0].dtype)]
    if norm_weight is not None:
        out.append(rms_norm(h, norm_weight, norm_eps).to(sources[0].dtype))
    if return_weights:
        out.append(alpha)
    return out[0] if len(out) == 1 else tuple(out)


@_fp32_math
def naive_attnres_phase1(sources, queries, gains, eps: float = 1e-6, *,
                         keys: Sequence[torch.Tensor] | None = None, m: torch.Tensor | None = None):
    """Block form, phase 1: all S queries of a block against its n completed sources at once.

    Args:
        sources: list of n tensors [B, T, D] or one [n, B, T, D] (b_0 and the completed block sums).
        queries, gains: [S, D].
        keys: as in naive_attnres.
        m: [S, B, T] stabiliser to use, held fixed (as the kernels' backward holds it), or None for the
            max score.
    Returns:
        online-softmax state per query, working dtype: m [S, B, T] (max score),
        l [S, B, T] (Σ_i exp(s_i − m)), o [S, B, T, D] (Σ_i exp(s_i − m) · v_i, unnormalised).
    """
    wd = work_dtype(sources[0])
    keys = source_keys(sources, eps) if keys is None else keys
    w = _w_tilde(queries, gains, wd)
    s = torch.stack([_score(v, r, w.T) for v, r in zip(sources, keys)]).permute(3, 0, 1, 2)   # (S, n, B, T)
    m = s.amax(1) if m is None else m.detach().to(wd)                                     # (S, B, T)
    p = (s - m[:, None]).exp()
    o = sum(p[:, j, ..., None] * v.to(wd) for j, v in enumerate(sources))                # (S, B, T, D)
    return m, p.sum(1), o


@_fp32_math
def naive_attnres_merge(m, l, o, partial, query, gain, eps: float = 1e-6, *, norm_weight=None,
                        norm_eps: float = 1e-6, out_dtype: torch.dtype | None = None):
    """Block form, phase 2: merge the block's running partial sum into one query's phase-1 state.

    Args:
        m, l: [B, T]; o: [B, T, D] — one query's phase-1 state.
        partial: [B, T, D] or None (the first sublayer of a block has no partial source).
        query, gain: [D].
        norm_weight: [D] or None; if given, also return y = RMSNorm(h) · norm_weight.
        out_dtype: dtype of h (and y); default o's (working) dtype.
    Returns:
        h [B, T, D] (and y).
    """
    if partial is None:
        h = o / l[..., None]
    else:
        p = partial.to(o.dtype)
        s = _score(p, source_keys([p], eps)[0], _w_tilde(query, gain, o.dtype))              # (B, T)
        m_new = torch.maximum(m, s)
        a, b = (m - m_new).exp(), (s - m_new).exp()
        h = (o * a[..., None] + b[..., None] * p) / (l * a + b)[..., None]
    out_dtype = o.dtype if out_dtype is None else out_dtype
    if norm_weight is None:
        return h.to(out_dtype)
    return h.to(out_dtype), rms_norm(h, norm_weight, norm_eps).to(out_dtype)


def naive_attnres_block(blocks, partial, query, gain, eps: float = 1e-6):
    """Block form in one softmax (the definition two-phase must equal): sources are the completed
    blocks [n, B, T, D] (or list) plus the partial sum [B, T, D] (or None). Returns h [B, T, D]."""
    srcs = list(blocks) + ([] if partial is None else [partial])
    return naive_attnres(srcs, query, gain, eps)
