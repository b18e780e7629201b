"""AttnRes (SPEC §5): each sublayer's input is a softmax mix over depth instead of a residual sum.

Modes: `full` (sources: embedding + every earlier sublayer output) and `block` (sources: embedding,
completed block sums, and the running partial sum of the current block; any S ≥ 1, the last block
may be partial). Scores are w̃ · RMS(source) with w̃ = w ⊙ γ, softmax over sources in fp32, no
temperature; values are the raw (un-normalised) sources. w is zero-initialised, γ starts at 1, so
training starts from uniform averaging — which, after the sublayers' own RMSNorm (eps 0), is
exactly the plain residual stack. A final mix (own w, γ) over all sources feeds the final norm.

The functions here are the torch references a fused kernel (k3cli/ops/attnres) is tested against.
Shapes: sources [N, B, T, D]; queries/gains [D] (one sublayer) or [S, D] (a block's sublayers).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from k3cli.layers.norm import rms_norm

MODES = ("full", "block")
IMPLS = ("naive", "two_phase")


def _wd(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def naive_attnres(sources: torch.Tensor, query: torch.Tensor, gain: torch.Tensor, eps: float = 1e-6,
                  return_weights: bool = False):
    """One depth mix. sources [N, B, T, D]; query, gain [D] -> h [B, T, D] in sources.dtype
    (and, with return_weights, α [N, B, T] in fp32 summing to 1 over N)."""
    wd = _wd(sources)
    v = sources.to(wd)
    s = torch.einsum("d,nbtd->nbt", (query * gain).to(wd), rms_norm(v, None, eps))   # (N, B, T)
    alpha = s.softmax(0)
    h = torch.einsum("nbt,nbtd->btd", alpha, v).to(sources.dtype)
    return (h, alpha) if return_weights else h


def attnres_phase1(blocks: torch.Tensor, queries: torch.Tensor, gains: torch.Tensor, eps: float = 1e-6):
    """Phase 1 of block AttnRes: all S queries of a block against its n completed sources at once.

    blocks [n, B, T, D]; queries, gains [S, D] -> online-softmax state per query:
    m [S, B, T] (max score), l [S, B, T] (Σ exp(s − m)), o [S, B, T, D] (Σ exp(s − m) · v), fp32.
    """
    wd = _wd(blocks)
    v = blocks.to(wd)
    s = torch.einsum("qd,nbtd->qnbt", (queries * gains).to(wd), rms_norm(v, None, eps))  # (S, n, B, T)
    m = s.amax(1)                                                                         # (S, B, T)
    p = (s - m[:, None]).exp()
    return m, p.sum(1), torch.einsum("qnbt,nbtd->qbtd", p, v)


def attnres_merge(m: torch.Tensor, l: torch.Tensor, o: torch.Tensor, partial: torch.Tensor | None,
                  query: torch.Tensor, gain: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Phase 2: merge one more source (the block's partial sum) into a phase-1 state and normalise.

    m, l [B, T]; o [B, T, D]; partial [B, T, D] or None (first sublayer of a block) -> h [B, T, D]
    in o's (fp32/fp64 working) dtype.
    """
    if partial is None:
        return o / l[..., None]
    p = partial.to(o.dtype)
    s = torch.einsum("d,btd->bt", (query * gain).to(o.dtype), rms_norm(p, None, eps))     # (B, T)
    m_new = torch.maximum(m, s)
    a, b = (m - m_new).exp(), (s - m_new).exp()
    return (o * a[..., None] + b[..., None] * p) / (l * a + b)[..., None]


class AttnResMixer(nn.Module):
    """Drives the N = 2L sublayers with depth mixes. Parameters: query [N, D] (zeros), gain [N, D]
    (ones), out_query [D], out_gain [D] for the final mix."""

    def __init__(self, hidden_size: int, num_sublayers: int, mode: str = "block", block_size: int = 2,
                 eps: float = 1e-6, impl: str = "two_phase"):
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

    def forward(self, emb: torch.Tensor, sublayers: Sequence[Callable[[torch.Tensor], torch.Tensor]]):
        """emb [B, T, D]; sublayers: N callables h [B, T, D] -> raw output [B, T, D] (each applies its
        own pre-norm). Returns the final mix [B, T, D] (before the model's final RMSNorm)."""
        if len(sublayers) != self.num_sublayers:
            raise ValueError(f"AttnResMixer built for {self.num_sublayers} sublayers, got {len(sublayers)}")
        if self.mode == "full":
            return self._full(emb, sublayers)
        if self.impl == "naive":
            return self._block_naive(emb, sublayers)
        return self._block_two_phase(emb, sublayers)

    def _mix(self, sources: list[torch.Tensor], l: int | None) -> torch.Tensor:
        q, g = (self.out_query, self.out_gain) if l is None else (self.query[l], self.gain[l])
        return naive_attnres(torch.stack(sources), q, g, self.eps)

    def _full(self, emb, sublayers):
        sources = [emb]
        for l, f in enumerate(sublayers):
            sources.append(f(self._mix(sources, l)))
        return self._mix(sources, None)

    def _block_naive(self, emb, sublayers):
        N, S = self.num_sublayers, self.block_size
        blocks, partial = [emb], None
        for l, f in enumerate(sublayers):
            v = f(self._mix(blocks + ([] if partial is None else [partial]), l))
            partial = v if partial is None else partial + v
            if (l + 1) % S == 0 or l + 1 == N:
                blocks.append(partial)
                partial = None
        return self._mix(blocks, None)

    def _block_two_phase(self, emb, sublayers):
        N, S = self.num_sublayers, self.block_size
        blocks = [emb]
        for start in range(0, N, S):
            stop = min(start + S, N)
            m, lsum, o = attnres_phase1(torch.stack(blocks), self.query[start:stop],
                                        self.gain[start:stop], self.eps)
            partial = None
            for r, l in enumerate(range(start, stop)):
                h = attnres_merge(m[r], lsum[r], o[r], partial, self.query[l], self.gain[l], self.eps)
                v = sublayers[l](h.to(emb.dtype))
                partial = v if partial is None else partial + v
            blocks.append(partial)
        return self._mix(blocks, None)

    def extra_repr(self) -> str:
        return f"mode={self.mode}, block_size={self.block_size}, impl={self.impl}, eps={self.eps}"
