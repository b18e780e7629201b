"""AttnRes (SPEC §5): each sublayer's input is a softmax mix over depth instead of a residual sum.

Modes: `full` (sources: embedding + every earlier sublayer output) and `block` (sources: embedding,
completed block sums, and the running partial sum of the current block; any S ≥ 1, the last block
may be partial). Scores are w̃ · RMS(source) with w̃ = w ⊙ γ, softmax over sources in fp32, no
temperature; values are the raw (un-normalised) sources. w is zero-initialised, γ starts at 1, so
training starts from uniform averaging — which, after the sublayers' own RMSNorm (eps 0), is
exactly the plain residual stack. A final mix (own w, γ) over all sources feeds the final norm.

The functions here are the torch references a fused kernel (k3cli/ops/attnres) is tested against.
Shapes: sources [N, B, T, D] or a list of N [B, T, D]; queries/gains [D] (one sublayer) or [S, D]
(a block's sublayers).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from k3cli.layers.norm import rms_norm

MODES = ("full", "block")
IMPLS = ("auto", "naive", "two_phase", "fused")
MAX_FUSED_SOURCES = 32  # the Triton kernels' pointer-table limit (k3cli/ops/attnres/fused.py)


def _wd(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _fp32_math(fn):
    """Run fn with autocast off: scores and softmax stay fp32 (autocast would run the matvecs in bf16)."""
    @functools.wraps(fn)
    def wrapper(first, *args, **kwargs):
        dev = (first[0] if isinstance(first, (list, tuple)) else first).device.type
        with torch.autocast(dev, enabled=False):
            return fn(first, *args, **kwargs)
    return wrapper


def source_keys(sources: Sequence[torch.Tensor], eps: float = 1e-6) -> list[torch.Tensor]:
    """RMS(v) without gain for each source [B, T, D], in fp32 (fp64 stays fp64)."""
    return [rms_norm(v.to(_wd(v)), None, eps) for v in sources]


@_fp32_math
def _w_tilde(query: torch.Tensor, gain: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The scoring vector(s) w̃ = query ⊙ gain in `dtype`; gain None: query is w̃ already."""
    return (query if gain is None else query * gain).to(dtype)


def naive_attnres(sources: Sequence[torch.Tensor], query: torch.Tensor, gain: torch.Tensor,
                  eps: float = 1e-6, keys: Sequence[torch.Tensor] | None = None,
                  return_weights: bool = False):
    """One depth mix: h = Σ_i softmax_i(w̃ · RMS(v_i)) v_i.

    sources: [N, B, T, D] or a list of N [B, T, D]; query, gain [D]; keys: `source_keys(sources)` if
    already computed (the mixer caches them: each source is a key for every later sublayer).
    gain None: `query` is w̃ = query ⊙ gain already (the same for the phase functions below).
    Returns h [B, T, D] in the sources' dtype (and, with return_weights, α [N, B, T] fp32).
    """
    wd = _wd(sources[0])
    keys = source_keys(sources, eps) if keys is None else keys
    w = _w_tilde(query, gain, wd)
    # a matvec per source and an accumulated weighted sum: einsum over [N, B, T, D] lowers to
    # B·T tiny bmms and was ~4× slower on CPU for k3-toy
    s = torch.stack([key @ w for key in keys])                                           # (N, B, T)
    alpha = s.softmax(0)
    h = sum(alpha[i, ..., None] * v.to(wd) for i, v in enumerate(sources))              # (B, T, D)
    h = h.to(sources[0].dtype)
    return (h, alpha) if return_weights else h


@_fp32_math
def attnres_phase1(blocks: Sequence[torch.Tensor], queries: torch.Tensor, gains: torch.Tensor,
                   eps: float = 1e-6, keys: Sequence[torch.Tensor] | None = None):
    """Phase 1 of block AttnRes: all S queries of a block against its n completed sources at once.

    blocks [n, B, T, D] or a list of n [B, T, D]; queries, gains [S, D]; keys as in naive_attnres.
    Returns the online-softmax state per query, fp32: m [S, B, T] (max score),
    l [S, B, T] (Σ exp(s − m)), o [S, B, T, D] (Σ exp(s − m) · v).
    """
    wd = _wd(blocks[0])
    keys = source_keys(blocks, eps) if keys is None else keys
    w = _w_tilde(queries, gains, wd)
    s = torch.stack([key @ w.T for key in keys]).permute(3, 0, 1, 2)                    # (S, n, B, T)
    m = s.amax(1)                                                                         # (S, B, T)
    p = (s - m[:, None]).exp()
    o = sum(p[:, j, ..., None] * v.to(wd) for j, v in enumerate(blocks))                 # (S, B, T, D)
    return m, p.sum(1), o


@_fp32_math
def attnres_merge(m: torch.Tensor, l: torch.Tensor, o: torch.Tensor, partial: torch.Tensor | None,
                  query: torch.Tensor, gain: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Phase 2: merge one more source (the block's partial sum) into a phase-1 state and normalise.

    m, l [B, T]; o [B, T, D]; partial [B, T, D] or None (first sublayer of a block) -> h [B, T, D]
    in o's (fp32/fp64 working) dtype.
    """
    if partial is None:
        return o / l[..., None]
    p = partial.to(o.dtype)
    s = rms_norm(p, None, eps) @ _w_tilde(query, gain, o.dtype)                           # (B, T)
    m_new = torch.maximum(m, s)
    a, b = (m - m_new).exp(), (s - m_new).exp()
    return (o * a[..., None] + b[..., None] * p) / (l * a + b)[..., None]


def _fused_call(kernel, *args, norm: nn.Module | None = None, **kwargs) -> torch.Tensor:
    """A Triton mix (`fused_attnres` / `attnres_merge`): its h, or with `norm` (an RMSNorm) the
    normalised y the kernel computes in the same pass."""
    if norm is None:
        return kernel(*args, **kwargs)
    return kernel(*args, norm_weight=norm.weight, norm_eps=norm.eps, **kwargs)[1]


class AttnResMixer(nn.Module):
    """Drives the N = 2L sublayers with depth mixes. Parameters: query [N, D] (zeros), gain [N, D]
    (ones), out_query [D], out_gain [D] for the final mix.

    impl: `naive` (block: one softmax over all sources per sublayer), `two_phase` (block: phase 1 +
    merge in torch), `fused` (the Triton kernels of k3cli/ops/attnres), `auto` (fused on CUDA when
    importable, else two_phase). Full mode has one form; `fused` / `auto` pick its kernel the same way.
    """

    def __init__(self, hidden_size: int, num_sublayers: int, mode: str = "block", block_size: int = 2,
                 eps: float = 1e-6, impl: str = "auto"):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown AttnRes mode '{mode}'; valid: {', '.join(MODES)}")
        if impl not in IMPLS:
            raise ValueError(f"unknown AttnRes impl '{impl}'; valid: {', '.join(IMPLS)}")
        if block_size < 1:
            raise ValueError(f"AttnRes block_size must be >= 1, got {block_size}")
        self.mode, self.block_size, self.eps, self.impl = mode, block_size, eps, impl
        self.num_sublayers = num_sublayers
        self.query = nn.Parameter(torch.zeros(num_sublayers, hidden_size))
        self.gain = nn.Parameter(torch.ones(num_sublayers, hidden_size))
        self.out_query = nn.Parameter(torch.zeros(hidden_size))
        self.out_gain = nn.Parameter(torch.ones(hidden_size))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)
        nn.init.ones_(self.gain)
        nn.init.zeros_(self.out_query)
        nn.init.ones_(self.out_gain)

    def forward(self, emb: torch.Tensor, sublayers: Sequence[Callable[[torch.Tensor], torch.Tensor]],
                norms: Sequence[nn.Module] | None = None, final_norm: nn.Module | None = None):
        """emb [B, T, D]; sublayers: N callables [B, T, D] -> raw output [B, T, D]. Without `norms`
        each applies its own pre-norm to the mix it gets; with `norms` (N RMSNorm modules: weight,
        eps) the mixer applies norm l to mix l and sublayer l gets the normalised input — on the
        Triton path the norm is fused into the mix kernel. `final_norm`: likewise for the final mix.
        Returns the final mix [B, T, D] (normalised by `final_norm` when given).

        Sources are kept in emb's dtype (under autocast the sublayers return bf16 while the embedding
        stays fp32), as the plain residual stream x + v would be.
        """
        if len(sublayers) != self.num_sublayers:
            raise ValueError(f"AttnResMixer built for {self.num_sublayers} sublayers, got {len(sublayers)}")
        if norms is not None and len(norms) != self.num_sublayers:
            raise ValueError(f"AttnResMixer built for {self.num_sublayers} sublayers, got {len(norms)} norms")
        ops = self._triton_ops(emb)
        # one unbind per parameter (a single stack in the backward) instead of a select, and its
        # zero-filled [N, D] gradient, per sublayer; the kernels take w̃ = query ⊙ gain, formed once
        # for all sublayers (one product and its backward instead of one per kernel call)
        if ops is not None:
            rows = ((self.query * self.gain).unbind(0), (None,) * self.num_sublayers)
        else:
            rows = (self.query.unbind(0), self.gain.unbind(0))
        norms = list(norms) if norms is not None else [None] * self.num_sublayers
        if self.mode == "full":
            return self._full(emb, sublayers, ops, rows, norms, final_norm)
        if self.impl == "naive":
            return self._block_naive(emb, sublayers, rows, norms, final_norm)
        return self._block_two_phase(emb, sublayers, ops, rows, norms, final_norm)

    def _triton_ops(self, emb: torch.Tensor):
        """The Triton kernels (fused_attnres, attnres_phase1, attnres_merge), or None for torch."""
        if self.impl in ("naive", "two_phase") or (self.impl == "auto" and not emb.is_cuda):
            return None
        try:
            from k3cli.ops.attnres import attnres_merge, attnres_phase1, fused_attnres
        except ImportError as e:
            if self.impl == "fused":
                raise RuntimeError(f"AttnRes impl=fused but the Triton kernels are unavailable: {e}") from None
            return None
        return fused_attnres, attnres_phase1, attnres_merge

    def _mix(self, sources: list[torch.Tensor], keys: list[torch.Tensor] | None, l: int | None,
             ops=None, rows=None, norm: nn.Module | None = None) -> torch.Tensor:
        """Mix for sublayer l (its query / gain rows from `rows`), or the output mix (l None);
        passed through `norm` (an RMSNorm; fused into the kernel on the Triton path) when given."""
        q, g = (self.out_query, self.out_gain) if l is None else (rows[0][l], rows[1][l])
        if ops is not None and len(sources) <= MAX_FUSED_SOURCES:
            return _fused_call(ops[0], sources, q, g, self.eps, norm=norm)
        h = naive_attnres(sources, q, g, self.eps, keys=keys)
        return h if norm is None else norm(h)

    def _full(self, emb, sublayers, ops, rows, norms, final_norm):
        # the torch form caches RMS(v) per source (each is a key for every later sublayer)
        sources, keys = [emb], (None if ops else source_keys([emb], self.eps))
        for l, f in enumerate(sublayers):
            v = f(self._mix(sources, keys, l, ops, rows, norms[l])).to(emb.dtype)
            sources.append(v)
            keys = None if ops else keys + source_keys([v], self.eps)
        return self._mix(sources, keys, None, ops, norm=final_norm)

    def _block_naive(self, emb, sublayers, rows, norms, final_norm):
        N, S = self.num_sublayers, self.block_size
        blocks, keys, partial = [emb], source_keys([emb], self.eps), None
        for l, f in enumerate(sublayers):
            if partial is None:
                h = self._mix(blocks, keys, l, rows=rows, norm=norms[l])
            else:
                h = self._mix(blocks + [partial], keys + source_keys([partial], self.eps), l, rows=rows,
                              norm=norms[l])
            v = f(h).to(emb.dtype)
            partial = v if partial is None else partial + v
            if (l + 1) % S == 0 or l + 1 == N:
                blocks.append(partial)
                keys += source_keys([partial], self.eps)
                partial = None
        return self._mix(blocks, keys, None, norm=final_norm)

    def _block_two_phase(self, emb, sublayers, ops, rows, norms, final_norm):
        N, S = self.num_sublayers, self.block_size
        blocks, keys = [emb], (None if ops else source_keys([emb], self.eps))
        for start in range(0, N, S):
            stop = min(start + S, N)
            qs = torch.stack(rows[0][start:stop])
            gs = None if rows[1][start] is None else torch.stack(rows[1][start:stop])
            if ops is not None and len(blocks) <= MAX_FUSED_SOURCES:
                m, lsum, o = ops[1](blocks, qs, gs, self.eps)
            else:
                m, lsum, o = attnres_phase1(blocks, qs, gs, self.eps, keys=keys)
            partial = None
            # unbind, not m[r]: one stack in the backward instead of a zero-filled full-size gradient
            # per row (and the sums of those) for each of m, lsum, o
            fused_merge = ops is not None and o.dtype == torch.float32
            m, lsum, o = m.unbind(0), lsum.unbind(0), o.unbind(0)
            for r, l in enumerate(range(start, stop)):
                args = (m[r], lsum[r], o[r], partial, rows[0][l], rows[1][l], self.eps)
                if fused_merge:
                    h = _fused_call(ops[2], *args, norm=norms[l], out_dtype=emb.dtype)
                else:
                    h = attnres_merge(*args).to(emb.dtype)
                    h = h if norms[l] is None else norms[l](h)
                v = sublayers[l](h)
                if partial is None or torch.promote_types(v.dtype, emb.dtype) != emb.dtype:
                    v = v.to(emb.dtype)   # a v wider than emb is rounded first, as before
                # else the sum promotes a narrower v itself (exactly), as the residual x + v does
                partial = v if partial is None else partial + v
            blocks.append(partial)
            keys = None if ops else keys + source_keys([partial], self.eps)
        return self._mix(blocks, keys, None, ops, norm=final_norm)

    def extra_repr(self) -> str:
        return f"mode={self.mode}, block_size={self.block_size}, impl={self.impl}, eps={self.eps}"
