"""Analytic FLOPs per token of a K3 / pure-KDA model, and model FLOPs utilisation (docs/math.md §9).

Convention:
- one multiply-add is 2 FLOPs; only products are counted (matmuls, the short convs, the KDA chunk
  products, attention scores and weighted sums); norms, activations, gates, softmax, exp and the
  loss are elementwise and count 0, and so does the embedding lookup;
- a parameter used in a matmul costs 2 FLOPs per token forward: the dense projections, the shared
  experts, the router and the top-k routed experts a token uses (never the n_r − k it skips);
- training = 3 × forward (the forward product, then one product each for the gradients of its two
  operands), for every counted term; recomputation in the backward (the KDA kernels re-run their
  state scan, activation checkpointing re-runs a block's forward) is not counted, so the figure is
  model FLOPs, not hardware FLOPs;
- the chunked KDA is counted as the Triton kernels compute it per chunk of C tokens (docs/math.md
  §2.2, k3cli/ops/kda/README.md §2), including the padded tail chunk; MLA attention counts the
  T(T + 1)/2 query-key pairs a causal kernel keeps.
"""
from __future__ import annotations

import math
import re

from k3cli.models.k3_config import ModelConfig
from k3cli.models.layout import routed_expert_width

# dense bf16 tensor-core peak (no sparsity), TFLOP/s, from the vendors' datasheets; keys are matched as
# whole words in the device name, longest first ("H100 PCIe" before "H100")
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H200 NVL": 835.5,
    "H200": 989.4,  # H200 SXM
    "H100 PCIe": 756.5,
    "H100 NVL": 835.5,
    "H100": 989.4,  # H100 SXM, which torch names "NVIDIA H100 80GB HBM3"
    "A100": 312.0,  # SXM and PCIe
    "L40S": 362.05,
    "RTX 4090": 165.2,  # with fp32 accumulation (the Ada whitepaper; 330.3 is with fp16 accumulation)
}


def device_peak_tflops(device_name: str) -> tuple[float, str] | None:
    """(dense bf16 peak in TFLOP/s, matched table key) for a device name such as
    `torch.cuda.get_device_name()`, or None when the table has no entry for it."""
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        # whole-word match, so "A100" does not claim an "A1000"
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name, re.IGNORECASE):
            return PEAK_BF16_TFLOPS[key], key
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s (tokens/s × training FLOPs per token, e.g.
    `flops_per_token(cfg, T)["total"]`) over the device peak; a fraction in [0, 1] for sane inputs."""
    if peak_tflops <= 0:
        raise ValueError(f"peak_tflops must be > 0, got {peak_tflops}")
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)


def kda_sub_chunk(chunk_size: int) -> int:
    """Rows of the kernels' score and solve blocks: 16 where the chunk splits into them, else the chunk."""
    return 16 if chunk_size % 16 == 0 else chunk_size


def kda_chunk_macs(chunk_size: int, head_k_dim: int, head_v_dim: int) -> dict[str, int]:
    """Multiply-adds of the chunked KDA forward for one chunk and one value head, by stage.

    scores: Aqk and Akk, the s×s blocks on and below the block diagonal (s = 16-row sub-chunks);
    solve: Tm = (I + Akk)^-1, each diagonal block by the nilpotent product (I + P)(I + P²)… and the
    blocks below it by block forward substitution; wu: W = Tm·X and U = Tm·Y as full C×C products;
    state: Vn = U − W·S, O = Q_g·S + Aqk·Vn and the update K_dᵀ·Vn.
    """
    C, K, V = chunk_size, head_k_dim, head_v_dim
    s = kda_sub_chunk(C)
    ns = C // s
    scores = 2 * (ns * (ns + 1) // 2) * s * s * K
    # ceil(log2 s) − 1 squarings of P and as many products: the powers up to P^(s − 1)
    inverse_dots = 2 * max(math.ceil(math.log2(s)) - 1, 0) if s > 1 else 0
    # block (i, j), i > j, costs i − j products for Σ A_im T_mj and one for T_ii · (that sum)
    below = sum((ns - d) * (d + 1) for d in range(1, ns))
    solve = (ns * inverse_dots + below) * s ** 3
    wu = C * C * (K + V)
    state = 3 * C * K * V + C * C * V
    return {"scores": scores, "solve": solve, "wu": wu, "state": state}


def _kda_proj_params(cfg: ModelConfig) -> int:
    """KDA weights used in products per token: q, k, v, the short convs, gate, β, output gate, o_proj."""
    D, c = cfg.hidden_size, cfg.kda
    H, HV, K, V = c.num_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim
    p = 2 * D * H * K + D * HV * V + (2 * H * K + HV * V) * c.short_conv
    p += D * K + K * HV * K + D * HV
    p += (D * V + V * HV * V) if c.output_gate else 0
    return p + HV * V * D


def _mla_proj_params(cfg: ModelConfig) -> int:
    """MLA weights used in products per token: q down/up (or the direct q_proj), kv down (latent and shared
    key), W_UK, W_UV, gate (when on), o_proj."""
    D, c = cfg.hidden_size, cfg.mla
    H, qr, r, dq, dv, dr = (c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.v_head_dim,
                            c.qk_rope_head_dim)
    q = D * qr + qr * H * (dq + dr) if qr else D * H * (dq + dr)
    return q + D * (r + dr) + H * dq * r + H * dv * r + (2 if c.output_gate else 1) * D * H * dv


def attnres_sources(cfg: ModelConfig) -> int:
    """Sources summed over every AttnRes mix of one token (each sublayer's and the final one); 0 when off."""
    mode, N, S = cfg.attnres.mode, 2 * cfg.num_hidden_layers, cfg.attnres.block_size
    if mode == "off":
        return 0
    if mode == "full":
        # sublayer l mixes v_0 … v_l, the final mix all N + 1
        return sum(l + 1 for l in range(N)) + N + 1
    # the embedding, the completed blocks, and the partial sum for all but a block's first sublayer
    n = sum(1 + l // S + (1 if l % S else 0) for l in range(N))
    return n + 1 + -(-N // S)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict:
    """Training and forward FLOPs per token of `cfg` at sequence length `seq_len`, by component
    (convention in the module docstring, formulas in docs/math.md §9).

    Returns {"total": training FLOPs, "forward": forward FLOPs, "components": training FLOPs by
    component, "forward_components": the same forward, "matmul_params": active parameters used in
    matmuls per token (head included, embedding not)}. Components: embedding (0), attn_projections
    (KDA and MLA weights), kda_chunk, mla_attention, ffn (SwiGLU), moe_router, moe_latent_proj
    (W_↓, W_↑), moe_shared_experts, moe_routed_experts (top-k only), attnres, lm_head.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    T, D = seq_len, cfg.hidden_size
    kda, mla, moe = cfg.kda, cfg.mla, cfg.moe
    macs = dict.fromkeys(("embedding", "attn_projections", "kda_chunk", "mla_attention", "ffn", "moe_router",
                          "moe_latent_proj", "moe_shared_experts", "moe_routed_experts", "attnres",
                          "lm_head"), 0.0)
    # the tail chunk is padded to C and computed in full
    chunks = -(-T // kda.chunk_size)
    kda_chunk = kda.num_v_heads * chunks * sum(kda_chunk_macs(kda.chunk_size, kda.head_k_dim,
                                                              kda.head_v_dim).values()) / T
    # causal: query t sees t keys, (T + 1) / 2 on average
    pairs = (T + 1) / 2
    # scores over [c | k_r] (r + d_r) and the latent sum (r), or per-head keys (d_q + d_r) and values (d_v)
    dr = mla.qk_rope_head_dim
    mla_width = 2 * mla.kv_lora_rank + dr if mla.absorb else mla.qk_head_dim + dr + mla.v_head_dim
    mla_attention = mla.num_heads * mla_width * pairs
    lat = cfg.moe_latent_dim
    # with the latent off the routed experts work at width D and there is no W_↓, W_↑
    routed_width, lat_proj = routed_expert_width(cfg), (2 * D * lat if moe.latent else 0)
    for attn, ffn in cfg.layer_specs():
        if attn == "kda":
            macs["attn_projections"] += _kda_proj_params(cfg)
            macs["kda_chunk"] += kda_chunk
        else:
            macs["attn_projections"] += _mla_proj_params(cfg)
            macs["mla_attention"] += mla_attention
        if ffn == "swiglu":
            macs["ffn"] += 3 * D * cfg.intermediate_size
        else:
            macs["moe_router"] += D * moe.num_routed_experts
            macs["moe_latent_proj"] += lat_proj
            macs["moe_shared_experts"] += moe.num_shared_experts * 3 * D * moe.d_ff
            macs["moe_routed_experts"] += moe.top_k * 3 * routed_width * moe.d_ff
    # a score (w̃ · RMS(source)) and a weighted-sum term per source and mix, D wide each
    macs["attnres"] = 2 * D * attnres_sources(cfg)
    macs["lm_head"] = D * cfg.vocab_size
    forward = {k: 2.0 * v for k, v in macs.items()}
    training = {k: 3.0 * v for k, v in forward.items()}
    param_terms = ("attn_projections", "ffn", "moe_router", "moe_latent_proj", "moe_shared_experts",
                   "moe_routed_experts", "lm_head")
    return {"total": sum(training.values()), "forward": sum(forward.values()), "components": training,
            "forward_components": forward, "matmul_params": int(sum(macs[k] for k in param_terms))}
