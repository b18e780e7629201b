"""Decoder block (docs/math.md §1) and the two factories that turn a layer spec into modules.

DecoderBlock(x): x = x + attn(attn_norm(x)); x = x + ffn(ffn_norm(x))   (pre-norm residual).
With AttnRes on, the model drives the two sublayers itself: `sublayer_cores()` (attn, ffn without
their pre-norms) with `sublayer_norms()`, so the mixer can fuse each pre-norm into its mix kernel.
`cache` (the attention layer's KDACache / MLACache) makes the attention sublayer continue a decode.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from k3cli.layers.ffn import SwiGLUMLP
from k3cli.layers.kda import KDAAttention
from k3cli.layers.mla import GatedMLA
from k3cli.layers.moe import LatentMoE
from k3cli.layers.norm import RMSNorm
from k3cli.layers.segments import Segments

if TYPE_CHECKING:   # annotations only: layers import nothing from models at run time
    from k3cli.models.k3_config import ModelConfig

ATTN_KINDS = ("kda", "mla")
FFN_KINDS = ("swiglu", "moe")


def build_attn(config: ModelConfig, kind: str) -> nn.Module:
    """'kda' → KDAAttention, 'mla' → GatedMLA, sized from config."""
    D = config.hidden_size
    if kind == "kda":
        c = config.kda
        return KDAAttention(D, c.num_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim,
                            short_conv=c.short_conv, output_gate=c.output_gate,
                            lower_bound=c.lower_bound, chunk_size=c.chunk_size, backend=c.backend,
                            norm_eps=config.norm_eps, gate=c.gate)
    if kind == "mla":
        c = config.mla
        return GatedMLA(D, c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.v_head_dim,
                        absorb=c.absorb, norm_eps=c.latent_norm_eps or config.norm_eps,
                        init_std=config.initializer_range, qk_rope_head_dim=c.qk_rope_head_dim,
                        output_gate=c.output_gate)
    raise ValueError(f"unknown attention kind '{kind}'; valid: {', '.join(ATTN_KINDS)}")


def build_ffn(config: ModelConfig, kind: str) -> nn.Module:
    """'swiglu' → SwiGLUMLP(D, intermediate_size), 'moe' → LatentMoE, sized from config."""
    D = config.hidden_size
    if kind == "swiglu":
        return SwiGLUMLP(D, config.intermediate_size)
    if kind == "moe":
        c = config.moe
        return LatentMoE(D, c.num_routed_experts, c.top_k, c.num_shared_experts, c.d_ff,
                         config.moe_latent_dim, dispatch=c.dispatch, bias_update_rate=c.bias_update_rate,
                         norm_eps=config.norm_eps, init_std=config.initializer_range,
                         routed_scaling_factor=c.routed_scaling_factor, renormalize=c.renormalize,
                         num_expert_groups=c.num_expert_groups, topk_groups=c.topk_groups,
                         expert_act=c.expert_act, latent=c.latent)
    raise ValueError(f"unknown FFN kind '{kind}'; valid: {', '.join(FFN_KINDS)}")


class DecoderBlock(nn.Module):
    """Pre-norm block: attn_norm [D], attn, ffn_norm [D], ffn."""

    def __init__(self, attn: nn.Module, ffn: nn.Module, hidden_size: int, norm_eps: float = 1e-6):
        super().__init__()
        self.attn_norm = RMSNorm(hidden_size, norm_eps)
        self.attn = attn
        self.ffn_norm = RMSNorm(hidden_size, norm_eps)
        self.ffn = ffn

    @classmethod
    def from_spec(cls, config: ModelConfig, attn: str, ffn: str) -> DecoderBlock:
        return cls(build_attn(config, attn), build_ffn(config, ffn), config.hidden_size, config.norm_eps)

    def new_cache(self):
        """An empty decode cache for this block's attention (KDACache | MLACache); FFNs keep none."""
        return self.attn.new_cache()

    def attn_sublayer(self, h: torch.Tensor, cache=None, segments: Segments | None = None) -> torch.Tensor:
        """Raw attention output attn(attn_norm(h)), [B, T, D] -> [B, T, D] (no residual)."""
        return self.attn(self.attn_norm(h), **_attn_kwargs(cache, segments))

    def ffn_sublayer(self, h: torch.Tensor) -> torch.Tensor:
        """Raw FFN output ffn(ffn_norm(h)), [B, T, D] -> [B, T, D] (no residual)."""
        return self.ffn(self.ffn_norm(h))

    def sublayer_cores(self, cache=None, segments: Segments | None = None) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """attn and ffn without their pre-norms (inputs already normalised by `sublayer_norms()`)."""
        kw = _attn_kwargs(cache, segments)
        return [functools.partial(self.attn, **kw) if kw else self.attn, self.ffn]

    def sublayer_norms(self) -> list[RMSNorm]:
        return [self.attn_norm, self.ffn_norm]

    def forward(self, x: torch.Tensor, cache=None, segments: Segments | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; `segments`: packed documents (layers/segments.py)."""
        x = x + self.attn_sublayer(x, cache, segments)
        return x + self.ffn_sublayer(x)


def _attn_kwargs(cache, segments) -> dict:
    return {k: v for k, v in (("cache", cache), ("segments", segments)) if v is not None}
