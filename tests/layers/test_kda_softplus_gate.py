"""KDA's softplus gate (Kimi Linear's, docs/math.md §2.3): g = −exp(A_log)·softplus(W x + dt_bias), with no lower
bound. The layer against the token-by-token recurrence (outputs and every gradient), at decays far below −5 per
step; prefill + decode against the full forward; packed documents against each document alone; the Triton
decode step (interpreter on CPU) against the torch one."""
import pytest
import torch
import torch.nn.functional as F

from k3cli.layers.kda import KDAAttention
from k3cli.layers.segments import Segments
from k3cli.ops.kda import naive
from k3cli.testing import assert_close, scaled_max_error

GATE_PARAMS = ("A_log", "dt_bias", "f_a.weight", "f_b.weight")


def make(D=24, H=2, HV=2, K=8, V=6, conv=4, chunk=16, a_log=0.0, seed=0, backend="torch") -> KDAAttention:
    torch.manual_seed(seed)
    m = KDAAttention(D, H, HV, K, V, short_conv=conv, chunk_size=chunk, backend=backend, gate="softplus")
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("proj.weight") or name[:3] in ("f_a", "f_b", "g_a", "g_b"):
                p.normal_(std=0.3)
        m.A_log.fill_(a_log)   # exp(a_log) scales every step's decay
    return m.double()


def run(m, x, **kw):
    m.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    y = m(x, **kw)
    # drawn in fp64 whatever y's dtype: a bf16 draw is another sequence of numbers, not a rounding of this one
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y))
    return y.detach(), {"x": x.grad, **{n: p.grad.clone() for n, p in m.named_parameters()}}


def reference_gate(g_raw, A_log, dt_bias):
    # the definition, written out: −e^{A_h} · softplus(raw + bias), per head h and key channel
    return -(A_log.double().exp()[:, None]) * F.softplus(g_raw.double() + dt_bias.double())


def test_gate_is_the_definition():
    g_raw = torch.randn(2, 5, 3, 4, dtype=torch.float64) * 4
    A_log, dt = torch.randn(3, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    g = naive.naive_kda_softplus_gate(g_raw, A_log, dt)
    assert_close("g", g, reference_gate(g_raw, A_log, dt), 1e-12)
    assert (g <= 0).all()


# (id, conv, H, HV, T, chunk, a_log): a_log 4 makes steps of −20 and below (e^4 · softplus)
CASES = [
    ("conv4_T20", 4, 2, 2, 20, 16, 0.0),
    ("GVA_T33_odd_chunk", 2, 1, 2, 33, 16, 0.0),
    ("T1", 4, 2, 2, 1, 16, 0.0),
    ("deep_decay", 4, 2, 2, 37, 16, 4.0),
    ("deep_decay_chunk64", 0, 2, 4, 70, 64, 4.0),
]


@pytest.mark.parametrize("conv,H,HV,T,chunk,a_log", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_chunked_softplus_layer_equals_the_recurrence(conv, H, HV, T, chunk, a_log, monkeypatch):
    m = make(H=H, HV=HV, conv=conv, chunk=chunk, a_log=a_log)
    x = torch.randn(2, T, 24, dtype=torch.float64)
    with torch.no_grad():
        g = m._gate(m.f_b(m.f_a(x)).view(2, T, HV, 8))
    if a_log:
        assert g.min() < -20   # far below the lower-bound gate's −5
    y, grads = run(m, x)
    bad = [n for n, d in grads.items() if not torch.isfinite(d).all()]
    assert bad == [], f"non-finite gradients: {bad}"
    # the chunked form swapped for the definition: the recurrence token by token, each row's document alone
    from k3cli.ops.kda import torch_chunk
    oracle = naive.naive_chunk_kda_varlen

    def recurrence(*a, chunk_size, output_final_state=False, reach_checked=False):
        return oracle(*a, chunk_size=chunk_size, output_final_state=output_final_state,
                      fn=lambda *b, chunk_size, **kw: naive.naive_recurrent_kda(*b, **kw))
    monkeypatch.setattr(torch_chunk, "torch_chunk_kda_varlen", recurrence)
    y_ref, g_ref = run(m, x)
    assert_close("y", y, y_ref, 1e-9)
    for name in g_ref:
        if not (T == 1 and name in GATE_PARAMS):
            assert_close(f"d{name}", grads[name], g_ref[name], 1e-5 if name in GATE_PARAMS else 1e-9)


@pytest.mark.parametrize("a_log", [0.0, 3.0])
def test_prefill_then_decode_equals_the_full_forward(a_log):
    m = make(a_log=a_log).eval()
    x = torch.randn(2, 21, 24, dtype=torch.float64)
    with torch.no_grad():
        full = m(x)
        cache = m.new_cache()
        parts = [m(x[:, :13], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(13, 21)]
    assert_close("decode", torch.cat(parts, 1), full, 1e-10)


def test_packed_documents_equal_each_document_alone():
    m = make(a_log=2.0)
    lengths = [5, 19, 8]
    x = torch.randn(1, sum(lengths), 24, dtype=torch.float64)
    starts = torch.zeros(1, sum(lengths), dtype=torch.bool)
    starts[0, torch.tensor([0, 5, 24])] = True
    with torch.no_grad():
        packed = m(x, segments=Segments.from_starts(starts))
        alone = torch.cat([m(part) for part in x.split(lengths, dim=1)], 1)
    assert_close("packed", packed, alone, 1e-10)


@pytest.mark.triton
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_triton_layer_equals_the_torch_layer(packed):
    """The Triton path (the softplus gate in the kernel, chunked KDA with pair-by-pair diagonal score blocks;
    the interpreter on CPU) against the torch path, fp32, steps below −20: outputs and every gradient."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = make(H=1, HV=2, a_log=4.0).float().to(dev)
    x = torch.randn(2, 37, 24, device=dev)
    kw = {}
    if packed:
        x = x.view(1, 74, 24)
        starts = torch.zeros(1, 74, dtype=torch.bool)
        starts[0, torch.tensor([0, 5, 40])] = True
        kw["segments"] = Segments.from_starts(starts, dev)
    runs = {}
    for backend in ("torch", "triton"):
        m.backend = backend
        runs[backend] = run(m, x, **kw)
    (y_ref, g_ref), (y, g) = runs["torch"], runs["triton"]
    assert_close("y", y, y_ref, 1e-5)
    for name in g_ref:
        assert_close(f"d{name}", g[name], g_ref[name], 1e-4)


@pytest.mark.triton
def test_triton_decode_step_equals_the_torch_one():
    """Prefill by the chunked kernel and decode by the fused recurrent one, both with the softplus gate in the
    kernel, against the torch path."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = make(a_log=3.0).float().to(dev).eval()
    x = torch.randn(2, 9, 24, device=dev)
    outs = []
    for backend in ("torch", "triton"):
        m.backend = backend
        with torch.no_grad():
            cache = m.new_cache()
            outs.append(torch.cat([m(x[:, :4], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(4, 9)], 1))
    assert_close("triton decode", outs[1], outs[0], 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("a_log", [0.0, 4.0])
def test_bf16_on_the_gpu_follows_the_fp32_layer(a_log):
    """The softplus gate in bf16 under autocast on CUDA (the Triton kernels), against the same layer in fp32:
    outputs and every gradient, at decays below −20 per step too, each within twice the error of the torch path
    in bf16 (its rounding alone; a conv weight's gradient, a sum over every token, carries ~6 %) or 1e-2."""
    m = make(a_log=a_log, backend="auto").float().cuda()
    x = torch.randn(2, 70, 24, device="cuda")
    y_ref, g_ref = run(m, x)
    errs = {}
    for backend in ("torch", "auto"):
        m.backend = backend
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, g = run(m, x)
        errs[backend] = {"y": scaled_max_error(y.float(), y_ref),
                         **{f"d{n}": scaled_max_error(g[n].float(), g_ref[n]) for n in g_ref}}
    for name, err in errs["auto"].items():
        assert err <= max(2 * errs["torch"][name], 1e-2), (name, err, errs["torch"][name])
