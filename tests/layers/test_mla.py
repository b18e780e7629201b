"""Gated MLA: absorbed == decompressed == causal SDPA, values and gradients (docs/math.md §3, §7.4)."""
import pytest
import torch
import torch.nn.functional as F

from k3cli.layers.mla import GatedMLA
from k3cli.testing import assert_close

# max |a − b| / max(1, max |b|), fp64 throughout
TOL = {"y": 1e-12, "grad": 1e-12}


# (id, B, T, D, H, q_lora, r, d_q, d_v)
CASES = [
    ("toy_T17", 2, 17, 32, 4, 16, 8, 8, 8),
    ("T1", 1, 1, 24, 2, 8, 4, 8, 8),
    ("H1_dq_ne_dv", 2, 9, 20, 1, 12, 6, 10, 6),
    ("odd_D_r_gt_dq", 1, 13, 33, 3, 8, 24, 4, 12),
]


def sdpa_reference(m: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """The same weights, decompressed by hand and run through F.scaled_dot_product_attention."""
    B, T, _ = x.shape
    q = m.q_up(m.q_norm(m.q_down(x))).view(B, T, m.num_heads, -1).transpose(1, 2)
    c = m.kv_norm(m.kv_down(x))
    k = torch.einsum("bsj,hdj->bhsd", c, m.W_UK)
    v = torch.einsum("bsj,hvj->bhsv", c, m.W_UV)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=m.qk_head_dim ** -0.5)
    o = o.transpose(1, 2).reshape(B, T, -1)
    return m.o_proj(torch.sigmoid(m.g_proj(x)) * o)


def run(m, x, fn):
    """Output and gradients (x and every parameter) for a fixed random cotangent."""
    m.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    y = fn(m, x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype).to(y.device))
    return y.detach(), {"x": x.grad, **{n: p.grad.clone() for n, p in m.named_parameters()}}


@pytest.mark.parametrize("B,T,D,H,ql,r,dq,dv", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_absorbed_equals_decompressed_equals_sdpa(B, T, D, H, ql, r, dq, dv):
    torch.manual_seed(0)
    m = GatedMLA(D, H, ql, r, dq, dv, init_std=0.3).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    y_ref, g_ref = run(m, x, sdpa_reference)
    for absorb in (True, False):
        y, g = run(m, x, lambda m_, x_, a=absorb: m_(x_, absorb=a))
        assert_close(f"y absorb={absorb}", y, y_ref, TOL["y"])
        for name in g_ref:
            assert_close(f"d{name} absorb={absorb}", g[name], g_ref[name], TOL["grad"])


@pytest.mark.parametrize("absorb", [True, False])
def test_config_flag_selects_path(absorb, monkeypatch):
    """The configured flag picks the path (the other one would raise), with the same values as asking for it."""
    torch.manual_seed(0)
    m = GatedMLA(16, 2, 8, 4, 8, 8, absorb=absorb).double()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    expected = m(x, absorb=absorb)

    def wrong_path(*args, **kwargs):
        raise AssertionError(f"absorb={absorb} took the other path")

    monkeypatch.setattr(m, "_decompressed" if absorb else "_absorbed", wrong_path)
    assert_close("flag", m(x), expected, TOL["y"])


def test_causal():
    torch.manual_seed(0)
    m = GatedMLA(16, 2, 8, 4, 8, 8, init_std=0.3).double()
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 7:] += torch.randn_like(x2[:, 7:])
    for absorb in (True, False):
        assert torch.equal(m(x, absorb=absorb)[:, :7], m(x2, absorb=absorb)[:, :7])


def test_parameter_shapes():
    m = GatedMLA(32, 4, 16, 8, 6, 5)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {
        "q_down.weight": (16, 32), "q_norm.weight": (16,), "q_up.weight": (24, 16),
        "kv_down.weight": (8, 32), "kv_norm.weight": (8,), "W_UK": (4, 6, 8), "W_UV": (4, 5, 8),
        "g_proj.weight": (20, 32), "o_proj.weight": (32, 20),
    }


def test_flex_document_attention_matches_the_masked_sdpa(monkeypatch):
    """The CUDA path of packed-document attention (FlexAttention with a block mask) against the CPU path (SDPA
    with the boolean block-diagonal causal mask), forward on the CPU (FlexAttention has no CPU backward; the
    GPU tier compares gradients of the compiled kernel). FlexAttention runs unfused here: torch 2.13's CPU
    Inductor build of it gave whole wrong rows when freshly compiled (right ones from its disk cache), and
    the model never runs it on a CPU."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from k3cli.layers import mla
    from k3cli.layers.mla import _document_mask, _flex_document_attention
    monkeypatch.setattr(mla, "_fused_flex_attention", lambda: flex_attention)
    g = torch.Generator().manual_seed(0)
    B, H, T, d = 2, 2, 40, 8
    doc = torch.tensor([[0] * 7 + [1] * 20 + [2] * 13, [0] * 40])
    q, k, v = (torch.randn(B, H, T, d, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=_document_mask(doc)[:, None], scale=0.3)
    got = _flex_document_attention(q, k, v, doc, 0.3)
    assert (got - ref).abs().max() < 1e-5


@pytest.mark.gpu
def test_flex_document_attention_gradients_match_the_masked_sdpa_on_cuda():
    import torch.nn.functional as F

    from k3cli.layers.mla import _document_mask, _flex_document_attention
    g = torch.Generator().manual_seed(0)
    B, H, T, d = 2, 4, 300, 32
    doc = torch.cat([torch.zeros(B, 100), torch.ones(B, 150), 2 * torch.ones(B, 50)], 1).long().cuda()
    q, k, v = (torch.randn(B, H, T, d, generator=g).cuda().requires_grad_() for _ in range(3))
    do = torch.randn(B, H, T, d, generator=g).cuda()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=_document_mask(doc)[:, None], scale=0.2)
    got = _flex_document_attention(q, k, v, doc, 0.2)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
        assert (a - b).abs().max() < 1e-3
    assert (got - ref).abs().max() < 1e-4
