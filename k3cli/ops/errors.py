"""The error metrics the tolerance tables are stated in (the ops' verify modules and the tests)."""
from __future__ import annotations

import torch


def scaled_max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| / max(max |expected|, 1): relative for large values, absolute near 0."""
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item()


def relative_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """RMS(actual − expected) / RMS(expected) over all elements, in fp64.

    Where expected is zero up to fp64 rounding (RMS ≤ 1e-12, e.g. a gradient the math says vanishes)
    there is no relative error: the absolute RMS of the difference is returned instead.
    """
    actual, expected = actual.double(), expected.double()
    err, ref = (actual - expected).pow(2).mean().sqrt().item(), expected.pow(2).mean().sqrt().item()
    return err if ref <= 1e-12 else err / ref


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| over all elements."""
    return (actual - expected).abs().max().item()
