"""Gated MLA with NoPE (docs/math.md §3): low-rank q, a single KV latent c [B, T, r], a sigmoid output gate.

Options (each off by default): a direct query projection (q_lora_rank = 0), a shared key part k_r of d_r
numbers per token that every head scores against without rotation or norm (qk_rope_head_dim = d_r > 0,
the Kimi Linear / DeepSeek layout without RoPE; scale (d_q + d_r)^-0.5), and no output gate.

Two equivalent attention paths:
- absorbed: W_UK folds into the query and W_UV is applied after attention, so keys/values are the
  latent c itself (the decode path: the cache is r numbers per token);
- decompressed: k, v are expanded per head and fed to causal SDPA (cheaper to train at scale).
Both use scale (d_q + d_r)^-0.5 (not r^-0.5) and no positional encoding (KDA's decay carries position).
Decode keeps `MLACache` ([c | k_r] of every token so far); prefill runs the configured path, later calls
the absorbed one against the whole cache.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3cli.layers.linear import fused_linear
from k3cli.layers.norm import RMSNorm
from k3cli.layers.segments import Segments
from k3cli.ops.precision import work_dtype


@dataclass
class MLACache:
    """Decode cache of one GatedMLA layer: the latent c of every token so far, r numbers per token, followed
    by the shared key k_r when qk_rope_head_dim = d_r > 0 (r + d_r numbers per token).

    `c` is [B, length, r + d_r], a view of a buffer whose capacity doubles (amortised O(1) appends).
    """
    buf: torch.Tensor | None = None                                                 # (B, capacity, r + d_r)
    length: int = 0

    @property
    def c(self) -> torch.Tensor | None:
        return None if self.buf is None else self.buf[:, :self.length]

    def append(self, c_new: torch.Tensor) -> torch.Tensor:
        """c_new [B, T, r + d_r] -> every cached row [B, length + T, r + d_r]."""
        B, T, r = c_new.shape
        need = self.length + T
        if self.buf is None or need > self.buf.shape[1]:
            buf = c_new.new_empty(B, max(need, 2 * self.length, 16), r)
            if self.buf is not None:
                buf[:, :self.length] = self.c
            self.buf = buf
        self.buf[:, self.length:need] = c_new
        self.length = need
        return self.c


class GatedMLA(nn.Module):
    """Multi-head latent attention, causal, NoPE, with a gate between W_UV and W_o. No biases.

    Parameters: q_down D→q_lora, q_norm [q_lora], q_up q_lora→H·(d_q + d_r) (q_lora_rank = 0: q_proj
    D→H·(d_q + d_r) instead of the three), kv_down D→r + d_r (the latent's rows, then the shared key's),
    kv_norm [r], W_UK [H, d_q, r], W_UV [H, d_v, r], g_proj D→H·d_v (output_gate only), o_proj H·d_v→D.
    `norm_eps` is the eps of q_norm and kv_norm.
    """

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
                 qk_head_dim: int, v_head_dim: int, absorb: bool = False, norm_eps: float = 1e-6,
                 init_std: float = 0.02, qk_rope_head_dim: int = 0, output_gate: bool = True):
        super().__init__()
        D, H, r, dr = hidden_size, num_heads, kv_lora_rank, qk_rope_head_dim
        self.num_heads, self.qk_head_dim, self.v_head_dim = H, qk_head_dim, v_head_dim
        self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim = q_lora_rank, r, dr
        self.absorb = absorb
        self.scale = (qk_head_dim + dr) ** -0.5
        if q_lora_rank > 0:
            self.q_down = nn.Linear(D, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps)
            self.q_up = nn.Linear(q_lora_rank, H * (qk_head_dim + dr), bias=False)
        else:
            self.q_proj = nn.Linear(D, H * (qk_head_dim + dr), bias=False)
        self.kv_down = nn.Linear(D, r + dr, bias=False)
        self.kv_norm = RMSNorm(r, norm_eps)
        self.W_UK = nn.Parameter(torch.randn(H, qk_head_dim, r) * init_std)
        self.W_UV = nn.Parameter(torch.randn(H, v_head_dim, r) * init_std)
        self.g_proj = nn.Linear(D, H * v_head_dim, bias=False) if output_gate else None
        self.o_proj = nn.Linear(H * v_head_dim, D, bias=False)

    def new_cache(self) -> MLACache:
        return MLACache()

    def forward(self, x: torch.Tensor, absorb: bool | None = None,
                cache: MLACache | None = None, segments: Segments | None = None) -> torch.Tensor:
        """x [B, T, D] (pre-normed) -> [B, T, D]. `absorb` overrides the configured path. With `cache`,
        x continues the cached tokens (prefill when empty) and its latents are appended. With `segments`
        (packed documents, no cache) a token attends within its own document only."""
        B, T, _ = x.shape
        H = self.num_heads
        if segments is not None and cache is not None:
            raise ValueError("GatedMLA: segments (packed documents) and a decode cache do not combine")
        gated = self.g_proj is not None
        q_in = self.q_down if self.q_lora_rank else self.q_proj
        q, c, *gate = fused_linear(x, q_in, self.kv_down, *([self.g_proj] if gated else []))  # one matmul reads x
        if self.q_lora_rank:
            q = self.q_up(self.q_norm(q))
        q = q.view(B, T, H, self.qk_head_dim + self.qk_rope_head_dim)               # (B, T, H, d_q + d_r)
        if self.qk_rope_head_dim:
            # [c | k_r]: the shared key k_r is neither normalised nor rotated and is cached beside the latent
            r = self.kv_lora_rank
            c = torch.cat([self.kv_norm(c[..., :r]), c[..., r:]], -1)               # (B, T, r + d_r)
        else:
            c = self.kv_norm(c)                                                      # (B, T, r)
        use_absorb = self.absorb if absorb is None else absorb
        past = 0
        if cache is not None:
            past = cache.length
            c = cache.append(c)                                                      # (B, past + T, r + d_r)
            # decode: queries see the whole cache through the latent (the absorbed form)
            use_absorb = use_absorb or past > 0
        doc = None if segments is None else segments.doc
        o = self._absorbed(q, c, past, doc) if use_absorb else self._decompressed(q, c, doc)  # (B, H, T, d_v)
        o = o.transpose(1, 2).reshape(B, T, H * self.v_head_dim)                     # (B, T, H·d_v)
        if not gated:
            return self.o_proj(o)
        # the gate reads the layer input x and sits before W_o, so W_UV cannot fold into W_o
        return self.o_proj(torch.sigmoid(gate[0]) * o)

    def _absorbed(self, q: torch.Tensor, c: torch.Tensor, past: int = 0, doc: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, T, H, d_q + d_r], c [B, past + T, r + d_r] -> õ [B, H, T, d_v]; attention runs in the latent
        space; query i sits at position past + i. `doc` [B, T] (no past): attend within the document."""
        T, S = q.shape[1], c.shape[1]
        dq, r = self.qk_head_dim, self.kv_lora_rank
        if self.qk_rope_head_dim:
            # [W_UKᵀ q_n | q_r] against [c | k_r]: one product scores both parts
            q_abs = torch.cat([torch.einsum("bthd,hdj->bthj", q[..., :dq], self.W_UK), q[..., dq:]], -1)
        else:
            q_abs = torch.einsum("bthd,hdj->bthj", q, self.W_UK)                     # (B, T, H, r)
        # scores and softmax in fp32 (fp64 stays fp64 for identity tests)
        wd = work_dtype(q)
        score = torch.einsum("bthj,bsj->bhts", q_abs, c).to(wd) * self.scale         # (B, H, T, S)
        if doc is not None:
            score = score.masked_fill(~_document_mask(doc)[:, None], float("-inf"))
        elif T > 1:   # one query (a decode step) sees the whole cache: nothing to mask
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(past)
            score = score.masked_fill(~mask, float("-inf"))
        attn = score.softmax(-1).to(q.dtype)
        if self.qk_rope_head_dim:
            c = c[..., :r]
        o_lat = torch.einsum("bhts,bsj->bhtj", attn, c)                              # (B, H, T, r)
        return torch.einsum("bhtj,hvj->bhtv", o_lat, self.W_UV)                      # (B, H, T, d_v)

    def _decompressed(self, q: torch.Tensor, c: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, T, H, d_q + d_r], c [B, T, r + d_r] -> õ [B, H, T, d_v] via per-head k, v and causal SDPA; with `doc`
        [B, T] block-diagonal causal (docs/math.md §10): FlexAttention on CUDA, whose block mask skips the
        blocks between documents and never holds a [T, T] mask; on CPU, where FlexAttention has no backward,
        and for head sizes below 16, SDPA with the [B, 1, T, T] boolean mask."""
        if self.qk_rope_head_dim:
            r = self.kv_lora_rank
            c, k_r = c[..., :r], c[..., r:]
        k = torch.einsum("bsj,hdj->bhsd", c, self.W_UK)                              # (B, H, T, d_q)
        v = torch.einsum("bsj,hvj->bhsv", c, self.W_UV)                              # (B, H, T, d_v)
        if self.qk_rope_head_dim:   # every head's key ends with the same k_r
            k = torch.cat([k, k_r[:, None].expand(-1, k.shape[1], -1, -1)], -1)    # (B, H, T, d_q + d_r)
        q = q.transpose(1, 2)                                                        # (B, H, T, d_q + d_r)
        if doc is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        if q.is_cuda and min(q.shape[-1], v.shape[-1]) >= FLEX_MIN_HEAD_DIM:
            return _flex_document_attention(q, k, v, doc, self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_document_mask(doc)[:, None], scale=self.scale)


# FlexAttention's kernels need query-key and value head sizes of at least 16 (tiny test models have less)
FLEX_MIN_HEAD_DIM = 16


def _document_mask(doc: torch.Tensor) -> torch.Tensor:
    """doc [B, T] -> [B, T, T] bool: query i may see key j iff j <= i in the same document."""
    T = doc.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    return causal & (doc[:, :, None] == doc[:, None, :])


@functools.cache
def _fused_flex_attention():
    """FlexAttention compiled once: called eagerly it runs an unfused form that holds every [T, T] score."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _flex_document_attention(q, k, v, doc: torch.Tensor, scale: float) -> torch.Tensor:
    """Block-diagonal causal attention by FlexAttention (q, k, v [B, H, T, d])."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def same_document_causal(b, h, i, j):
        return (j <= i) & (doc[b, i] == doc[b, j])
    B, T = doc.shape
    block_mask = create_block_mask(same_document_causal, B, None, T, T, device=q.device)
    # inside a compiled model the outer graph fuses it; eagerly, the compiled function does
    attend = flex_attention if torch.compiler.is_compiling() else _fused_flex_attention()
    return attend(q, k, v, block_mask=block_mask, scale=scale)
