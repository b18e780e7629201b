"""Several bias-free projections of one input as one matmul.

A layer that projects its input x through n small weights W_1 … W_n (KDA's gate and output-gate
down-projections, MLA's two latents and gate, the MoE's latent and shared experts) reads x n times
and, in the backward, writes n gradients of x that autograd then adds. As one product with the rows
[W_1; …; W_n] stacked, x is read once, the backward's dx is one matmul, and narrow weights (KDA's
b_proj has HV rows) no longer run as matmuls too thin to use the tensor cores. The parameters stay
the separate nn.Linear modules, so checkpoints and the references do not change.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def fused_linear(x: torch.Tensor, *layers: nn.Linear) -> tuple[torch.Tensor, ...]:
    """(layer(x) for layer in layers) as one matmul: x [..., D] -> one [..., out_i] per layer."""
    if len(layers) == 1:   # nothing to fuse: no copy of the weight
        return (layers[0](x),)
    weight = torch.cat([layer.weight for layer in layers])
    return F.linear(x, weight).split([layer.out_features for layer in layers], dim=-1)


def summed_linear(xs: list[torch.Tensor], layers: list[nn.Linear]) -> torch.Tensor:
    """Σ_i layers[i](xs[i]) as one matmul over the inputs concatenated along features: the sum
    happens in the product's fp32 accumulator instead of as separate adds of rounded outputs."""
    if len(layers) == 1:
        return layers[0](xs[0])
    x = torch.cat(xs, dim=-1)
    return F.linear(x, torch.cat([layer.weight for layer in layers], dim=1))
