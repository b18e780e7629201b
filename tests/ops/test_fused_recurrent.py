"""Fused recurrent KDA (decode kernel) against the token-by-token definition (docs/math.md §2.1, §2.5).

CPU tier: the Triton kernel under TRITON_INTERPRET=1, fp32, tiny shapes (the interpreter is wrong for
bf16). GPU tier (@pytest.mark.gpu): bf16 at the real K3 head size, skipped without CUDA.
"""

import pytest
import torch
import torch.nn.functional as F

from k3cli.ops.kda.fused_recurrent import TOL
from k3cli.ops.kda.naive import naive_kda_gate, naive_recurrent_kda
from k3cli.testing import assert_close, relative_rms_error

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = pytest.mark.triton
gpu = pytest.mark.gpu

def make_inputs(B, T, H, G, K, V, dtype=torch.float32, device=DEVICE, seed=0):
    """Raw (un-normalised) q/k, raw gate input, beta in (0, 1), an fp32 initial state, gate params."""
    gen = torch.Generator().manual_seed(seed)
    HV = H * G
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, V, generator=gen)
    g_raw = torch.randn(B, T, HV, K, generator=gen)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    h0 = torch.randn(B, HV, K, V, generator=gen)
    A_log = 0.3 * torch.randn(HV, generator=gen)
    dt_bias = torch.randn(HV, K, generator=gen)
    low = [x.to(device=device, dtype=dtype) for x in (q, k, v, g_raw, beta)]
    return (*low, *(x.to(device) for x in (h0, A_log, dt_bias)))


def reference(q, k, v, g_raw, beta, h0, A_log, dt_bias, l2norm, gate):
    """fp32 torch: optional L2 norm (eps 1e-6 inside the sqrt) and lower-bound gate, then the recurrence."""
    q, k = q.float(), k.float()
    if l2norm:
        q, k = (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    else:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = naive_kda_gate(g_raw, A_log, dt_bias) if gate else -5.0 * torch.sigmoid(g_raw.float())
    return naive_recurrent_kda(q, k, v.float(), g, beta.float(), initial_state=h0, output_final_state=True)


def kernel_inputs(q, k, g_raw, l2norm, gate):
    """What the kernel gets for the same math: normalised q/k unless in-kernel, g unless in-kernel."""
    if not l2norm:
        q, k = F.normalize(q.float(), dim=-1).to(q.dtype), F.normalize(k.float(), dim=-1).to(k.dtype)
    g = g_raw if gate else -5.0 * torch.sigmoid(g_raw.float())
    return q, k, g


# (id, B, T, H, G, K, V, l2norm_in_kernel, gate_in_kernel)
CASES = [
    ("T1_G1_K16", 2, 1, 2, 1, 16, 16, True, True),
    ("T3_G1_K16", 2, 3, 2, 1, 16, 16, True, True),
    ("T1_G2_K32", 1, 1, 2, 2, 32, 32, True, True),
    ("T3_G2_K32", 2, 3, 1, 2, 32, 32, True, True),
    ("T3_G2_K16_V32", 2, 3, 2, 2, 16, 32, True, True),
    ("T3_nol2_nogate", 2, 3, 2, 2, 16, 16, False, False),
    ("T1_l2_nogate", 2, 1, 2, 1, 32, 32, True, False),
    ("T3_nol2_gate", 1, 3, 2, 2, 32, 16, False, True),
    ("T3_K12_V20", 2, 3, 2, 1, 12, 20, True, True),
]


@pytest.mark.parametrize("B,T,H,G,K,V,l2norm,gate", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fused_recurrent_matches_naive(B, T, H, G, K, V, l2norm, gate):
    from k3cli.ops.kda.fused_recurrent import fused_recurrent_kda

    q, k, v, g_raw, beta, h0, A_log, dt_bias = make_inputs(B, T, H, G, K, V)
    ro, rh = reference(q, k, v, g_raw, beta, h0, A_log, dt_bias, l2norm, gate)
    kq, kk, kg = kernel_inputs(q, k, g_raw, l2norm, gate)
    o, ht = fused_recurrent_kda(kq, kk, v, kg, beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=gate,
                                A_log=A_log, dt_bias=dt_bias)
    assert o.shape == v.shape and o.dtype == v.dtype and ht.dtype == torch.float32
    assert_close("o", o, ro, TOL[torch.float32], relative_rms_error)
    assert_close("ht", ht, rh, TOL[torch.float32], relative_rms_error)


def test_inplace_state_token_by_token_equals_one_call():
    """Decoding one token per call with the state updated in place == all T tokens in one call."""
    from k3cli.ops.kda.fused_recurrent import fused_recurrent_kda

    q, k, v, g_raw, beta, h0, A_log, dt_bias = make_inputs(2, 3, 2, 2, 16, 16, seed=1)
    kw = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias}
    ro, rh = reference(q, k, v, g_raw, beta, h0, A_log, dt_bias, True, True)
    state = h0.clone()
    outs = []
    for t in range(3):
        o, ht = fused_recurrent_kda(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g_raw[:, t:t + 1],
                                    beta[:, t:t + 1], initial_state=state, inplace_state=True, **kw)
        assert ht is state
        outs.append(o)
    assert_close("o", torch.cat(outs, 1), ro, TOL[torch.float32], relative_rms_error)
    assert_close("ht", state, rh, TOL[torch.float32], relative_rms_error)


def test_no_initial_state_and_no_final_state():
    from k3cli.ops.kda.fused_recurrent import fused_recurrent_kda

    q, k, v, g_raw, beta, _, A_log, dt_bias = make_inputs(2, 3, 2, 1, 16, 16, seed=2)
    zeros = torch.zeros(2, 2, 16, 16, device=DEVICE)
    ro, _ = reference(q, k, v, g_raw, beta, zeros, A_log, dt_bias, True, True)
    o, ht = fused_recurrent_kda(q, k, v, g_raw, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                A_log=A_log, dt_bias=dt_bias)
    assert ht is None
    assert_close("o", o, ro, TOL[torch.float32], relative_rms_error)


def test_grad_mode_falls_back_to_the_differentiable_reference():
    from k3cli.ops.kda.fused_recurrent import fused_recurrent_kda

    q, k, v, g_raw, beta, h0, A_log, dt_bias = make_inputs(1, 2, 1, 1, 16, 16, seed=3)
    q.requires_grad_(True)
    o, _ = fused_recurrent_kda(q, k, v, g_raw, beta, initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                               dt_bias=dt_bias)
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with pytest.raises(ValueError, match="inplace_state"):
        fused_recurrent_kda(q, k, v, g_raw, beta, initial_state=h0, inplace_state=True)


@pytest.mark.parametrize("bad,match", [
    ("beta_shape", "beta shape"), ("state_dtype", "initial_state dtype"), ("gate_no_A", "A_log is required"),
    ("inplace_no_state", "needs an initial_state"), ("gva", "multiple of q/k heads"),
])
def test_validation_names_the_argument(bad, match):
    from k3cli.ops.kda.fused_recurrent import fused_recurrent_kda

    q, k, v, g, beta, h0, _, _ = make_inputs(1, 1, 2, 1, 16, 16)
    kw = {}
    if bad == "beta_shape":
        beta = beta[..., :1]
    elif bad == "state_dtype":
        kw["initial_state"] = h0.double()
    elif bad == "gate_no_A":
        kw["use_gate_in_kernel"] = True
    elif bad == "inplace_no_state":
        kw["inplace_state"] = True
    elif bad == "gva":
        v, g, beta = v[:, :, :1].repeat(1, 1, 3, 1), g[:, :, :1].repeat(1, 1, 3, 1), beta[..., :1].repeat(1, 1, 3)
    with pytest.raises((ValueError, TypeError), match=match):
        fused_recurrent_kda(q, k, v, g, beta, **kw)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 32])
def test_fused_recurrent_bf16_full_size(B):
    """K3 head size (H = HV = 32 here, K = V = 128), bf16 inputs, a few decode tokens."""
    from k3cli.ops.kda.fused_recurrent import fused_recurrent_kda

    q, k, v, g_raw, beta, h0, A_log, dt_bias = make_inputs(B, 4, 32, 1, 128, 128, dtype=torch.bfloat16)
    ro, rh = reference(q, k, v, g_raw, beta, h0, A_log, dt_bias, True, True)
    state = h0.clone()
    o, _ = fused_recurrent_kda(q, k, v, g_raw, beta, initial_state=state, inplace_state=True,
                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                               dt_bias=dt_bias)
    assert o.dtype == torch.bfloat16
    assert_close("o", o, ro, TOL[torch.bfloat16], relative_rms_error)
    assert_close("ht", state, rh, TOL[torch.bfloat16], relative_rms_error)


def test_bench_decode_runs_and_reports_state_bandwidth():
    from k3cli.ops.kda.bench_decode import bench_decode, format_rows

    rows = bench_decode(shapes=[(1, 2, 2, 16)], with_fla=False, dtype=torch.float32)
    assert rows[0]["triton_ms"] > 0 and rows[0]["torch_ms"] > 0 and rows[0]["triton_GBps"] > 0
    assert "triton ms" in format_rows(rows)
