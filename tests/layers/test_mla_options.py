"""GatedMLA options (docs/math.md §3): a direct query projection (q_lora_rank = 0), a shared unrotated key part
(qk_rope_head_dim = d_r), no output gate, and the latent norms' own eps; and the Kimi Linear attention they express.

The reference below is written from the equations, not from the layer:
    q = W_q x, or W_qb RMSNorm(W_qa x);      q_h = [q_n,h (d_q) | q_r,h (d_r)]
    [c̃ | k_r] = W_kva x;  c = RMSNorm(c̃)    k_r shared by every head, not normalised, not rotated
    score_h(i, j) = (q_n,h(i) · W_UK,h c(j) + q_r,h(i) · k_r(j)) · (d_q + d_r)^-1/2, causal softmax
    y = W_o (σ(W_g x) ⊙ [Σ_j a_h(i, j) W_UV,h c(j)]_h)          (no σ(W_g x) factor without the gate)
"""
import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from k3cli.config import load_config
from k3cli.errors import ConfigError
from k3cli.layers.block import build_attn
from k3cli.layers.mla import GatedMLA
from k3cli.layers.segments import Segments
from k3cli.models import flops as fl
from k3cli.models.causal_lm import CausalLM
from k3cli.models.layout import mla_params, param_counts
from k3cli.testing import TINY_MODEL, assert_close

# max |a − b| / max(1, max |b|), fp64 throughout
TOL = 1e-12

# (id, B, T, D, H, q_lora, r, d_q, d_r, d_v, output_gate, eps)
CASES = [
    ("direct_q", 2, 9, 20, 3, 0, 6, 8, 0, 8, True, 1e-6),
    ("shared_key", 2, 11, 24, 2, 12, 8, 6, 5, 6, True, 1e-6),
    ("no_gate", 1, 10, 18, 3, 10, 7, 4, 0, 9, False, 1e-6),
    ("latent_eps", 2, 7, 16, 2, 8, 5, 6, 0, 6, True, 0.5),
    ("kimi_direct", 2, 13, 19, 3, 0, 11, 5, 3, 7, False, 1e-6),
    ("kimi_lora", 1, 12, 21, 5, 7, 9, 7, 4, 3, True, 0.25),
    ("all_odd_T1", 3, 1, 17, 3, 0, 5, 3, 7, 5, False, 1e-3),
]
IDS = [c[0] for c in CASES]


def _mla(D, H, ql, r, dq, dr, dv, gate, eps, **kw) -> GatedMLA:
    return GatedMLA(D, H, ql, r, dq, dv, norm_eps=eps, init_std=0.3, qk_rope_head_dim=dr, output_gate=gate, **kw)


def _randomise(m: GatedMLA, seed: int = 0) -> GatedMLA:
    """Norm gains away from 1 too, so a wrong norm shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.3 if p.dim() > 1 else 0.5)
                    + (1.0 if p.dim() == 1 else 0.0))
    return m


def _rms(t: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w


def reference(m: GatedMLA, x: torch.Tensor, eps: float, doc: torch.Tensor | None = None) -> torch.Tensor:
    """The equations of the module docstring, on m's parameters (so autograd reaches them)."""
    B, T, _ = x.shape
    H, dq, dr, dv, r = m.num_heads, m.qk_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    if m.q_lora_rank:
        q = _rms(x @ m.q_down.weight.T, m.q_norm.weight, eps) @ m.q_up.weight.T
    else:
        q = x @ m.q_proj.weight.T
    q = q.reshape(B, T, H, dq + dr)
    q_n, q_r = q[..., :dq], q[..., dq:]
    ckr = x @ m.kv_down.weight.T
    c, k_r = _rms(ckr[..., :r], m.kv_norm.weight, eps), ckr[..., r:]
    k_n = torch.einsum("hdj,bsj->bshd", m.W_UK, c)                          # W_UK,h c(s)
    v = torch.einsum("hvj,bsj->bshv", m.W_UV, c)
    score = torch.einsum("bthd,bshd->bhts", q_n, k_n) + torch.einsum("bthd,bsd->bhts", q_r, k_r)
    score = score / (dq + dr) ** 0.5
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    if doc is not None:
        allowed = allowed & (doc[:, None, :, None] == doc[:, None, None, :])
    a = score.masked_fill(~allowed, float("-inf")).softmax(-1)
    o = torch.einsum("bhts,bshv->bthv", a, v).reshape(B, T, H * dv)
    if m.g_proj is not None:
        o = torch.sigmoid(x @ m.g_proj.weight.T) * o
    return o @ m.o_proj.weight.T


def run(m, x, fn):
    """Output and gradients (x and every parameter) for a fixed random cotangent."""
    m.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    y = fn(m, x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype))
    return y.detach(), {"x": x.grad, **{n: p.grad.clone() for n, p in m.named_parameters()}}


def _case(B, T, D, H, ql, r, dq, dr, dv, gate, eps, seed=0):
    torch.manual_seed(seed)
    m = _randomise(_mla(D, H, ql, r, dq, dr, dv, gate, eps).double(), seed)
    x = torch.randn(B, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 7))
    return m, x


@pytest.mark.parametrize("B,T,D,H,ql,r,dq,dr,dv,gate,eps", [c[1:] for c in CASES], ids=IDS)
def test_parameters_follow_the_options(B, T, D, H, ql, r, dq, dr, dv, gate, eps):
    m, _ = _case(B, T, D, H, ql, r, dq, dr, dv, gate, eps)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    q = ({"q_down.weight": (ql, D), "q_norm.weight": (ql,), "q_up.weight": (H * (dq + dr), ql)} if ql
         else {"q_proj.weight": (H * (dq + dr), D)})
    assert shapes == {**q, "kv_down.weight": (r + dr, D), "kv_norm.weight": (r,), "W_UK": (H, dq, r),
                      "W_UV": (H, dv, r), **({"g_proj.weight": (H * dv, D)} if gate else {}),
                      "o_proj.weight": (D, H * dv)}
    assert m.kv_norm.eps == eps and (not ql or m.q_norm.eps == eps)


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "decompressed"])
@pytest.mark.parametrize("B,T,D,H,ql,r,dq,dr,dv,gate,eps", [c[1:] for c in CASES], ids=IDS)
def test_matches_the_reference_values_and_gradients(B, T, D, H, ql, r, dq, dr, dv, gate, eps, absorb):
    m, x = _case(B, T, D, H, ql, r, dq, dr, dv, gate, eps)
    y_ref, g_ref = run(m, x, lambda m_, x_: reference(m_, x_, eps))
    y, g = run(m, x, lambda m_, x_: m_(x_, absorb=absorb))
    assert_close("y", y, y_ref, TOL)
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        assert_close(f"d{name}", g[name], g_ref[name], TOL)


@pytest.mark.parametrize("B,T,D,H,ql,r,dq,dr,dv,gate,eps", [c[1:] for c in CASES], ids=IDS)
def test_absorbed_equals_decompressed(B, T, D, H, ql, r, dq, dr, dv, gate, eps):
    m, x = _case(B, T, D, H, ql, r, dq, dr, dv, gate, eps)
    y_a, g_a = run(m, x, lambda m_, x_: m_(x_, absorb=True))
    y_d, g_d = run(m, x, lambda m_, x_: m_(x_, absorb=False))
    assert_close("y", y_a, y_d, TOL)
    for name in g_d:
        assert_close(f"d{name}", g_a[name], g_d[name], TOL)


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "decompressed"])
@pytest.mark.parametrize("B,T,D,H,ql,r,dq,dr,dv,gate,eps", [c[1:] for c in CASES], ids=IDS)
def test_prefill_then_decode_equals_the_full_forward(B, T, D, H, ql, r, dq, dr, dv, gate, eps, absorb):
    """Prefill a prefix, then one token at a time and a chunk of two; the cache holds r + d_r numbers a token."""
    m, x = _case(B, T + 6, D, H, ql, r, dq, dr, dv, gate, eps)
    m.absorb = absorb
    n = x.shape[1]
    with torch.no_grad():
        full = m(x)
        cache = m.new_cache()
        p = max(1, n // 2)
        parts = [m(x[:, :p], cache=cache)]
        t = p
        while t < n:
            step = 2 if (t - p) % 3 == 2 and t + 2 <= n else 1
            parts.append(m(x[:, t:t + step], cache=cache))
            t += step
    assert_close("decode", torch.cat(parts, 1), full, TOL)
    assert cache.length == n and cache.c.shape == (B, n, r + dr) and cache.buf.shape[2] == r + dr
    # the cached row is [RMSNorm(c̃) | k_r]
    with torch.no_grad():
        ckr = m.kv_down(x)
        assert_close("cache", cache.c, torch.cat([_rms(ckr[..., :r], m.kv_norm.weight, eps), ckr[..., r:]], -1), TOL)


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "decompressed"])
@pytest.mark.parametrize("case", [c for c in CASES if c[2] > 1], ids=[c[0] for c in CASES if c[2] > 1])
def test_document_masked_equals_separate_documents(case, absorb):
    """Packed documents: each document's outputs (and the gradients) equal the layer run on it alone."""
    _, B, T, D, H, ql, r, dq, dr, dv, gate, eps = case
    T = 15
    m, x = _case(B, T, D, H, ql, r, dq, dr, dv, gate, eps)
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[:, 4] = True
    starts[-1, 11] = True
    seg = Segments.from_starts(starts)
    y, g = run(m, x, lambda m_, x_: m_(x_, absorb=absorb, segments=seg))

    def separate(m_, x_):
        rows = []
        for b in range(B):
            bounds = torch.nonzero(starts[b] | (torch.arange(T) == 0)).flatten().tolist() + [T]
            rows.append(torch.cat([m_(x_[b:b + 1, s:e], absorb=absorb) for s, e in zip(bounds, bounds[1:])], 1))
        return torch.cat(rows)

    y_sep, g_sep = run(m, x, separate)
    assert_close("y", y, y_sep, TOL)
    for name in g_sep:
        assert_close(f"d{name}", g[name], g_sep[name], TOL)
    # and the reference with the same block-diagonal causal mask
    assert_close("y ref", y, reference(m, x, eps, seg.doc).detach(), TOL)


def test_defaults_are_todays_layer():
    """Default options build today's parameters from the same random draws, and the explicit defaults run the
    same code: bit-identical outputs and gradients."""
    torch.manual_seed(0)
    a = GatedMLA(33, 3, 12, 9, 7, 5)
    torch.manual_seed(0)
    b = GatedMLA(33, 3, 12, 9, 7, 5, qk_rope_head_dim=0, output_gate=True)
    assert [n for n, _ in a.named_parameters()] == ["W_UK", "W_UV", "q_down.weight", "q_norm.weight",
                                                    "q_up.weight", "kv_down.weight", "kv_norm.weight",
                                                    "g_proj.weight", "o_proj.weight"]
    assert a.scale == 7 ** -0.5 and a.kv_down.out_features == 9
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    x = torch.randn(2, 10, 33)
    for absorb in (True, False):
        ya, ga = run(a, x, lambda m_, x_, k=absorb: m_(x_, absorb=k))
        yb, gb = run(b, x, lambda m_, x_, k=absorb: m_(x_, absorb=k))
        assert torch.equal(ya, yb) and all(torch.equal(ga[n], gb[n]) for n in ga)
    cfg = load_config("k3-toy").model
    assert (cfg.mla.qk_rope_head_dim, cfg.mla.output_gate, cfg.mla.latent_norm_eps) == (0, True, 0.0)


def _k3_cfg(*extra: str):
    return load_config("k3-toy", overrides=TINY_MODEL + list(extra)).model


OPTION_SETS = {
    "defaults": (),
    "direct_q": ("model.mla.q_lora_rank=0",),
    "shared_key": ("model.mla.qk_rope_head_dim=5",),
    "no_gate": ("model.mla.output_gate=false",),
    "kimi": ("model.mla.q_lora_rank=0", "model.mla.qk_rope_head_dim=3", "model.mla.output_gate=false",
             "model.mla.latent_norm_eps=1e-6", "model.norm_eps=1e-5"),
    "kimi_absorbed": ("model.mla.q_lora_rank=0", "model.mla.qk_rope_head_dim=3", "model.mla.output_gate=false",
                      "model.mla.absorb=true", "model.mla.kv_lora_rank=12"),
    "lora_shared_key_no_gate": ("model.mla.qk_rope_head_dim=4", "model.mla.output_gate=false",
                                "model.mla.absorb=true"),
}


def test_config_plumbing_and_validation():
    cfg = _k3_cfg("model.norm_eps=1e-5")
    m = build_attn(cfg, "mla")
    assert m.q_norm.eps == m.kv_norm.eps == 1e-5 and m.g_proj is not None and m.qk_rope_head_dim == 0
    cfg = _k3_cfg(*OPTION_SETS["kimi"])
    m = build_attn(cfg, "mla")
    assert not hasattr(m, "q_down") and m.q_proj.out_features == 2 * (8 + 3)
    assert m.kv_norm.eps == 1e-6 and m.g_proj is None and m.kv_down.out_features == 8 + 3
    assert m.scale == (8 + 3) ** -0.5
    m = build_attn(_k3_cfg("model.mla.latent_norm_eps=0.01"), "mla")
    assert m.q_norm.eps == m.kv_norm.eps == 0.01
    base = _k3_cfg()
    for field, value, msg in (("q_lora_rank", -1, "q_lora_rank: must be >= 0"),
                              ("qk_rope_head_dim", -2, "qk_rope_head_dim: must be >= 0"),
                              ("latent_norm_eps", -1e-6, "latent_norm_eps: must be >= 0"),
                              ("kv_lora_rank", 0, "kv_lora_rank: must be >= 1")):
        bad = dataclasses.replace(base, mla=dataclasses.replace(base.mla, **{field: value}))
        with pytest.raises(ConfigError, match=msg):
            bad.validate()


@pytest.mark.parametrize("extra", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_parameter_count_matches_the_model(extra):
    cfg = _k3_cfg(*extra)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    assert model.num_parameters() == param_counts(cfg)["total"]
    assert sum(p.numel() for p in model.blocks[-1].attn.parameters()) == mla_params(cfg)


_CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
             lambda q, k, v, *a, out_shape=None, **kw: sdpa_flop_count(q, k, v)}


@pytest.mark.parametrize("extra", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_flops_match_the_counter(extra):
    """The MLA terms of flops_per_token against torch's counter on one layer's forward: the counter charges the
    T×T square where the analytic count keeps the T(T + 1)/2 causal pairs."""
    cfg = _k3_cfg(*extra)
    torch.manual_seed(0)
    m = build_attn(cfg, "mla")
    B, T = 2, 16
    x = torch.randn(B, T, cfg.hidden_size)
    fc = FlopCounterMode(display=False, custom_mapping=_CPU_SDPA)
    with fc, torch.no_grad():
        m(x)
    n_mla = cfg.layer_types().count("mla")
    f = fl.flops_per_token(cfg, T)["forward_components"]
    projections = 2 * fl._mla_proj_params(cfg)
    attention = f["mla_attention"] / n_mla * 2 * T / (T + 1)
    assert fc.get_total_flops() == pytest.approx(B * T * (projections + attention), rel=1e-12)
    # the projections term is the layer's matmul weights: all its parameters but the norm gains
    norms = sum(p.numel() for n, p in m.named_parameters() if "norm" in n)
    assert fl._mla_proj_params(cfg) == mla_params(cfg) - norms


@pytest.mark.parametrize("extra", [OPTION_SETS["kimi"], OPTION_SETS["lora_shared_key_no_gate"]],
                         ids=["kimi", "lora_shared_key_no_gate"])
def test_compiled_fullgraph_equals_eager(extra):
    """torch.compile(fullgraph=True) of the layer, plain and with packed documents, values and gradients."""
    cfg = _k3_cfg(*extra)
    torch.manual_seed(0)
    m = build_attn(cfg, "mla")
    x = torch.randn(2, 12, cfg.hidden_size)
    starts = torch.zeros(2, 12, dtype=torch.bool)
    starts[1, 5] = True
    seg = Segments.from_starts(starts)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    for kw in ({}, {"segments": seg}):
        y_ref, g_ref = run(m, x, lambda m_, x_, kw=kw: m_(x_, **kw))
        y, g = run(m, x, lambda m_, x_, kw=kw: compiled(x_, **kw))
        assert_close("y", y, y_ref, 1e-6)
        for name in g_ref:
            assert_close(f"d{name}", g[name], g_ref[name], 1e-6)


@pytest.mark.parametrize("q_lora_rank", [None, 12], ids=["q_proj", "q_lora"])
def test_kimi_linear_attention_equals_k3_mla(q_lora_rank):
    """transformers' KimiLinearAttention (eager, causal mask from create_causal_mask) with its weights copied into
    a GatedMLA built with the matching options: q_lora_rank 0 or the rank, qk_rope_head_dim, no output gate."""
    pytest.importorskip("transformers")
    from transformers import KimiLinearConfig
    from transformers.masking_utils import create_causal_mask
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    D, H, r, dn, dr, dv, B, T = 40, 4, 10, 8, 6, 7, 2, 19
    cfg = KimiLinearConfig(vocab_size=64, hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                           num_key_value_heads=H, q_lora_rank=q_lora_rank, kv_lora_rank=r, qk_rope_head_dim=dr,
                           qk_nope_head_dim=dn, v_head_dim=dv, attention_bias=False, attn_implementation="eager",
                           pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    kimi = KimiLinearAttention(cfg, layer_idx=0).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in kimi.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.3) + (p.dim() == 1))
    m = GatedMLA(D, H, q_lora_rank or 0, r, dn, dv, norm_eps=1e-6, qk_rope_head_dim=dr, output_gate=False).eval()
    with torch.no_grad():
        if q_lora_rank is None:
            m.q_proj.weight.copy_(kimi.q_proj.weight)
        else:
            m.q_down.weight.copy_(kimi.q_a_proj.weight)
            m.q_norm.weight.copy_(kimi.q_a_layernorm.weight)
            m.q_up.weight.copy_(kimi.q_b_proj.weight)
        m.kv_down.weight.copy_(kimi.kv_a_proj_with_mqa.weight)         # latent rows, then the shared key's
        m.kv_norm.weight.copy_(kimi.kv_a_layernorm.weight)
        kv_b = kimi.kv_b_proj.weight.view(H, dn + dv, r)
        m.W_UK.copy_(kv_b[:, :dn])
        m.W_UV.copy_(kv_b[:, dn:])
        m.o_proj.weight.copy_(kimi.o_proj.weight)
    assert m.kv_norm.eps == kimi.kv_a_layernorm.variance_epsilon
    x = torch.randn(B, T, D, generator=g)
    mask = create_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None,
                              position_ids=torch.arange(T)[None])
    with torch.no_grad():
        y_kimi, _ = kimi(x, attention_mask=mask)
        for absorb in (True, False):
            assert_close(f"absorb={absorb}", m(x, absorb=absorb), y_kimi, 1e-5, metric=_rel_max)
        cache = m.new_cache()
        y_dec = torch.cat([m(x[:, :7], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(7, T)], 1)
        assert_close("decode", y_dec, y_kimi, 1e-5, metric=_rel_max)


def _rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_flex_document_attention_with_a_wider_key_than_value(monkeypatch):
    """The CUDA path of packed documents (FlexAttention) with q·k over d_q + d_r and values of d_v: forward on the
    CPU, unfused (as in test_mla.py), against SDPA with the block-diagonal causal mask."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from k3cli.layers import mla
    from k3cli.layers.mla import _document_mask, _flex_document_attention
    monkeypatch.setattr(mla, "_fused_flex_attention", lambda: flex_attention)
    g = torch.Generator().manual_seed(0)
    B, H, T = 2, 3, 40
    doc = torch.tensor([[0] * 7 + [1] * 20 + [2] * 13, [0] * 40])
    q, k = (torch.randn(B, H, T, 11, generator=g) for _ in range(2))
    v = torch.randn(B, H, T, 7, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=_document_mask(doc)[:, None], scale=0.3)
    assert (_flex_document_attention(q, k, v, doc, 0.3) - ref).abs().max() < 1e-5


@pytest.mark.gpu
def test_shared_key_packed_documents_on_cuda():
    """On CUDA the decompressed path attends within documents by FlexAttention (q·k width d_q + d_r ≠ d_v): it
    equals the absorbed path, values and gradients, eagerly and compiled (fullgraph, inductor)."""
    torch.manual_seed(0)
    m = GatedMLA(64, 4, 0, 32, 32, 32, qk_rope_head_dim=16, output_gate=False).cuda()
    x = torch.randn(2, 300, 64, device="cuda")
    starts = torch.zeros(2, 300, dtype=torch.bool)
    starts[:, 100] = True
    starts[1, 250] = True
    seg = Segments.from_starts(starts, device="cuda")

    def grads(fn):
        m.zero_grad()
        xx = x.clone().requires_grad_(True)
        y = fn(xx)
        y.square().sum().backward()
        return [y.detach(), xx.grad] + [p.grad.clone() for p in m.parameters()]

    ref = grads(lambda xx: m(xx, absorb=True, segments=seg))
    compiled = torch.compile(m, fullgraph=True)
    for fn in (lambda xx: m(xx, absorb=False, segments=seg), lambda xx: compiled(xx, segments=seg)):
        for a, b in zip(grads(fn), ref):
            assert ((a - b).abs().max() / b.abs().max().clamp_min(1)).item() < 1e-3
