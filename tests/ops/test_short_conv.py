"""short_conv (KDA's fused depthwise causal conv + SiLU + per-head L2 norm) against its torch reference in fp64:
the output and both gradients, on awkward shapes (T = 1, T past one tile, odd channel counts, a head size that is
not a power of 2, document boundaries, several tiles per backward program). Kernels run on CUDA or on CPU under
Triton's interpreter (fp32 and fp16 there: the interpreter's bf16 is wrong; bf16 is checked on the GPU)."""
import pytest
import torch

from k3cli.ops.custom import triton_runs
from k3cli.ops.kda import conv
from k3cli.ops.kda.conv import (
    document_positions,
    short_conv,
    short_conv_bwd_op,
    short_conv_op,
    short_conv_reference,
)
from k3cli.testing import assert_close, relative_rms_error

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# relative RMS error against fp64, per input dtype (fp16: one rounding of x, y, dy and the stored da)
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def positions(B, T, seed=0, p=0.15):
    """Each token's position in its document, documents starting where a coin with probability p lands."""
    gen = torch.Generator().manual_seed(seed)
    return document_positions(torch.rand(B, T, generator=gen) < p)


def inputs(B, T, C, W, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen).to(DEV, dtype)
    w = (torch.randn(C, W, generator=gen) * 0.6).to(DEV)
    dy = torch.randn(B, T, C, generator=gen).to(DEV, dtype)
    return x, w, dy


def grads(fn, x, w, dy, *args):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w, *args)
    dx, dw = torch.autograd.grad(y, (x, w), dy.to(y.dtype))
    return {"y": y.detach(), "dx": dx, "dw": dw}


CASES = [
    pytest.param(1, 1, 20, 4, 5, False, id="T1-head5"),
    pytest.param(2, 37, 24, 4, 8, False, id="T37-head8"),
    pytest.param(2, 70, 16, 4, 0, True, id="T70-docs-nonorm"),
    pytest.param(1, 40, 300, 4, 0, False, id="C300-three-tiles"),
    pytest.param(2, 45, 12, 3, 4, True, id="W3-docs-head4"),
    pytest.param(1, 9, 6, 1, 3, False, id="W1"),
]


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("B,T,C,W,norm_dim,docs", CASES)
def test_short_conv_matches_reference(B, T, C, W, norm_dim, docs, dtype):
    x, w, dy = inputs(B, T, C, W, dtype)
    pos = positions(B, T).to(DEV) if docs else None
    out = grads(short_conv, x, w, dy, pos, norm_dim)
    ref = grads(short_conv_reference, x.double(), w.double(), dy.double(), pos, norm_dim)
    assert out["y"].dtype == dtype and out["dx"].dtype == dtype and out["dw"].dtype == torch.float32
    for name in ("y", "dx", "dw"):
        assert_close(name, out[name], ref[name], TOL[dtype], relative_rms_error)


@pytest.mark.triton
def test_short_conv_backward_loops_over_tiles(monkeypatch):
    """With few programs allowed, each backward program sums dw over several row tiles: the same gradients."""
    x, w, dy = inputs(2, 150, 16, 4, torch.float32)
    pos = positions(2, 150, seed=1).to(DEV)
    one = grads(short_conv, x, w, dy, pos, 8)
    monkeypatch.setattr(conv, "_PROGRAMS", 1)
    looped = grads(short_conv, x, w, dy, pos, 8)
    ref = grads(short_conv_reference, x.double(), w.double(), dy.double(), pos, 8)
    for name in ("y", "dx", "dw"):
        assert_close(name, looped[name], ref[name], TOL[torch.float32], relative_rms_error)
    torch.testing.assert_close(looped["dx"], one["dx"], rtol=0, atol=0)


@pytest.mark.triton
def test_short_conv_documents_do_not_leak():
    """A token's output and its input's gradient see nothing of the documents before and after it."""
    B, T, C = 1, 40, 8
    x, w, dy = inputs(B, T, C, 4, torch.float32)
    pos = positions(B, T, seed=2, p=0.2).to(DEV)
    starts = (pos[0] == 0).nonzero().flatten().tolist() + [T]
    a, b = starts[1], starts[2]                                          # the second document
    alone = grads(short_conv, x[:, a:b], w, dy[:, a:b], None, 4)
    packed = grads(short_conv, x, w, dy, pos, 4)
    torch.testing.assert_close(packed["y"][:, a:b], alone["y"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(packed["dx"][:, a:b], alone["dx"], rtol=1e-6, atol=1e-6)


@pytest.mark.triton
def test_short_conv_eager_function_equals_op():
    """Eagerly short_conv runs the op's implementation under an autograd.Function: bitwise equal to the op."""
    x, w, dy = inputs(2, 37, 24, 4, torch.float32)
    pos = positions(2, 37).to(DEV)
    via_op = grads(lambda a, b: short_conv_op(a, b, pos, 8, 1e-6), x, w, dy)
    eager = grads(lambda a, b: short_conv(a, b, pos, 8), x, w, dy)
    for name in ("y", "dx", "dw"):
        torch.testing.assert_close(eager[name], via_op[name], rtol=0, atol=0)


@pytest.mark.parametrize("path", [pytest.param("triton", marks=pytest.mark.triton), "reference"])
def test_opcheck_short_conv(path, monkeypatch):
    if path == "reference":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dev = DEV if path == "triton" else "cpu"
    assert triton_runs(torch.device(dev)) == (path == "triton")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 8, generator=gen).to(dev).requires_grad_()
    w = torch.randn(8, 4, generator=gen).to(dev).requires_grad_()
    pos = positions(2, 9).to(dev)
    for p, nd in ((None, 4), (pos, 0)):
        torch.library.opcheck(short_conv_op, (x, w, p, nd, 1e-6))
        torch.library.opcheck(short_conv_bwd_op, (x.detach(), w.detach(), p, torch.randn_like(x), nd, 1e-6))


def test_short_conv_fp64_and_cpu_reference_path(monkeypatch):
    """fp64 (and CPU without the interpreter) runs the torch form: equal to the reference."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w, dy = inputs(1, 11, 8, 4, torch.float64)
    x, w, dy = x.cpu(), w.cpu().double(), dy.cpu()
    out = grads(short_conv, x, w, dy, None, 4)
    ref = grads(short_conv_reference, x, w, dy, None, 4)
    for name in ("y", "dx", "dw"):
        torch.testing.assert_close(out[name], ref[name], rtol=0, atol=0)


def test_short_conv_rejects_bad_input():
    x = torch.randn(1, 5, 8)
    w = torch.randn(8, 4)
    cases = [((x[0], w), "x must have 3 dims"), ((x, torch.randn(6, 4)), r"weight shape \(6, 4\) must be \[C=8, W\]"),
             ((x, torch.randn(8, 5)), "1 <= W <= 4"), ((x.int(), w), "x dtype"),
             ((x, w, torch.zeros(1, 4, dtype=torch.long)), r"pos shape \(1, 4\) must be \(1, 5\)"),
             ((x, w, torch.zeros(1, 5)), "pos dtype"), ((x, w, None, 3), "norm_dim=3 must be 0 or divide C=8"),
             ((x, w, None, -8), "norm_dim=-8"), ((x, w, None, 4, -1.0), "eps=-1.0")]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            short_conv(*args)
