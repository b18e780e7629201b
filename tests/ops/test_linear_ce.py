"""The chunked linear + cross-entropy against F.cross_entropy on full logits: the loss and the gradients of
the hidden states and the head weight, on awkward shapes (one token, a last chunk that is short, odd sizes,
ignored labels), fp32 and fp64, through the row kernel (the interpreter on a CPU) and through its torch form;
the row kernel against `ce_rows_reference`, rows wider than one kernel block, fp16 logits; autocast; the op's
registration (opcheck) and one full graph under torch.compile."""
import pytest
import torch

import k3cli.ops.linear_ce as lce
from k3cli.ops.custom import triton_runs
from k3cli.ops.linear_ce import (
    ce_rows,
    ce_rows_reference,
    linear_ce_op,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from k3cli.testing import assert_close

INTERPRETED = triton_runs(torch.device("cpu"))
needs_triton = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                  reason="the row kernel needs CUDA or TRITON_INTERPRET=1")


def case(N, D, V, dtype, ignore_every=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=dtype) * 2
    w = torch.randn(V, D, generator=g, dtype=dtype) * 0.3
    labels = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        labels[::ignore_every] = -100
    return h, w, labels


def loss_and_grads(fn, h, w, labels, **kw):
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = fn(h, w, labels, **kw)
    loss.backward(torch.tensor(1.7, dtype=loss.dtype))
    return loss.detach(), h.grad, w.grad


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """The row kernel (on a CPU: under TRITON_INTERPRET=1, which the op leaves to these tests) or its torch form."""
    if request.param == "kernel":
        if not INTERPRETED:
            pytest.skip("the row kernel runs on a CPU under TRITON_INTERPRET=1 only")
        monkeypatch.setattr(lce, "_kernel_runs", lambda device: True)
    return request.param


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("N, D, V, rows, ignore_every", [
    (1, 8, 11, None, 0),        # one token
    (37, 24, 101, 8, 0),        # chunks of 8, the last of 5
    (64, 33, 257, 64, 3),       # one chunk, every third label ignored
    (50, 16, 7, 1, 2),          # a chunk per token, half ignored
    (20, 12, 50, 7, 0),
])
def test_equals_cross_entropy_on_full_logits(N, D, V, rows, ignore_every, dtype, tol, path):
    h, w, labels = case(N, D, V, dtype, ignore_every)
    ref = loss_and_grads(linear_cross_entropy_reference, h, w, labels)
    got = loss_and_grads(linear_cross_entropy, h, w, labels, rows=rows)
    for name, a, b in zip(("loss", "dh", "dw"), got, ref):
        assert_close(name, a, b, tol)


def test_every_label_ignored_is_nan_as_cross_entropy(path):
    h, w, labels = case(4, 8, 9, torch.float32)
    labels[:] = -100
    assert torch.isnan(linear_cross_entropy(h, w, labels, rows=2))
    assert torch.isnan(linear_cross_entropy_reference(h, w, labels))


def test_bad_shapes_are_one_error():
    h, w, labels = case(4, 8, 9, torch.float32)
    with pytest.raises(ValueError, match="h \\[N, D\\], w \\[V, D\\], labels \\[N\\]"):
        linear_cross_entropy(h, w[:, :5], labels)


def test_one_full_graph_under_compile():
    h, w, labels = case(37, 24, 101, torch.float32, ignore_every=4)
    ref = loss_and_grads(linear_cross_entropy, h, w, labels, rows=8)
    compiled = torch.compile(linear_cross_entropy, fullgraph=True, backend="aot_eager")
    got = loss_and_grads(compiled, h, w, labels, rows=8)
    for name, a, b in zip(("loss", "dh", "dw"), got, ref):
        assert_close(name, a, b, 1e-6)


@needs_triton
@pytest.mark.parametrize("R, V, dtype, tol", [
    (3, 5000, torch.float32, 1e-6),     # wider than one 4,096-column block: the online max over pieces
    (5, 4096, torch.float32, 1e-6),     # exactly one block
    (4, 77, torch.float16, 2e-3),       # 16-bit logits, dz rounded to fp16 on the store
    (1, 1, torch.float32, 1e-6),        # a one-word vocabulary: loss 0, dz 0
])
def test_row_kernel_equals_its_torch_form(R, V, dtype, tol):
    g = torch.Generator().manual_seed(1)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    z = (torch.randn(R, V, generator=g) * 6).to(dev, dtype)
    labels = torch.randint(0, V, (R,), generator=g).to(dev)
    labels[R // 2] = -100
    scale = torch.tensor(0.37, device=dev)
    loss_ref, dz_ref = ce_rows_reference(z, labels, scale, -100)
    zk = z.clone()
    loss = ce_rows(zk, labels, scale, -100)
    assert_close("loss", loss, loss_ref, tol)
    assert_close("dz", zk.float(), dz_ref.float(), tol)
    assert (zk[R // 2] == 0).all() and loss[R // 2] == 0          # an ignored row: no loss, no gradient
    assert_close("loss, no grad", ce_rows(z.clone(), labels, scale, -100, grad=False), loss_ref, tol)


def test_fp16_and_autocast_follow_the_full_logits(path):
    """fp16 inputs: the logits are rounded to fp16 as F.linear rounds them; under autocast (fp16 on a CPU) h and
    w are cast as F.linear casts them, and the gradients come back in the leaves' dtype."""
    h, w, labels = case(40, 24, 300, torch.float32, ignore_every=5)
    for cast in ("fp16", "autocast"):
        if cast == "fp16":
            args = (h.half(), w.half(), labels)
            ref = loss_and_grads(linear_cross_entropy_reference, *args)
            got = loss_and_grads(linear_cross_entropy, *args, rows=16)
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                ref = loss_and_grads(linear_cross_entropy_reference, h, w, labels)
                got = loss_and_grads(linear_cross_entropy, h, w, labels, rows=16)
        assert [x.dtype for x in got[1:]] == [x.dtype for x in ref[1:]]
        for name, a, b in zip(("loss", "dh", "dw"), got, ref):
            assert_close(f"{cast} {name}", a.float(), b.float(), 2e-3)


def test_no_gradients_made_without_autograd(path):
    h, w, labels = case(37, 24, 101, torch.float32, ignore_every=4)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, labels, rows=8)
    _, dh, dw = linear_ce_op(h, w, labels, -100, 8, False)
    assert dh.numel() == 0 and dw.numel() == 0
    assert_close("loss", loss, linear_cross_entropy_reference(h, w, labels), 2e-5)


def test_opcheck():
    h, w, labels = case(37, 24, 101, torch.float32, ignore_every=4)
    for grad in (True, False):
        args = (h.requires_grad_(grad), w.requires_grad_(grad), labels, -100, 8, grad)
        torch.library.opcheck(linear_ce_op, args)
