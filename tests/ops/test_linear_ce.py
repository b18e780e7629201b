"""The chunked linear + cross-entropy against F.cross_entropy on full logits: the loss and the gradients of
the hidden states and the head weight, on awkward shapes (one token, a last chunk that is short, odd sizes,
ignored labels), fp32 and fp64."""
import pytest
import torch

from k3cli.ops.linear_ce import linear_cross_entropy, linear_cross_entropy_reference
from k3cli.testing import assert_close


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


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("N, D, V, rows, ignore_every", [
    (1, 8, 11, None, 0),        # one token
    (37, 24, 101, 8, 0),        # chunks of 8, the last of 5
    (64, 33, 257, 64, 3),       # one chunk, every third label ignored
    (50, 16, 7, 1, 2),          # a chunk per token, half ignored
    (20, 12, 50, 7, 0),
])
def test_equals_cross_entropy_on_full_logits(N, D, V, rows, ignore_every, dtype, tol):
    h, w, labels = case(N, D, V, dtype, ignore_every)
    ref = loss_and_grads(linear_cross_entropy_reference, h, w, labels)
    got = loss_and_grads(linear_cross_entropy, h, w, labels, rows=rows)
    for name, a, b in zip(("loss", "dh", "dw"), got, ref):
        assert_close(name, a, b, tol)


def test_every_label_ignored_is_nan_as_cross_entropy():
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
