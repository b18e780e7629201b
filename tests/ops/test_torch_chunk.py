"""`torch_chunk_kda` (the CPU training path) against the reference `naive_chunk_kda`: output, final
state and all six gradients, on awkward shapes (T = 1, T not a multiple of the chunk, GVA, several
sub-chunks per chunk), at the edge of its anchor range, and its fallback beyond that range."""

import pytest
import torch

from k3cli.ops.kda import naive_chunk_kda, torch_chunk
from k3cli.ops.kda.torch_chunk import torch_chunk_kda
from k3cli.testing import assert_close, run_with_grads
from k3cli.testing import kda_inputs as make_inputs

# scaled max error against the reference on the same inputs, by working precision
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 1e-2}


def check_against_reference(inputs, chunk_size, tol):
    ref = run_with_grads(naive_chunk_kda, *inputs, chunk_size=chunk_size)
    out = run_with_grads(torch_chunk_kda, *inputs, chunk_size=chunk_size)
    for name, r in ref.items():
        assert out[name].dtype == r.dtype, name
        assert_close(name, out[name].double(), r.double(), tol)


# (B, T, H, G, K, V, chunk)
CASES = [
    pytest.param(2, 256, 2, 1, 16, 16, 16, id="k3-toy-heads"),
    pytest.param(1, 1, 1, 1, 16, 16, 16, id="T1"),
    pytest.param(1, 1, 1, 2, 8, 8, 64, id="T1-G2-C64"),
    pytest.param(2, 100, 2, 2, 16, 32, 16, id="T100-G2-C16"),
    pytest.param(2, 63, 1, 1, 24, 8, 64, id="T63-K24-C64"),
    pytest.param(1, 130, 2, 1, 32, 32, 64, id="T130-C64"),
    pytest.param(1, 50, 1, 2, 8, 8, 10, id="T50-C10-odd-chunk"),
    pytest.param(1, 40, 1, 3, 8, 8, 32, id="T40-G3-C32"),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("B,T,H,G,K,V,C", CASES)
def test_matches_reference(B, T, H, G, K, V, C, dtype):
    check_against_reference(make_inputs(B, T, H, G, K, V, dtype=dtype), C, TOL[dtype])


def test_bf16_inputs_match_reference():
    check_against_reference(make_inputs(2, 70, 2, 2, 16, 16, dtype=torch.bfloat16), 16, TOL[torch.bfloat16])


@pytest.mark.parametrize("C", [16, 64])
def test_gate_at_the_lower_bound_stays_on_the_fast_path(C, monkeypatch):
    # every step at the k3 lower bound (-5): the anchors' widest reach, still without the fallback
    q, k, v, _, beta, h0 = make_inputs(2, 3 * C - 5, 2, 1, 16, 16)
    g = torch.full((2, 3 * C - 5, 2, 16), -4.999)
    ref = run_with_grads(naive_chunk_kda, q, k, v, g, beta, h0, chunk_size=C)
    monkeypatch.setattr(torch_chunk, "naive_chunk_kda", None)
    out = run_with_grads(torch_chunk_kda, q, k, v, g, beta, h0, chunk_size=C)
    for name, r in ref.items():
        assert torch.isfinite(out[name]).all(), name
        assert_close(name, out[name], r, TOL[torch.float32])


def test_without_initial_or_final_state():
    q, k, v, g, beta, _ = make_inputs(1, 37, 2, 1, 16, 16)
    o, s = torch_chunk_kda(q, k, v, g, beta, chunk_size=16)
    o_ref, _ = naive_chunk_kda(q, k, v, g, beta, chunk_size=16)
    assert s is None
    assert_close("o", o, o_ref, TOL[torch.float32])


def test_falls_back_to_the_reference_beyond_the_anchor_range(monkeypatch):
    # gates far below the lower bound: exp(Γ − c) would leave the safe range, so the reference runs
    q, k, v, g, beta, h0 = make_inputs(1, 32, 1, 1, 8, 8, gate_scale=40.0)
    calls = []
    monkeypatch.setattr(torch_chunk, "naive_chunk_kda",
                        lambda *a, **kw: calls.append(1) or naive_chunk_kda(*a, **kw))
    o, s = torch_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    o_ref, s_ref = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    assert calls == [1]
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("C", [16, 64])
def test_causal_bit_for_bit(C):
    # the anchors sit at each sub-chunk's first row, so later tokens cannot change earlier outputs
    q, k, v, g, beta, h0 = make_inputs(1, 2 * C + 7, 2, 1, 16, 16)
    q2, k2, v2, g2, beta2, _ = make_inputs(1, 2 * C + 7, 2, 1, 16, 16, seed=1)
    t = C + 5
    mix = [torch.cat([a[:, :t], b[:, t:]], dim=1) for a, b in zip((q, k, v, g, beta), (q2, k2, v2, g2, beta2))]
    o, _ = torch_chunk_kda(q, k, v, g, beta, initial_state=h0, chunk_size=C)
    o2, _ = torch_chunk_kda(*mix, initial_state=h0, chunk_size=C)
    assert torch.equal(o[:, :t], o2[:, :t])


def test_covers_gate():
    assert torch_chunk.covers_gate(-5.0, 16) and torch_chunk.covers_gate(-5.0, 64)
    assert torch_chunk.covers_gate(-5.0, 10)          # one sub-chunk of 10 rows
    assert not torch_chunk.covers_gate(-5.0, 24)      # one sub-chunk of 24 rows: 23 · 5 > MAX_REACH
    assert not torch_chunk.covers_gate(-6.0, 16)
