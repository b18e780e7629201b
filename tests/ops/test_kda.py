"""KDA ops against the token-by-token definition (docs/math.md §2, §7.1, §7.2, §7.7, §7.8).

CPU tier: torch references always; Triton kernels under TRITON_INTERPRET=1 (tiny shapes).
GPU tier (@pytest.mark.gpu): bf16 full-size shapes, skipped without CUDA.
"""

import pytest
import torch

from k3cli.ops.kda import chunk_local_cumsum, naive_chunk_kda, naive_kda_gate, naive_recurrent_kda
from k3cli.ops.kda.verify import TOL, rel_rms
from k3cli.testing import assert_close as _assert_close
from k3cli.testing import kda_inputs as make_inputs
from k3cli.testing import run_with_grads

SLOW = pytest.mark.slow   # 15-20 s each in the interpreter: the slow tier

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.triton
gpu = pytest.mark.gpu


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, tol: float | None = None) -> None:
    """Relative RMS error against the op's tolerance table (k3cli/ops/kda/verify.py) unless `tol` is given."""
    _assert_close(name, x, ref, TOL[name] if tol is None else tol, rel_rms)


def check_against_recurrent(inputs, tol=None, fn=None, **kw):
    """chunk_kda's (or `fn`'s) outputs and gradients against the fp32 recurrence on the same (fp32-cast) inputs."""
    from k3cli.ops.kda import chunk_kda
    ref = run_with_grads(naive_recurrent_kda, *[None if x is None else x.float() for x in inputs])
    out = run_with_grads(fn or chunk_kda, *inputs, **kw)
    for name in ref:
        assert_close(name, out[name], ref[name], tol=tol)


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


# ---------------------------------------------------------------- Triton chunk_kda (CPU interpreter tier)
# (B, T, H, G, K, V, chunk, dtype, with h0)
TRITON_CASES = [
    pytest.param(1, 1, 1, 1, 16, 16, 64, torch.float32, True, id="T1"),
    pytest.param(2, 63, 1, 1, 16, 16, 64, torch.float32, True, id="T63-H1"),
    pytest.param(1, 100, 2, 2, 16, 32, 64, torch.float32, True, id="T100-G2"),
    pytest.param(1, 130, 1, 1, 32, 32, 64, torch.float32, False, id="T130-K32-noh0"),
    pytest.param(1, 63, 1, 2, 24, 16, 64, torch.float32, True, id="T63-K24-G2"),
    pytest.param(1, 50, 2, 1, 16, 16, 16, torch.float32, True, id="T50-C16"),
    pytest.param(1, 70, 1, 1, 16, 16, 32, torch.float16, True, id="T70-C32-fp16"),
    # K > 64: the backward splits the key dim into 64-wide blocks (K = 96: a masked second block)
    pytest.param(1, 70, 1, 2, 96, 32, 64, torch.float32, True, id="T70-K96-G2-kblocks", marks=SLOW),
    pytest.param(1, 40, 1, 1, 128, 128, 64, torch.float32, True, id="T40-K128"),
    # half inputs with K > 64: the default ("auto") stores W, U, Q e^Γ, K e^(γ-Γ) 2-byte
    pytest.param(1, 70, 1, 2, 96, 32, 64, torch.float16, True, id="T70-K96-G2-fp16-2byte-buffers", marks=SLOW),
    # K > 64 scores per block pair: one sub-chunk per chunk (C16, T = 1), two (C32, 16-bit buffers)
    pytest.param(1, 1, 1, 1, 96, 16, 16, torch.float32, True, id="T1-K96-C16-pairs"),
    pytest.param(1, 90, 1, 2, 96, 24, 32, torch.float16, True, id="T90-K96-G2-C32-fp16-pairs"),
    pytest.param(1, 45, 2, 1, 40, 24, 16, torch.float32, False, id="T45-K40-V24-C16"),
]


@needs_triton
@pytest.mark.parametrize("B,T,H,G,K,V,C,dtype,h0", TRITON_CASES)
def test_chunk_kda_matches_recurrent(B, T, H, G, K, V, C, dtype, h0):
    from k3cli.ops.kda import chunk_kda
    inputs = make_inputs(B, T, H, G, K, V, dtype=dtype, device=DEVICE, h0=h0)
    # the reference sees the same (rounded) inputs, in fp32
    ref_inputs = [None if x is None else x.float() for x in inputs]
    ref = run_with_grads(naive_recurrent_kda, *ref_inputs)
    out = run_with_grads(chunk_kda, *inputs, chunk_size=C)
    assert out["o"].dtype == dtype and out["ht"].dtype == torch.float32
    for name in ref:
        assert out[name].shape == ref[name].shape, name
        assert_close(name, out[name], ref[name])


# lower_bound=None: the pair-by-pair diagonal score blocks, steps down to -40 (tests/ops/test_extremes.py shows the
# anchored blocks going non-finite there); the awkward shapes of TRITON_CASES, both score launch forms
UNBOUNDED_CASES = [
    pytest.param(1, 1, 1, 1, 16, 16, 64, torch.float32, True, id="T1"),
    pytest.param(2, 63, 1, 1, 16, 16, 64, torch.float32, True, id="T63-H1"),
    pytest.param(1, 100, 2, 2, 16, 32, 64, torch.float32, True, id="T100-G2"),
    pytest.param(1, 63, 1, 2, 24, 16, 64, torch.float32, True, id="T63-K24-G2"),
    pytest.param(1, 70, 1, 1, 16, 16, 32, torch.float16, True, id="T70-C32-fp16"),
    pytest.param(1, 1, 1, 1, 96, 16, 16, torch.float32, True, id="T1-K96-C16-pairs"),
    pytest.param(1, 90, 1, 2, 96, 24, 32, torch.float16, True, id="T90-K96-G2-C32-fp16-pairs"),
    pytest.param(1, 45, 2, 1, 40, 24, 16, torch.float32, False, id="T45-K40-V24-C16"),
]


@needs_triton
@pytest.mark.parametrize("B,T,H,G,K,V,C,dtype,h0", UNBOUNDED_CASES)
def test_chunk_kda_unbounded_decay_matches_recurrent(B, T, H, G, K, V, C, dtype, h0):
    inputs = make_inputs(B, T, H, G, K, V, dtype=dtype, device=DEVICE, h0=h0, gate_scale=40.0)
    assert inputs[3].min() < -20
    check_against_recurrent(inputs, chunk_size=C, lower_bound=None)


def run_plan(p_over: dict, q, k, v, g, beta, initial_state=None, output_final_state=False, chunk_size=64):
    """chunk_kda with fields of its launch plan replaced (e.g. ranges: the CUDA-only chunk ranges on CPU)."""
    from unittest import mock

    from k3cli.ops.kda import chunk
    plan = chunk.plan
    with mock.patch.object(chunk, "plan", lambda *a, **kw: plan(*a, **kw)._replace(**p_over)):
        return chunk.chunk_kda(q, k, v, g, beta, initial_state=initial_state,
                               output_final_state=output_final_state, chunk_size=chunk_size)


# (B, T, H, G, K, V, chunk, ranges): the forward in chunk ranges (on CPU one after another: the carry between
# ranges is what is tested), bit-equal to one range and right against the recurrence
RANGE_CASES = [
    pytest.param(1, 200, 1, 1, 16, 16, 16, 4, id="T200-C16-4ranges"),
    pytest.param(1, 130, 1, 2, 40, 24, 16, 3, id="T130-K40-G2-3ranges", marks=SLOW),
    pytest.param(1, 100, 1, 1, 96, 32, 32, 2, id="T100-K96-C32-2ranges", marks=SLOW),
]


@needs_triton
@pytest.mark.parametrize("B,T,H,G,K,V,C,n", RANGE_CASES)
def test_chunk_kda_ranges_match_one_range(B, T, H, G, K, V, C, n):
    from functools import partial
    inputs = make_inputs(B, T, H, G, K, V, dtype=torch.float32, device=DEVICE, gate_scale=0.5)
    base = run_with_grads(partial(run_plan, {"ranges": 0}), *inputs, chunk_size=C)
    out = run_with_grads(partial(run_plan, {"ranges": n}), *inputs, chunk_size=C)
    for name in base:
        assert torch.equal(out[name], base[name]), f"{n} ranges: {name} differs from one range"
    ref = run_with_grads(naive_recurrent_kda, *inputs)
    for name in ref:
        assert_close(name, out[name], ref[name])


# The default inputs' gate forgets the state within a chunk, so a wrong carry between chunks shows only near
# chunk boundaries; with a slow gate the initial state and every chunk's state reach the end of the sequence.
LONG_MEMORY_CASES = [
    pytest.param(0, 1, 200, 1, 2, 40, 24, 64, id="T200-G2", marks=SLOW),
    pytest.param(3, 1, 200, 1, 1, 24, 16, 64, id="T200-3ranges"),
]


@needs_triton
@pytest.mark.parametrize("n,B,T,H,G,K,V,C", LONG_MEMORY_CASES)
def test_chunk_kda_long_memory_matches_recurrent(n, B, T, H, G, K, V, C):
    from functools import partial
    inputs = make_inputs(B, T, H, G, K, V, dtype=torch.float32, device=DEVICE, h0=True, gate_scale=0.01)
    ref = run_with_grads(naive_recurrent_kda, *inputs)
    # the inputs are what this test is about: the initial state must still move the last 64 outputs by
    # over 5 % (relative RMS), 5000 times the tolerance below
    o_no_h0, _ = naive_recurrent_kda(*inputs[:5], initial_state=None, output_final_state=True)
    assert rel_rms(o_no_h0[:, -64:], ref["o"][:, -64:]) > 0.05
    out = run_with_grads(partial(run_plan, {"ranges": n}), *inputs, chunk_size=C)
    for name in ref:
        assert_close(name, out[name], ref[name], tol=1e-5)


@needs_triton
def test_chunk_kda_no_grad_forward_matches():
    # without autograd the forward skips the backward-only Mkk store; the outputs must not change
    from k3cli.ops.kda import chunk_kda
    x = make_inputs(1, 70, 1, 2, 24, 16, dtype=torch.float32, device=DEVICE)
    with torch.no_grad():
        o0, h0 = chunk_kda(*x[:5], initial_state=x[5], output_final_state=True)
    out = run_with_grads(chunk_kda, *x)
    assert torch.equal(o0, out["o"]) and torch.equal(h0, out["ht"])


@needs_triton
def test_chunk_kda_dg_keeps_g_precision():
    # half q, k, v with an fp32 g (what the model's fused gate produces): dg is accumulated and stored in
    # fp32, not rounded through the half dtype on the way
    from k3cli.ops.kda import chunk_kda
    x = make_inputs(1, 70, 1, 1, 24, 16, dtype=torch.float16, device=DEVICE)
    assert x[3].dtype == torch.float32
    out = run_with_grads(chunk_kda, *x)
    assert out["dg"].dtype == torch.float32
    assert not torch.equal(out["dg"], out["dg"].half().float()), "dg went through fp16"
    ref = run_with_grads(naive_recurrent_kda, *[None if t is None else t.float() for t in x])
    assert_close("dg", out["dg"], ref["dg"])


def test_plan_rules():
    from k3cli.ops.kda.chunk import plan
    bf, fp, f32 = torch.bfloat16, torch.float16, torch.float32
    # 4 chunk ranges on CUDA only, where the scan has few programs and many chunks
    assert plan(1, 16384, 16, 128, 128, 64, bf, True).ranges == 4      # B1 T16384 H16: 32 programs, 256 chunks
    assert plan(8, 2048, 16, 128, 128, 64, bf, True).ranges == 0       # B8 T2048 H16: 256 programs
    assert plan(1, 1024, 16, 128, 128, 64, bf, True).ranges == 0       # 16 chunks
    assert plan(8, 2048, 8, 16, 16, 16, bf, True).ranges == 0          # the toy shape: 64 programs
    assert plan(1, 16384, 16, 128, 128, 64, bf, False).ranges == 0     # the interpreter
    # K > 64: 2-byte stage-1 buffers and the scores per block pair with 2 stages; else fp32, per sub-chunk
    wide, narrow = plan(2, 100, 4, 128, 128, 64, bf, True), plan(2, 100, 4, 64, 64, 64, bf, True)
    assert (wide.inter_dtype, wide.gated_dtype, wide.per_pair, wide.score_stages) == (bf, bf, True, 2)
    assert (narrow.inter_dtype, narrow.gated_dtype, narrow.per_pair, narrow.score_stages) == (f32, f32, False, 1)
    assert plan(2, 100, 4, 65, 64, 64, fp, True).inter_dtype == fp
    assert plan(2, 100, 4, 128, 128, 64, f32, True).inter_dtype == f32
    # dots: fp32 inputs fp32-accurate unless TF32 is allowed; 16-bit inputs TF32, the scan in the input dtype
    # at V >= 64 on CUDA (at any V in the interpreter), and scale·Aqk stored in that dtype exactly then
    assert plan(2, 100, 4, 64, 64, 64, f32, True).prec == "tf32x3"
    assert plan(2, 100, 4, 64, 64, 64, f32, True, tf32=True).prec == "tf32"
    p = plan(2, 100, 4, 64, 64, 64, bf, True)
    assert (p.prec, p.scan_prec, p.aqk_dtype) == ("tf32", "bf16", bf)
    p = plan(2, 100, 4, 32, 32, 64, fp, True)
    assert (p.prec, p.scan_prec, p.aqk_dtype) == ("tf32", "tf32", f32)
    p = plan(2, 100, 4, 32, 32, 64, fp, False)
    assert (p.scan_prec, p.aqk_dtype) == ("fp16", fp)
    p = plan(2, 100, 4, 64, 64, 64, f32, True)
    assert (p.scan_prec, p.aqk_dtype) == ("tf32x3", f32)


def test_segment_ranges():
    from k3cli.ops.kda.chunk import segment_ranges
    assert segment_ranges(256, 4) == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert segment_ranges(7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert segment_ranges(2, 4) == [(0, 1), (1, 2)]
    assert segment_ranges(1, 4) is None and segment_ranges(100, 0) is None



@needs_triton
def test_chunk_kda_in_kernel_l2norm_and_gate():
    from k3cli.ops.kda import chunk_kda
    gen = torch.Generator().manual_seed(1)
    B, T, H, K, V = 1, 40, 2, 16, 16
    q = torch.randn(B, T, H, K, generator=gen).to(DEVICE).requires_grad_()
    k = torch.randn(B, T, H, K, generator=gen).to(DEVICE).requires_grad_()
    v = torch.randn(B, T, H, V, generator=gen).to(DEVICE).requires_grad_()
    g_raw = torch.randn(B, T, H, K, generator=gen).to(DEVICE).requires_grad_()
    beta = torch.rand(B, T, H, generator=gen).to(DEVICE).requires_grad_()
    A_log = torch.randn(H, generator=gen).to(DEVICE).requires_grad_()
    dt_bias = torch.randn(H, K, generator=gen).to(DEVICE).requires_grad_()
    leaves = (q, k, v, g_raw, beta, A_log, dt_bias)
    do = torch.randn(B, T, H, V, generator=gen).to(DEVICE)

    def l2(x):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    o_ref, _ = naive_recurrent_kda(l2(q), l2(k), v, naive_kda_gate(g_raw, A_log, dt_bias), beta)
    ref = torch.autograd.grad((o_ref * do).sum(), leaves)
    o, _ = chunk_kda(q, k, v, g_raw, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     A_log=A_log, dt_bias=dt_bias)
    got = torch.autograd.grad((o * do).sum(), leaves)
    assert_close("o", o, o_ref)
    for name, x, r in zip(("dq", "dk", "dv", "dg_raw", "dbeta", "dA_log", "ddt_bias"), got, ref):
        assert_close(name if name in TOL else "dg", x, r)


def _perturb_after(t, *xs):
    out = []
    for x in xs:
        y = x.clone()
        y[:, t + 1:] = y[:, t + 1:].flip(1) * 0.5 - 0.1 if y.is_floating_point() else y[:, t + 1:]
        out.append(y)
    return out


@needs_triton
def test_chunk_kda_causality_bit_stable():
    from k3cli.ops.kda import chunk_kda
    q, k, v, g, beta, h0 = make_inputs(1, 100, 1, 1, 16, 16, device=DEVICE)
    o, _ = chunk_kda(q, k, v, g, beta, initial_state=h0)
    # inside sub-chunk 0, at a chunk end, past it, and mid-way through later 16-row sub-chunks
    for t in (10, 20, 40, 63, 70):
        q2, k2, v2, b2 = _perturb_after(t, q, k, v, beta)
        g2 = g.clone()
        g2[:, t + 1:] = -4.0 * torch.rand_like(g2[:, t + 1:])
        o2, _ = chunk_kda(q2, k2, v2, g2, b2, initial_state=h0)
        assert torch.equal(o[:, :t + 1], o2[:, :t + 1]), f"output at <= {t} changed"
        assert not torch.equal(o[:, t + 1:], o2[:, t + 1:])


@needs_triton
def test_chunk_kda_batch_invariance():
    from k3cli.ops.kda import chunk_kda
    q, k, v, g, beta, h0 = make_inputs(3, 70, 2, 1, 16, 16, device=DEVICE)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o1, ht1 = chunk_kda(q[1:2], k[1:2], v[1:2], g[1:2], beta[1:2], initial_state=h0[1:2],
                        output_final_state=True)
    assert torch.equal(o[1:2], o1) and torch.equal(ht[1:2], ht1)


VALIDATION_CASES = [
    pytest.param({"k": "short"}, ValueError, "k shape", id="k-shape"),
    pytest.param({"v": "badB"}, ValueError, "v shape", id="v-batch"),
    pytest.param({"v": "HV3"}, ValueError, "multiple of q/k heads", id="gva-heads"),
    pytest.param({"g": "shape"}, ValueError, "g shape", id="g-shape"),
    pytest.param({"beta": "shape"}, ValueError, "beta", id="beta-shape"),
    pytest.param({"q": "int"}, TypeError, "q dtype", id="q-int"),
    pytest.param({"k": "fp16"}, TypeError, "share a dtype", id="mixed-dtype"),
    pytest.param({"h0": "fp16"}, TypeError, "initial_state dtype", id="h0-dtype"),
    pytest.param({"h0": "shape"}, ValueError, "initial_state shape", id="h0-shape"),
    pytest.param({"lower_bound": -6.0}, ValueError, "lower_bound", id="lower-bound-low"),
    pytest.param({"lower_bound": 0.0}, ValueError, "lower_bound", id="lower-bound-zero"),
    pytest.param({"chunk_size": 48}, ValueError, "chunk_size", id="chunk-size"),
    pytest.param({"gate": "noA"}, ValueError, "A_log", id="gate-no-A_log"),
    pytest.param({"q": "list"}, TypeError, "q must be a torch.Tensor", id="q-not-tensor"),
]


def test_fp32_dots_follow_torch_tf32_settings():
    """fp32 inputs get fp32-accurate dots (plain TF32 cost 1.4e-2 in a whole-model decode check on the
    H200) unless the user allowed TF32 matmuls in torch, through either API."""
    from k3cli.ops.kda.chunk import plan
    from k3cli.ops.kda.chunk_fwd import torch_allows_tf32

    def prec():
        return plan(1, 64, 1, 16, 16, 64, torch.float32, True, torch_allows_tf32()).prec

    matmul = torch.backends.cuda.matmul
    has_new = hasattr(matmul, "fp32_precision")
    saved = matmul.fp32_precision if has_new else matmul.allow_tf32
    try:
        if has_new:
            matmul.fp32_precision = "ieee"
        else:
            matmul.allow_tf32 = False
        assert prec() == "tf32x3"
        if has_new:
            matmul.fp32_precision = "tf32"
            assert prec() == "tf32"
            matmul.fp32_precision = "none"   # defer to the global setting (default ieee)
            assert prec() == ("tf32" if torch.backends.fp32_precision == "tf32" else "tf32x3")
        matmul.allow_tf32 = True   # the legacy API, mixed with the new one: its read would raise
        assert prec() == "tf32"
    finally:
        if has_new:
            matmul.fp32_precision = saved
        else:
            matmul.allow_tf32 = saved


@pytest.mark.parametrize("bad,exc,msg", VALIDATION_CASES)
def test_chunk_kda_validation(bad, exc, msg):
    from k3cli.ops.kda import chunk_kda
    q, k, v, g, beta, h0 = make_inputs(1, 8, 2, 1, 16, 16)
    kw = {"initial_state": h0}
    if bad.get("k") == "short":
        k = k[:, :4]
    if bad.get("v") == "badB":
        v = torch.cat([v, v])
    if bad.get("v") == "HV3":
        v = torch.randn(1, 8, 3, 16)
    if bad.get("g") == "shape":
        g = g[..., :8]
    if bad.get("beta") == "shape":
        beta = beta[..., None]
    if bad.get("q") == "int":
        q = q.long()
    if bad.get("q") == "list":
        q = q.tolist()
    if bad.get("k") == "fp16":
        k = k.half()
    if bad.get("h0") == "fp16":
        kw["initial_state"] = h0.half()
    if bad.get("h0") == "shape":
        kw["initial_state"] = h0[:, :, :8]
    if "lower_bound" in bad:
        kw["lower_bound"] = bad["lower_bound"]
    if "chunk_size" in bad:
        kw["chunk_size"] = bad["chunk_size"]
    if bad.get("gate") == "noA":
        kw["use_gate_in_kernel"] = True
    with pytest.raises(exc, match=msg):
        chunk_kda(q, k, v, g, beta, **kw)


# ---------------------------------------------------------------- fused gate
# (B, T, HV, K, chunk, cumsum, bias, dtype, lower_bound: None is the softplus gate)
GATE_CASES = [
    pytest.param(2, 70, 3, 24, 16, True, True, torch.float32, -5.0, id="T70-K24-C16-cumsum"),
    pytest.param(1, 1, 1, 16, 64, True, True, torch.float32, -5.0, id="T1"),
    pytest.param(1, 100, 2, 16, 64, False, True, torch.float32, -5.0, id="T100-nocumsum"),
    pytest.param(1, 33, 2, 8, 64, True, False, torch.float16, -5.0, id="T33-nobias-fp16"),
    pytest.param(2, 70, 3, 24, 16, True, True, torch.float32, None, id="softplus-T70-K24-C16-cumsum"),
    pytest.param(1, 1, 1, 16, 64, False, True, torch.float32, None, id="softplus-T1-nocumsum"),
    pytest.param(1, 33, 2, 8, 64, True, False, torch.float16, None, id="softplus-T33-nobias-fp16"),
]


@needs_triton
@pytest.mark.parametrize("B,T,HV,K,C,cumsum,bias,dtype,bound", GATE_CASES)
def test_kda_gate_matches_torch(B, T, HV, K, C, cumsum, bias, dtype, bound):
    from k3cli.ops.kda import kda_gate
    gen = torch.Generator().manual_seed(0)
    g_raw = (torch.randn(B, T, HV, K, generator=gen) * 2).to(DEVICE, dtype).requires_grad_()
    A_log = torch.randn(HV, generator=gen).to(DEVICE).requires_grad_()
    dt_bias = torch.randn(HV, K, generator=gen).to(DEVICE).requires_grad_() if bias else None
    leaves = [g_raw, A_log] + ([dt_bias] if bias else [])
    ref = naive_kda_gate(g_raw.float(), A_log, dt_bias, bound)
    ref = chunk_local_cumsum(ref, C) if cumsum else ref
    out = kda_gate(g_raw, A_log, dt_bias, lower_bound=bound, chunk_size=C, cumsum=cumsum)
    assert out.dtype == torch.float32
    assert_close("o", out, ref, tol=1e-5)
    do = torch.randn(ref.shape, generator=gen).to(DEVICE)
    g_ref = torch.autograd.grad((ref * do).sum(), leaves)
    g_out = torch.autograd.grad((out * do).sum(), leaves)
    for name, x, r in zip(("dg_raw", "dA_log", "ddt_bias"), g_out, g_ref):
        assert_close(name, x, r, tol=1e-3 if dtype == torch.float16 else 1e-5)


def test_kda_gate_validation():
    from k3cli.ops.kda import kda_gate
    g_raw = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(g_raw, torch.zeros(3))
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(g_raw, torch.zeros(2), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(g_raw, torch.zeros(2), lower_bound=-7.0)


# ---------------------------------------------------------------- GPU tier: bf16, full sizes
# (B, T, H, G, K=V)
GPU_CASES = [
    pytest.param(2, 63, 1, 1, 16, id="T63-H1-K16"),
    pytest.param(2, 1000, 4, 2, 64, id="T1000-H4-G2-K64"),
    pytest.param(2, 2048, 16, 1, 128, id="T2048-H16-K128"),
    pytest.param(2, 1000, 16, 2, 128, id="T1000-H16-G2-K128"),
    pytest.param(3, 2048, 4, 1, 64, id="T2048-H4-K64"),
    pytest.param(2, 63, 4, 2, 128, id="T63-H4-G2-K128"),
    pytest.param(2, 1000, 1, 2, 16, id="T1000-H1-G2-K16"),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,T,H,G,K", GPU_CASES)
def test_chunk_kda_bf16_gpu(B, T, H, G, K):
    check_against_recurrent(make_inputs(B, T, H, G, K, K, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,T,H,G,K", GPU_CASES[2:])
def test_chunk_kda_unbounded_decay_bf16_gpu(B, T, H, G, K):
    """lower_bound=None (the softplus gate's path) in bf16, steps down to -40, within the same table."""
    check_against_recurrent(make_inputs(B, T, H, G, K, K, dtype=torch.bfloat16, device="cuda", gate_scale=40.0),
                            lower_bound=None)


@pytest.mark.gpu
@gpu
def test_chunk_kda_fp32_gpu_is_fp32_accurate():
    """fp32 inputs get fp32-accurate dots (tf32x3, chunk.plan): against the fp32 recurrence at 1e-4
    (plain TF32 moved a whole fp32 model 2.9e-3 to 1.4e-2, scaled max, from its exact-fp32 decode)."""
    check_against_recurrent(make_inputs(2, 300, 4, 2, 128, 128, dtype=torch.float32, device="cuda"), tol=1e-4)


@pytest.mark.gpu
@gpu
def test_chunk_kda_long_memory_gpu():
    """The carried state across chunk ranges on a GPU, where the ranges' scans run on a side stream: fp32, a
    slow gate, against the fp32 recurrence at the GPU tier's fp32 tolerance."""
    from functools import partial
    check_against_recurrent(make_inputs(1, 1500, 2, 2, 64, 64, dtype=torch.float32, device="cuda", gate_scale=0.01),
                            tol=1e-4, fn=partial(run_plan, {"ranges": 5}))


@pytest.mark.gpu
@gpu
def test_chunk_kda_ranged_forward_gpu_is_exact():
    """The ranged forward (stage 1 on the current stream, each range's scan on a high-priority side stream
    after that range's event): the same kernels, the state carried through fp32 buffers, so the outputs and
    the gradients must equal the one-range run exactly (a missing stream wait shows as a mismatch)."""
    from functools import partial

    from k3cli.ops.kda import chunk_kda
    from k3cli.ops.kda.chunk import plan
    inputs = make_inputs(1, 4000, 4, 2, 128, 128, dtype=torch.bfloat16, device="cuda")
    assert plan(1, 4000, 8, 128, 128, 64, torch.bfloat16, True).ranges == 4   # chunk_kda runs 4 ranges here
    base = run_with_grads(partial(run_plan, {"ranges": 0}), *inputs)
    for fn in (partial(run_plan, {"ranges": 2}), partial(run_plan, {"ranges": 5}), chunk_kda):
        out = run_with_grads(fn, *inputs)
        for name in base:
            assert torch.equal(out[name], base[name]), f"{fn}: {name} differs"


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of x whose data pointer is one element past a 16-byte boundary."""
    buf = torch.empty(x.numel() + 1, device=x.device, dtype=x.dtype)
    out = buf[1:].view(x.shape)
    out.copy_(x)
    assert out.data_ptr() % 16 != 0
    return out


@pytest.mark.gpu
@gpu
def test_chunk_kda_fast_launch_gpu_is_exact():
    """k3cli/ops/launch.py: launches after the first call the cached compiled kernels
    directly. Outputs and gradients must equal Triton's own launch path exactly, on the call that fills the
    cache and on the ones that hit it, for shapes that change the specialisation (T = 1, T not a multiple of
    the chunk, GVA, K = 16 / 64 / 128, the 4-range forward) and for misaligned inputs, which Triton compiles
    without the 16-byte alignment hint (a cache keyed too coarsely would run the aligned kernel on them)."""
    from k3cli.ops import launch
    from k3cli.ops.kda import chunk_fwd, chunk_kda
    try:
        cases = [(2, 1, 2, 2, 64), (2, 63, 4, 2, 128), (3, 2048, 4, 1, 64), (1, 4000, 4, 2, 128), (2, 1000, 1, 2, 16)]
        for B, T, H, G, K in cases:
            inputs = make_inputs(B, T, H, G, K, K, dtype=torch.bfloat16, device="cuda")
            launch.configure(False)
            base = run_with_grads(chunk_kda, *inputs)
            launch.configure(True)
            for rep in range(3):   # the first fills the launch cache (or finds it filled), the others hit it
                out = run_with_grads(chunk_kda, *inputs)
                for name in base:
                    assert torch.equal(out[name], base[name]), f"{(B, T, H, G, K)} call {rep}: {name} differs"
            # the same values through misaligned input pointers, against Triton's path on those pointers
            odd = [_misaligned(x) if x is not None and x.dtype == torch.bfloat16 else x for x in inputs]
            results = []
            for fast in (False, True, True):
                launch.configure(fast)
                leaves = [x.detach().requires_grad_(True) for x in odd[:5]]
                o, ht = chunk_kda(*leaves, initial_state=odd[5], output_final_state=True)
                results.append((o, ht, *torch.autograd.grad((o.float() ** 2).sum() + ht.sum(), leaves)))
            for fast_res in results[1:]:
                for a, b in zip(results[0], fast_res):
                    assert torch.equal(a, b), f"{(B, T, H, G, K)} misaligned inputs differ"
        assert launch.configure(True), "a launch hook is set: the fast path is off"
        cached = [k for k in vars(chunk_fwd).values() if isinstance(k, launch.FastLaunch) and k.launches]
        assert cached, "no launch was cached: the fast path never ran"
    finally:
        launch.configure(True)


@pytest.mark.gpu
@gpu
def test_chunk_kda_causality_bf16_gpu():
    """Perturbing tokens after t leaves outputs at <= t bit-identical (bf16, K=128, GVA); t inside
    sub-chunk 0, at and past a chunk end, and mid-way through later 16-row sub-chunks."""
    from k3cli.ops.kda import chunk_kda
    q, k, v, g, beta, h0 = make_inputs(2, 300, 4, 2, 128, 128, dtype=torch.bfloat16, device="cuda")
    o, _ = chunk_kda(q, k, v, g, beta, initial_state=h0)
    for t in (0, 20, 40, 63, 64, 200):
        q2, k2, v2, b2 = _perturb_after(t, q, k, v, beta)
        g2 = g.clone()
        g2[:, t + 1:] = -4.0 * torch.rand_like(g2[:, t + 1:])
        o2, _ = chunk_kda(q2, k2, v2, g2, b2, initial_state=h0)
        assert torch.equal(o[:, :t + 1], o2[:, :t + 1]), f"output at <= {t} changed"


@pytest.mark.gpu
@gpu
def test_chunk_kda_batch_invariance_bf16_gpu():
    from k3cli.ops.kda import chunk_kda
    q, k, v, g, beta, h0 = make_inputs(4, 1000, 4, 2, 128, 128, dtype=torch.bfloat16, device="cuda")
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o1, ht1 = chunk_kda(q[2:3], k[2:3], v[2:3], g[2:3], beta[2:3], initial_state=h0[2:3],
                        output_final_state=True)
    assert_close("o", o1, o[2:3])
    assert_close("ht", ht1, ht[2:3])


@needs_triton
def test_prune_state_configs_narrow_blocks_with_16bit_operands_need_kd_t(monkeypatch):
    """With 16-bit scan operands on a GPU, BV 32 / 16 configs stay only when the scan reads K_d^T as a tile
    (the forward scan); TF32 operands keep every width; BV is clamped to the padded value width."""
    from k3cli.ops.kda import chunk_fwd

    monkeypatch.setattr(chunk_fwd, "interpreting", lambda x=None: False)
    two = {n: torch.empty(1, dtype=torch.bfloat16) for n in ("w", "kd", "qg", "aqk")}
    base = {"V": 128, "BK": 128, "BT": 64, **two}

    def widths(**named):
        return sorted({c.kwargs["BV"] for c in chunk_fwd.prune_state_configs(chunk_fwd.STATE_CONFIGS, {**base, **named})})

    assert widths(PREC="bf16", KD_T=False) == [64]
    assert widths(PREC="bf16", KD_T=True) == [16, 32, 64]
    assert widths(PREC="tf32", KD_T=False) == [16, 32, 64]
    assert widths(PREC="bf16", KD_T=True, V=16) == [16]
    # 2-stage configs are kept where two stages of 2-byte [BT, BK] tiles fit in shared memory
    kept = chunk_fwd.prune_state_configs(chunk_fwd.STATE_CONFIGS, {**base, "PREC": "bf16", "KD_T": True})
    assert any(c.num_stages == 2 and c.kwargs["BV"] == 16 and c.num_warps == 4 for c in kept)
