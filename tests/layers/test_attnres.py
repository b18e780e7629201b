"""AttnRes mixer: block S=1 == full, two-phase == naive, partial blocks, norms (docs/math.md §5, §7.6).

The torch references themselves are tested in tests/ops/test_attnres.py; the zero-init == off
identity runs on whole CausalLMs in tests/models/test_causal_lm.py.
"""
import os

import pytest
import torch

from k3cli.layers.attnres import AttnResMixer, wants_kernels
from k3cli.layers.norm import RMSNorm, rms_norm
from k3cli.ops.attnres.naive import naive_attnres
from k3cli.ops.attnres.verify import MIXER_TOL
from k3cli.testing import assert_close

D = 12


def make_sublayers(n: int, seed: int = 0, dtype=torch.float64, device="cpu") -> list:
    """n small nonlinear sublayers with their own weights (stand-ins for attn / ffn)."""
    gen = torch.Generator().manual_seed(seed)
    ws = [(torch.randn(D, D, generator=gen, dtype=torch.float64) / D ** 0.5).to(device, dtype) for _ in range(n)]
    return [lambda h, w=w: torch.tanh(rms_norm(h, None, 0.0) @ w) * 3.0 for w in ws]


def make_mixer(N, mode, S=2, impl="two_phase", random_init=True, seed=1):
    m = AttnResMixer(D, N, mode, S, eps=1e-6, impl=impl).double()
    if random_init:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return m


def run(mixer, emb, subs):
    mixer.zero_grad()
    emb = emb.detach().clone().requires_grad_(True)
    y = mixer(emb, subs)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=y.dtype).to(y.device))
    return y.detach(), {"emb": emb.grad, **{n: p.grad.clone() for n, p in mixer.named_parameters()}}


# (id, N sublayers, S)
BLOCK_CASES = [
    ("N6_S2", 6, 2),
    ("N6_S3", 6, 3),
    ("N6_S4_partial_last", 6, 4),
    ("N5_S2_partial_last", 5, 2),
    ("N4_S4_one_block", 4, 4),
    ("N3_S8_block_larger_than_N", 3, 8),
    ("N1_S1", 1, 1),
]


@pytest.mark.parametrize("N,S", [c[1:] for c in BLOCK_CASES], ids=[c[0] for c in BLOCK_CASES])
def test_block_two_phase_equals_naive(N, S):
    emb = torch.randn(2, 5, D, dtype=torch.float64)
    subs = make_sublayers(N)
    y_ref, g_ref = run(make_mixer(N, "block", S, impl="naive"), emb, subs)
    y, g = run(make_mixer(N, "block", S, impl="two_phase"), emb, subs)
    assert_close("y", y, y_ref, MIXER_TOL["fp64"])
    for name in g_ref:
        assert_close(f"d{name}", g[name], g_ref[name], MIXER_TOL["fp64"])


@pytest.mark.parametrize("impl", ["naive", "two_phase"])
@pytest.mark.parametrize("N", [1, 4, 7])
def test_block_S1_equals_full(N, impl):
    emb = torch.randn(2, 3, D, dtype=torch.float64)
    subs = make_sublayers(N)
    y_ref, g_ref = run(make_mixer(N, "full"), emb, subs)
    y, g = run(make_mixer(N, "block", 1, impl=impl), emb, subs)
    assert_close("y", y, y_ref, MIXER_TOL["fp64"])
    for name in g_ref:
        assert_close(f"d{name}", g[name], g_ref[name], MIXER_TOL["fp64"])


def test_full_mixer_equals_hand_loop():
    N = 4
    emb = torch.randn(2, 3, D, dtype=torch.float64)
    subs = make_sublayers(N)
    mixer = make_mixer(N, "full")
    sources = [emb]
    for l, f in enumerate(subs):
        sources.append(f(naive_attnres(torch.stack(sources), mixer.query[l], mixer.gain[l])))
    ref = naive_attnres(torch.stack(sources), mixer.out_query, mixer.out_gain)
    assert_close("y", mixer(emb, subs), ref, MIXER_TOL["fp64"])


def test_block_differs_from_full_when_S_gt_1():
    emb = torch.randn(1, 3, D, dtype=torch.float64)
    subs = make_sublayers(4)
    assert not torch.allclose(make_mixer(4, "full")(emb, subs), make_mixer(4, "block", 2)(emb, subs))


@pytest.mark.parametrize("mode,S", [("full", 1), ("block", 2), ("block", 3)], ids=["full", "block2", "block3"])
def test_zero_init_is_scaled_residual_sum(mode, S):
    # uniform weights: every sublayer input is the plain residual sum divided by the source count
    N = 5
    emb = torch.randn(2, 3, D, dtype=torch.float64)
    subs = make_sublayers(N)
    mixer = make_mixer(N, mode, S, random_init=False)
    y = mixer(emb, subs)
    x = emb
    for f in subs:
        x = x + f(x)  # the sublayers RMS-normalise first (eps 0), so the scale does not matter
    n_src = N + 1 if mode == "full" else 1 + -(-N // S)
    assert_close("y", y, x / n_src, MIXER_TOL["fp64"])


def test_queries_get_gradients_from_zero_init():
    mixer = make_mixer(4, "block", 2, random_init=False)
    mixer(torch.randn(1, 3, D, dtype=torch.float64), make_sublayers(4)).pow(2).sum().backward()
    assert mixer.query.grad[1:].abs().sum() > 0 and mixer.out_query.grad.abs().sum() > 0


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="unknown AttnRes mode 'half'"):
        AttnResMixer(D, 4, "half")
    with pytest.raises(ValueError, match="built for 4 sublayers, got 3"):
        AttnResMixer(D, 4, "full")(torch.zeros(1, 1, D), make_sublayers(3))


# (id, mode, N, S)
FUSED_CASES = [("full_N6", "full", 6, 1), ("block_N6_S2", "block", 6, 2), ("block_N7_S3_partial", "block", 7, 3),
               # 32 sources in the final mix (the kernels' limit); S = 1 and S = 4 with a partial last block
               ("full_N31_32_sources", "full", 31, 1), ("block_N8_S1", "block", 8, 1),
               ("block_N10_S4_partial", "block", 10, 4)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode,N,S", [c[1:] for c in FUSED_CASES], ids=[c[0] for c in FUSED_CASES])
def test_fused_impl_equals_torch(mode, N, S):
    _check_fused_impl(mode, N, S, "cuda", T=33)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter tier (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("mode,N,S", [c[1:] for c in FUSED_CASES], ids=[c[0] for c in FUSED_CASES])
def test_fused_impl_equals_torch_interpreter(mode, N, S):
    _check_fused_impl(mode, N, S, "cpu", T=5)


def _check_fused_impl(mode, N, S, device, T):
    # seeded like every other input here: drawn from the global RNG the inputs changed with test order, and
    # some draws make the 31-sublayer stack ill-conditioned in fp32 (both implementations then sit far from
    # fp64, and 2.5e-4 apart from each other)
    emb = torch.randn(2, T, D, generator=torch.Generator().manual_seed(0)).to(device)
    subs = make_sublayers(N, dtype=torch.float32, device=device)
    y_ref, g_ref = run(make_mixer(N, mode, S, impl="two_phase").float().to(device), emb, subs)
    y, g = run(make_mixer(N, mode, S, impl="fused").float().to(device), emb, subs)
    assert_close("y", y, y_ref, MIXER_TOL["fused"])
    for name in g_ref:
        assert_close(f"d{name}", g[name], g_ref[name], MIXER_TOL["fused"])


def make_cores(n: int, seed: int = 0, dtype=torch.float64, device="cpu") -> list:
    """Sublayer stand-ins without an input normalisation of their own (so the mixer's norm gains
    and eps show in every output and gradient)."""
    gen = torch.Generator().manual_seed(seed)
    ws = [(torch.randn(D, D, generator=gen, dtype=torch.float64) / D ** 0.5).to(device, dtype) for _ in range(n)]
    return [lambda h, w=w: torch.tanh(h @ w) * 3.0 for w in ws]


def _norms(N, seed=3, dtype=torch.float64, device="cpu"):
    """N RMSNorms with random gains (so a wrong or missing gain shows)."""
    gen = torch.Generator().manual_seed(seed)
    norms = [RMSNorm(D, eps=1e-6).to(device, dtype) for _ in range(N + 1)]
    with torch.no_grad():
        for n in norms:
            n.weight.copy_(1 + 0.5 * torch.randn(D, generator=gen, dtype=torch.float64))
    return norms[:N], norms[N]


def _run_with_norms(mixer, emb, cores, norms, final):
    """Gradients of the mixer's parameters, emb and every norm gain."""
    for n in norms + [final]:
        n.zero_grad()
    y, grads = run_fn(lambda e: mixer(e, cores, norms=norms, final_norm=final), mixer, emb)
    for i, n in enumerate(norms + [final]):
        grads[f"norm{i}"] = n.weight.grad.clone()
    return y, grads


def run_fn(fn, mixer, emb):
    mixer.zero_grad()
    emb = emb.detach().clone().requires_grad_(True)
    y = fn(emb)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=y.dtype).to(y.device))
    return y.detach(), {"emb": emb.grad, **{n: p.grad.clone() for n, p in mixer.named_parameters()}}


@pytest.mark.parametrize("mode,N,S,impl", [("full", 5, 1, "two_phase"), ("block", 7, 3, "two_phase"),
                                           ("block", 6, 2, "naive")])
def test_mixer_applied_norms_equal_sublayers_own_norms(mode, N, S, impl):
    # norms=[...] (the model's path: the mixer normalises, fused on CUDA) is the same function as
    # sublayers that normalise their own input, and the final_norm the same as norming the output
    cores = make_cores(N)
    norms, final = _norms(N)
    own = [lambda h, f=f, n=n: f(n(h)) for f, n in zip(cores, norms)]
    emb = torch.randn(2, 5, D, dtype=torch.float64)
    mixer = make_mixer(N, mode, S, impl=impl)
    y_ref, g_ref = run_fn(lambda e: final(mixer(e, own)), mixer, emb)
    for i, n in enumerate(norms + [final]):
        g_ref[f"norm{i}"] = n.weight.grad.clone()
    y, g = _run_with_norms(mixer, emb, cores, norms, final)
    assert_close("y", y, y_ref, MIXER_TOL["fp64"])
    for name in g_ref:
        assert_close(f"d{name}", g[name], g_ref[name], MIXER_TOL["fp64"])


NORM_FUSED_CASES = [("full", 5, 1), ("block", 7, 3), ("block", 4, 2)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode,N,S", NORM_FUSED_CASES)
def test_fused_norms_equal_torch_cuda(mode, N, S):
    _check_fused_norms(mode, N, S, "cuda", T=33)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter tier (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("mode,N,S", NORM_FUSED_CASES)
def test_fused_norms_equal_torch_interpreter(mode, N, S):
    _check_fused_norms(mode, N, S, "cpu", T=3)


def _check_fused_norms(mode, N, S, device, T):
    # the fused pre-norm (merge / full kernel with norm_weight) against the torch mixer, fp32
    cores = make_cores(N, dtype=torch.float32, device=device)
    emb = torch.randn(2, T, D, device=device)
    out = []
    for impl in ("two_phase", "fused"):
        norms, final = _norms(N, dtype=torch.float32, device=device)
        out.append(_run_with_norms(make_mixer(N, mode, S, impl=impl).float().to(device), emb, cores, norms, final))
    (y_ref, g_ref), (y, g) = out
    assert_close("y", y, y_ref, MIXER_TOL["fused"])
    for name in g_ref:
        assert_close(f"d{name}", g[name], g_ref[name], MIXER_TOL["fused"])


def test_auto_impl_runs_block_in_torch_under_compile():
    """`auto`: the Triton kernels on CUDA, except block mode inside torch.compile (Inductor fuses the torch
    two-phase form); full mode keeps its kernel when compiled; the explicit impls ignore the context."""
    assert wants_kernels("auto", "block", cuda=True, compiling=False)
    assert not wants_kernels("auto", "block", cuda=True, compiling=True)
    assert wants_kernels("auto", "full", cuda=True, compiling=True)
    assert not wants_kernels("auto", "full", cuda=False, compiling=False)
    assert wants_kernels("fused", "block", cuda=True, compiling=True)
    assert wants_kernels("fused", "block", cuda=False, compiling=False)
    assert not any(wants_kernels(impl, "block", cuda=True, compiling=False) for impl in ("naive", "two_phase"))


def test_mixer_asks_whether_it_is_being_compiled(monkeypatch):
    """The mixer passes torch.compile's state to `wants_kernels`: True while traced, False when run eagerly."""
    import k3cli.layers.attnres as attnres
    seen = []

    def spy(impl, mode, cuda, compiling):
        seen.append(compiling)
        return False
    monkeypatch.setattr(attnres, "wants_kernels", spy)
    mixer, emb, subs = make_mixer(3, "block"), torch.randn(2, 3, D, dtype=torch.float64), make_sublayers(3)
    torch._dynamo.reset()
    torch.compile(lambda e: mixer(e, subs), backend="eager", fullgraph=True)(emb)
    mixer(emb, subs)
    assert seen == [True, False]
