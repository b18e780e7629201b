"""AttnRes kernels against the torch references (docs/math.md §5, §7.6).

CPU tier: torch references always; Triton kernels under TRITON_INTERPRET=1 (tiny shapes, fp32/fp16:
the interpreter is wrong for bf16). GPU tier (@pytest.mark.gpu): bf16 full-size shapes.
Tolerances: the one table in k3cli/ops/attnres/verify.py (`tolerance(name, dtype)`, MIXER_TOL).
"""

import pytest
import torch

from k3cli.ops.attnres import (
    attnres_merge,
    attnres_phase1,
    fused_attnres,
    naive_attnres,
    naive_attnres_block,
    naive_attnres_merge,
    naive_attnres_phase1,
)
from k3cli.ops.attnres.verify import (
    MIXER_TOL,
    compare,
    make_inputs,
    rounded,
    run_block,
    run_full,
    tolerance,
    verify_attnres,
)
from k3cli.testing import assert_close, relative_rms_error

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.triton
gpu = pytest.mark.gpu


def assert_rows(rows):
    bad = [f"{n}: rel RMS {e:.3g} > {t:.3g}" for n, e, _, t, ok in rows if not ok]
    assert not bad, "; ".join(bad)


# ---------------------------------------------------------------- torch references (fp64 identities)
def test_naive_weights_sum_to_one():
    srcs, _, q, g, _ = make_inputs(6, 2, 5, 48, seed=1)
    h, alpha = naive_attnres(srcs, q[0], g[0], return_weights=True)
    assert_close("alpha_sum", alpha.sum(0), torch.ones_like(alpha[0]), MIXER_TOL["fp64"])
    assert (alpha > 0).all()
    assert alpha.std() > 0.05, "scores should be far from uniform in this fixture"
    assert_close("h", h, torch.einsum("nbt,nbtd->btd", alpha, torch.stack(srcs)), MIXER_TOL["fp64"])


def test_naive_scores_use_rms_of_sources_not_values():
    # scaling one source scales its value but not its score
    gen = torch.Generator().manual_seed(4)
    sources = torch.randn(3, 1, 2, 12, generator=gen, dtype=torch.float64)
    q, g = torch.randn(12, generator=gen, dtype=torch.float64), torch.ones(12, dtype=torch.float64)
    _, a1 = naive_attnres(sources, q, g, eps=0.0, return_weights=True)
    sources[1] *= 10
    _, a2 = naive_attnres(sources, q, g, eps=0.0, return_weights=True)
    assert_close("alpha", a2, a1, MIXER_TOL["fp64"])


@pytest.mark.parametrize("n,S,D", [pytest.param(1, 1, 48, id="n1-S1"), pytest.param(3, 2, 100, id="n3-S2-D100"),
                                   pytest.param(7, 4, 64, id="n7-S4")])
def test_naive_two_phase_equals_one_softmax_fp64(n, S, D):
    srcs, partial, q, g, _ = make_inputs(n, 2, 7, D, S, seed=2)
    m, l, o = naive_attnres_phase1(srcs, q, g)
    for r in range(S):
        for p in (None, partial):
            h = naive_attnres_merge(m[r], l[r], o[r], p, q[r], g[r])
            assert_close(f"h{r}", h, naive_attnres_block(srcs, p, q[r], g[r]), MIXER_TOL["fp64"])


def test_naive_zero_query_is_uniform_average():
    srcs, _, q, g, _ = make_inputs(4, 1, 3, 32, seed=3)
    h = naive_attnres(srcs, torch.zeros_like(q[0]), g[0], eps=0.0)
    assert_close("h", h, torch.stack(srcs).mean(0), MIXER_TOL["fp64"])


# ---------------------------------------------------------------- Triton, full form
# (n sources, B, T, D, fused output norm, stacked buffer instead of a pointer table)
FULL_CASES = [
    pytest.param(1, 1, 5, 48, False, False, id="n1-D48"),
    pytest.param(2, 2, 9, 100, True, False, id="n2-D100-norm"),
    pytest.param(5, 2, 9, 100, True, True, id="n5-D100-norm-stacked"),
    pytest.param(7, 1, 1, 64, False, True, id="n7-T1-stacked"),
    pytest.param(11, 1, 17, 33, True, False, id="n11-T17-D33-norm"),
    pytest.param(32, 1, 6, 48, True, False, id="n32-D48-norm"),
]


@needs_triton
@pytest.mark.parametrize("n,B,T,D,norm,stacked", FULL_CASES)
def test_fused_full_matches_naive(n, B, T, D, norm, stacked):
    inputs = make_inputs(n, B, T, D, seed=n + D, device=DEVICE)
    got = run_full("triton", inputs, torch.float32, stacked=stacked, norm=norm)
    ref = run_full("naive", inputs, torch.float64, stacked=stacked, norm=norm)
    assert set(ref) <= set(got)
    assert_rows(compare(got, ref, torch.float32))


@needs_triton
@pytest.mark.parametrize("form", ["full", "block"])
def test_fp16_matches_naive(form):
    inputs = rounded(make_inputs(6, 2, 9, 100, S=3, seed=4, device=DEVICE), torch.float16)
    run = run_full if form == "full" else run_block
    assert_rows(compare(run("triton", inputs, torch.float16), run("naive", inputs, torch.float64),
                        torch.float16))


@needs_triton
@pytest.mark.parametrize("used", ["y-only", "h-only"])
def test_fused_norm_one_output_used(used):
    """Only one of (h, y) reaches the loss: the other gradient is None in backward."""
    srcs, _, q, g, nw = make_inputs(4, 1, 8, 48, seed=5, device=DEVICE)
    grads = []
    for fn, dt in ((fused_attnres, torch.float32), (naive_attnres, torch.float64)):
        xs = [s.to(dt).requires_grad_(True) for s in srcs]
        qq, gg, ww = (t.to(dt).requires_grad_(True) for t in (q[0], g[0], nw))
        h, y = fn(xs, qq, gg, 1e-6, norm_weight=ww)
        (y if used == "y-only" else h).pow(2).sum().backward()
        grads.append([*(x.grad for x in xs), qq.grad, gg.grad,
                      ww.grad if ww.grad is not None else torch.zeros_like(ww)])
    for i, (a, b) in enumerate(zip(*grads)):
        name = f"dsrc{i}" if i < len(srcs) else ("dquery", "dgain", "dnorm")[i - len(srcs)]
        assert_close(name, a, b, tolerance(name), relative_rms_error)


@needs_triton
def test_fused_weights_sum_to_one():
    """Identical sources: any weights that sum to 1 return the source itself."""
    v = make_inputs(1, 2, 5, 100, seed=6, device=DEVICE)[0][0].float()
    q = torch.randn(100, device=DEVICE)
    h = fused_attnres([v, v.clone(), v.clone()], q, torch.ones(100, device=DEVICE))
    torch.testing.assert_close(h, v, rtol=2e-6, atol=2e-6)


@needs_triton
def test_fused_zero_query_is_uniform_average():
    srcs = [s.float() for s in make_inputs(5, 1, 4, 48, seed=7, device=DEVICE)[0]]
    h = fused_attnres(srcs, torch.zeros(48, device=DEVICE), torch.ones(48, device=DEVICE), eps=0.0)
    torch.testing.assert_close(h, torch.stack(srcs).mean(0), rtol=2e-6, atol=2e-6)


@needs_triton
def test_list_and_stacked_agree():
    srcs = [s.float() for s in make_inputs(4, 2, 5, 48, seed=8, device=DEVICE)[0]]
    q, g = torch.randn(48, device=DEVICE) * 0.3, torch.ones(48, device=DEVICE)
    torch.testing.assert_close(fused_attnres(srcs, q, g), fused_attnres(torch.stack(srcs), q, g), rtol=0, atol=0)


@needs_triton
def test_strided_queries_and_w_tilde_rows():
    # the kernels index w̃ rows as i·D + d: a strided query (gain None: query is w̃) or a transposed
    # [S, D] query block must still give the naive result (review finding: it did not before)
    srcs = [s.float() for s in make_inputs(3, 1, 4, 48, seed=9, device=DEVICE)[0]]
    big = torch.randn(96, device=DEVICE)
    ref = naive_attnres(srcs, big[::2].clone(), torch.ones(48, device=DEVICE))
    torch.testing.assert_close(fused_attnres(srcs, big[::2], None), ref, rtol=1e-5, atol=1e-5)
    qt = torch.randn(48, 2, device=DEVICE).T          # [2, 48], not contiguous
    gains = torch.rand(2, 48, device=DEVICE) + 0.5
    m, l, o = attnres_phase1(srcs, qt, gains)
    m_ref, l_ref, o_ref = naive_attnres_phase1(srcs, qt.contiguous(), gains)
    for got, want in ((m, m_ref), (l, l_ref), (o, o_ref)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_address_tables_are_reused_and_follow_the_pointers():
    """The pointer-table cache: the same sources give the same table; a table is keyed by the
    addresses alone, so sources freed and re-allocated at those addresses still read correctly."""
    from k3cli.ops.attnres.fused import address_table
    srcs = [s.float() for s in make_inputs(3, 1, 4, 16, seed=2, device=DEVICE)[0]]
    t1 = address_table(srcs)
    assert address_table(list(srcs)) is t1
    assert t1.tolist() == [s.data_ptr() for s in srcs]
    assert address_table(srcs[::-1]).tolist() == [s.data_ptr() for s in srcs[::-1]]
    q, g = torch.randn(16, device=DEVICE) * 0.5, torch.ones(16, device=DEVICE)
    for seed in range(3):   # new values each round; the allocator tends to hand back the same addresses
        fresh = [s.float() for s in make_inputs(3, 1, 4, 16, seed=10 + seed, device=DEVICE)[0]]
        assert_close("h", fused_attnres(fresh, q, g), naive_attnres(fresh, q, g), tolerance("h"), relative_rms_error)
        del fresh


# ---------------------------------------------------------------- Triton, block form (two-phase)
# (n completed sources, S queries, B, T, D, fused output norm, stacked)
BLOCK_CASES = [
    pytest.param(1, 1, 1, 5, 48, False, False, id="n1-S1"),
    pytest.param(2, 2, 2, 9, 48, True, False, id="n2-S2-norm"),
    pytest.param(3, 3, 2, 9, 100, True, True, id="n3-S3-D100-norm-stacked"),
    pytest.param(4, 4, 1, 13, 64, False, False, id="n4-S4-T13"),
    pytest.param(32, 2, 1, 6, 48, False, True, id="n32-S2-stacked"),
]


@needs_triton
@pytest.mark.parametrize("n,S,B,T,D,norm,stacked", BLOCK_CASES)
def test_two_phase_matches_naive(n, S, B, T, D, norm, stacked):
    inputs = make_inputs(n, B, T, D, S, seed=10 * n + S, device=DEVICE)
    got = run_block("triton", inputs, torch.float32, stacked=stacked, norm=norm)
    ref = run_block("naive", inputs, torch.float64, stacked=stacked, norm=norm)
    assert set(ref) <= set(got)
    assert_rows(compare(got, ref, torch.float32))


@needs_triton
@pytest.mark.parametrize("S", [1, 2, 3, 4])
def test_two_phase_equals_one_softmax(S):
    srcs, partial, q, g, _ = make_inputs(3, 2, 7, 100, S, seed=20 + S, device=DEVICE)
    f32 = [s.float() for s in srcs]
    m, l, o = attnres_phase1(f32, q.float(), g.float())
    for r in range(S):
        p = partial if r > 0 else None
        h = attnres_merge(m[r], l[r], o[r], None if p is None else p.float(), q[r].float(), g[r].float())
        assert_close(f"h{r}", h, naive_attnres_block(srcs, p, q[r], g[r]), tolerance("h"), relative_rms_error)


@needs_triton
def test_block_size_one_equals_full():
    srcs, _, q, g, nw = make_inputs(5, 1, 9, 48, seed=30, device=DEVICE)
    srcs, q, g, nw = [s.float() for s in srcs], q.float(), g.float(), nw.float()
    m, l, o = attnres_phase1(srcs, q, g)
    h, y = attnres_merge(m[0], l[0], o[0], None, q[0], g[0], norm_weight=nw)
    hf, yf = fused_attnres(srcs, q[0], g[0], norm_weight=nw)
    assert_close("h", h, hf, tolerance("h"), relative_rms_error)
    assert_close("y", y, yf, tolerance("y"), relative_rms_error)


def _block_stack(impl, emb, W, Q, G, S, eps=1e-6):
    """A tiny AttnRes-block model: N = len(W) sublayers v_l = tanh(h_l @ W_l), blocks of S (the last
    partial when N % S != 0), a final mix with query Q[N]. impl: 'triton' two-phase or 'naive'."""
    N = len(W)
    blocks = [emb]
    for start in range(0, N, S):
        stop = min(start + S, N)
        if impl == "triton":
            m, l, o = attnres_phase1(blocks, Q[start:stop], G[start:stop], eps)
        partial = None
        for r, j in enumerate(range(start, stop)):
            if impl == "triton":
                h = attnres_merge(m[r], l[r], o[r], partial, Q[j], G[j], eps, out_dtype=emb.dtype)
            else:
                h = naive_attnres_block(blocks, partial, Q[j], G[j], eps)
            v = torch.tanh(h @ W[j])
            partial = v if partial is None else partial + v
        blocks.append(partial)
    mix = fused_attnres if impl == "triton" else naive_attnres
    return mix(blocks, Q[N], G[N], eps)


@needs_triton
@pytest.mark.parametrize("N,S", [pytest.param(5, 2, id="N5-S2-partial-last"), pytest.param(4, 3, id="N4-S3"),
                                 pytest.param(3, 1, id="N3-S1")])
def test_block_stack_matches_naive(N, S):
    D = 48
    gen = torch.Generator().manual_seed(40 + N)
    emb = torch.randn(2, 6, D, generator=gen, dtype=torch.float64)
    W = torch.randn(N, D, D, generator=gen, dtype=torch.float64) / D ** 0.5
    Q = torch.randn(N + 1, D, generator=gen, dtype=torch.float64) / D ** 0.5
    G = 1 + 0.1 * torch.randn(N + 1, D, generator=gen, dtype=torch.float64)
    emb, W, Q, G = (t.to(DEVICE) for t in (emb, W, Q, G))
    res = []
    for impl, dt in (("triton", torch.float32), ("naive", torch.float64)):
        leaves = [t.to(dt).requires_grad_(True) for t in (emb, W, Q, G)]
        out = _block_stack(impl, *leaves, S=S)
        out.pow(2).sum().backward()
        res.append([out, *(t.grad for t in leaves)])
    for name, a, b in zip(("h", "dsrc", "dsrc", "dquery", "dgain"), *res):
        assert_close(name, a, b, tolerance(name), relative_rms_error)


# ---------------------------------------------------------------- validation
@needs_triton
def test_input_errors_name_the_argument():
    srcs = [torch.randn(1, 4, 48, device=DEVICE) for _ in range(3)]
    with pytest.raises(ValueError, match="query"):
        fused_attnres(srcs, torch.zeros(47, device=DEVICE), torch.ones(48, device=DEVICE))
    with pytest.raises(ValueError, match=r"sources\[1\]"):
        fused_attnres([srcs[0], torch.randn(1, 4, 32, device=DEVICE)], torch.zeros(48, device=DEVICE),
                      torch.ones(48, device=DEVICE))
    with pytest.raises(ValueError, match="sources: 33 sources"):
        fused_attnres([srcs[0]] * 33, torch.zeros(48, device=DEVICE), torch.ones(48, device=DEVICE))
    with pytest.raises(ValueError, match="gains"):
        attnres_phase1(srcs, torch.zeros(2, 48, device=DEVICE), torch.ones(3, 48, device=DEVICE))


@needs_triton
def test_verify_ci_rows_pass():
    """The CLI's `verify_attnres` on its CI shapes: every output and gradient row passes."""
    rows = verify_attnres("ci", torch.float32, device=DEVICE)
    assert {r[0].split("/")[-1] for r in rows} >= {"h", "y", "dquery", "dgain", "dnorm", "dsrc0", "dpartial"}
    assert_rows(rows)


# ---------------------------------------------------------------- GPU tier
@gpu
@pytest.mark.gpu
def test_gpu_bf16_full_size():
    assert_rows(verify_attnres("full", torch.bfloat16, device="cuda"))


@gpu
@pytest.mark.gpu
def test_gpu_fp32_full_size():
    assert_rows(verify_attnres("full", torch.float32, device="cuda"))
