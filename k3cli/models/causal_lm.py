"""CausalLM: the whole K3 / pure-KDA model (docs/math.md §1, §5) in one sitting.

    Embedding → DecoderBlock × L (or the AttnRes mixer over their 2L sublayers) → RMSNorm → LM head

Notable features:
- layer kinds come from `config.layer_specs()` (KDA/MLA attention, SwiGLU/LatentMoE FFN);
- `attnres.mode != "off"` replaces the residual sum by softmax mixes over depth, including a final
  mix before the last norm (K3, docs/math.md §5);
- loss is the shifted next-token cross-entropy in fp32, labels = -100 ignored, computed from the final hidden
  states chunk by chunk (`k3cli/ops/linear_ce`): the [B·T, vocab] fp32 logits are never held;
- `num_active_parameters()` drops the (n_r − k) unchosen routed experts of every MoE layer;
- decode (docs/math.md §2.5, §7.3): `prefill(ids) -> (logits, DecodeCache)`, then `decode_step(next_ids, cache)`;
  the cache holds a KDA state + conv windows or an MLA latent per block; AttnRes and FFNs need none.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3cli.layers.attnres import AttnResMixer
from k3cli.layers.block import DecoderBlock
from k3cli.layers.kda import KDAAttention
from k3cli.layers.moe import LatentMoE
from k3cli.layers.norm import RMSNorm
from k3cli.layers.segments import Segments
from k3cli.models.k3_config import ModelConfig
from k3cli.ops.linear_ce import linear_cross_entropy


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, T, vocab]; None when labels are given (the loss never makes them all)
    loss: torch.Tensor | None = None  # scalar, when labels are given


@dataclass
class DecodeCache:
    """Per-block attention caches (KDACache | MLACache), the batch size, and the tokens seen so far."""
    layers: list
    batch_size: int
    position: int = 0


class CausalLM(nn.Module):
    """Parameters: embed_tokens [vocab, D], blocks, attnres (mode full/block), norm [D],
    lm_head [vocab, D] unless tie_word_embeddings."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.blocks = nn.ModuleList(DecoderBlock.from_spec(config, a, f) for a, f in config.layer_specs())
        ar = config.attnres
        self.attnres = None
        if ar.mode != "off":
            self.attnres = AttnResMixer(D, 2 * len(self.blocks), ar.mode, ar.block_size, ar.eps)
        self.norm = RMSNorm(D, config.norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(D, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # "block": each decoder block (with AttnRes: each sublayer core) recomputes its activations
        # in backward instead of keeping them; set by the training loop (train.activation_checkpointing)
        self.activation_checkpointing = "none"

    def _init_weights(self, module: nn.Module) -> None:
        # normal(0, initializer_range) for every projection and the embedding (GPT-2 / nanoGPT);
        # norms, conv kernels, KDA's A_log/dt_bias and AttnRes w/γ keep their own inits
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def _logits(self, input_ids: torch.Tensor, caches: list | None = None,
                segments: Segments | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab]; `caches` (one per block) continue a decode; `segments`:
        the documents packed in the batch, each then computed as if alone (docs/math.md §10)."""
        return F.linear(self._hidden(input_ids, caches, segments), self._head_weight())

    def _hidden(self, input_ids: torch.Tensor, caches: list | None = None,
                segments: Segments | None = None) -> torch.Tensor:
        """input_ids [B, T] -> the final normed hidden states [B, T, D] the LM head reads."""
        caches = caches or [None] * len(self.blocks)
        x = self.embed_tokens(input_ids)                                           # (B, T, D)
        if not self.config.fp32_residual and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        recompute = self.activation_checkpointing == "block" and self.training and torch.is_grad_enabled()
        if self.attnres is None:
            for block, cache in zip(self.blocks, caches):
                x = (checkpoint(block, x, cache, segments, use_reentrant=False) if recompute
                     else block(x, cache, segments))
        else:
            # token-local: the same mixer runs over the sublayers of however many tokens come in
            # the mixer applies each sublayer's pre-norm (fused into its kernel on CUDA) and the final norm
            cores = [f for block, c in zip(self.blocks, caches) for f in block.sublayer_cores(c, segments)]
            if recompute:
                cores = [functools.partial(checkpoint, f, use_reentrant=False) for f in cores]
            norms = [n for block in self.blocks for n in block.sublayer_norms()]
            return self.attnres(x, cores, norms=norms, final_norm=self.norm)
        return self.norm(x)

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                segments: Segments | None = None) -> ModelOutput:
        """input_ids [B, T] long → ModelOutput(logits [B, T, V]); with labels [B, T] (usually = input_ids)
        → ModelOutput(None, loss). `segments` (Segments.from_starts): the documents packed in the rows; no token
        sees another document."""
        x = self._hidden(input_ids, segments=segments)
        if labels is None:
            return ModelOutput(logits=F.linear(x, self._head_weight()))
        # position t predicts token t+1; the last position of a row predicts nothing (ignored): the mean over
        # the counted tokens is that of F.cross_entropy on logits[:, :-1], without copying the hidden states
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        return ModelOutput(logits=None, loss=linear_cross_entropy(x.flatten(0, 1), self._head_weight(),
                                                                  targets.flatten()))

    def new_cache(self, batch_size: int) -> DecodeCache:
        return DecodeCache([block.new_cache() for block in self.blocks], batch_size)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, DecodeCache]:
        """Run the prompt input_ids [B, T] (chunked KDA) -> (logits [B, T, vocab], cache for decode_step)."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"prefill: input_ids must be [B, T] with T >= 1, got {tuple(input_ids.shape)}")
        cache = self.new_cache(input_ids.shape[0])
        logits = self._logits(input_ids, cache.layers)
        cache.position = input_ids.shape[1]
        return logits, cache

    @torch.no_grad()
    def decode_step(self, token_ids: torch.Tensor, cache: DecodeCache) -> torch.Tensor:
        """The next token(s) token_ids [B, 1] (or [B, n], recurrent KDA) after `cache` -> logits [B, n, vocab].
        The cache advances in place."""
        if token_ids.dim() != 2 or token_ids.shape[1] == 0:
            raise ValueError(f"decode_step: token_ids must be [B, n] with n >= 1, got {tuple(token_ids.shape)}")
        if token_ids.shape[0] != cache.batch_size:
            raise ValueError(f"decode_step: batch size {token_ids.shape[0]} != the cache's {cache.batch_size}")
        if cache.position == 0:
            raise ValueError("decode_step: the cache is empty; call prefill(input_ids) first")
        logits = self._logits(token_ids, cache.layers)
        cache.position += token_ids.shape[1]
        return logits

    def layout_chunk_sizes(self) -> list[int]:
        """The chunk sizes of the KDA layers: with packed documents, the input pipeline makes each batch's
        chunk-aligned layout for these ahead of its step (ops/kda/varlen.py)."""
        return sorted({m.chunk_size for m in self.modules() if isinstance(m, KDAAttention)})

    def moe_layers(self) -> list[LatentMoE]:
        return [m for m in self.modules() if isinstance(m, LatentMoE)]

    def num_parameters(self) -> int:
        """Total parameters (a tied embedding counted once). Works on the meta device."""
        return sum(p.numel() for p in self.parameters())

    def num_active_parameters(self) -> int:
        """Parameters one token touches: total − (n_r − k) routed experts' weights per MoE layer."""
        from k3cli.models.layout import routed_expert_params

        m = self.config.moe
        per_layer = (m.num_routed_experts - m.top_k) * routed_expert_params(self.config)
        return self.num_parameters() - per_layer * len(self.moe_layers())
