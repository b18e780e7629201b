"""Model configuration: one small dataclass per component, and the two model configs of the seeds.

`KDAConfig` is the pure-KDA model (every block KDA + SwiGLU); `K3Config` is the hybrid
(3 KDA : 1 MLA, last block MLA, every FFN a LatentMoE). Both share `ModelConfig`'s fields; the
preset's `model.arch` (`kda` | `k3`) picks the class. See docs/math.md §1 and §6.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from k3cli.errors import ConfigError
from k3cli.ops.backend import BACKENDS


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


# far above any model this toolkit trains (the largest vocabularies are ~256k, widths ~16k, depths ~130);
# past them a typo would fail as an allocation error or a killed process instead of one line
MAX_VOCAB, MAX_WIDTH, MAX_LAYERS = 2**22, 2**16, 1024


@dataclass
class KDALayerConfig:
    num_heads: int = 8  # H: query/key heads
    num_v_heads: int = 8  # HV = G·H value heads (GVA)
    head_k_dim: int = 16  # K
    head_v_dim: int = 16  # V
    chunk_size: int = 64  # C
    short_conv: int = 4  # depthwise causal conv kernel on q, k, v; 0 = off
    output_gate: bool = True
    lower_bound: float = -5.0  # gate g ∈ (lower_bound, 0)
    backend: str = "auto"  # auto: Triton on CUDA, torch (torch_chunk_kda) on CPU
    gate: str = "lower_bound"  # lower_bound: L·σ(·) ∈ (L, 0); softplus: −e^A·softplus(·), unbounded (Kimi Linear)

    CHOICES: ClassVar[dict] = {"backend": BACKENDS, "gate": ("lower_bound", "softplus")}

    def validate(self, p: str) -> None:
        for name in ("num_heads", "num_v_heads", "head_k_dim", "head_v_dim", "chunk_size"):
            _check(getattr(self, name) >= 1, f"{p}.{name}", "must be >= 1")
        _check(self.num_v_heads % self.num_heads == 0, f"{p}.num_v_heads",
               f"must be a multiple of num_heads ({self.num_heads}) for GVA")
        _check(self.short_conv >= 0, f"{p}.short_conv", "must be >= 0 (0 = off)")
        _check(-5.0 <= self.lower_bound < 0, f"{p}.lower_bound", "must lie in [-5, 0)")


@dataclass
class MLAConfig:
    num_heads: int = 8
    q_lora_rank: int = 64  # 0 = a direct query projection (no bottleneck, no q norm)
    kv_lora_rank: int = 32  # r: the KV cache, r (+ qk_rope_head_dim) numbers per token
    qk_head_dim: int = 16  # d_q
    v_head_dim: int = 16  # d_v
    absorb: bool = False  # training path: absorbed (True) or decompressed (False); decode is absorbed
    qk_rope_head_dim: int = 0  # d_r: a key part shared by all heads, not normalised nor rotated (Kimi Linear)
    output_gate: bool = True  # sigmoid gate on the attention output before o_proj
    latent_norm_eps: float = 0.0  # eps of q_norm and kv_norm; 0 = the model's norm_eps

    def validate(self, p: str) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_head_dim", "v_head_dim"):
            _check(getattr(self, name) >= 1, f"{p}.{name}", "must be >= 1")
        _check(self.q_lora_rank >= 0, f"{p}.q_lora_rank", "must be >= 0 (0 = a direct query projection)")
        _check(self.qk_rope_head_dim >= 0, f"{p}.qk_rope_head_dim", "must be >= 0 (0 = off)")
        _check(self.latent_norm_eps >= 0, f"{p}.latent_norm_eps", "must be >= 0 (0 = model.norm_eps)")


@dataclass
class MoEConfig:
    num_routed_experts: int = 16  # n_r
    top_k: int = 2  # k
    num_shared_experts: int = 2  # n_s
    d_ff: int = 96  # expert hidden width (shared and routed)
    latent_dim: int = 0  # ℓ; 0 = hidden_size // 2
    bias_update_rate: float = 1e-3  # γ of the auxiliary-loss-free balancing
    dispatch: str = "grouped"  # grouped | tiled | loop | dense
    routed_scaling_factor: float = 1.0  # the routed weights × this, after the renormalisation (if any)
    renormalize: bool = True  # weights = chosen scores / their sum; False: the chosen sigmoid scores as they are
    num_expert_groups: int = 1  # G: top-k only among the best topk_groups of G equal groups (DeepSeek-V3); 1 = off
    topk_groups: int = 1  # groups a token may choose experts from
    expert_act: str = "situ"  # shared and routed experts' gated activation: situ (bounded) | silu (SwiGLU)
    latent: bool = True  # False: routed experts at full width on x, no W_↓ / RMSNorm / W_↑ (Kimi Linear)

    CHOICES: ClassVar[dict] = {"dispatch": ("grouped", "tiled", "loop", "dense"), "expert_act": ("situ", "silu")}

    def validate(self, p: str) -> None:
        _check(self.num_routed_experts >= 1, f"{p}.num_routed_experts", "must be >= 1")
        _check(1 <= self.top_k <= self.num_routed_experts, f"{p}.top_k",
               f"must lie in [1, num_routed_experts={self.num_routed_experts}]")
        _check(self.num_shared_experts >= 0, f"{p}.num_shared_experts", "must be >= 0")
        _check(self.d_ff >= 1, f"{p}.d_ff", "must be >= 1")
        _check(self.latent_dim >= 0, f"{p}.latent_dim", "must be >= 0 (0 = hidden_size // 2)")
        _check(self.bias_update_rate >= 0, f"{p}.bias_update_rate", "must be >= 0")
        _check(self.routed_scaling_factor > 0, f"{p}.routed_scaling_factor", "must be > 0")
        E, G = self.num_routed_experts, self.num_expert_groups
        _check(G >= 1, f"{p}.num_expert_groups", "must be >= 1 (1 = no grouping)")
        _check(E % G == 0, f"{p}.num_expert_groups", f"must divide num_routed_experts={E}")
        _check(G == 1 or E // G >= 2, f"{p}.num_expert_groups",
               f"leaves {E // G} expert per group; a group's score sums its best 2, so at least 2 are needed")
        _check(1 <= self.topk_groups <= G, f"{p}.topk_groups", f"must lie in [1, num_expert_groups={G}]")
        _check(self.top_k <= E // G * self.topk_groups, f"{p}.top_k",
               f"must be <= {E // G * self.topk_groups} (experts per group × topk_groups) to find its experts")


@dataclass
class AttnResConfig:
    mode: str = "off"  # off | full | block
    block_size: int = 2  # S, in atomic sublayers (block mode)
    eps: float = 1e-6  # RMS eps of the source keys

    CHOICES: ClassVar[dict] = {"mode": ("off", "full", "block")}

    def validate(self, p: str) -> None:
        _check(self.block_size >= 1, f"{p}.block_size", "must be >= 1")
        _check(self.eps >= 0, f"{p}.eps", "must be >= 0")


@dataclass
class ModelConfig:
    arch: str = "k3"  # k3 (hybrid) | kda (pure KDA)
    vocab_size: int = 4096
    hidden_size: int = 256  # D
    num_hidden_layers: int = 4  # L
    intermediate_size: int = 512  # SwiGLU width (kda arch)
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # the residual stream (AttnRes: its sources) under autocast: fp32 (as the embedding), or false for the
    # autocast dtype, which halves the bytes the residual adds, norms and depth mixes move
    fp32_residual: bool = True
    mla_layers: str = ""  # k3: 0-based blocks that are MLA, e.g. "3,7,11" ("" = every 4th and the last)
    first_dense_layers: int = 0  # k3: the first N blocks' FFN is a dense SwiGLU (intermediate_size), not the MoE
    kda: KDALayerConfig = field(default_factory=KDALayerConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    attnres: AttnResConfig = field(default_factory=AttnResConfig)

    CHOICES: ClassVar[dict] = {"arch": ("k3", "kda")}

    @property
    def moe_latent_dim(self) -> int:
        return self.moe.latent_dim or self.hidden_size // 2

    def layer_types(self) -> list[str]:
        raise NotImplementedError

    def layer_specs(self) -> list[tuple[str, str]]:
        raise NotImplementedError

    def validate(self, p: str = "model") -> None:
        _check(2 <= self.vocab_size <= MAX_VOCAB, f"{p}.vocab_size", f"must lie in [2, {MAX_VOCAB:,}]")
        for name in ("hidden_size", "num_hidden_layers", "intermediate_size"):
            _check(getattr(self, name) >= 1, f"{p}.{name}", "must be >= 1")
        _check(self.hidden_size <= MAX_WIDTH, f"{p}.hidden_size", f"must be <= {MAX_WIDTH:,}")
        _check(self.intermediate_size <= 4 * MAX_WIDTH, f"{p}.intermediate_size", f"must be <= {4 * MAX_WIDTH:,}")
        _check(self.num_hidden_layers <= MAX_LAYERS, f"{p}.num_hidden_layers", f"must be <= {MAX_LAYERS:,}")
        _check(self.norm_eps >= 0, f"{p}.norm_eps", "must be >= 0")
        _check(self.initializer_range > 0, f"{p}.initializer_range", "must be > 0")
        _check(0 <= self.first_dense_layers <= self.num_hidden_layers, f"{p}.first_dense_layers",
               f"must lie in [0, num_hidden_layers={self.num_hidden_layers}]")
        if self.mla_layers.strip():
            parts = [s.strip() for s in self.mla_layers.split(",")]
            _check(all(s.isdigit() for s in parts), f"{p}.mla_layers",
                   f"must be comma-separated block indices from 0, got {self.mla_layers!r}")
            idx = [int(s) for s in parts]
            _check(all(i < self.num_hidden_layers for i in idx) and len(set(idx)) == len(idx), f"{p}.mla_layers",
                   f"must name distinct blocks below num_hidden_layers={self.num_hidden_layers}")
        self.kda.validate(f"{p}.kda")
        self.mla.validate(f"{p}.mla")
        self.moe.validate(f"{p}.moe")
        self.attnres.validate(f"{p}.attnres")


@dataclass
class KDAConfig(ModelConfig):
    """Pure KDA model: `[("kda", "swiglu")] * L`."""

    arch: str = "kda"

    def layer_types(self) -> list[str]:
        return ["kda"] * self.num_hidden_layers

    def layer_specs(self) -> list[tuple[str, str]]:
        return [("kda", "swiglu")] * self.num_hidden_layers


@dataclass
class K3Config(ModelConfig):
    """Hybrid K3: MLA at 0-based blocks i % 4 == 3 and always at the last block (or at `mla_layers`); every FFN
    LatentMoE (but the first `first_dense_layers`, dense SwiGLU)."""

    arch: str = "k3"

    def layer_types(self) -> list[str]:
        if self.mla_layers.strip():
            mla = {int(s) for s in self.mla_layers.split(",")}
            return ["mla" if i in mla else "kda" for i in range(self.num_hidden_layers)]
        types = ["mla" if i % 4 == 3 else "kda" for i in range(self.num_hidden_layers)]
        types[-1] = "mla"
        return types

    def layer_specs(self) -> list[tuple[str, str]]:
        return [(kind, "swiglu" if i < self.first_dense_layers else "moe") for i, kind in enumerate(self.layer_types())]


MODEL_CLASSES: dict[str, type[ModelConfig]] = {"k3": K3Config, "kda": KDAConfig}
