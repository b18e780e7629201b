"""AttnRes (docs/math.md §5): each sublayer's input is a softmax mix over depth instead of a residual sum.

Modes: `full` (sources: embedding + every earlier sublayer output) and `block` (sources: embedding,
completed block sums, and the running partial sum of the current block; any S ≥ 1, the last block
may be partial). Scores are w̃ · RMS(source) with w̃ = w ⊙ γ, softmax over sources in fp32, no
temperature; values are the raw (un-normalised) sources. w is zero-initialised, γ starts at 1, so
training starts from uniform averaging — which, after the sublayers' own RMSNorm (eps 0), is
exactly the plain residual stack. A final mix (own w, γ) over all sources feeds the final norm.

The torch math (also the kernels' reference) is k3cli/ops/attnres/naive.py; the Triton kernels are
k3cli/ops/attnres. Shapes: sources [B, T, D] each; queries/gains [N, D] (one row per sublayer).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from k3cli.ops.attnres.naive import naive_attnres, naive_attnres_merge, naive_attnres_phase1, source_keys

MODES = ("full", "block")
IMPLS = ("auto", "naive", "two_phase", "fused")
MAX_FUSED_SOURCES = 32  # the Triton kernels' pointer-table limit (k3cli/ops/attnres/fused.py)


def wants_kernels(impl: str, mode: str, cuda: bool, compiling: bool) -> bool:
    """Whether the mixes run the Triton kernels: `fused` always, `naive` / `two_phase` never, `auto` on CUDA
    except in block mode under torch.compile, where Inductor fuses the torch two-phase form with the ops
    around it and the step is faster (docs/performance.md, "AttnRes in a compiled step")."""
    if impl == "auto":
        return cuda and not (compiling and mode == "block")
    return impl == "fused"


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
    importable, but two_phase for block mode under torch.compile; else two_phase). Full mode has one
    form; `fused` / `auto` pick its kernel the same way (`wants_kernels`).
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
        """The Triton kernels (fused_attnres, attnres_phase1, attnres_merge: entry points of the k3:: custom
        ops, opaque nodes under torch.compile), or None for torch."""
        if not wants_kernels(self.impl, self.mode, emb.is_cuda, torch.compiler.is_compiling()):
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
        # the torch form caches each source's key (`source_keys`: a scale per token) for every later sublayer
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
                m, lsum, o = naive_attnres_phase1(blocks, qs, gs, self.eps, keys=keys)
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
                    h = naive_attnres_merge(*args).to(emb.dtype)
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
