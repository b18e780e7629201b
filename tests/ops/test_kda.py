"""KDA ops against the token-by-token definition (SPEC §2, §7.1, §7.2, §7.7, §7.8).

CPU tier: torch references always; Triton kernels under TRITON_INTERPRET=1 (tiny shapes).
GPU tier (@pytest.mark.gpu): bf16 full-size shapes, skipped without CUDA.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from k3cli.ops.kda import chunk_local_cumsum, naive_chunk_kda, naive_kda_gate, naive_recurrent_kda

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRET),
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

# relative RMS error limits against the fp32 (or fp64) reference, per output
TOL = {"o": 0.005, "ht": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dh0": 0.008,
       "dg": 0.02, "dbeta": 0.02, "dg_raw": 0.008, "dA_log": 0.008, "ddt_bias": 0.008}


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, tol: float | None = None) -> None:
    tol = TOL[name] if tol is None else tol
    err = rel_rms(x, ref)
    assert err <= tol, f"{name}: relative RMS error {err:.3g} > {tol}"


def make_inputs(B, T, H, G, K, V, dtype=torch.float32, device="cpu", seed=0, h0=True):
    """L2-normalised q/k, gate in (-5, 0) as the lower-bound gate produces, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    HV = H * G
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64) - 1.0)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen, dtype=torch.float64))
    s0 = torch.randn(B, HV, K, V, generator=gen, dtype=torch.float64) if h0 else None
    low = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
    g = g.to(device=device, dtype=torch.float32 if dtype != torch.float64 else dtype)
    beta = beta.to(device=device, dtype=dtype)
    s0 = None if s0 is None else s0.to(device=device, dtype=torch.float32 if dtype != torch.float64 else dtype)
    return (*low, g, beta, s0)


def run_with_grads(fn, q, k, v, g, beta, h0, **kw):
    """Call fn, backprop a fixed random cotangent into o and the final state; return outputs + grads."""
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in (q, k, v, g, beta, h0)]
    o, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(123)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht)
    ((o * do).sum() + (ht * dht).sum()).backward()
    grads = {n: x.grad for n, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), leaves) if x is not None}
    return {"o": o.detach(), "ht": ht.detach(), **grads}


# ---------------------------------------------------------------- torch references
# (B, T, H, G, K, V, chunk)
NAIVE_CASES = [
    pytest.param(2, 100, 2, 2, 16, 32, 16, id="T100-G2-C16"),
    pytest.param(1, 1, 1, 1, 16, 16, 64, id="T1"),
    pytest.param(2, 63, 1, 1, 24, 8, 64, id="T63-K24-H1"),
    pytest.param(1, 130, 2, 1, 32, 32, 64, id="T130-C64"),
    pytest.param(1, 64, 3, 1, 16, 16, 64, id="T64-exact"),
    pytest.param(1, 50, 1, 2, 8, 8, 10, id="T50-C10-odd-chunk"),
]


@pytest.mark.parametrize("B,T,H,G,K,V,C", NAIVE_CASES)
def test_naive_chunk_matches_recurrent_fp64(B, T, H, G, K, V, C):
    inputs = make_inputs(B, T, H, G, K, V, dtype=torch.float64)
    ref = run_with_grads(naive_recurrent_kda, *inputs)
    out = run_with_grads(naive_chunk_kda, *inputs, chunk_size=C)
    for name, x in out.items():
        # both are exact algorithms in fp64: only rounding separates them
        assert_close(name, x, ref[name], tol=1e-10)


def test_naive_chunk_without_initial_state_and_fp32():
    q, k, v, g, beta, _ = make_inputs(2, 77, 2, 1, 16, 16, dtype=torch.float32, h0=False)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    o, s = naive_chunk_kda(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert_close("o", o, o_ref, tol=1e-5)
    assert_close("ht", s, s_ref, tol=1e-5)
    o2, s2 = naive_chunk_kda(q, k, v, g, beta)
    assert s2 is None and torch.equal(o, o2)


def test_naive_chunk_fp16_returns_input_dtype():
    q, k, v, g, beta, h0 = make_inputs(1, 20, 1, 1, 16, 16, dtype=torch.float16)
    o, s = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float16 and s.dtype == torch.float32


def test_naive_chunk_causality_is_bit_stable():
    q, k, v, g, beta, h0 = make_inputs(1, 90, 2, 1, 16, 16)
    o, _ = naive_chunk_kda(q, k, v, g, beta, initial_state=h0)
    t = 40
    q2, k2, v2, g2, b2 = (x.clone() for x in (q, k, v, g, beta))
    for x in (q2, k2, v2):
        x[:, t + 1:] = torch.randn_like(x[:, t + 1:])
    g2[:, t + 1:] = -5 * torch.rand_like(g2[:, t + 1:])
    b2[:, t + 1:] = torch.rand_like(b2[:, t + 1:])
    o2, _ = naive_chunk_kda(q2, k2, v2, g2, b2, initial_state=h0)
    assert torch.equal(o[:, :t + 1], o2[:, :t + 1])


def test_naive_gate_and_cumsum():
    gen = torch.Generator().manual_seed(0)
    g_raw = torch.randn(2, 70, 3, 8, generator=gen)
    A_log = torch.randn(3, generator=gen)
    bias = torch.randn(3, 8, generator=gen)
    g = naive_kda_gate(g_raw, A_log, bias)
    assert g.dtype == torch.float32 and (g < 0).all() and (g > -5).all()
    expect = -5.0 * torch.sigmoid(A_log.exp()[:, None] * (g_raw + bias))
    torch.testing.assert_close(g, expect)
    c = chunk_local_cumsum(g, 16)
    torch.testing.assert_close(c[:, 16:32], g[:, 16:32].cumsum(1))
    torch.testing.assert_close(c[:, 64:], g[:, 64:].cumsum(1))
    r = chunk_local_cumsum(g, 16, reverse=True)
    torch.testing.assert_close(r[:, :16], g[:, :16].flip(1).cumsum(1).flip(1))
