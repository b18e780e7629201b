"""The block layout of a model config and its parameter counts, computed from the config alone.

`param_counts` mirrors the module structure of `k3cli.layers` exactly (no linear biases); a test
builds every preset's model and checks the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3cli.models.k3_config import ModelConfig


def kda_params(cfg: ModelConfig) -> int:
    D, c = cfg.hidden_size, cfg.kda
    H, HV, K, V, n = c.num_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim, c.short_conv
    p = 2 * D * H * K + D * HV * V  # q, k, v projections
    p += (2 * H * K + HV * V) * n  # depthwise short convs (0 when off)
    p += D * K + K * HV * K  # low-rank gate projection f_a, f_b
    p += D * HV  # beta projection
    p += HV + HV * K  # A_log, dt_bias
    p += (D * V + V * HV * V) if c.output_gate else 0  # low-rank output gate g_a, g_b
    p += V + HV * V * D  # per-head output norm, o_proj
    return p


def mla_params(cfg: ModelConfig) -> int:
    D, c = cfg.hidden_size, cfg.mla
    H, qr, r, dq, dv = c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.v_head_dim
    dqk = dq + c.qk_rope_head_dim  # query width per head (the shared key part included)
    q = D * qr + qr + qr * H * dqk if qr else D * H * dqk  # q_down, q_norm, q_up | q_proj
    return (q
            + D * (r + c.qk_rope_head_dim) + r  # kv_down (latent and shared key), kv_norm
            + H * dq * r + H * dv * r  # W_UK, W_UV
            + (D * H * dv if c.output_gate else 0) + H * dv * D)  # gate, o_proj


def swiglu_params(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden_size * cfg.intermediate_size


def routed_expert_width(cfg: ModelConfig) -> int:
    """The width routed experts read and write: the latent ℓ, or D with `moe.latent` off."""
    return cfg.moe_latent_dim if cfg.moe.latent else cfg.hidden_size


def routed_expert_params(cfg: ModelConfig) -> int:
    return 3 * routed_expert_width(cfg) * cfg.moe.d_ff


def moe_params(cfg: ModelConfig) -> int:
    D, m, lat = cfg.hidden_size, cfg.moe, cfg.moe_latent_dim
    return (m.num_shared_experts * 3 * D * m.d_ff  # shared SiTU-GLU experts on x
            + D * m.num_routed_experts  # router (its balancing bias is a buffer)
            + m.num_routed_experts * routed_expert_params(cfg)
            + ((D * lat + lat + lat * D) if m.latent else 0))  # W_down, u_norm, W_up


ATTN_PARAMS = {"kda": kda_params, "mla": mla_params}
FFN_PARAMS = {"swiglu": swiglu_params, "moe": moe_params}


@dataclass
class BlockRow:
    index: int
    attn: str
    ffn: str
    attn_sublayer: int  # atomic sublayer index 2i
    ffn_sublayer: int  # 2i + 1
    attn_group: str  # AttnRes block membership of each sublayer ("-" when off, "full" for full)
    ffn_group: str
    params: int


def block_rows(cfg: ModelConfig) -> list[BlockRow]:
    mode, S = cfg.attnres.mode, cfg.attnres.block_size

    def group(sub: int) -> str:
        if mode == "off":
            return "-"
        if mode == "full":
            return "full"
        return f"b{sub // S + 1}"  # b0 is the embedding source

    rows = []
    for i, (attn, ffn) in enumerate(cfg.layer_specs()):
        p = ATTN_PARAMS[attn](cfg) + FFN_PARAMS[ffn](cfg) + 2 * cfg.hidden_size  # + the two norms
        rows.append(BlockRow(i, attn, ffn, 2 * i, 2 * i + 1, group(2 * i), group(2 * i + 1), p))
    return rows


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Total and active-per-token parameter counts, by component."""
    D, Vv, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    blocks = sum(r.params for r in block_rows(cfg))
    embed = Vv * D
    head = 0 if cfg.tie_word_embeddings else Vv * D
    attnres = 0 if cfg.attnres.mode == "off" else (2 * L + 1) * 2 * D  # query + gain per sublayer, + output mix
    total = embed + blocks + D + head + attnres
    n_moe = sum(1 for _, f in cfg.layer_specs() if f == "moe")
    inactive = n_moe * (cfg.moe.num_routed_experts - cfg.moe.top_k) * routed_expert_params(cfg)
    return {"total": total, "active": total - inactive, "embedding": embed, "lm_head": head,
            "blocks": blocks, "attnres": attnres, "final_norm": D}


def components(cfg: ModelConfig) -> dict[str, str]:
    """One line per layer kind the model uses, with the options that shape it."""
    kinds = {k for spec in cfg.layer_specs() for k in spec}
    k, m, e = cfg.kda, cfg.mla, cfg.moe
    out = {}
    if "kda" in kinds:
        out["kda"] = (f"H {k.num_heads}, HV {k.num_v_heads}, K {k.head_k_dim}, V {k.head_v_dim}, short conv "
                      f"{k.short_conv}, gate {k.gate}" + (f" (L {k.lower_bound:g})" if k.gate == "lower_bound" else "")
                      + ("" if k.output_gate else ", no output gate"))
    if "mla" in kinds:
        out["mla"] = (f"H {m.num_heads}, query {'low-rank ' + str(m.q_lora_rank) if m.q_lora_rank else 'direct'}, "
                      f"latent r {m.kv_lora_rank}, d_q {m.qk_head_dim}"
                      + (f" + shared key {m.qk_rope_head_dim}" if m.qk_rope_head_dim else "")
                      + f", d_v {m.v_head_dim}, output gate {'on' if m.output_gate else 'off'}")
    if "moe" in kinds:
        out["moe"] = (f"{e.num_routed_experts} experts top-{e.top_k}"
                      + (f" in {e.num_expert_groups} groups (best {e.topk_groups})" if e.num_expert_groups > 1 else "")
                      + f", {e.num_shared_experts} shared, d_ff {e.d_ff}, "
                      + (f"latent {cfg.moe_latent_dim}" if e.latent else "full width") + f", {e.expert_act}"
                      + (f", weights ×{e.routed_scaling_factor:g}" if e.routed_scaling_factor != 1 else "")
                      + ("" if e.renormalize else ", not renormalised"))
    if "swiglu" in kinds:
        out["swiglu"] = f"SwiGLU d_ff {cfg.intermediate_size}"
    return out


def layout_dict(cfg: ModelConfig) -> dict:
    counts = param_counts(cfg)
    return {
        "components": components(cfg),
        "arch": cfg.arch,
        "num_hidden_layers": cfg.num_hidden_layers,
        "attnres": {"mode": cfg.attnres.mode,
                    "block_size": cfg.attnres.block_size if cfg.attnres.mode == "block" else None,
                    "num_sublayers": 2 * cfg.num_hidden_layers},
        "pattern": " ".join(t.upper() for t in cfg.layer_types()),
        "blocks": [r.__dict__ for r in block_rows(cfg)],
        "params": counts,
    }


def human(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)
