"""The k3:: custom ops (torch.library; k3cli/ops/custom.py): schema, fake implementation and autograd
registration (`torch.library.opcheck`), equality with the torch references, and compiled graphs that hold
the kernels as opaque nodes with no graph break.

Every op is checked on both of its CPU implementations: the Triton kernel under the interpreter
(`triton` marker: TRITON_INTERPRET=1; on CUDA the kernel on the GPU) and the torch reference, which an op
runs on CPU when TRITON_INTERPRET is unset at call time (`custom.triton_runs`).
"""
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from k3cli.ops.attnres.block import (
    attnres_merge,
    attnres_merge_bwd_op,
    attnres_merge_op,
    attnres_phase1,
    attnres_phase1_bwd_op,
    attnres_phase1_op,
)
from k3cli.ops.attnres.fused import fused_attnres, fused_attnres_bwd_op, fused_attnres_op
from k3cli.ops.attnres.naive import naive_attnres, naive_attnres_merge, naive_attnres_phase1
from k3cli.ops.attnres.verify import tolerance
from k3cli.ops.kda.chunk import chunk_kda, chunk_kda_bwd_op, chunk_kda_op
from k3cli.ops.kda.fused_recurrent import (
    _reference,
    fused_recurrent_kda,
    fused_recurrent_kda_bwd_op,
    fused_recurrent_kda_inplace_op,
    fused_recurrent_kda_op,
)
from k3cli.ops.kda.gate import kda_gate, kda_gate_bwd_op, kda_gate_op
from k3cli.ops.kda.naive import chunk_local_cumsum, naive_kda_gate
from k3cli.ops.kda.torch_chunk import torch_chunk_kda
from k3cli.ops.kda.verify import TOL, rel_rms
from k3cli.testing import assert_close, kda_inputs, relative_rms_error, run_with_grads

HAS_CUDA = torch.cuda.is_available()
PATHS = [pytest.param("triton", marks=pytest.mark.triton), "reference"]


@pytest.fixture(params=PATHS)
def device(request, monkeypatch):
    """The device the op runs on, with the environment that selects the implementation under test."""
    if request.param == "reference":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return "cpu"
    return "cuda" if HAS_CUDA else "cpu"


def reference_path(device) -> bool:
    from k3cli.ops.custom import triton_runs
    return not triton_runs(torch.device(device))


opcheck = torch.library.opcheck


def leaves(*xs):
    """Copies of the tensors that require grad (the forward ops' opcheck then checks their autograd too)."""
    return [x if not isinstance(x, torch.Tensor) or not x.is_floating_point() else x.detach().clone().requires_grad_()
            for x in xs]


def rand(*shape, seed=0, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device)


# ---------------------------------------------------------------- chunk_kda
# (B, T, H, G, K, V, chunk, initial state, output_final_state): T = 1, T not a multiple of the chunk, GVA
CHUNK_CASES = [
    pytest.param(1, 1, 1, 1, 16, 16, 16, True, True, id="T1"),
    pytest.param(1, 20, 1, 2, 16, 16, 16, True, True, id="T20-C16-GVA"),
    pytest.param(1, 17, 1, 1, 16, 8, 32, False, False, id="T17-C32-noh0-nofinal"),
]


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "unbounded"])
@pytest.mark.parametrize("B,T,H,G,K,V,C,h0,final", CHUNK_CASES)
def test_opcheck_chunk_kda(device, B, T, H, G, K, V, C, h0, final, bounded):
    q, k, v, g, beta, s0 = kda_inputs(B, T, H, G, K, V, device=device, h0=h0, gate_scale=5.0 if bounded else 40.0)
    scale = K ** -0.5
    opcheck(chunk_kda_op, (*leaves(q, k, v, g, beta, s0), scale, C, final, True, bounded))
    out = chunk_kda_op(q, k, v, g, beta, s0, scale, C, final, True, bounded)
    if reference_path(device):
        assert all(t.numel() == 0 for t in out[2:]), "the reference keeps no kernel buffers"
    dht = torch.randn_like(out[1]) if final else None
    opcheck(chunk_kda_bwd_op, (q, k, v, g, beta, s0, *out[2:], torch.randn_like(out[0]), dht, scale, C, bounded))


@pytest.mark.parametrize("h0", [True, False], ids=["h0", "noh0"])
def test_chunk_kda_op_matches_reference(device, h0):
    inputs = kda_inputs(1, 37, 1, 2, 16, 16, device=device, h0=h0)
    out = run_with_grads(chunk_kda, *inputs, chunk_size=16)
    ref = run_with_grads(torch_chunk_kda, *inputs, chunk_size=16)
    assert set(out) == set(ref)
    for name in ref:
        if reference_path(device):
            assert torch.equal(out[name], ref[name]), name   # the op runs the reference itself
        else:
            assert_close(name, out[name], ref[name], TOL[name], rel_rms)


def strided(t):
    """The same values in a non-contiguous layout (the short convs hand the layer transposed tensors)."""
    return None if t is None else t.transpose(0, -1).contiguous().transpose(0, -1)


def test_ops_take_strided_inputs(device):
    """Each op called directly with non-contiguous inputs: outputs and gradients as with contiguous ones
    (the kernels index dense rows, so the implementations make contiguous copies and keep the copies a
    pointer table refers to alive). Exact for the kernels; torch's own kernels may sum in another order
    for another layout."""
    def same(a, b):
        return torch.equal(a, b) if not reference_path(device) else torch.allclose(a, b, rtol=1e-5, atol=1e-6)

    def chunk(q, k, v, g, beta, initial_state=None, output_final_state=True):
        return chunk_kda_op(q, k, v, g, beta, initial_state, 0.25, 16, output_final_state, True, True)[:2]

    x = kda_inputs(2, 20, 1, 2, 16, 16, device=device)
    want, got = run_with_grads(chunk, *x), run_with_grads(chunk, *map(strided, x))
    assert all(same(got[n], want[n]) for n in want), [n for n in want if not same(got[n], want[n])]
    gate = gate_inputs(2, 20, 3, 8, True, device)
    srcs, q, g, nw, p = attnres_inputs(2, 2, 5, 48, 1, device)
    m, l, o = (t[0] for t in attnres_phase1_op(srcs, q, g, 1e-6))
    calls = [(lambda a, b, c: kda_gate_op(a, b, c, -5.0, 16, True), gate),
             (lambda *s: fused_attnres_op(list(s), q[0], g[0], nw, 1e-6, 1e-6)[:2], srcs),
             (lambda l, o, p: attnres_merge_op(m, l, o, p, q[0], g[0], nw, 1e-6, 1e-6, torch.float32)[:2], (l, o, p))]
    for fn, inputs in calls:
        results = []
        for xs in (leaves(*inputs), leaves(*map(strided, inputs))):
            outs = fn(*xs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            loss = sum((t * rand(*t.shape, seed=30 + i, device=device)).sum() for i, t in enumerate(outs))
            results.append((*outs, *torch.autograd.grad(loss, xs)))
        assert all(same(a, b) for a, b in zip(*results)), [i for i, (a, b) in enumerate(zip(*results)) if not same(a, b)]


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_chunk_kda_eager_function_equals_op(device, varlen):
    """Eagerly chunk_kda runs the ops' implementations under a plain autograd.Function (less host time per
    call); torch.compile traces the ops. Same code below the wrapper: outputs and every gradient bitwise equal,
    with the final state in the loss and without it."""
    from k3cli.ops.kda.chunk import chunk_kda_varlen_op
    from k3cli.ops.kda.varlen import cu_seqlens_of
    cu = cu_seqlens_of([5, 16, 1, 15]) if varlen else None
    x = kda_inputs(1, 37, 1, 2, 16, 16, device=device, h0=False) if varlen else \
        kda_inputs(2, 21, 1, 2, 16, 16, device=device)

    def op(q, k, v, g, beta, initial_state=None, output_final_state=True):
        if varlen:
            return chunk_kda_varlen_op(q, k, v, g, beta, initial_state, cu, 0.25, 16, output_final_state, False)
        return chunk_kda_op(q, k, v, g, beta, initial_state, 0.25, 16, output_final_state, True, True)[:2]

    def eager(q, k, v, g, beta, initial_state=None, output_final_state=True):
        o, ht = chunk_kda(q, k, v, g, beta, scale=0.25, initial_state=initial_state,
                          output_final_state=output_final_state, chunk_size=16, cu_seqlens=cu)
        assert type(o.grad_fn).__name__ == ("_ChunkKDAVarlenBackward" if varlen else "_ChunkKDABackward")
        return o, ht

    want, got = run_with_grads(op, *x), run_with_grads(eager, *x)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want), \
        [n for n in want if not torch.equal(got[n], want[n])]
    # only o reaches the loss (the final state's gradient is None in the backward), then only the final state
    for out, final in ((0, False), (1, True)):
        q = x[0].detach().clone().requires_grad_(True)
        grads = [torch.autograd.grad(fn(q, *x[1:5], x[5], final)[out].square().sum(), q)[0] for fn in (op, eager)]
        assert torch.equal(*grads)


@pytest.mark.triton
def test_chunk_kda_varlen_eager_backward_reuses_the_forward(monkeypatch):
    """Eagerly the varlen forward reads its inputs in place (no layout copy) and keeps its stage-1 buffers: the
    backward runs no stage 1 (the op's backward recomputes it) and lays out the inputs and dO."""
    import k3cli.ops.kda.chunk as ck
    from k3cli.ops.kda.varlen import cu_seqlens_of
    calls = {"intra": 0, "lay_out": 0}

    def counted(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped
    monkeypatch.setattr(ck, "kda_fwd_intra", counted("intra", ck.kda_fwd_intra))
    monkeypatch.setattr(ck, "_lay_out", counted("lay_out", ck._lay_out))
    dev = "cuda" if HAS_CUDA else "cpu"
    q, k, v, g, beta, _ = leaves(*kda_inputs(1, 37, 1, 2, 16, 16, device=dev, h0=False))
    o, _ = chunk_kda(q, k, v, g, beta, chunk_size=16, cu_seqlens=cu_seqlens_of([5, 16, 1, 15]))
    assert calls == {"intra": 1, "lay_out": 0}
    o.sum().backward()
    assert calls == {"intra": 1, "lay_out": 6}


def test_kda_gate_eager_function_equals_op(device):
    """kda_gate eagerly runs the op's implementation under an autograd.Function, as chunk_kda: bitwise equal."""
    x = gate_inputs(2, 20, 3, 8, True, device)
    results = []
    for fn in (lambda *a: kda_gate_op(*a, -5.0, 16, True), lambda *a: kda_gate(*a, chunk_size=16)):
        xs = leaves(*x)
        out = fn(*xs)
        results.append((out, *torch.autograd.grad((out * rand(*out.shape, seed=7, device=device)).sum(), xs)))
    assert type(out.grad_fn).__name__ == "_KDAGateBackward"
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_fused_recurrent_eager_equals_op(device):
    """fused_recurrent_kda eagerly runs the ops' implementations (the autograd one under an autograd.Function,
    the in-place decode step directly): bitwise equal to the ops, state included."""
    q, k, v, g, beta, s0 = kda_inputs(2, 3, 1, 2, 16, 16, device=device)
    args = (None, None, 0.25, -5.0)
    results = []
    for eager in (False, True):
        xs = leaves(q, k, v, g, beta, s0)
        if eager:
            o, ht = fused_recurrent_kda(*xs[:5], scale=0.25, initial_state=xs[5], output_final_state=True)
            assert type(o.grad_fn).__name__ == "_FusedRecurrentKDABackward"
        else:
            o, ht = fused_recurrent_kda_op(*xs, *args, True, False, False)
        grads = torch.autograd.grad((o * rand(*o.shape, seed=3, device=device)).sum() + ht.square().sum(), xs)
        state = s0.clone()
        with torch.no_grad():
            step = fused_recurrent_kda(q, k, v, g, beta, scale=0.25, initial_state=state, inplace_state=True)[0] \
                if eager else fused_recurrent_kda_inplace_op(q, k, v, g, beta, state, *args, False, False)
        results.append((o, ht, *grads, step, state))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_chunk_kda_without_store_mkk_refuses_backward(device):
    q, k, v, g, beta, s0 = leaves(*kda_inputs(1, 5, 1, 1, 16, 16, device=device))
    o = chunk_kda_op(q, k, v, g, beta, s0, 0.25, 16, False, False, True)[0]
    with pytest.raises(RuntimeError, match="store_mkk"):
        o.sum().backward()


# ---------------------------------------------------------------- kda_gate
# (B, T, HV, K, chunk, cumsum, dt_bias)
GATE_CASES = [
    pytest.param(1, 1, 1, 16, 64, True, True, id="T1"),
    pytest.param(2, 20, 3, 8, 16, True, True, id="T20-C16-cumsum"),
    pytest.param(1, 9, 2, 24, 64, False, False, id="T9-nocumsum-nobias"),
]


def gate_inputs(B, T, HV, K, bias, device):
    return (rand(B, T, HV, K, seed=1, device=device, scale=2.0), rand(HV, seed=2, device=device),
            rand(HV, K, seed=3, device=device) if bias else None)


@pytest.mark.parametrize("B,T,HV,K,C,cumsum,bias", GATE_CASES)
def test_opcheck_kda_gate(device, B, T, HV, K, C, cumsum, bias):
    g_raw, A_log, dt_bias = gate_inputs(B, T, HV, K, bias, device)
    opcheck(kda_gate_op, (*leaves(g_raw, A_log, dt_bias), -5.0, C, cumsum))
    opcheck(kda_gate_bwd_op, (g_raw, A_log, dt_bias, torch.randn_like(g_raw), -5.0, C, cumsum))


@pytest.mark.parametrize("cumsum", [True, False])
def test_kda_gate_op_matches_reference(device, cumsum):
    x = leaves(*gate_inputs(2, 20, 3, 8, True, device))
    ref_x = leaves(*x)
    out = kda_gate(*x, chunk_size=16, cumsum=cumsum)
    ref = naive_kda_gate(*ref_x)
    ref = chunk_local_cumsum(ref, 16) if cumsum else ref
    do = torch.randn_like(ref)
    (out * do).sum().backward()
    (ref * do).sum().backward()
    for name, a, b in [("g", out, ref)] + [(n, a.grad, b.grad) for n, a, b in zip(("dg_raw", "dA_log", "ddt_bias"), x, ref_x)]:
        assert_close(name, a, b, 0.0 if reference_path(device) else 1e-5, relative_rms_error)


# ---------------------------------------------------------------- fused_recurrent_kda (decode)
# (B, T, H, G, K, V, initial state, output_final_state, l2norm in kernel, gate in kernel)
DECODE_CASES = [
    pytest.param(2, 1, 1, 2, 16, 16, True, True, True, True, id="T1-GVA-gate-l2"),
    pytest.param(1, 3, 2, 1, 16, 8, False, False, False, False, id="T3-noh0-nofinal-plain"),
]


def decode_inputs(B, T, H, G, K, V, h0, gate, device):
    HV = H * G
    q, k = rand(B, T, H, K, seed=1, device=device), rand(B, T, H, K, seed=2, device=device)
    if not gate:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    v = rand(B, T, HV, V, seed=3, device=device)
    g = rand(B, T, HV, K, seed=4, device=device)
    g = g if gate else -5.0 * torch.sigmoid(g)
    beta = torch.sigmoid(rand(B, T, HV, seed=5, device=device))
    s0 = rand(B, HV, K, V, seed=6, device=device) if h0 else None
    A_log, dt_bias = (rand(HV, seed=7, device=device, scale=0.3), rand(HV, K, seed=8, device=device)) if gate \
        else (None, None)
    return q, k, v, g, beta, s0, A_log, dt_bias


@pytest.mark.parametrize("B,T,H,G,K,V,h0,final,l2,gate", DECODE_CASES)
def test_opcheck_fused_recurrent_kda(device, B, T, H, G, K, V, h0, final, l2, gate):
    x = decode_inputs(B, T, H, G, K, V, h0, gate, device)
    flags = (K ** -0.5, -5.0)
    opcheck(fused_recurrent_kda_op, (*leaves(*x), *flags, final, l2, gate))
    dht = rand(B, H * G, K, V, device=device) if final else None
    opcheck(fused_recurrent_kda_bwd_op, (*x, torch.randn_like(x[2]), dht, *flags, l2, gate))
    state = x[5] if x[5] is not None else torch.zeros(B, H * G, K, V, device=device)
    opcheck(fused_recurrent_kda_inplace_op, (*x[:5], state.clone(), *x[6:], *flags, l2, gate))


def test_fused_recurrent_op_matches_reference(device):
    x = decode_inputs(2, 3, 1, 2, 16, 16, True, True, device)
    kw = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "lower_bound": -5.0}
    ins, ref_ins = leaves(*x), leaves(*x)
    o, ht = fused_recurrent_kda(*ins[:5], initial_state=ins[5], output_final_state=True, A_log=ins[6],
                                dt_bias=ins[7], **kw)
    ro, rh = _reference(*ref_ins[:5], 16 ** -0.5, ref_ins[5], True, True, True, ref_ins[6], ref_ins[7], -5.0)
    do, dht = torch.randn_like(ro), torch.randn_like(rh)
    ((o * do).sum() + (ht * dht).sum()).backward()
    ((ro * do).sum() + (rh * dht).sum()).backward()
    exact = reference_path(device)
    assert_close("o", o, ro, 0.0 if exact else 1e-5, relative_rms_error)
    assert_close("ht", ht, rh, 0.0 if exact else 1e-5, relative_rms_error)
    for i, (a, b) in enumerate(zip(ins, ref_ins)):
        # the backward is autograd through the same reference on every device: exact on both paths
        assert torch.equal(a.grad, b.grad), f"grad of input {i}"
    # the in-place decode step: the same output, the cached state advanced
    state = x[5].clone()
    with torch.no_grad():
        o2, s2 = fused_recurrent_kda(*x[:5], initial_state=state, inplace_state=True, A_log=x[6], dt_bias=x[7],
                                     **kw)
    assert s2 is state
    assert torch.equal(o2, o.detach()) and torch.equal(state, ht.detach())


# ---------------------------------------------------------------- AttnRes mixes
def attnres_inputs(n, B, T, D, S, device):
    srcs = [rand(B, T, D, seed=10 + i, device=device) for i in range(n)]
    q, g = rand(S, D, seed=1, device=device, scale=0.5), 1 + rand(S, D, seed=2, device=device, scale=0.1)
    return srcs, q, g, 1 + rand(D, seed=3, device=device, scale=0.1), rand(B, T, D, seed=4, device=device)


# (n sources, B, T, D, stacked buffer, fused output norm)
FULL_CASES = [
    pytest.param(3, 2, 5, 48, False, True, id="n3-list-norm"),
    pytest.param(1, 1, 1, 16, True, False, id="n1-T1-stacked"),
]


@pytest.mark.parametrize("n,B,T,D,stacked,norm", FULL_CASES)
def test_opcheck_fused_attnres(device, n, B, T, D, stacked, norm):
    srcs, q, g, nw, _ = attnres_inputs(n, B, T, D, 1, device)
    srcs = [torch.stack(srcs)] if stacked else srcs
    nw = nw if norm else None
    opcheck(fused_attnres_op, (leaves(*srcs), *leaves(q[0], g[0], nw), 1e-6, 1e-6))
    h, y, stat = fused_attnres_op(srcs, q[0], g[0], nw, 1e-6, 1e-6)
    dy = torch.randn_like(h) if norm else None
    opcheck(fused_attnres_bwd_op, (srcs, q[0], g[0], nw, h, stat, torch.randn_like(h), dy, 1e-6, 1e-6))


# (n sources, S queries, B, T, D, stacked buffer)
PHASE1_CASES = [
    pytest.param(2, 2, 2, 5, 48, False, id="n2-S2-list"),
    pytest.param(3, 1, 1, 1, 16, True, id="n3-S1-T1-stacked"),
]


@pytest.mark.parametrize("n,S,B,T,D,stacked", PHASE1_CASES)
def test_opcheck_attnres_phase1(device, n, S, B, T, D, stacked):
    srcs, q, g, _, _ = attnres_inputs(n, B, T, D, S, device)
    srcs = [torch.stack(srcs)] if stacked else srcs
    opcheck(attnres_phase1_op, (leaves(*srcs), *leaves(q, g), 1e-6))
    m, l, o = attnres_phase1_op(srcs, q, g, 1e-6)
    opcheck(attnres_phase1_bwd_op, (srcs, q, g, m, torch.randn_like(l), torch.randn_like(o), 1e-6))


@pytest.mark.parametrize("partial", [True, False], ids=["partial", "nopartial"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "nonorm"])
def test_opcheck_attnres_merge(device, partial, norm):
    srcs, q, g, nw, p = attnres_inputs(2, 2, 5, 48, 1, device)
    m, l, o = (t[0] for t in attnres_phase1_op(srcs, q, g, 1e-6))
    p, nw = (p if partial else None), (nw if norm else None)
    opcheck(attnres_merge_op, (m, *leaves(l, o, p, q[0], g[0], nw), 1e-6, 1e-6, torch.float32))
    h, y, stat = attnres_merge_op(m, l, o, p, q[0], g[0], nw, 1e-6, 1e-6, torch.float32)
    # the forward keeps what its own backward reads: h and stat (kernels) or m, l, o (reference)
    kept = (m, l, o, None) if reference_path(device) else (None, None, None, stat)
    dy = torch.randn_like(h) if norm else None
    opcheck(attnres_merge_bwd_op, (*kept[:3], p, q[0], g[0], nw, h, kept[3], torch.randn_like(h), dy, 1e-6, 1e-6))


def test_attnres_ops_match_reference(device):
    """Full mix (list and stacked) and phase 1 + merge: outputs and every gradient against the naive
    references. The reference path's outputs are exact (it runs them); its gradients hold phase 1's
    stabiliser m fixed, as the kernels do, where the naive graph differentiates through it (to rounding,
    the merged mix does not depend on m)."""
    srcs, q, g, nw, p = attnres_inputs(3, 2, 5, 48, 2, device)

    def run(full, phase1, merge, xs):
        srcs, q, g, nw, p = xs[:3], *xs[3:]
        h, y = full(srcs, q[0], g[0], 1e-6, norm_weight=nw)
        hs = full(torch.stack(srcs), q[1], g[1], 1e-6)
        m, l, o = phase1(srcs, q, g, 1e-6)
        hm, ym = merge(m[1], l[1], o[1], p, q[1], g[1], 1e-6, norm_weight=nw)
        h0 = merge(m[0], l[0], o[0], None, q[0], g[0], 1e-6)
        mixes = (h, y, hs, hm, ym, h0)   # not m, l, o: they depend on the choice of m
        loss = sum((t * rand(*t.shape, seed=20 + i, device=device)).sum() for i, t in enumerate(mixes))
        names = ("h", "y", "h_stacked", "h_merge", "y_merge", "h_merge0", "m", "l", "o")
        return dict(zip(names, (*mixes, m, l, o))), torch.autograd.grad(loss, xs)

    xs = (*srcs, q, g, nw, p)
    out, grads = run(fused_attnres, attnres_phase1, attnres_merge, leaves(*xs))
    ref, ref_grads = run(naive_attnres, naive_attnres_phase1, naive_attnres_merge, leaves(*xs))
    for name in ref:
        if reference_path(device):
            assert torch.equal(out[name], ref[name]), name
        else:
            assert_close(name, out[name], ref[name], tolerance("h"), relative_rms_error)
    for name, a, b in zip(("dsrc0", "dsrc1", "dsrc2", "dquery", "dgain", "dnorm", "dpartial"), grads, ref_grads):
        assert_close(name, a, b, tolerance(name), relative_rms_error)


# ---------------------------------------------------------------- compiled graphs
def capturing_backend():
    """aot_eager that also keeps the forward and backward graphs it compiles."""
    graphs = {"fw": [], "bw": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")), graphs


def k3_ops(gms) -> set[str]:
    """The k3 ops called in the graphs: directly, or (a mutating op) through functionalization's wrapper."""
    found = set()
    for node in (n for gm in gms for n in gm.graph.nodes if n.op == "call_function"):
        target = node.args[0] if str(node.target).startswith("auto_functionalized") else node.target
        if str(target).startswith("k3."):
            found.add(str(target))
    return found


@pytest.mark.triton
def test_compiled_chunk_kda_is_one_graph_with_opaque_kernels():
    """chunk_kda with the in-kernel gate and L2 norm, forward and backward, under torch.compile(fullgraph=True):
    one forward and one backward graph, the kernels opaque nodes in them, gradients equal to eager's."""
    torch._dynamo.reset()
    dev = "cuda" if HAS_CUDA else "cpu"
    q, k, v, _, beta, h0 = kda_inputs(1, 20, 1, 2, 16, 16, device=dev)
    g_raw, A_log, dt_bias = gate_inputs(1, 20, 2, 16, True, dev)

    def step(q, k, v, g_raw, beta, A_log, dt_bias, h0):
        o, ht = chunk_kda(q, k, v, g_raw, beta, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                          chunk_size=16)
        return (o * o).sum() + ht.sum()

    backend, graphs = capturing_backend()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    args = (q, k, v, g_raw, beta, A_log, dt_bias, h0)
    results = []
    for fn in (compiled, step):
        xs = leaves(*args)
        loss = fn(*xs)
        results.append((loss, *torch.autograd.grad(loss, xs)))
    assert len(graphs["fw"]) == 1 and len(graphs["bw"]) == 1
    assert k3_ops(graphs["fw"]) == {"k3.chunk_kda.default", "k3.kda_gate.default"}
    assert k3_ops(graphs["bw"]) == {"k3.chunk_kda_bwd.default", "k3.kda_gate_bwd.default"}
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"compiled result {i} differs from eager"


@pytest.mark.triton
def test_compiled_layers_are_one_graph_each():
    """The model's call sites: a KDA layer on the Triton backend, the AttnRes block mixer on the fused
    kernels (with the fused pre-norms), and a decode step on the cached state, each one compiled graph."""
    from k3cli.layers.attnres import AttnResMixer
    from k3cli.layers.kda import KDAAttention
    from k3cli.layers.norm import RMSNorm
    torch._dynamo.reset()
    dev = "cuda" if HAS_CUDA else "cpu"
    torch.manual_seed(0)
    kda = KDAAttention(16, 2, 4, 16, 8, chunk_size=16, backend="triton").to(dev)
    mixer = AttnResMixer(16, 4, mode="block", block_size=3, impl="fused").to(dev)
    with torch.no_grad():
        mixer.query.normal_()
        mixer.out_query.normal_()
    subs = [torch.nn.Linear(16, 16).to(dev) for _ in range(4)]
    norms, final = [RMSNorm(16).to(dev) for _ in range(4)], RMSNorm(16).to(dev)
    cases = [(kda, rand(1, 20, 16, device=dev), {"k3.chunk_kda.default", "k3.kda_gate.default",
                                                 "k3.short_conv.default"}),
             (lambda e: mixer(e, subs, norms=norms, final_norm=final), rand(1, 5, 16, device=dev),
              {"k3.fused_attnres.default", "k3.attnres_phase1.default", "k3.attnres_merge.default"})]
    for fn, x, ops in cases:
        backend, graphs = capturing_backend()
        x = x.requires_grad_()
        torch.compile(fn, fullgraph=True, backend=backend)(x).sum().backward()
        assert len(graphs["fw"]) == 1 and len(graphs["bw"]) == 1 and k3_ops(graphs["fw"]) == ops
        assert k3_ops(graphs["bw"]) == {op.replace(".default", "_bwd.default") for op in ops}
    # decode: prefill eagerly, then one token through the compiled layer (the in-place recurrent step)
    cache = kda.new_cache()
    with torch.no_grad():
        kda(rand(1, 7, 16, device=dev), cache)
        state, x = cache.state.clone(), rand(1, 1, 16, seed=1, device=dev)
        want = kda(x, type(cache)(state=state.clone(), conv_q=cache.conv_q, conv_k=cache.conv_k,
                                  conv_v=cache.conv_v))
        backend, graphs = capturing_backend()
        got = torch.compile(kda, fullgraph=True, backend=backend)(x, cache)
    assert len(graphs["fw"]) == 1 and k3_ops(graphs["fw"]) == {"k3.fused_recurrent_kda_inplace.default"}
    assert torch.equal(got, want) and not torch.equal(cache.state, state)
