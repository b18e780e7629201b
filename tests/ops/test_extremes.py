"""Numeric extremes of the kernel entry points against the fp64 references (README.md of k3cli/ops/kda and
k3cli/ops/attnres, "Input contract"): finite outputs and gradients that match.

Every case feeds the op and the fp64 reference (`naive_recurrent_kda` after the fp64 gate / L2 norm,
`naive_kda_gate`, the naive AttnRes forms) the same rounded inputs and compares every output and every
gradient by relative RMS error (k3cli.testing.relative_rms_error). Tolerances:
- KDA, fp32 inputs: `FP32_TOL` per path. fused_recurrent_kda (token by token) 1e-5, its table's fp32 bound.
  The chunked forms (chunk_kda, torch_chunk_kda) 2e-4: they get dg from differences of Γ-weighted terms that
  cancel when every g_t = -5 (measured 3.7e-5), and chunk_kda's 16-token solve (product form) loses bits when
  keys are parallel with β = 1 and no decay (dk 4.7e-5, kda/README.md "Triangular solve"); elsewhere <= 8e-6.
- KDA, fp16 inputs: the op's own table (k3cli/ops/kda/verify.py TOL); measured <= 7.4e-4.
- kda_gate: 1e-5 (fp32) and 1e-3 (fp16), the bounds of its tests in test_kda.py; measured <= 6.8e-6 (dA_log,
  a sum over B, T, K) and 2e-4.
- AttnRes: its one table (k3cli/ops/attnres/verify.py `tolerance`), which is stated against fp64 already.
Inputs outside a dtype's range are not errors of the ops; where a true result exceeds fp16 (65504) the fp16
result must be inf exactly there (`assert_fp16_overflow`), not NaN and not inf elsewhere.
Kernel paths run under the interpreter (`triton` marker) or on CUDA; the torch CPU training path
(`torch_chunk_kda`, reach_checked False and True, after the torch gate) runs everywhere. bf16 cases (the
interpreter is wrong for bf16) are the GPU tier (`gpu` marker), within the same tables as fp16.
"""
import functools

import pytest
import torch
import torch.nn.functional as F

from k3cli.ops.attnres.naive import source_keys
from k3cli.ops.attnres.verify import compare, make_inputs, rounded, run_block, run_full, upstream_grads
from k3cli.ops.kda import chunk_kda, chunk_local_cumsum, fused_recurrent_kda, kda_gate
from k3cli.ops.kda.naive import naive_kda_gate, naive_recurrent_kda
from k3cli.ops.kda.torch_chunk import torch_chunk_kda
from k3cli.ops.kda.verify import TOL as KDA_TOL
from k3cli.ops.norm import l2norm, rms_norm
from k3cli.testing import assert_close, relative_rms_error

# the interpreter's numpy exp overflows to inf inside sigmoid at saturated gates: 1 / (1 + inf) = 0 is exact
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
FP16_MAX_ROUNDS_TO = 65520.0   # values at or above it round to inf in fp16
FP32_TOL = {"chunk_kda": 2e-4, "torch_chunk": 2e-4, "torch_chunk_checked": 2e-4, "fused_recurrent_kda": 1e-5}
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
FP32_ONLY = {torch.float32}
BOTH = {torch.float32, torch.float16, torch.bfloat16}
BF16_TOO = {torch.float32, torch.bfloat16}   # in fp16 out of range, in bf16 not


def dtype_marks(dtype):
    return [pytest.mark.gpu] if dtype == torch.bfloat16 else []


def dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- KDA
def kda_case(B=1, T=24, H=1, G=2, K=16, V=16, seed=0, gate=False, **edits):
    """fp64 inputs: L2-normalised q, k, v ~ N(0, 1), g in (-5, 0) or the raw gate input with A_log, dt_bias
    (gate), beta in (0, 1), an initial state; then edits[name](tensor) for each named input."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    HV = H * G
    x = dict(q=F.normalize(r(B, T, H, K), dim=-1), k=F.normalize(r(B, T, H, K), dim=-1), v=r(B, T, HV, V),
             g=r(B, T, HV, K) if gate else -5 * torch.sigmoid(r(B, T, HV, K) - 1), beta=torch.sigmoid(r(B, T, HV)),
             initial_state=r(B, HV, K, V))
    if gate:
        x.update(A_log=r(HV), dt_bias=r(HV, K))
    for name, edit in edits.items():
        x[name] = edit(x[name])
    return x


FP32_INPUTS = ("g", "initial_state", "A_log", "dt_bias")   # fp32 whatever the q / k / v dtype


def cast(x, dtype, device=DEVICE):
    return {n: t.to(device, torch.float32 if n in FP32_INPUTS and dtype != torch.float64 else dtype)
            for n, t in x.items()}


def run_kda(fn, x, **kw):
    """fn's outputs and the gradients of a fixed random projection of them at every input."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, ht = fn(**leaves, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(123)
    loss = sum((t.double() * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)).sum()
               for t in (o, ht))
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"o": o.detach(), "ht": ht.detach(), **{f"d{n}": d for n, d in zip(leaves, grads)}}


def reference(q, k, v, g, beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=False,
              use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=-5.0, chunk_size=None):
    """The definition (in the inputs' dtype: fp64 here): L2 norm and gate in torch, then the recurrence."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        g = naive_kda_gate(g, A_log, dt_bias, lower_bound)
    return naive_recurrent_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)


def torch_chunk(reach_checked):
    """The CPU training path (layers/kda.py): torch L2 norm and gate, then torch_chunk_kda."""
    def fn(q, k, v, g, beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=False,
           use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=-5.0, chunk_size=16):
        if use_qk_l2norm_in_kernel:
            q, k = l2norm(q), l2norm(k)
        if use_gate_in_kernel:
            g = naive_kda_gate(g, A_log, dt_bias, lower_bound)
        return torch_chunk_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                               chunk_size=chunk_size, reach_checked=reach_checked)
    return fn


def _recurrent(chunk_size=None, **kw):
    return fused_recurrent_kda(**kw)


PATHS = {"chunk_kda": chunk_kda, "fused_recurrent_kda": _recurrent, "torch_chunk": torch_chunk(False),
         "torch_chunk_checked": torch_chunk(True)}
KERNELS = {"chunk_kda", "fused_recurrent_kda"}


def _saturating(t):
    """t with 70% of its entries replaced by +-1e4 (the gate saturates at 0 or lower_bound there)."""
    gen = torch.Generator().manual_seed(5)
    pick = torch.rand(t.shape, generator=gen, dtype=torch.float64)
    return torch.where(pick < 0.35, -1e4, torch.where(pick < 0.7, 1e4, t))


def _const(c):
    return lambda t: torch.full_like(t, c)


def _scale(c):
    return lambda t: t * c


C16 = {"chunk_size": 16}
GATED = {"use_gate_in_kernel": True, **C16}
L2 = {"use_qk_l2norm_in_kernel": True, **C16}
# (id, kda_case arguments, op keywords, input dtypes)
KDA_CASES = [
    ("g_raw-pm1e4", dict(gate=True, g=_saturating), GATED, BOTH),
    ("g_raw+1e4", dict(gate=True, g=_const(1e4)), GATED, FP32_ONLY),
    ("g_raw-1e4", dict(gate=True, g=_const(-1e4)), GATED, FP32_ONLY),
    ("A_log+20", dict(gate=True, A_log=_const(20.0)), GATED, BOTH),
    ("A_log-20", dict(gate=True, A_log=_const(-20.0)), GATED, FP32_ONLY),
    ("g=-5", dict(g=_const(-5.0)), C16, BOTH),
    ("g=0", dict(g=_const(0.0)), C16, FP32_ONLY),
    ("beta=0", dict(beta=_const(0.0)), C16, BOTH),
    ("beta=1", dict(beta=_const(1.0)), C16, BOTH),
    ("beta=1-g=0-same-k", dict(beta=_const(1.0), g=_const(0.0), k=lambda t: t[:, :1].expand_as(t).clone()), C16,
     FP32_ONLY),
    ("q*1e4", dict(q=_scale(1e4)), C16, BOTH),
    ("q*1e-4", dict(q=_scale(1e-4)), C16, BF16_TOO),
    ("k*1e-4", dict(k=_scale(1e-4)), C16, FP32_ONLY),
    ("v*1e4", dict(v=_scale(1e4)), C16, BF16_TOO),
    ("v*1e-4", dict(v=_scale(1e-4)), C16, BOTH),
    ("h0*1e4", dict(initial_state=_scale(1e4)), C16, FP32_ONLY),
    ("qk*1e4-l2norm", dict(q=_scale(1e4), k=_scale(1e4)), L2, FP32_ONLY),
    ("qk*1e-4-l2norm", dict(q=_scale(1e-4), k=_scale(1e-4)), L2, FP32_ONLY),
]


UNBOUNDED = {"lower_bound": None, **C16}   # chunk_kda: the pair-by-pair diagonal blocks
SOFTPLUS = {"use_gate_in_kernel": True, **UNBOUNDED}


def rms_against(ref_name):
    """The RMS error relative to the reference's `ref_name` output instead of the compared one's own."""
    def metric(actual, expected, refs):
        return (actual.double() - expected).pow(2).mean().sqrt().item() / refs[ref_name].pow(2).mean().sqrt().item()
    metric.needs_refs = True
    return metric


# bounds (tol, metric, dtypes) where the default does not measure what the chunked forms can do, each from the
# errors measured for chunk_kda and torch_chunk (the torch chunked form) on these inputs:
# - g=-20: the true dg is ~1e-10 (every pair decays by e^-20 or more) and a chunked form gets it as the
#   difference of Γ terms the size of k·dk (README.md of k3cli/ops/kda, "Backward"), so its error is measured
#   against dk: 2.5e-10 (chunk_kda, fp32 and fp16 inputs), 2e-9 (torch_chunk); relative to dg itself 0.85, 2.4.
# - softplus-g_raw-pm1e4: after a step of -1e4 the chunk's Γ carries an ulp of ~1e-3, which the small steps after
#   it are differenced from: fp32 outputs and gradients <= 5.4e-4 in both forms; dA_log (Σ g·dg, weighted towards
#   the deepest decays, where dg is that difference) 3.1e-3 and 1.1e-2.
# - softplus-A_log+4 (steps near -20 and below), fp32: dA_log 6.7e-4 and 4.2e-5, d dt_bias 2.6e-4 and 9.5e-5.
ANY = {torch.float32, torch.float16, torch.bfloat16}
UNBOUNDED_TOL = {
    "g=-20": {"dg": (1e-8, rms_against("dk"), ANY)},
    "softplus-g_raw-pm1e4": {**{n: (1.5e-3, relative_rms_error, FP32_ONLY) for n in
                                ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "ddt_bias")},
                             "dA_log": (3e-2, relative_rms_error, FP32_ONLY)},
    "softplus-A_log+4": {"dA_log": (2e-3, relative_rms_error, FP32_ONLY),
                         "ddt_bias": (1e-3, relative_rms_error, FP32_ONLY)},
}
# decay far below the lower-bound gate's -5 per step; torch_chunk_checked promises that bound, so it is left out
UNBOUNDED_CASES = [
    ("g=-20", dict(g=_const(-20.0)), UNBOUNDED, BOTH),
    ("g=-1e4", dict(g=_const(-1e4)), UNBOUNDED, BOTH),
    ("g-in-(-40,0)", dict(g=_scale(8.0)), UNBOUNDED, BOTH),
    ("g-in-(-40,0)-T=300", dict(T=300, g=_scale(8.0)), UNBOUNDED, FP32_ONLY),
    ("softplus-g_raw-pm1e4", dict(gate=True, g=_saturating), SOFTPLUS, BOTH),
    ("softplus-A_log+4", dict(gate=True, A_log=_const(4.0)), SOFTPLUS, BOTH),
    ("softplus-A_log-20", dict(gate=True, A_log=_const(-20.0)), SOFTPLUS, FP32_ONLY),
]


def kda_params():
    out = []
    for name, case, kw, dtypes in KDA_CASES + UNBOUNDED_CASES:
        for path in PATHS:
            if "lower_bound" in kw and path == "torch_chunk_checked":   # lower_bound None: no bound to promise
                continue
            for dtype in sorted(dtypes, key=str):
                if dtype != torch.float32 and path not in KERNELS:
                    continue   # the torch path is trained in fp32 on CPU
                marks = ([pytest.mark.triton] if path in KERNELS else []) + dtype_marks(dtype)
                tols = {n: (tol, m) for n, (tol, m, dts) in UNBOUNDED_TOL.get(name, {}).items() if dtype in dts}
                out.append(pytest.param(path, case, kw, dtype, tols, marks=marks,
                                        id=f"{name}-{path}-{dtype_id(dtype)}"))
    return out


def check_kda(path, case, kw, dtype, tols=None):
    x = cast(kda_case(**case) if isinstance(case, dict) else case, dtype)
    ref = run_kda(reference, cast(x, torch.float64), **kw)
    out = run_kda(PATHS[path], x, **kw)
    for name, r in ref.items():
        assert torch.isfinite(out[name]).all(), f"{path}: {name} is not finite"
        tol = FP32_TOL[path] if dtype == torch.float32 else KDA_TOL[table_name(name, kw)]
        tol, metric = (tols or {}).get(name, (tol, relative_rms_error))
        if getattr(metric, "needs_refs", False):
            metric = functools.partial(lambda a, e, m: m(a, e, ref), m=metric)
        assert_close(f"{path} {name}", out[name], r, tol, metric)


def table_name(name, kw):
    """The row of the KDA tolerance table for an output of run_kda."""
    if name == "dg" and kw.get("use_gate_in_kernel"):
        return "dg_raw"
    return {"dinitial_state": "dh0"}.get(name, name)


@pytest.mark.parametrize("path,case,kw,dtype,tols", kda_params())
def test_kda_extremes(path, case, kw, dtype, tols):
    check_kda(path, case, kw, dtype, tols)


@pytest.mark.parametrize("path", [pytest.param(p, marks=[pytest.mark.triton] if p in KERNELS else []) for p in PATHS])
def test_kda_long_sequence(path):
    """T = 300 with chunk 16 (19 chunks, a partial last one) and a slow gate, so that the initial state and every
    chunk's state reach the end of the sequence."""
    check_kda(path, dict(T=300, G=1, g=lambda t: t / 100), C16, torch.float32)


@pytest.mark.triton
def test_kda_fp16_overflow_is_where_the_true_value_overflows():
    """v * 1e4 in fp16: o and the state fit, but dk and dbeta exceed fp16's range (|dk| ~ 9e4 in fp64). The
    fp16 gradients must be inf exactly where the fp64 ones round to inf, and right elsewhere."""
    x = cast(kda_case(T=40, v=_scale(1e4)), torch.float16)
    ref = run_kda(reference, cast(x, torch.float64), **C16)
    for path in ("chunk_kda", "fused_recurrent_kda"):
        out = run_kda(PATHS[path], x, **C16)
        assert not all(torch.isfinite(out[n]).all() for n in ("dk", "dbeta")), "the case no longer overflows"
        for name, r in ref.items():
            assert_fp16_overflow(f"{path} {name}", out[name], r, KDA_TOL[table_name(name, C16)])


def assert_fp16_overflow(name, got, ref, tol):
    """got is never NaN; inf where ref rounds to inf in fp16 and finite where it does not, but for values
    within tol of that bound (the op's own error may carry them across); within tol (relative RMS) elsewhere."""
    assert not got.isnan().any(), f"{name}: NaN"
    size = ref.abs() / FP16_MAX_ROUNDS_TO
    over, under = size >= 1 + tol, size < 1 - tol
    assert got[over].isinf().all() and got[under].isfinite().all(), \
        f"{name}: inf at {int(got.isinf().sum())} entries, the true value overflows at {int((size >= 1).sum())}"
    fits = got.isfinite()
    assert_close(name, got[fits], ref[fits], tol, relative_rms_error)


# ---------------------------------------------------------------- kda_gate
GATE_TOL = {torch.float32: 1e-5, torch.float16: 1e-3}


def gate_case(g=None, A_log=None):
    gen = torch.Generator().manual_seed(0)
    g_raw = torch.randn(1, 50, 3, 16, generator=gen, dtype=torch.float64)
    a = torch.randn(3, generator=gen, dtype=torch.float64)
    bias = torch.randn(3, 16, generator=gen, dtype=torch.float64)
    return (g_raw if g is None else g(g_raw)), (a if A_log is None else A_log(a)), bias


HALF = {torch.float32, torch.float16}   # the gate's tests state no bf16 bound
# (id, gate_case arguments, g_raw dtypes); fp16 with A_log = -20: d g_raw is below fp16's range
# (test_kda_gate_fp16_gradient_underflows_to_zero)
GATE_CASES = [
    ("g_raw-pm1e4", dict(g=_saturating), HALF),
    ("g_raw+1e4", dict(g=_const(1e4)), HALF),
    ("g_raw-1e4", dict(g=_const(-1e4)), HALF),
    ("A_log+20", dict(A_log=_const(20.0)), HALF),
    ("A_log-20", dict(A_log=_const(-20.0)), FP32_ONLY),
    ("A_log+-20-g_raw-pm1e4", dict(g=_saturating, A_log=lambda a: torch.tensor([20.0, -20.0, 0.0]).double()),
     FP32_ONLY),
]
GATE_PATHS = [pytest.param("triton", marks=pytest.mark.triton), "reference"]


@pytest.fixture(params=GATE_PATHS)
def gate_device(request, monkeypatch):
    """The device of the implementation under test: the kernels' (interpreter or CUDA), or the CPU reference."""
    if request.param == "reference":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return "cpu"
    return DEVICE


def run_gate(fn, g_raw, A_log, dt_bias, device="cpu"):
    leaves = [t.detach().to(device).requires_grad_(True) for t in (g_raw, A_log, dt_bias)]
    y = fn(*leaves)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(device)
    return [t.cpu() for t in (y.detach(), *torch.autograd.grad((y.double() * dy).sum(), leaves))]


def gate_params():
    """Both gates; the softplus gate's d g_raw = -dg·e^A_log·sigmoid(..) does not saturate, so with A_log = 20
    its true value (~5e8) is beyond fp16, where the lower-bound gate's is not."""
    out = []
    for bound, gate in ((-5.0, "lower_bound"), (None, "softplus")):
        for name, edits, dtypes in GATE_CASES:
            if bound is None and name == "A_log+20":
                dtypes = FP32_ONLY
            out += [pytest.param(edits, dt, bound, id=f"{gate}-{name}-{dtype_id(dt)}") for dt in sorted(dtypes, key=str)]
    return out


@pytest.mark.parametrize("cumsum", [True, False], ids=["cumsum", "per-step"])
@pytest.mark.parametrize("edits,dtype,bound", gate_params())
def test_kda_gate_extremes(gate_device, edits, dtype, bound, cumsum):
    g_raw, A_log, dt_bias = gate_case(**edits)
    g_raw = g_raw.to(dtype)
    ref = run_gate(lambda a, b, c: ref_gate(a, b, c, cumsum, bound), g_raw.double(), A_log, dt_bias)
    out = run_gate(lambda a, b, c: kda_gate(a, b, c, lower_bound=bound, chunk_size=16, cumsum=cumsum), g_raw,
                   A_log.float(), dt_bias.float(), gate_device)
    for name, a, b in zip(("g", "dg_raw", "dA_log", "ddt_bias"), out, ref):
        assert torch.isfinite(a).all(), f"{name} is not finite"
        assert_close(name, a, b, GATE_TOL[dtype], relative_rms_error)


def ref_gate(g_raw, A_log, dt_bias, cumsum, lower_bound=-5.0):
    g = naive_kda_gate(g_raw, A_log, dt_bias, lower_bound)
    return chunk_local_cumsum(g, 16) if cumsum else g


def test_kda_gate_fp16_gradient_underflows_to_zero(gate_device):
    """A_log = -20 with fp16 g_raw: the true d g_raw (|x| < 2^-25) rounds to 0 in fp16, and so must the op's."""
    g_raw, A_log, dt_bias = gate_case(A_log=_const(-20.0))
    ref = run_gate(lambda a, b, c: ref_gate(a, b, c, True), g_raw.half().double(), A_log, dt_bias)
    out = run_gate(lambda a, b, c: kda_gate(a, b, c, chunk_size=16), g_raw.half(), A_log.float(), dt_bias.float(),
                   gate_device)
    assert ref[1].abs().max() < 2.0 ** -25 and ref[1].abs().max() > 0
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for name, a, b in zip(("g", "dA_log", "ddt_bias"), out[:1] + out[2:], ref[:1] + ref[2:]):
        assert_close(name, a, b, GATE_TOL[torch.float16], relative_rms_error)


# ---------------------------------------------------------------- AttnRes
def attnres_case(src=1.0, query=1.0, partial=None, zero_source=False, n=4, S=3, D=48):
    srcs, p, q, g, nw = make_inputs(n, 2, 9, D, S, device=DEVICE)
    srcs = [s * src for s in srcs]
    if zero_source:
        srcs[1] = torch.zeros_like(srcs[1])
    return srcs, p * (src if partial is None else partial), q * query, g, nw


ATTNRES_CASES = [
    ("src*1e4", dict(src=1e4), BF16_TOO),
    ("src*1e-4", dict(src=1e-4), BOTH),
    ("query*1e4", dict(query=1e4), BOTH),
    ("query*1e-4", dict(query=1e-4), BOTH),
    ("query*1e4-src*1e4", dict(query=1e4, src=1e4), BF16_TOO),
    ("partial*1e4", dict(partial=1e4), BF16_TOO),
    ("partial*1e-4", dict(partial=1e-4), BOTH),
    ("zero-source", dict(zero_source=True), BOTH),
]


def attnres_params():
    # the partial source is the block form's only
    return [pytest.param(case, form, dt, id=f"{name}-{form}-{dtype_id(dt)}", marks=dtype_marks(dt))
            for name, case, dtypes in ATTNRES_CASES for form in ("full", "full-stacked", "block")
            for dt in sorted(dtypes, key=str) if form == "block" or "partial" not in case]


@pytest.mark.triton
@pytest.mark.parametrize("case,form,dtype", attnres_params())
def test_attnres_extremes(case, form, dtype):
    """fused_attnres (list and stacked sources) and attnres_phase1 + attnres_merge against the fp64 naive forms."""
    inputs = rounded(attnres_case(**case), dtype)
    run = run_block if form == "block" else run_full
    stacked = form == "full-stacked"
    got, ref = run("triton", inputs, dtype, stacked=stacked), run("naive", inputs, torch.float64, stacked=stacked)
    for key, x in got.items():
        assert x is None or torch.isfinite(x).all(), f"{key} is not finite"
    # a saturated softmax: d query and d gain vanish in fp64, so they are held to their rounding bound instead
    vanishing = {k for k in ("dquery", "dgain") if ref[k].double().pow(2).mean().sqrt() <= 1e-12}
    if vanishing:
        bound = vanishing_dw_bound(inputs, ref, form)
        _, _, query, gain, _ = inputs
        for k in vanishing:
            factor = (gain if k == "dquery" else query)[: bound.shape[0]].cpu().abs()
            err = (got[k].double().cpu() - ref[k].cpu()).abs()
            assert (err <= bound * factor).all(), f"{k}: |error| {err.max():.3g} above its rounding bound"
    bad = [f"{n}: {e:.3g} > {t:.3g}" for n, e, _, t, ok in compare(got, ref, dtype) if not ok and n not in vanishing]
    assert not bad, "; ".join(bad)


def vanishing_dw_bound(inputs, ref, form, eps=1e-6):
    """Elementwise bound [S, D] on the fp32 kernels' d w̃ where its fp64 value vanishes.

    d w̃_q = Σ_{j,t} P_qjt r_jt (dh_q·v_j − dh_q·h_q) v_j, with P the softmax weights over the sources v_j
    (the block form's partial among them), r_j = 1/RMS(v_j), dh_q the gradient reaching h_q. Saturated,
    v_j = h_q where P = 1 and P = 0 elsewhere, so the difference is exactly 0 in fp64. The kernels form the two
    dot products as separate fp32 sums; the block form in two kernels (phase-1 backward and merge backward)
    whose autotuned tile shapes may sum in different orders, each off by at most γ_D Σ|terms|, γ_D = D·2^-24.
    With sources and queries ×1e4 the bf16 block case failed the relative table on an H100 (which compares the
    absolute error where the reference vanishes); two summation orders of its dot products give d gain ~1e2
    against a true 1e-104. The bound is ~2e-4 of d query's scale with the same sources and query ×1 (1.3e5)."""
    srcs, partial, query, gain, nw = [t.cpu() if torch.is_tensor(t) else [s.cpu() for s in t] for t in inputs]
    # the outputs the run fed gradients to, in its order: h0, y0, h1, ... (block) or h, y (full, query 0)
    suffixes = [str(q) for q in range(query.shape[0])] if form == "block" else [""]
    names = [f"{o}{x}" for x in suffixes for o in ("h", "y")]
    ups = dict(zip(names, upstream_grads([ref[n].cpu() for n in names])))
    bound = torch.zeros(len(suffixes), nw.shape[0], dtype=torch.float64)
    for q, x in enumerate(suffixes):
        h = ref[f"h{x}"].detach().cpu().requires_grad_(True)
        dh = ups[f"h{x}"] + torch.autograd.grad(rms_norm(h, nw, 1e-6), h, ups[f"y{x}"])[0]
        vs = srcs + ([partial] if form == "block" and q > 0 else [])
        v, r = torch.stack(vs), torch.stack(source_keys(vs, eps))
        weight = torch.softmax((v @ (query[q] * gain[q])) * r, dim=0)
        terms = (dh * v).abs().sum(-1) + (dh * h.detach()).abs().sum(-1)
        bound[q] = nw.shape[0] * 2.0 ** -24 * torch.einsum("jbt,jbtd->d", weight * r * terms, v.abs())
    return bound


@pytest.mark.triton
@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_attnres_fp16_overflow_is_where_the_true_value_overflows(stacked):
    """Sources and partial * 3e3 in fp16: the mix fits, the query gradient (~1e5 in fp64) does not. It must be
    inf exactly where the fp64 value rounds to inf, and right elsewhere. The full form only: in the block
    form a query is used by phase 1 and by its merge, and autograd adds the two gradients in fp16, so one
    that overflows makes the sum inf where the sum itself would fit (no op's error: keep such leaves fp32)."""
    from k3cli.ops.attnres.verify import tolerance
    inputs = rounded(attnres_case(src=3e3), torch.float16)
    got, ref = run_full("triton", inputs, torch.float16, stacked), run_full("naive", inputs, torch.float64, stacked)
    assert not torch.isfinite(got["dquery"]).all(), "the case no longer overflows"
    for key in ref:
        assert_fp16_overflow(key, got[key], ref[key], tolerance(key, torch.float16))
