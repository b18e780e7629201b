"""KDAAttention (docs/math.md §2.4): switches, parameter structure, chunked op == recurrence, causality.

Whole-model causality and batch invariance (docs/math.md §7.7, §7.8) are in tests/models/test_causal_lm.py.
"""
import pytest
import torch

from k3cli.layers.kda import KDAAttention
from k3cli.ops.kda import naive, torch_chunk
from k3cli.testing import assert_close

# max |a − b| / max(1, max |b|), fp64; naive_kda_gate runs in fp32 even for fp64 inputs (docs/math.md §2.3),
# so gradients that flow back through the gate carry fp32 rounding
TOL = {"y": 1e-10, "grad": 1e-10, "grad_through_gate": 1e-5,
       # fp32 on GPU: a bound for plain TF32 dots (≤ 6.2e-3 measured, dA_log, G = 2); fp32 inputs take the
       # more accurate tf32x3 dots (chunk.plan)
       "triton_vs_torch": 1e-2}
GATE_PARAMS = ("A_log", "dt_bias", "f_a.weight", "f_b.weight")


def make(D=24, H=2, HV=2, K=8, V=6, conv=4, gate=True, chunk=16, seed=0) -> KDAAttention:
    torch.manual_seed(seed)
    m = KDAAttention(D, H, HV, K, V, short_conv=conv, output_gate=gate, chunk_size=chunk, backend="torch")
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("proj.weight") or name[:3] in ("f_a", "f_b", "g_a", "g_b"):
                p.normal_(std=0.3)
    return m.double()


# (id, conv, output_gate, H, HV, T)
CASES = [
    ("conv4_gate", 4, True, 2, 2, 20),
    ("noconv_gate", 0, True, 2, 2, 20),
    ("conv4_nogate", 4, False, 2, 2, 20),
    ("noconv_nogate", 0, False, 2, 2, 20),
    ("conv2_GVA_G2", 2, True, 1, 2, 33),
    ("T1", 4, True, 2, 2, 1),
    ("conv6_torch_conv", 6, True, 2, 2, 9),   # wider than the fused short conv takes: the torch conv
]


def run(m, x):
    m.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    y = m(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype).to(y.device))
    return y.detach(), {"x": x.grad, **{n: p.grad.clone() for n, p in m.named_parameters()}}


@pytest.mark.parametrize("conv,gate,H,HV,T", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_chunked_layer_equals_recurrent_layer(conv, gate, H, HV, T, monkeypatch):
    m = make(H=H, HV=HV, conv=conv, gate=gate)
    x = torch.randn(2, T, 24, dtype=torch.float64)
    y, g = run(m, x)
    assert y.shape == x.shape
    # at T = 1 the decay acts on the zero initial state, so the gate gets no gradient
    bad = [n for n, d in g.items() if not (torch.isfinite(d).all() and d.abs().sum() > 0)
           and not (T == 1 and n in GATE_PARAMS)]
    assert bad == [], f"zero or non-finite gradients: {bad}"
    # swap the chunked ops (the fast path and the reference) for the definition, token by token
    for module, name in ((torch_chunk, "torch_chunk_kda"), (naive, "naive_chunk_kda")):
        monkeypatch.setattr(module, name, lambda *a, chunk_size, **_: naive.naive_recurrent_kda(*a))
    y_ref, g_ref = run(m, x)
    assert_close("y", y, y_ref, TOL["y"])
    for name in g_ref:
        assert_close(f"d{name}", g[name], g_ref[name], TOL["grad_through_gate" if name in GATE_PARAMS else "grad"])


def test_parameter_structure():
    D, H, HV, K, V, n = 24, 2, 4, 8, 6, 3
    m = KDAAttention(D, H, HV, K, V, short_conv=n, output_gate=True)
    shapes = {name: tuple(p.shape) for name, p in m.named_parameters()}
    assert shapes == {
        "q_proj.weight": (H * K, D), "k_proj.weight": (H * K, D), "v_proj.weight": (HV * V, D),
        "q_conv.weight": (H * K, 1, n), "k_conv.weight": (H * K, 1, n), "v_conv.weight": (HV * V, 1, n),
        "f_a.weight": (K, D), "f_b.weight": (HV * K, K), "b_proj.weight": (HV, D), "A_log": (HV,),
        "dt_bias": (HV * K,), "g_a.weight": (V, D), "g_b.weight": (HV * V, V), "o_norm.weight": (V,),
        "o_proj.weight": (D, HV * V),
    }
    assert (m.A_log == 0).all()
    bare = KDAAttention(D, H, HV, K, V, short_conv=0, output_gate=False)
    assert not any(k in n for n, _ in bare.named_parameters() for k in ("conv", "g_a", "g_b"))


def test_layer_is_causal_bit_exact():
    m = make(chunk=8)
    x = torch.randn(1, 29, 24, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 13:] = torch.randn_like(x2[:, 13:]) * 5
    with torch.no_grad():
        assert torch.equal(m(x)[:, :13], m(x2)[:, :13])


def test_auto_backend_on_cpu_is_the_torch_reference():
    m = make()
    x = torch.randn(1, 10, 24, dtype=torch.float64)
    with torch.no_grad():
        y = m(x)
        m.backend = "auto"
        assert torch.equal(m(x), y)


def test_gva_requires_divisible_heads():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        KDAAttention(16, 3, 4, 8, 8)


@pytest.mark.triton
@pytest.mark.parametrize("conv,gate,H,HV,T", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_triton_backend_equals_torch_backend(conv, gate, H, HV, T):
    """The Triton kernels (chunk_kda, the gate, the fused short conv with q's and k's L2 norm) against the torch
    path, fp32, values and every gradient: on CUDA, or on CPU under the interpreter."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = make(H=H, HV=HV, conv=conv, gate=gate).float().to(dev)
    x = torch.randn(2, T, 24, device=dev)
    y_ref, g_ref = run(m, x)
    m.backend = "triton"
    y, g = run(m, x)
    for name, a, b in [("y", y, y_ref)] + [(f"d{n}", g[n], g_ref[n]) for n in g_ref]:
        if not (T == 1 and name[1:] in GATE_PARAMS):  # zero at T = 1: only rounding noise to compare
            assert_close(name, a, b, TOL["triton_vs_torch"])


@pytest.mark.parametrize("path", ["shifted", "shifted-masked", "conv1d"])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_short_conv_equals_depthwise_conv1d(T, path, monkeypatch):
    """Both forms of the short conv (the shifted-row sum that torch.compile fuses, with and without the
    document mask, and F.conv1d eagerly) are the causal depthwise conv + SiLU, values and gradients, fp64."""
    from k3cli.layers.kda import _short_conv
    torch.manual_seed(0)
    x = torch.randn(2, T, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 1, 4, dtype=torch.float64, requires_grad=True)
    pos = None
    if path == "shifted":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)   # the branch a compiled model traces
    elif path == "shifted-masked":
        pos = torch.arange(T).expand(2, T)   # one document per row: every tap allowed
    y = _short_conv(x, w, pos)
    monkeypatch.undo()
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(
        torch.nn.functional.pad(x.transpose(1, 2), (3, 0)), w, groups=6).transpose(1, 2))
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w), dy)
    want = torch.autograd.grad(ref, (x, w), dy)
    assert_close("y", y, ref, 1e-12)
    for name, a, b in zip(("dx", "dw"), got, want):
        assert_close(name, a, b, 1e-12)


def test_short_conv_keeps_the_input_dtype_under_autocast():
    """bf16 activations with fp32 conv weights (autocast) give bf16 q, k, v, as conv1d did: an fp32 result
    would send chunk_kda down its fp32 path."""
    from k3cli.layers.kda import _short_conv
    x = torch.randn(2, 5, 8, dtype=torch.bfloat16)
    w = torch.randn(8, 1, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _short_conv(x, w).dtype == torch.bfloat16
        assert _short_conv(x, w, torch.zeros(2, 5, dtype=torch.long)).dtype == torch.bfloat16
