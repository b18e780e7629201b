"""chunk_kda with cu_seqlens: N sequences flattened into one B = 1 row, each as if run alone (its own initial
and final state, every gradient), against chunk_kda on each sequence and the torch varlen reference.

Layouts cover T = 1, T off the chunk, a boundary exactly on a chunk edge, several chunks per sequence and GVA.
Under the interpreter (tiny shapes, fp32 and fp16); bf16 belongs to the GPU tier.
"""
import pytest
import torch

from k3cli.ops.kda import chunk_kda
from k3cli.ops.kda.chunk import chunk_kda_varlen_op
from k3cli.ops.kda.naive import naive_chunk_kda_varlen
from k3cli.ops.kda.torch_chunk import torch_chunk_kda_varlen
from k3cli.ops.kda.varlen import cu_seqlens_of
from k3cli.ops.kda.verify import TOL, rel_rms
from k3cli.testing import assert_close, kda_inputs

FP32_TOL = 2e-4   # chunk_kda's fp32 bound against the fp64 reference (tests/ops/test_extremes.py)
NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")
# (id, sequence lengths, chunk size, H, G)
LAYOUTS = [
    ("one-token", [1], 16, 1, 1),
    ("15-16-17", [15, 16, 17], 16, 1, 2),
    ("on-chunk-edges", [16, 32, 16], 16, 2, 1),
    ("mixed", [1, 15, 16, 17, 40], 16, 1, 2),
    ("chunk32", [3, 40, 33], 32, 1, 1),
]
LONG = ("long", [300, 5, 1], 16, 1, 1)


def cu_of(lens):
    return cu_seqlens_of(lens)


def run(fn, q, k, v, g, beta, h0, seed=7):
    """fn's outputs and the gradients of a fixed random cotangent of (o, final states)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, ht = fn(*leaves)
    gen = torch.Generator().manual_seed(seed)
    do, dht = torch.randn(o.shape, generator=gen).to(o), torch.randn(ht.shape, generator=gen).to(ht)
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (ht * dht).sum(), leaves)
    return dict(zip(NAMES, (o.detach(), ht.detach(), *grads)))


def varlen_inputs(lens, H, G, dtype, K=16, gate_scale=5.0):
    q, k, v, g, beta, _ = kda_inputs(1, sum(lens), H, G, K, K, dtype, "cpu", gate_scale=gate_scale)
    h0 = torch.randn(len(lens), H * G, K, K, generator=torch.Generator().manual_seed(3))
    return q, k, v, g, beta, h0


def check_layout(lens, C, H, G, dtype, lower_bound=-5.0):
    """lower_bound None: decay steps down to -40 (the pair-by-pair diagonal score blocks)."""
    cu = cu_of(lens)
    x = varlen_inputs(lens, H, G, dtype, gate_scale=5.0 if lower_bound is not None else 40.0)
    packed = run(lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=C,
                                      cu_seqlens=cu, lower_bound=lower_bound), *x)

    def alone(q, k, v, g, beta, h0):
        outs = [chunk_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=h0[i:i + 1],
                          output_final_state=True, chunk_size=C, lower_bound=lower_bound)
                for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))]
        return torch.cat([o for o, _ in outs], 1), torch.cat([s for _, s in outs])
    each = run(alone, *x)
    ref = run(lambda *a: naive_chunk_kda_varlen(*a[:5], cu, initial_state=a[5], output_final_state=True,
                                                chunk_size=C),
              *[t.double() for t in x])
    for name in NAMES:
        tol = FP32_TOL if dtype == torch.float32 else TOL[name]
        assert_close(f"{name} vs each sequence alone", packed[name], each[name], tol, rel_rms)
        assert_close(f"{name} vs the fp64 varlen reference", packed[name], ref[name], tol, rel_rms)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("lens,C,H,G", [pytest.param(*x[1:], id=x[0]) for x in LAYOUTS])
def test_chunk_kda_varlen_equals_each_sequence_alone(lens, C, H, G, dtype):
    check_layout(lens, C, H, G, dtype)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_chunk_kda_varlen_unbounded_decay_equals_each_sequence_alone(dtype):
    check_layout([1, 15, 16, 17, 40], 16, 1, 2, dtype, lower_bound=None)


@pytest.mark.triton
@pytest.mark.slow   # ~19 s in the interpreter
def test_chunk_kda_varlen_long_sequence():
    check_layout(*LONG[1:], torch.float32)


@pytest.mark.triton
def test_empty_sequences_pass_their_state_through():
    """cu_seqlens with repeated entries (empty sequences, as a fixed-capacity table ends): their final state is
    their initial state, their initial-state gradient the final-state gradient; the others are unaffected."""
    lens, C = [5, 0, 20, 0, 0], 16
    cu = cu_of(lens)
    x = varlen_inputs(lens, 1, 1, torch.float32)
    packed = run(lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=C,
                                      cu_seqlens=cu), *x)
    ref = run(lambda *a: naive_chunk_kda_varlen(*a[:5], cu, initial_state=a[5], output_final_state=True,
                                                chunk_size=C), *[t.double() for t in x])
    for name in NAMES:
        assert_close(name, packed[name], ref[name], FP32_TOL, rel_rms)
    assert torch.equal(packed["ht"][1], x[5][1]) and torch.equal(packed["ht"][4], x[5][4])


@pytest.mark.triton
def test_chunk_kda_varlen_without_states_and_with_the_gate():
    """No initial state, no final state, the in-kernel gate and L2 norm: still each sequence alone."""
    lens, C = [5, 20, 16], 16
    cu = cu_of(lens)
    q, k, v, g, beta, _ = varlen_inputs(lens, 1, 2, torch.float32)
    A_log, dt_bias = torch.randn(2), torch.randn(2, 16)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, chunk_size=C)
    o, ht = chunk_kda(q, k, v, g * 3, beta, cu_seqlens=cu, **kw)
    assert ht is None
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o1, _ = chunk_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b] * 3, beta[:, a:b], **kw)
        assert_close("o", o[:, a:b], o1, FP32_TOL, rel_rms)


@pytest.mark.triton
@pytest.mark.parametrize("states", [True, False], ids=["states", "no-states"])
def test_scans_split_over_launches_at_the_grid_limit(monkeypatch, states):
    """More sequences than one launch's grid z may hold (a packed batch has one cu_seqlens entry per token, so
    B·T sequences, most empty): the scans run as several launches, each from its first row of `seqs`. Here the
    limit is lowered to 2 so that 7 sequences (3 empty) take several launches: with states every sequence gets
    a program, without them (as in training) only the 4 with chunks do. Outputs, states, all gradients against
    the fp64 reference."""
    from k3cli.ops.kda import chunk_fwd
    monkeypatch.setattr(chunk_fwd, "MAX_GRID_Z", 2)
    assert chunk_fwd.seq_launches(7) == [(0, 2), (2, 2), (4, 2), (6, 1)]
    lens, C = [7, 0, 33, 0, 16, 1, 0], 16
    cu = cu_of(lens)
    x = varlen_inputs(lens, 1, 2, torch.float32)
    if states:
        packed = run(lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=C,
                                          cu_seqlens=cu), *x)
        ref = run(lambda *a: naive_chunk_kda_varlen(*a[:5], cu, initial_state=a[5], output_final_state=True,
                                                    chunk_size=C), *[t.double() for t in x])
    else:   # no h0 to differentiate: a zero "final state" keeps run()'s shape, h0 enters with weight 0
        packed = run(lambda *a: (chunk_kda(*a[:5], chunk_size=C, cu_seqlens=cu)[0], 0 * a[5]), *x)
        ref = run(lambda *a: (naive_chunk_kda_varlen(*a[:5], cu, chunk_size=C)[0], 0 * a[5]),
                  *[t.double() for t in x])
    for name in NAMES:
        assert_close(name, packed[name], ref[name], FP32_TOL, rel_rms)


@pytest.mark.parametrize("lens", [[1, 15, 17, 40], [7, 0, 33, 0]], ids=["mixed", "with-empty"])
def test_torch_varlen_matches_the_per_sequence_oracle_fp64(lens):
    """The op's CPU path and the model's CPU path (torch_chunk_kda on a zero-padded batch of the sequences)
    against naive_chunk_kda on each sequence alone, fp64: outputs, final states, all gradients."""
    C = 16
    cu = cu_of(lens)
    x = [t.double() for t in varlen_inputs(lens, 1, 2, torch.float32)]
    fast = run(lambda *a: torch_chunk_kda_varlen(*a[:5], cu, initial_state=a[5], output_final_state=True,
                                                 chunk_size=C), *x)
    ref = run(lambda *a: naive_chunk_kda_varlen(*a[:5], cu, initial_state=a[5], output_final_state=True,
                                                chunk_size=C), *x)
    for name in NAMES:
        assert_close(name, fast[name], ref[name], 1e-10, rel_rms)


@pytest.mark.triton
def test_varlen_custom_ops_pass_opcheck():
    lens, C = [3, 17], 16
    q, k, v, g, beta, h0 = varlen_inputs(lens, 1, 2, torch.float32)
    args = [x.requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    torch.library.opcheck(chunk_kda_varlen_op, (*args, cu_of(lens), 0.25, C, True))
    torch.library.opcheck(chunk_kda_varlen_op, (*args, cu_of(lens), 0.25, C, True, False, False))


def _bad(**over):
    lens = [3, 5]
    q, k, v, g, beta, h0 = varlen_inputs(lens, 1, 1, torch.float32)
    kw = dict(cu_seqlens=cu_of(lens), initial_state=h0, chunk_size=16)
    kw.update(over)
    if "B" in kw:
        q, k, v, g, beta = (torch.cat([x, x]) for x in (q, k, v, g, beta))
        kw.pop("B")
    return q, k, v, g, beta, kw


BAD = [
    ("float dtype", dict(cu_seqlens=torch.tensor([0.0, 3.0, 8.0])), "cu_seqlens dtype"),
    ("not a tensor", dict(cu_seqlens=[0, 3, 8]), "cu_seqlens must be a tensor"),
    ("2-D", dict(cu_seqlens=torch.tensor([[0, 3, 8]])), "cu_seqlens shape"),
    ("one entry", dict(cu_seqlens=torch.tensor([0])), "cu_seqlens shape"),
    ("not from 0", dict(cu_seqlens=torch.tensor([1, 3, 8])), "cu_seqlens must start at 0"),
    ("not to T", dict(cu_seqlens=torch.tensor([0, 3, 7])), "end at total_T"),
    ("decreasing", dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), "non-decreasing"),
    ("B = 2", dict(B=2), "B = 1"),
    ("initial_state per row", dict(initial_state=torch.zeros(1, 1, 16, 16)), "initial_state shape"),
]


@pytest.mark.parametrize("over,match", [pytest.param(o, m, id=i) for i, o, m in BAD])
def test_bad_cu_seqlens_is_one_value_error_naming_it(over, match):
    q, k, v, g, beta, kw = _bad(**over)
    with pytest.raises(ValueError, match=match) as e:
        chunk_kda(q, k, v, g, beta, **kw)
    assert "\n" not in str(e.value) and ("cu_seqlens" in str(e.value) or "initial_state" in str(e.value))


@pytest.mark.triton
def test_decode_step_batch_is_independent_sequences():
    """fused_recurrent_kda over a batch (the decode step of several packed documents' continuations): each
    row equals that row run alone from its own state, so decoding needs no cu_seqlens."""
    from k3cli.ops.kda import fused_recurrent_kda
    q, k, v, g, beta, h0 = kda_inputs(3, 2, 1, 2, 16, 16, torch.float32, "cpu")
    o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for b in range(3):
        o1, h1 = fused_recurrent_kda(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1],
                                     initial_state=h0[b:b + 1], output_final_state=True)
        assert torch.equal(o[b:b + 1], o1) and torch.equal(ht[b:b + 1], h1)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,H,K", [((1, 63, 64, 65, 1000, 3000, 7, 2048), 16, 128), ((5, 300, 129), 4, 64),
                                      ((2000, 1, 33), 8, 16)], ids=["H16-K128", "H4-K64", "H8-K16"])
def test_chunk_kda_varlen_bf16_gpu(lens, H, K):
    """bf16 on the GPU, several sequences in one row, against the fp32 per-sequence reference (the op's
    tolerance table): outputs, final states, every gradient."""
    cu = cu_of(lens)
    q, k, v, g, beta, _ = kda_inputs(1, sum(lens), H, 1, K, K, torch.bfloat16, "cuda")
    h0 = torch.randn(len(lens), H, K, K, generator=torch.Generator().manual_seed(3)).cuda()
    x = (q, k, v, g, beta, h0)
    packed = run(lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=64,
                                      cu_seqlens=cu), *x)
    ref = run(lambda *a: naive_chunk_kda_varlen(*a[:5], cu, initial_state=a[5], output_final_state=True,
                                                chunk_size=64), *[t.float() for t in x])
    for name in NAMES:
        assert_close(name, packed[name], ref[name], TOL[name], rel_rms)


def test_varlen_layout_is_reused_only_for_equal_boundaries():
    """The last layout serves a call with equal cu_seqlens (by value, another tensor), chunk size and device;
    any other call gets its own, and changing the caller's tensor afterwards does not reach the kept copy."""
    from k3cli.ops.kda import varlen
    cu = cu_of([3, 40, 33])
    first = varlen.varlen_layout(cu, 16, "cpu")
    assert varlen.varlen_layout(cu.clone().long(), 16, "cpu") is first
    fresh = varlen._make_layout(cu.long(), 16, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(first[:4], fresh[:4])) and first.n_seq == fresh.n_seq
    assert varlen.varlen_layout(cu, 32, "cpu") is not first
    other = cu_of([3, 41, 32])
    lay = varlen.varlen_layout(other, 16, "cpu")
    assert not torch.equal(lay.dst, first.dst)
    other[1] = 5   # the caller reuses its buffer: the kept copy must not follow
    assert varlen.varlen_layout(cu_of([3, 41, 32]), 16, "cpu") is lay
    assert torch.equal(varlen.varlen_layout(other, 16, "cpu").dst, varlen._make_layout(other.long(), 16,
                                                                                        torch.device("cpu")).dst)


@pytest.mark.parametrize("trailing", [0, 5], ids=["exact", "fixed-capacity"])
def test_varlen_layout_gives_each_sequence_its_chunks_longest_first(trailing):
    """`seqs`, the scans' table: one row per sequence (empty ones included, with no chunk), its chunk range
    exactly ceil(length / C) chunks starting where its first token was laid out, the ranges disjoint and
    covering every chunk, longest first. A fixed-capacity cu_seqlens (trailing empty sequences, laid out
    apart from the others) changes nothing but those rows, which come last in their order."""
    from k3cli.ops.kda import varlen
    lens, C = [7, 0, 33, 0, 16, 1] + [0] * trailing, 16
    lay = varlen._make_layout(cu_of(lens).long(), C, torch.device("cpu"))
    if trailing:
        exact = varlen._make_layout(cu_of(lens[:-trailing]).long(), C, torch.device("cpu"))
        assert all(torch.equal(a, b) for a, b in zip(lay[:4], exact[:4])) and lay.n_run == exact.n_run
        assert torch.equal(lay.seqs[:-trailing], exact.seqs)
        assert [r[0] for r in lay.seqs[-trailing:].tolist()] == list(range(len(lens) - trailing, len(lens)))
    rows = lay.seqs.tolist()
    assert sorted(r[0] for r in rows) == list(range(len(lens)))
    counts = [n1 - n0 for _, n0, n1 in rows]
    assert counts == sorted(counts, reverse=True)
    cu = cu_of(lens).tolist()
    covered = []
    for s, n0, n1 in rows:
        assert n1 - n0 == -(-lens[s] // C)
        if lens[s]:
            assert int(lay.dst[cu[s]]) == n0 * C
        covered += range(n0, n1)
    assert sorted(covered) == list(range(lay.src.numel() // C))
    assert lay.n_run == 4 and all(n1 > n0 for _, n0, n1 in rows[:lay.n_run])


def test_varlen_layouts_made_ahead_are_kept_by_value():
    """The training loop's batch thread makes the next batches' layouts before their steps: several are kept,
    found by value, a fixed-capacity cu_seqlens (repeats of the total: empty sequences) included."""
    from k3cli.ops.kda import varlen
    varlen._MADE.clear()
    cus = [torch.cat([cu_of(lens), torch.full((5,), sum(lens), dtype=torch.int32)]) for lens in ([3, 40], [10, 33], [43])]
    lays = [varlen.varlen_layout(cu, 16, "cpu") for cu in cus]
    assert all(varlen.varlen_layout(cu.clone(), 16, "cpu") is lay for cu, lay in zip(cus, lays))
    shorter = varlen.varlen_layout(cus[0][:-1], 16, "cpu")   # one empty sequence fewer
    assert shorter is not lays[0] and shorter.n_seq == lays[0].n_seq - 1
    for cu, lay in zip(cus, lays):
        fresh = varlen._make_layout(cu.long(), 16, torch.device("cpu"))
        assert all(torch.equal(a, b) for a, b in zip(lay[:5], fresh[:5])) and lay.n_seq == fresh.n_seq


@pytest.mark.gpu
def test_new_document_layouts_compile_no_kernel_again():
    """Packed batches of one shape (a fixed-capacity cu_seqlens, as training makes) whose chunk counts differ, one
    a multiple of 16 and others not: after the first batch no chunk_kda kernel compiles again (Triton's
    specialisation on divisibility by 16 compiled every kernel anew at the first such batch of a run)."""
    from k3cli.ops.kda import chunk_bwd, chunk_fwd

    kernels = [chunk_fwd._kda_fwd_gamma_kernel, chunk_fwd._kda_fwd_scores_kernel, chunk_fwd._kda_fwd_tail_kernel,
               chunk_fwd._kda_fwd_state_kernel, chunk_bwd._kda_bwd_state_kernel, chunk_bwd._kda_bwd_vside_kernel,
               chunk_bwd._kda_bwd_scores_kernel, chunk_bwd._kda_bwd_kside_kernel]

    def compiled() -> int:
        return sum(len(cache[0]) for kern in kernels for cache in kern.jit.device_caches.values())

    T = 4096
    q, k, v, g, beta, _ = kda_inputs(1, T, 4, 1, 64, 64, torch.bfloat16, "cuda", h0=False)
    counts = []
    # chunks of 64 tokens: 64 (a multiple of 16), then 65 and 66
    for lens in ([T], [100, T - 100], [1000, 1000, 1000, T - 3000]):
        cu = torch.full((T + 1,), T, dtype=torch.int32)
        cu[:len(lens) + 1] = cu_of(lens)
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
        chunk_kda(*leaves, chunk_size=64, cu_seqlens=cu)[0].float().square().sum().backward()
        counts.append(compiled())
    assert counts[0] > 0 and counts[1:] == counts[:1] * 2, counts
