"""The kernel entry points' argument checks and their handling of strided inputs (README.md of
k3cli/ops/kda and k3cli/ops/attnres, "Input contract").

Bad inputs: one row per bad argument per op; each must raise a ValueError (dtype and type errors are
`InputTypeError`, a TypeError too) whose one-line message starts with the op's name and names the
argument, with the shape / dtype / device it got. The checks read no data, so these rows run no kernel
(CPU, no interpreter needed); "meta" tensors stand in for a second device.
Strided inputs (transposed, sliced, misaligned views) and empty gate inputs: the kernels under the
interpreter (`triton` marker) and the torch reference path, against the contiguous call.
"""
import pytest
import torch

from k3cli.ops.attnres import attnres_merge, attnres_phase1, fused_attnres
from k3cli.ops.checks import InputTypeError
from k3cli.ops.kda import chunk_kda, fused_recurrent_kda, kda_gate
from k3cli.testing import kda_inputs, scaled_max_error

PATHS = [pytest.param("triton", marks=pytest.mark.triton), "reference"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """The implementation under test: the Triton kernels (interpreter, or CUDA) or the CPU torch reference."""
    if request.param == "reference":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


def device_of(path):
    return DEVICE if path == "triton" else "cpu"


def meta(x):
    return x.to("meta")


# ---------------------------------------------------------------- KDA: chunk_kda, fused_recurrent_kda
B, T, H, G, K, V = 1, 8, 2, 2, 16, 8
HV = H * G


def kda_kwargs(gate=False):
    q, k, v, g, beta, h0 = kda_inputs(B, T, H, G, K, V)
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    if gate:
        kw.update(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV, K))
    return kw


def _set(**changes):
    """A row's edit of the valid keyword arguments: each value a function of the old one (or a constant)."""
    def edit(kw):
        for name, new in changes.items():
            kw[name] = new(kw.get(name)) if callable(new) else new
        return kw
    return edit


# (id, edit of the valid arguments, argument named in the message, text the message must show)
KDA_ROWS = [
    ("q-not-tensor", _set(q=lambda x: x.tolist()), "q", "list"),
    ("q-rank", _set(q=lambda x: x[0]), "q", "(8, 2, 16)"),
    ("k-rank", _set(k=lambda x: x[..., None]), "k", "(1, 8, 2, 16, 1)"),
    ("v-rank", _set(v=lambda x: x[0]), "v", "(8, 4, 8)"),
    ("g-rank", _set(g=lambda x: x[0]), "g", "(8, 4, 16)"),
    ("beta-rank", _set(beta=lambda x: x[..., None]), "beta", "(1, 8, 4, 1)"),
    ("h0-rank", _set(initial_state=lambda x: x[0]), "initial_state", "(4, 16, 8)"),
    ("k-T", _set(k=lambda x: x[:, :4]), "k shape", "(1, 4, 2, 16)"),
    ("k-K", _set(k=lambda x: x[..., :8]), "k shape", "(1, 8, 2, 8)"),
    ("k-H", _set(k=lambda x: x[:, :, :1]), "k shape", "(1, 8, 1, 16)"),
    ("v-B", _set(v=lambda x: torch.cat([x, x])), "v shape", "(2, 8, 4, 8)"),
    ("v-T", _set(v=lambda x: x[:, :5]), "v shape", "(1, 5, 4, 8)"),
    ("HV-not-multiple-of-H", _set(v=lambda x: x[:, :, :3], g=lambda x: x[:, :, :3], beta=lambda x: x[:, :, :3],
                                  initial_state=lambda x: x[:, :3]), "v heads", "HV=3"),
    ("g-HV", _set(g=lambda x: x[:, :, :2]), "g shape", "(1, 8, 2, 16)"),
    ("g-K", _set(g=lambda x: x[..., :8]), "g shape", "(1, 8, 4, 8)"),
    ("g-T", _set(g=lambda x: x[:, 1:]), "g shape", "(1, 7, 4, 16)"),
    ("beta-HV", _set(beta=lambda x: x[..., :2]), "beta shape", "(1, 8, 2)"),
    ("beta-T", _set(beta=lambda x: x[:, 1:]), "beta shape", "(1, 7, 4)"),
    ("h0-B", _set(initial_state=lambda x: torch.cat([x, x])), "initial_state shape", "(2, 4, 16, 8)"),
    ("h0-HV", _set(initial_state=lambda x: x[:, :2]), "initial_state shape", "(1, 2, 16, 8)"),
    ("h0-K", _set(initial_state=lambda x: x[:, :, :8]), "initial_state shape", "(1, 4, 8, 8)"),
    ("h0-V", _set(initial_state=lambda x: x[..., :4]), "initial_state shape", "(1, 4, 16, 4)"),
    ("q-int", _set(q=lambda x: x.long(), k=lambda x: x.long(), v=lambda x: x.long()), "q dtype", "torch.int64"),
    ("q-fp64", _set(q=torch.Tensor.double, k=torch.Tensor.double, v=torch.Tensor.double), "q dtype",
     "torch.float64"),
    ("g-fp64", _set(g=torch.Tensor.double), "g dtype", "torch.float64"),
    ("beta-int", _set(beta=lambda x: (x > 0.5).int()), "beta dtype", "torch.int32"),
    ("beta-bool", _set(beta=lambda x: x > 0.5), "beta dtype", "torch.bool"),
    ("h0-fp16", _set(initial_state=torch.Tensor.half), "initial_state dtype", "torch.float16"),
    ("h0-fp64", _set(initial_state=torch.Tensor.double), "initial_state dtype", "torch.float64"),
    ("k-device", _set(k=meta), "k is on meta", "cpu"),
    ("v-device", _set(v=meta), "v is on meta", "cpu"),
    ("g-device", _set(g=meta), "g is on meta", "cpu"),
    ("beta-device", _set(beta=meta), "beta is on meta", "cpu"),
    ("h0-device", _set(initial_state=meta), "initial_state is on meta", "cpu"),
    ("empty-B", _set(**{n: (lambda x: x[:0]) for n in ("q", "k", "v", "g", "beta", "initial_state")}),
     "q shape", "(0, 8, 2, 16)"),
    ("empty-T", _set(**{n: (lambda x: x[:, :0]) for n in ("q", "k", "v", "g", "beta")}), "q shape",
     "(1, 0, 2, 16)"),
    ("empty-H", _set(q=lambda x: x[:, :, :0], k=lambda x: x[:, :, :0]), "q shape", "(1, 8, 0, 16)"),
    ("empty-V", _set(v=lambda x: x[..., :0], initial_state=lambda x: x[..., :0]), "v shape", "(1, 8, 4, 0)"),
    ("empty-K", _set(q=lambda x: x[..., :0], k=lambda x: x[..., :0], g=lambda x: x[..., :0],
                     initial_state=lambda x: x[:, :, :0]), "q key dim", "K=0"),
    ("K-too-large", _set(q=lambda x: x.repeat(1, 1, 1, 17), k=lambda x: x.repeat(1, 1, 1, 17),
                         g=lambda x: x.repeat(1, 1, 1, 17), initial_state=lambda x: x.repeat(1, 1, 17, 1)),
     "q key dim", "K=272"),
    ("scale-tensor", _set(scale=torch.tensor(0.25)), "scale", "Tensor"),
    ("lower_bound-low", _set(lower_bound=-6.0), "lower_bound", "-6.0"),
    ("lower_bound-zero", _set(lower_bound=0.0), "lower_bound", "0.0"),
    ("lower_bound-nan", _set(lower_bound=float("nan")), "lower_bound", "nan"),
    ("lower_bound-tensor", _set(lower_bound=torch.tensor(-5.0)), "lower_bound", "Tensor"),
]
# with use_gate_in_kernel=True
KDA_GATE_ROWS = [
    ("A_log-missing", _set(A_log=None), "A_log", "required"),
    ("A_log-shape", _set(A_log=lambda x: x[:2]), "A_log shape", "(2,)"),
    ("A_log-rank", _set(A_log=lambda x: x[None]), "A_log", "(1, 4)"),
    ("A_log-int", _set(A_log=lambda x: x.long()), "A_log dtype", "torch.int64"),
    ("A_log-device", _set(A_log=meta), "A_log is on meta", "cpu"),
    ("dt_bias-shape", _set(dt_bias=lambda x: x[:, :8]), "dt_bias shape", "(4, 8)"),
    ("dt_bias-rank", _set(dt_bias=lambda x: x.flatten()), "dt_bias", "(64,)"),
    ("dt_bias-fp64", _set(dt_bias=torch.Tensor.double), "dt_bias dtype", "torch.float64"),
    ("dt_bias-device", _set(dt_bias=meta), "dt_bias is on meta", "cpu"),
]
CHUNK_ROWS = [
    ("mixed-dtype", _set(k=torch.Tensor.half), "q, k, v must share a dtype", "torch.float16"),
    ("chunk_size", _set(chunk_size=48), "chunk_size", "48"),
]
RECURRENT_ROWS = [
    ("inplace-without-state", _set(initial_state=None, inplace_state=True), "initial_state", "inplace_state"),
    ("inplace-strided-state", _set(initial_state=lambda x: x.transpose(-1, -2).contiguous().transpose(-1, -2),
                                   inplace_state=True), "initial_state", "contiguous"),
]


def expect_error(fn, op, arg, shows, **kw):
    with pytest.raises(ValueError) as e:
        fn(**kw)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{op}: "), msg
    assert arg in msg and shows in msg, f"{msg!r} should name {arg!r} and show {shows!r}"
    return e.value


def params(rows, *extra):
    return [pytest.param(edit, arg, shows, *extra, id=name) for name, edit, arg, shows in rows]


@pytest.mark.parametrize("edit,arg,shows,gate", params(KDA_ROWS, False) + params(KDA_GATE_ROWS, True)
                         + params(CHUNK_ROWS, False))
def test_chunk_kda_rejects(edit, arg, shows, gate):
    expect_error(chunk_kda, "chunk_kda", arg, shows, **edit(kda_kwargs(gate)))


@pytest.mark.parametrize("edit,arg,shows,gate", params(KDA_ROWS, False) + params(KDA_GATE_ROWS, True)
                         + params(RECURRENT_ROWS, False))
def test_fused_recurrent_kda_rejects(edit, arg, shows, gate):
    with torch.no_grad():   # inplace_state is refused under grad for another reason
        expect_error(fused_recurrent_kda, "fused_recurrent_kda", arg, shows, **edit(kda_kwargs(gate)))


def test_dtype_errors_are_type_errors_too():
    # the dtype / type rows raised TypeError before the audit: both clauses still catch them
    kw = kda_kwargs()
    kw["q"] = kw["q"].long()
    with pytest.raises(TypeError):
        chunk_kda(**kw)
    assert issubclass(InputTypeError, TypeError) and issubclass(InputTypeError, ValueError)


# ---------------------------------------------------------------- kda_gate
def gate_kwargs():
    gen = torch.Generator().manual_seed(0)
    return dict(g_raw=torch.randn(2, 5, 3, 8, generator=gen), A_log=torch.randn(3, generator=gen),
                dt_bias=torch.randn(3, 8, generator=gen))


GATE_ROWS = [
    ("g_raw-not-tensor", _set(g_raw=lambda x: x.numpy()), "g_raw", "ndarray"),
    ("g_raw-rank", _set(g_raw=lambda x: x[0]), "g_raw", "(5, 3, 8)"),
    ("g_raw-int", _set(g_raw=lambda x: x.long()), "g_raw dtype", "torch.int64"),
    ("g_raw-complex", _set(g_raw=lambda x: x.to(torch.complex64)), "g_raw dtype", "torch.complex64"),
    ("A_log-not-tensor", _set(A_log=None), "A_log", "NoneType"),
    ("A_log-shape", _set(A_log=lambda x: x[:2]), "A_log shape", "(2,)"),
    ("A_log-rank", _set(A_log=lambda x: x[0]), "A_log", "()"),
    ("A_log-int", _set(A_log=lambda x: x.long()), "A_log dtype", "torch.int64"),
    ("A_log-device", _set(A_log=meta), "A_log is on meta", "cpu"),
    ("dt_bias-shape", _set(dt_bias=lambda x: x[:, :4]), "dt_bias shape", "(3, 4)"),
    ("dt_bias-transposed-shape", _set(dt_bias=lambda x: x.t()), "dt_bias shape", "(8, 3)"),
    ("dt_bias-int", _set(dt_bias=lambda x: x.int()), "dt_bias dtype", "torch.int32"),
    ("dt_bias-device", _set(dt_bias=meta), "dt_bias is on meta", "cpu"),
    ("lower_bound", _set(lower_bound=-7.0), "lower_bound", "-7.0"),
    ("lower_bound-positive", _set(lower_bound=1.0), "lower_bound", "1.0"),
    ("chunk_size-48", _set(chunk_size=48), "chunk_size", "48"),
    ("chunk_size-0", _set(chunk_size=0), "chunk_size", "0"),
    ("chunk_size-float", _set(chunk_size=16.0), "chunk_size", "16.0"),
]


@pytest.mark.parametrize("edit,arg,shows", params(GATE_ROWS))
def test_kda_gate_rejects(edit, arg, shows):
    expect_error(kda_gate, "kda_gate", arg, shows, **edit(gate_kwargs()))


@pytest.mark.parametrize("shape", [(0, 5, 3, 8), (2, 0, 3, 8), (2, 5, 3, 0)], ids=["B0", "T0", "K0"])
@pytest.mark.parametrize("cumsum", [True, False])
def test_kda_gate_empty_input_gives_an_empty_result(path, shape, cumsum):
    """The gate is elementwise: an empty g_raw gives the empty output and zero gradients for A_log, dt_bias."""
    dev = device_of(path)
    g_raw = torch.randn(shape, device=dev).requires_grad_()
    A_log, dt_bias = (torch.randn(s, device=dev).requires_grad_() for s in ((3,), (3, shape[-1])))
    out = kda_gate(g_raw, A_log, dt_bias, chunk_size=16, cumsum=cumsum)
    assert out.shape == shape and out.dtype == torch.float32
    grads = torch.autograd.grad(out.sum(), (g_raw, A_log, dt_bias))
    assert grads[0].shape == shape
    assert not grads[1].any() and not grads[2].any() and grads[2].shape == dt_bias.shape


# ---------------------------------------------------------------- AttnRes
N, D = 3, 48


def attnres_parts(S=2):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)
    return dict(srcs=[r(2, 5, D) for _ in range(N)], queries=r(S, D) / D ** 0.5, gains=1 + 0.1 * r(S, D),
                nw=1 + 0.1 * r(D), partial=r(2, 5, D))


def full_kwargs():
    p = attnres_parts()
    return dict(sources=p["srcs"], query=p["queries"][0], gain=p["gains"][0], norm_weight=p["nw"])


def _src(i, fn):
    """Replace source i of the list by fn(source i)."""
    return lambda s: [fn(x) if j == i else x for j, x in enumerate(s)]


SOURCE_ROWS = [
    ("sources-not-list", _set(sources=lambda s: {"a": s[0]}), "sources", "dict"),
    ("sources-empty-list", _set(sources=[]), "sources", "at least one"),
    ("sources-33", _set(sources=lambda s: s * 11), "sources: 33 sources", "1..32"),
    ("stacked-rank", _set(sources=lambda s: torch.stack(s)[0]), "sources", "(2, 5, 48)"),
    ("stacked-0-sources", _set(sources=lambda s: torch.stack(s)[:0]), "sources: 0 sources", "1..32"),
    ("stacked-int", _set(sources=lambda s: torch.stack(s).long()), "sources dtype", "torch.int64"),
    ("source-not-tensor", _set(sources=_src(1, lambda x: x.tolist())), "sources[1]", "list"),
    ("source-rank", _set(sources=_src(1, lambda x: x[0])), "sources[1]", "(5, 48)"),
    ("source-shape", _set(sources=_src(2, lambda x: x[:, :3])), "sources[2] shape", "(2, 3, 48)"),
    ("source-D", _set(sources=_src(1, lambda x: x[..., :32])), "sources[1] shape", "(2, 5, 32)"),
    ("source-dtype", _set(sources=_src(1, torch.Tensor.half)), "sources[1] dtype", "torch.float16"),
    ("source-fp64", _set(sources=lambda s: [x.double() for x in s], query=torch.Tensor.double,
                         gain=torch.Tensor.double, norm_weight=torch.Tensor.double), "sources[0] dtype",
     "torch.float64"),
    ("source-device", _set(sources=_src(1, meta)), "sources[1] is on meta", "cpu"),
    ("sources-empty-B", _set(sources=lambda s: [x[:0] for x in s]), "sources", "(0, 5, 48)"),
    ("sources-empty-T", _set(sources=lambda s: torch.stack(s)[:, :, :0]), "sources", "(2, 0, 48)"),
    ("sources-D-too-large", _set(sources=lambda s: [x.repeat(1, 1, 400) for x in s]), "sources", "19200"),
]
FULL_ROWS = SOURCE_ROWS + [
    ("query-missing", _set(query=None), "query", "required"),
    ("query-shape", _set(query=lambda x: x[:47]), "query shape", "(47,)"),
    ("query-rank", _set(query=lambda x: x[None]), "query", "(1, 48)"),
    ("query-int", _set(query=lambda x: x.long()), "query dtype", "torch.int64"),
    ("query-device", _set(query=meta), "query is on meta", "cpu"),
    ("gain-shape", _set(gain=lambda x: x[:10]), "gain shape", "(10,)"),
    ("gain-not-tensor", _set(gain=1.0), "gain", "float"),
    ("norm_weight-shape", _set(norm_weight=lambda x: torch.cat([x, x])), "norm_weight shape", "(96,)"),
    ("norm_weight-device", _set(norm_weight=meta), "norm_weight is on meta", "cpu"),
    ("eps-negative", _set(eps=-1e-6), "eps", "-1e-06"),
    ("norm_eps-nan", _set(norm_eps=float("nan")), "norm_eps", "nan"),
]


@pytest.mark.parametrize("edit,arg,shows", params(FULL_ROWS))
def test_fused_attnres_rejects(edit, arg, shows):
    expect_error(fused_attnres, "fused_attnres", arg, shows, **edit(full_kwargs()))


def phase1_kwargs():
    p = attnres_parts()
    return dict(sources=p["srcs"], queries=p["queries"], gains=p["gains"])


PHASE1_ROWS = SOURCE_ROWS[:6] + [
    ("queries-rank", _set(queries=lambda x: x[0]), "queries", "(48,)"),
    ("queries-D", _set(queries=lambda x: x[:, :40]), "queries shape", "(2, 40)"),
    ("queries-S0", _set(queries=lambda x: x[:0], gains=lambda x: x[:0]), "queries shape", "(0, 48)"),
    ("queries-int", _set(queries=lambda x: x.long()), "queries dtype", "torch.int64"),
    ("queries-device", _set(queries=meta), "queries is on meta", "cpu"),
    ("gains-shape", _set(gains=lambda x: torch.cat([x, x])), "gains shape", "(4, 48)"),
    ("gains-fp64", _set(gains=torch.Tensor.double), "gains dtype", "torch.float64"),
    ("eps-negative", _set(eps=-1.0), "eps", "-1.0"),
]


@pytest.mark.parametrize("edit,arg,shows", params(PHASE1_ROWS))
def test_attnres_phase1_rejects(edit, arg, shows):
    expect_error(attnres_phase1, "attnres_phase1", arg, shows, **edit(phase1_kwargs()))


def merge_kwargs():
    p = attnres_parts()
    m, l, o = torch.randn(2, 5), torch.rand(2, 5) + 1, torch.randn(2, 5, D)   # one query's phase-1 state
    return dict(m=m, l=l, o=o, partial=p["partial"], query=p["queries"][0], gain=p["gains"][0],
                norm_weight=p["nw"])


MERGE_ROWS = [
    ("o-rank", _set(o=lambda x: x[0]), "o", "(5, 48)"),
    ("o-fp16", _set(o=torch.Tensor.half), "o dtype", "torch.float16"),
    ("o-not-tensor", _set(o=None), "o", "NoneType"),
    ("m-shape", _set(m=lambda x: x[:, :4]), "m shape", "(2, 4)"),
    ("m-rank", _set(m=lambda x: x[..., None]), "m", "(2, 5, 1)"),
    ("m-device", _set(m=meta), "m is on meta", "cpu"),
    ("l-shape", _set(l=lambda x: x[:1]), "l shape", "(1, 5)"),
    ("l-bf16", _set(l=lambda x: x.bfloat16()), "l dtype", "torch.bfloat16"),
    ("o-empty", _set(o=lambda x: x[:, :0], m=lambda x: x[:, :0], l=lambda x: x[:, :0]), "o shape", "(2, 0, 48)"),
    ("partial-shape", _set(partial=lambda x: x[:, :4]), "partial shape", "(2, 4, 48)"),
    ("partial-int", _set(partial=lambda x: x.long()), "partial dtype", "torch.int64"),
    ("partial-device", _set(partial=meta), "partial is on meta", "cpu"),
    ("query-missing", _set(query=None), "query", "required"),
    ("query-shape", _set(query=lambda x: x[:40]), "query shape", "(40,)"),
    ("gain-int", _set(gain=lambda x: x.long()), "gain dtype", "torch.int64"),
    ("norm_weight-shape", _set(norm_weight=lambda x: x[None]), "norm_weight", "(1, 48)"),
    ("out_dtype-int", _set(out_dtype=torch.int64), "out_dtype", "torch.int64"),
    ("eps-nan", _set(eps=float("nan")), "eps", "nan"),
]


@pytest.mark.parametrize("edit,arg,shows", params(MERGE_ROWS))
def test_attnres_merge_rejects(edit, arg, shows):
    expect_error(attnres_merge, "attnres_merge", arg, shows, **edit(merge_kwargs()))


# ---------------------------------------------------------------- the checks under torch.compile
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_checks_trace_without_graph_breaks(dynamic, monkeypatch):
    """Every entry point traces in one graph (fullgraph), static and dynamic shapes: the checks read only
    shapes, dtypes and Python numbers. The torch reference path: tracing, not the kernels, is under test."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()
    kw = kda_kwargs(gate=True)
    p = attnres_parts()
    m, l, o = torch.randn(2, 5), torch.rand(2, 5) + 1, torch.randn(2, 5, D)
    calls = [
        lambda: chunk_kda(**kw, output_final_state=True, chunk_size=16),
        lambda: fused_recurrent_kda(**kw, output_final_state=True, use_qk_l2norm_in_kernel=True),
        lambda: kda_gate(kw["g"], kw["A_log"], kw["dt_bias"], chunk_size=16),
        lambda: fused_attnres(p["srcs"], p["queries"][0], p["gains"][0], norm_weight=p["nw"]),
        lambda: attnres_phase1(torch.stack(p["srcs"]), p["queries"], p["gains"]),
        lambda: attnres_merge(m, l, o, p["partial"], p["queries"][0], p["gains"][0], norm_weight=p["nw"]),
    ]
    for call in calls:
        want = call()
        got = torch.compile(call, fullgraph=True, backend="eager", dynamic=dynamic)()
        want, got = (x if isinstance(x, tuple) else (x,) for x in (want, got))
        assert all(torch.equal(a, b) for a, b in zip(want, got) if a is not None)


# ---------------------------------------------------------------- strided inputs
def transposed(x):
    """The same values in a transposed layout (the short convs hand chunk_kda such views)."""
    return x.transpose(0, -1).contiguous().transpose(0, -1)


def sliced(x):
    """The same values as every other element of a wider tensor: the last dim has stride 2."""
    return torch.stack([x, torch.zeros_like(x)], -1)[..., 0]


def misaligned(x):
    """The same values, dense, at a data pointer 4 bytes past a 16-byte boundary."""
    return torch.cat([x.new_zeros(1), x.flatten()])[1:].view(x.shape)


def _identity(x):
    return x


LAYOUTS = [transposed, sliced, misaligned]


def grads_of(fn, leaves, layout, device="cpu"):
    """fn(*layout(leaves)) and the gradients of a fixed random projection of its outputs, at the leaves."""
    xs = [x.detach().to(device).requires_grad_(x.is_floating_point()) for x in leaves]
    viewed = [layout(x) for x in xs]
    if layout is not _identity:
        assert all(not v.is_contiguous() or v.data_ptr() % 16 for v in viewed if v.dim() > 1)
    outs = fn(*viewed)
    outs = [t for t in (outs if isinstance(outs, tuple) else (outs,)) if t is not None]
    gen = torch.Generator().manual_seed(7)
    loss = sum((t.double() * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(device)).sum()
               for t in outs)
    grads = torch.autograd.grad(loss, xs, allow_unused=True)   # m of a merge gets none
    return [t.detach() for t in outs] + [torch.zeros_like(x) if d is None else d for x, d in zip(xs, grads)]


def assert_same(path, want, got):
    # the kernels copy strided inputs to the same dense rows: bit-equal; torch's own kernels may sum in
    # another order for another layout (fp32 rounding: measured <= 3e-7 of the largest value)
    for i, (a, b) in enumerate(zip(want, got)):
        same = torch.equal(a, b) if path == "triton" else a.shape == b.shape and scaled_max_error(b, a) <= 1e-6
        assert same, f"output/gradient {i} differs with strided inputs"


def check_layouts(path, fn, leaves):
    want = grads_of(fn, leaves, _identity, device_of(path))
    for layout in LAYOUTS:
        assert_same(path, want, grads_of(fn, leaves, layout, device_of(path)))


def test_chunk_kda_strided(path):
    q, k, v, g, beta, h0 = kda_inputs(1, 20, 1, 2, 16, 16)
    gen = torch.Generator().manual_seed(1)
    A_log, dt_bias = 0.3 * torch.randn(2, generator=gen), torch.randn(2, 16, generator=gen)

    def plain(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)

    def gated(q, k, v, g_raw, beta, h0, A_log, dt_bias):
        return chunk_kda(q, k, v, g_raw, beta, initial_state=h0, output_final_state=True, chunk_size=16,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)

    check_layouts(path, plain, [q, k, v, g, beta, h0])
    check_layouts(path, gated, [q, k, v, torch.randn(g.shape, generator=gen), beta, h0, A_log, dt_bias])


def test_fused_recurrent_kda_strided(path):
    q, k, v, g, beta, h0 = kda_inputs(2, 3, 1, 2, 16, 16)
    gen = torch.Generator().manual_seed(1)
    A_log, dt_bias = 0.3 * torch.randn(2, generator=gen), torch.randn(2, 16, generator=gen)

    def gated(q, k, v, g_raw, beta, h0, A_log, dt_bias):
        return fused_recurrent_kda(q, k, v, g_raw, beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                   dt_bias=dt_bias)

    g_raw = torch.randn(g.shape, generator=gen)
    check_layouts(path, gated, [q, k, v, g_raw, beta, h0, A_log, dt_bias])
    # the decode step: strided token inputs, the cached state dense (updated in place)
    dev = device_of(path)
    with torch.no_grad():
        outs = []
        for layout in (_identity, *LAYOUTS):
            state = h0.to(dev, copy=True)
            o, _ = fused_recurrent_kda(*(layout(x.to(dev)) for x in (q, k, v, g_raw, beta)), initial_state=state,
                                       inplace_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       A_log=layout(A_log.to(dev)), dt_bias=layout(dt_bias.to(dev)))
            outs.append((o, state))
    for got in outs[1:]:
        assert_same(path, outs[0], got)


def test_kda_gate_strided(path):
    gen = torch.Generator().manual_seed(0)
    leaves = [2 * torch.randn(2, 20, 3, 8, generator=gen), torch.randn(3, generator=gen),
              torch.randn(3, 8, generator=gen)]
    for cumsum in (True, False):
        check_layouts(path, lambda a, b, c, cumsum=cumsum: kda_gate(a, b, c, chunk_size=16, cumsum=cumsum), leaves)


def test_attnres_strided(path):
    p = attnres_parts(S=3)
    srcs, Q, Gn, nw, part = p["srcs"], p["queries"], p["gains"], p["nw"], p["partial"]

    def full_list(s0, s1, s2, q, g, nw):
        return fused_attnres([s0, s1, s2], q, g, norm_weight=nw)

    def full_stacked(x, q, g):
        return fused_attnres(x, q, g)

    def block(s0, s1, s2, qs, gs, partial, nw):
        m, l, o = attnres_phase1([s0, s1, s2], qs, gs)
        h0 = attnres_merge(m[0], l[0], o[0], None, qs[0], gs[0])
        h1, y1 = attnres_merge(m[1], l[1], o[1], partial, qs[1], gs[1], norm_weight=nw)
        return l, o, h0, h1, y1

    def merge(m, l, o, partial, q, g, nw):
        return attnres_merge(m, l, o, partial, q, g, norm_weight=nw)

    check_layouts(path, full_list, [*srcs, Q[0], Gn[0], nw])
    check_layouts(path, full_stacked, [torch.stack(srcs), Q[0], Gn[0]])
    check_layouts(path, block, [*srcs, Q, Gn, part, nw])
    m, l, o = (t[1].detach() for t in attnres_phase1(srcs, Q, Gn))
    check_layouts(path, merge, [m, l, o, part, Q[1], Gn[1], nw])
    # a stacked buffer whose slots are dense but not adjacent (every other slot of a larger one)
    dev = device_of(path)
    dense = grads_of(full_stacked, [torch.stack([srcs[0], srcs[2], srcs[1]]), Q[0], Gn[0]], _identity, dev)
    wide = grads_of(full_stacked, [torch.stack([*srcs, *srcs]), Q[0], Gn[0]],
                    lambda x: x[::2] if x.dim() == 4 else x, dev)
    assert_same(path, [dense[0], *dense[2:]], [wide[0], *wide[2:]])   # h, dquery, dgain
    assert_same(path, [dense[1], torch.zeros_like(dense[1])], [wide[1][::2], wide[1][1::2]])
