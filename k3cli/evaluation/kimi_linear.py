"""`k3 import hf`: a Hugging Face `kimi_linear` folder (Moonshot's Kimi Linear) as a k3 run directory.

Kimi Linear is KDA and MLA 3:1 with a MoE, as K3 is; its components are options of k3's own layers:
- KDA: `kda.gate=softplus` (−exp(A_log)·softplus(·), no lower bound), value heads = query heads, K = V;
- MLA: `mla.q_lora_rank` 0 for a direct query projection, `mla.qk_rope_head_dim` for the key part shared by all
  heads (not rotated: Kimi Linear uses no positions), no output gate, latent norms at eps 1e-6;
- MoE: full-width experts (`moe.latent=false`) with SwiGLU (`moe.expert_act=silu`), grouped top-k routing over
  sigmoid scores with the correction bias, renormalised and scaled weights, shared experts;
- the layer pattern (`model.mla_layers`) and dense first blocks (`model.first_dense_layers`).

Weights are read shard by shard and renamed, split or stacked into k3's layout; each tensor is held once. The
run directory gets run.json, config.yaml (the preset's training settings, this model), the tokenizer (a
tokenizer.json, or one converted from Kimi Linear's tiktoken files: data/tiktoken_bpe.py) with its start and
end tokens in tokenizer_config.json, and checkpoint step 0 in the single-process format.
"""
from __future__ import annotations

import itertools
import json
import math
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from k3cli.checkpoint import single
from k3cli.config import config_from_dict, dump_config, load_config
from k3cli.data.tiktoken_bpe import read_tiktoken_folder
from k3cli.data.tokenizer import SPECIALS, token_text, write_specials
from k3cli.errors import ConfigError, DataError, UserError, first_line
from k3cli.files import build_folder, is_free, write_text_atomic
from k3cli.models.causal_lm import CausalLM
from k3cli.train import mark_run

LATENT_NORM_EPS = 1e-6   # Kimi Linear's q_a_layernorm and kv_a_layernorm keep the norm class's default


def _get(hf: dict, *names, default=None):
    for n in names:
        if n in hf and hf[n] is not None:
            return hf[n]
    return default


def _layer_types(hf: dict) -> list[str]:
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    lin = hf.get("linear_attn_config") or {}
    if lin.get("full_attn_layers") is not None:   # 1-based block numbers in the released configs
        full = {int(i) - 1 for i in lin["full_attn_layers"]}
        return ["full_attention" if i in full else "linear_attention" for i in range(n)]
    raise UserError("config.json gives neither layer_types nor linear_attn_config.full_attn_layers")


def model_config(hf: dict) -> dict:
    """k3's `model` section for a kimi_linear config.json (its dict); one UserError naming anything k3 lacks."""
    if hf.get("model_type") != "kimi_linear":
        raise UserError(f"not a kimi_linear model (model_type {hf.get('model_type')!r}); k3 imports kimi_linear only")
    unsupported = [(k, v) for k, v, ok in (
        ("attention_bias", hf.get("attention_bias", False), lambda v: not v),
        ("hidden_act", hf.get("hidden_act", "silu"), lambda v: v == "silu"),
        ("num_key_value_heads", hf.get("num_key_value_heads"),
         lambda v: v in (None, hf.get("num_attention_heads"))),
    ) if not ok(v)]
    if unsupported:
        k, v = unsupported[0]
        raise UserError(f"config.json {k}={v!r} is not supported by k3's layers")
    lin = hf.get("linear_attn_config") or {}
    types = _layer_types(hf)
    mlp = list(hf.get("mlp_layer_types") or [])
    if not mlp:
        dense = int(_get(hf, "first_k_dense_replace", default=1))
        mlp = ["dense" if i < dense else "sparse" for i in range(hf["num_hidden_layers"])]
    first_dense = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
    if any(t == "dense" for t in mlp[first_dense:]):
        raise UserError(f"config.json mlp_layer_types {mlp} has dense blocks after MoE ones; k3 takes dense blocks "
                        "first only")
    heads = int(_get(hf, "linear_num_heads", default=lin.get("num_heads")))
    head_dim = int(_get(hf, "linear_head_dim", default=lin.get("head_dim")))
    return {
        "arch": "k3", "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"],
        "num_hidden_layers": hf["num_hidden_layers"], "intermediate_size": hf["intermediate_size"],
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "tie_word_embeddings": False,
        "initializer_range": float(hf.get("initializer_range", 0.02)),
        "mla_layers": ",".join(str(i) for i, t in enumerate(types) if t == "full_attention"),
        "first_dense_layers": first_dense,
        "kda": {"num_heads": heads, "num_v_heads": heads, "head_k_dim": head_dim, "head_v_dim": head_dim,
                "short_conv": int(_get(hf, "linear_conv_kernel_dim", default=lin.get("short_conv_kernel_size", 4))),
                "output_gate": True, "gate": "softplus"},
        "mla": {"num_heads": hf["num_attention_heads"], "q_lora_rank": int(hf.get("q_lora_rank") or 0),
                "kv_lora_rank": hf["kv_lora_rank"], "qk_head_dim": hf["qk_nope_head_dim"],
                "v_head_dim": hf["v_head_dim"], "qk_rope_head_dim": int(hf.get("qk_rope_head_dim") or 0),
                "output_gate": False, "latent_norm_eps": LATENT_NORM_EPS},
        "moe": {"num_routed_experts": int(_get(hf, "num_experts", "num_local_experts")),
                "top_k": int(_get(hf, "num_experts_per_token", "num_experts_per_tok")),
                "num_shared_experts": int(_get(hf, "num_shared_experts", "n_shared_experts", default=0)),
                "d_ff": hf["moe_intermediate_size"], "latent": False, "expert_act": "silu",
                "num_expert_groups": int(_get(hf, "num_expert_group", "n_group", default=1)),
                "topk_groups": int(_get(hf, "topk_group", default=1)),
                "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
                "renormalize": bool(_get(hf, "moe_renormalize", "norm_topk_prob", default=True))},
        "attnres": {"mode": "off"},
    }


# ---- weights ------------------------------------------------------------------------------------------------

_EXPERT = re.compile(r"^blocks\.(\d+)\.ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


def _rename(name: str) -> str:
    """A kimi_linear tensor name (as saved: the Hub's names, or transformers' in-memory ones) in k3's words."""
    name = re.sub(r"^model\.", "", name)
    name = re.sub(r"^layers\.(\d+)\.", r"blocks.\1.", name)
    for a, b in ((".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".ffn_norm."),
                 (".self_attn.", ".attn."), (".block_sparse_moe.", ".ffn."), (".mlp.", ".ffn."),
                 (".forget_gate.", "."), (".f_a_proj.", ".f_a."), (".f_b_proj.", ".f_b."), (".g_a_proj.", ".g_a."),
                 (".g_b_proj.", ".g_b."), (".q_conv1d.", ".q_conv."), (".k_conv1d.", ".k_conv."),
                 (".v_conv1d.", ".v_conv."), (".q_a_proj.", ".q_down."), (".q_a_layernorm.", ".q_norm."),
                 (".q_b_proj.", ".q_up."), (".kv_a_proj_with_mqa.", ".kv_down."), (".kv_a_layernorm.", ".kv_norm."),
                 (".gate.e_score_correction_bias", ".router_bias"), (".ffn.gate.weight", ".ffn.router.weight")):
        name = name.replace(a, b)
    return name


class WeightMapper:
    """Tensors of a kimi_linear checkpoint in, k3 tensors out; pieces k3 keeps together (a layer's experts)
    are held until the last arrives."""

    def __init__(self, cfg):
        self.cfg = cfg.model
        self.pending: dict[tuple[int, str], dict[int, torch.Tensor]] = {}

    def add(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        c = self.cfg
        k = _rename(name)
        if m := _EXPERT.match(k):
            layer, e, w = int(m.group(1)), int(m.group(2)), m.group(3)
            box = self.pending.setdefault((layer, w), {})
            box[e] = t
            if len(box) < c.moe.num_routed_experts:
                return {}
            del self.pending[(layer, w)]
            stacked = torch.stack([box[i] for i in range(c.moe.num_routed_experts)])   # [E, out, in]
            # w1 gate [I, D], w3 up [I, D], w2 down [D, I]; k3 keeps [E, D, I] and [E, I, D]
            return {f"blocks.{layer}.ffn.{ {'w1': 'w_gate', 'w3': 'w_up', 'w2': 'w_down'}[w] }": stacked.transpose(1, 2)}
        if k.endswith(".ffn.experts.gate_up_proj"):   # transformers' fused in-memory form [E, 2I, D]
            i = c.moe.d_ff
            return {k.replace("experts.gate_up_proj", "w_gate"): t[:, :i].transpose(1, 2),
                    k.replace("experts.gate_up_proj", "w_up"): t[:, i:].transpose(1, 2)}
        if k.endswith(".ffn.experts.down_proj"):   # [E, D, I]
            return {k.replace("experts.down_proj", "w_down"): t.transpose(1, 2)}
        if ".ffn.shared_experts." in k:   # one SwiGLU of width n_s·I → n_s experts of width I
            n, i = c.moe.num_shared_experts, c.moe.d_ff
            part = k.split(".ffn.shared_experts.")[1]
            dim = 1 if part.startswith("down_proj") else 0
            return {k.replace(".ffn.shared_experts.", f".ffn.shared.{j}."): piece
                    for j, piece in enumerate(t.split(i, dim=dim))} if t.shape[dim] == n * i else {k: t}
        if k.endswith(".attn.conv1d.weight"):   # q, k, v convs concatenated (transformers' in-memory form)
            hk = c.kda.num_heads * c.kda.head_k_dim
            q, kk, v = t.split([hk, hk, t.shape[0] - 2 * hk])
            base = k[:-len("conv1d.weight")]
            return {base + "q_conv.weight": q, base + "k_conv.weight": kk, base + "v_conv.weight": v}
        if k.endswith(".attn.A_log"):
            return {k: t.reshape(-1)}
        if k.endswith(".attn.kv_b_proj.weight"):   # (H, d_n + d_v, r): the key and value up-projections
            H, dn, dv = c.mla.num_heads, c.mla.qk_head_dim, c.mla.v_head_dim
            w = t.view(H, dn + dv, -1)
            base = k[:-len("kv_b_proj.weight")]
            return {base + "W_UK": w[:, :dn], base + "W_UV": w[:, dn:]}
        return {k: t}


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` in storage of its own: a piece split or viewed out of a larger tensor is copied (a checkpoint file
    stores each tensor once, so pieces may not share memory)."""
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def shard_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [src / f for f in sorted(set(weight_map.values()))]
    if (src / "model.safetensors").is_file():
        return [src / "model.safetensors"]
    raise UserError(f"{src} holds no model.safetensors nor model.safetensors.index.json")


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32}


def _mapped(files: list[Path], cfg, meta: bool, log: Callable[[str], None] = lambda m: None):
    """(k3 name, tensor) in k3's layout, shard by shard; with `meta`, shapes only (nothing is read)."""
    from safetensors import SafetensorError, safe_open

    mapper = WeightMapper(cfg)
    for i, f in enumerate(files, 1):
        try:
            with safe_open(str(f), "pt") as shard:
                for name in shard.keys():
                    if meta:
                        piece = shard.get_slice(name)
                        t = torch.empty(piece.get_shape(), dtype=_DTYPES.get(piece.get_dtype(), torch.float32),
                                        device="meta")
                    else:
                        t = shard.get_tensor(name)
                    yield from mapper.add(name, t).items()
        except (OSError, SafetensorError) as e:
            raise UserError(f"cannot read {f}: {first_line(e, 200)}") from None
        log(f"read {f.name} ({i}/{len(files)})")
    if mapper.pending:
        raise UserError(f"{files[0].parent}: some layers' experts are incomplete: {sorted(mapper.pending)[:3]}")


def import_kimi_linear(src: str | Path, out: str | Path, preset: str = "k3-toy",
                       log: Callable[[str], None] = print) -> Path:
    """Write the kimi_linear folder `src` as the k3 run directory `out` (new or empty); returns its checkpoint.
    The weights are planned from the shards' headers, then read and written one tensor at a time: memory
    holds one shard's tensors (and a layer's experts until its last arrives), not the model."""
    src, out = Path(src), Path(out)
    if not (src / "config.json").is_file():
        raise UserError(f"{src} has no config.json; give a Hugging Face model folder")
    if not is_free(out):
        raise UserError(f"{out} already exists; refusing to overwrite it (choose a new --out)")
    try:
        hf = json.loads((src / "config.json").read_text())
    except ValueError as e:
        raise UserError(f"{src / 'config.json'} is not valid JSON ({e})") from None
    base = yaml.safe_load(dump_config(load_config(preset)))
    base["model"] = model_config(hf)
    try:
        cfg = config_from_dict(base, f"{src / 'config.json'}")
    except ConfigError as e:
        raise UserError(f"{src / 'config.json'}: {e}") from None
    files = shard_files(src)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in CausalLM(cfg.model).state_dict().items()
                    if not k.endswith("load_counts")}   # the MoE's load counters are not saved
    plan = [(k, tuple(t.shape)) for k, t in _mapped(files, cfg, meta=True)]
    missing, unexpected = sorted(set(expected) - {k for k, _ in plan}), sorted({k for k, _ in plan} - set(expected))
    if missing or unexpected or len(plan) != len(expected):
        raise UserError(f"{src}: the weights do not fit the model config.json describes (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]})")
    for k, shape in plan:
        if shape != expected[k]:
            raise UserError(f"{src}: {k} is {shape}, the config's model wants {expected[k]}")
    sizes = [4 * math.prod(shape) for _, shape in plan]   # fp32, as k3's parameters

    def write_weights(path: Path) -> None:
        # the safetensors layout: an 8-byte header length, the JSON header, then the tensors back to back
        offsets = [0, *itertools.accumulate(sizes)]
        header = {k: {"dtype": "F32", "shape": list(shape), "data_offsets": [offsets[i], offsets[i + 1]]}
                  for i, (k, shape) in enumerate(plan)}
        header["__metadata__"] = {"format": "pt", "step": "0"}
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for (k, t), (want, _) in zip(_mapped(files, cfg, meta=False, log=log), plan, strict=True):
                if k != want:   # the same shards in the same order give the same sequence
                    raise UserError(f"{src}: the shards changed while being read ({k} where {want} was planned)")
                f.write(t.to(torch.float32).contiguous().numpy().tobytes())

    out.mkdir(parents=True, exist_ok=True)
    mark_run(out)
    _import_tokenizer(src, out, hf, log)
    write_text_atomic(out / "config.yaml", dump_config(cfg))
    return single.save_weights(out, 0, write_weights, sum(sizes), extra={"imported_from": str(src.resolve())})


def _import_tokenizer(src: Path, out: Path, hf: dict, log: Callable[[str], None]) -> None:
    """`out/tokenizer.json` from `src`'s tokenizer.json, or from its tiktoken files (Kimi Linear's: tiktoken.model,
    tokenizer_config.json and the Python file with the split pattern), with its start and end tokens beside it
    (`data.tokenizer.SPECIALS`): those of tokenizer_config.json, else config.json's bos/eos_token_id."""
    try:
        meta = json.loads((src / SPECIALS).read_text(encoding="utf-8")) if (src / SPECIALS).is_file() else {}
    except ValueError as e:
        raise UserError(f"{src / SPECIALS} is not valid JSON ({e})") from None
    if (src / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(src / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
            raise UserError(f"{src / 'tokenizer.json'} cannot be read: {first_line(e)}") from None
    elif (src / "tiktoken.model").is_file():
        log(f"converting {src / 'tiktoken.model'} to tokenizer.json")
        try:
            tok, _, _ = read_tiktoken_folder(src)
        except DataError as e:
            raise UserError(f"{src}: its tokenizer cannot be read: {e}") from None
    else:
        log(f"warning: {src} has no tokenizer.json or tiktoken.model; k3 eval and k3 generate need a tokenizer in {out}")
        return

    def special(key: str) -> str | None:
        if (text := token_text(meta.get(key))) is not None:
            return text
        i = hf.get(f"{key}_id")
        return tok.id_to_token(i) if isinstance(i, int) else None

    bos, eos = special("bos_token"), special("eos_token")
    if bos is None or eos is None or tok.token_to_id(bos) is None or tok.token_to_id(eos) is None:
        raise UserError(f"{src}: no start and end tokens its tokenizer knows (bos {bos!r}, eos {eos!r}) in "
                        f"{SPECIALS} or config.json")
    tok.save(str(out / "tokenizer.json"))
    write_specials(out, bos, eos)


# ---- the reverse: a k3 run in the kimi_linear format --------------------------------------------------------

def _fits(cfg) -> None:
    """One UserError naming the first setting the kimi_linear format cannot hold."""
    m = cfg.model
    for ok, what in (
        (m.arch == "k3", f"model.arch={m.arch} (kimi_linear is the hybrid)"),
        (m.attnres.mode == "off", f"model.attnres.mode={m.attnres.mode}"),
        (not m.tie_word_embeddings, "model.tie_word_embeddings=true"),
        (m.kda.gate == "softplus", f"model.kda.gate={m.kda.gate}"),
        (m.kda.num_v_heads == m.kda.num_heads and m.kda.head_v_dim == m.kda.head_k_dim,
         "grouped value heads or head_v_dim != head_k_dim in model.kda"),
        (m.kda.output_gate and m.kda.short_conv > 0, "model.kda without its output gate or short conv"),
        (not m.mla.output_gate, "model.mla.output_gate=true"),
        (m.mla.latent_norm_eps == LATENT_NORM_EPS, f"model.mla.latent_norm_eps={m.mla.latent_norm_eps}"),
        (not m.moe.latent and m.moe.expert_act == "silu", "model.moe with a latent or SiTU experts"),
    ):
        if not ok:
            raise UserError(f"the kimi_linear format cannot hold {what}")


def kimi_config(cfg) -> dict:
    m = cfg.model
    types = ["full_attention" if t == "mla" else "linear_attention" for t in m.layer_types()]
    mlp = ["dense" if f == "swiglu" else "sparse" for _, f in m.layer_specs()]
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "float32",
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_hidden_layers,
        "intermediate_size": m.intermediate_size, "rms_norm_eps": m.norm_eps, "initializer_range": m.initializer_range,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
        "layer_types": types, "mlp_layer_types": mlp, "first_k_dense_replace": m.first_dense_layers,
        "linear_attn_config": {"num_heads": m.kda.num_heads, "head_dim": m.kda.head_k_dim,
                               "short_conv_kernel_size": m.kda.short_conv,
                               "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
                               "kda_layers": [i + 1 for i, t in enumerate(types) if t != "full_attention"]},
        "linear_num_heads": m.kda.num_heads, "linear_head_dim": m.kda.head_k_dim,
        "linear_conv_kernel_dim": m.kda.short_conv,
        "num_attention_heads": m.mla.num_heads, "num_key_value_heads": m.mla.num_heads,
        "q_lora_rank": m.mla.q_lora_rank or None, "kv_lora_rank": m.mla.kv_lora_rank,
        "qk_nope_head_dim": m.mla.qk_head_dim, "qk_rope_head_dim": m.mla.qk_rope_head_dim,
        "qk_head_dim": m.mla.qk_head_dim + m.mla.qk_rope_head_dim, "head_dim": m.mla.qk_rope_head_dim,
        "v_head_dim": m.mla.v_head_dim,
        "num_experts": m.moe.num_routed_experts, "num_experts_per_token": m.moe.top_k,
        "num_shared_experts": m.moe.num_shared_experts, "moe_intermediate_size": m.moe.d_ff,
        "num_expert_group": m.moe.num_expert_groups, "topk_group": m.moe.topk_groups,
        "routed_scaling_factor": m.moe.routed_scaling_factor, "moe_renormalize": m.moe.renormalize,
        "use_cache": True,
    }


_K3_TO_KIMI = [(".attn_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
               (".attn.f_a.", ".attn.f_a_proj."), (".attn.f_b.", ".attn.f_b_proj."), (".attn.g_a.", ".attn.g_a_proj."),
               (".attn.g_b.", ".attn.g_b_proj."), (".attn.q_conv.", ".attn.q_conv1d."),
               (".attn.k_conv.", ".attn.k_conv1d."), (".attn.v_conv.", ".attn.v_conv1d."),
               (".attn.q_down.", ".attn.q_a_proj."), (".attn.q_norm.", ".attn.q_a_layernorm."),
               (".attn.q_up.", ".attn.q_b_proj."), (".attn.kv_down.", ".attn.kv_a_proj_with_mqa."),
               (".attn.kv_norm.", ".attn.kv_a_layernorm."), (".ffn.router.weight", ".ffn.gate.weight"),
               (".ffn.router_bias", ".ffn.gate.e_score_correction_bias"), (".attn.", ".self_attn."),
               (".ffn.", ".block_sparse_moe.")]


def kimi_tensors(cfg, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """k3 tensors under the names and layouts a kimi_linear checkpoint keeps them (the Hub's)."""
    m, out, done = cfg.model, {}, set()
    for k, t in state.items():
        if k in done or k.endswith("load_counts"):
            continue
        blk = re.match(r"^blocks\.(\d+)\.(.*)$", k)
        if blk is None:
            out[("" if k == "lm_head.weight" else "model.") + k] = t
            continue
        i, rest = blk.groups()
        base = f"model.layers.{i}"
        if rest in ("ffn.w_gate", "ffn.w_up", "ffn.w_down"):
            w = {"ffn.w_gate": "w1", "ffn.w_up": "w3", "ffn.w_down": "w2"}[rest]
            for e in range(t.shape[0]):
                out[f"{base}.block_sparse_moe.experts.{e}.{w}.weight"] = t[e].T.contiguous()
            continue
        if rest in ("attn.W_UK", "attn.W_UV"):
            uk, uv = state[f"blocks.{i}.attn.W_UK"], state[f"blocks.{i}.attn.W_UV"]
            out[f"{base}.self_attn.kv_b_proj.weight"] = torch.cat([uk, uv], 1).reshape(-1, uk.shape[-1])
            done |= {f"blocks.{i}.attn.W_UK", f"blocks.{i}.attn.W_UV"}
            continue
        shared = re.match(r"^ffn\.shared\.\d+\.(gate_proj|up_proj|down_proj)\.weight$", rest)
        if shared:
            part = shared.group(1)
            names = [f"blocks.{i}.ffn.shared.{j}.{part}.weight" for j in range(m.moe.num_shared_experts)]
            out[f"{base}.block_sparse_moe.shared_experts.{part}.weight"] = torch.cat(
                [state[n] for n in names], 1 if part == "down_proj" else 0)
            done |= set(names)
            continue
        if rest == "attn.A_log":
            t = t.view(1, 1, -1, 1)
        name = f".{rest}"
        for a, b in _K3_TO_KIMI:
            name = name.replace(a, b)
        out[base + name] = t
    return out


def export_kimi_linear(run_dir: str | Path, ckpt: str | Path, out: str | Path) -> dict:
    """Checkpoint `ckpt` of `run_dir` as a kimi_linear folder `out` (new or empty): config.json,
    model.safetensors, tokenizer.json and its tokenizer_config.json. Returns {step, files}."""
    import safetensors.torch

    from k3cli.checkpoint import load_full_model_state

    run_dir, ckpt, out = Path(run_dir), Path(ckpt), Path(out)
    if not is_free(out):
        raise UserError(f"{out} already exists; refusing to overwrite it (choose a new --out)")
    cfg = load_config(str(run_dir / "config.yaml"))
    _fits(cfg)
    tensors = kimi_tensors(cfg, load_full_model_state(ckpt))

    def fill(tmp: Path) -> None:
        safetensors.torch.save_file({k: _own(v) for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                                    metadata={"format": "pt"})
        write_text_atomic(tmp / "config.json", json.dumps(kimi_config(cfg), indent=2) + "\n")
        for name in ("tokenizer.json", SPECIALS):   # the start and end tokens travel with it
            if (run_dir / name).is_file():
                shutil.copyfile(run_dir / name, tmp / name)

    build_folder(out, fill)
    step = json.loads((ckpt / "COMPLETE").read_text()).get("step")
    return {"step": step, "files": sorted(p.name for p in out.iterdir())}
