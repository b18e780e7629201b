"""fused_linear / summed_linear: one matmul gives what the separate projections give, values and gradients."""
import torch
from torch import nn

from k3cli.layers.linear import fused_linear, summed_linear


def _linears(shapes, seed=0):
    torch.manual_seed(seed)
    return [nn.Linear(i, o, bias=False).double() for i, o in shapes]


def test_fused_linear_matches_separate_projections():
    layers = _linears([(12, 5), (12, 1), (12, 7)])   # odd widths, one a single row (KDA's b_proj at HV = 1)
    x = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    got = fused_linear(x, *layers)
    ref = [layer(x) for layer in layers]
    dys = [torch.randn_like(r) for r in ref]
    params = [x, *(layer.weight for layer in layers)]
    g_got = torch.autograd.grad(sum((y * dy).sum() for y, dy in zip(got, dys)), params)
    g_ref = torch.autograd.grad(sum((y * dy).sum() for y, dy in zip(ref, dys)), params)
    assert [tuple(y.shape) for y in got] == [(2, 3, 5), (2, 3, 1), (2, 3, 7)]
    for a, b in zip([*got, *g_got], [*ref, *g_ref]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_summed_linear_matches_the_sum_of_projections():
    layers = _linears([(4, 6), (9, 6), (1, 6)])
    xs = [torch.randn(5, n, dtype=torch.float64, requires_grad=True) for n in (4, 9, 1)]
    got = summed_linear(xs, layers)
    ref = sum(layer(x) for layer, x in zip(layers, xs))
    dy = torch.randn_like(ref)
    params = [*xs, *(layer.weight for layer in layers)]
    g_got = torch.autograd.grad((got * dy).sum(), params)
    g_ref = torch.autograd.grad((ref * dy).sum(), params)
    for a, b in zip([got, *g_got], [ref, *g_ref]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_one_layer_is_the_layer_itself():
    (layer,) = _linears([(3, 2)])
    x = torch.randn(4, 3, dtype=torch.float64)
    assert torch.equal(fused_linear(x, layer)[0], layer(x))
    assert torch.equal(summed_linear([x], [layer]), layer(x))
