"""Argument checks shared by the kernel entry points (KDA: kda/checks.py; AttnRes: attnres/fused.py).

They look at types, shapes, dtypes and devices only: no tensor data is read (no host sync), so they cost
microseconds and torch.compile traces through them. Every message is one line that starts with the op's
name, names the offending argument and gives what was expected and what came.
"""
from __future__ import annotations

import numbers

import torch

# what the Triton kernels load and store; float64 goes to the naive references (the kernels compute in fp32)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class InputTypeError(TypeError, ValueError):
    """A wrong type or dtype: a TypeError by Python's convention, and a ValueError like every other rejected
    input of these ops, so that `except ValueError` catches them all."""


def dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(op: str, name: str, x, ndim: int, device=None, dtypes=FLOATS, shape: tuple | None = None,
                 ref: str | None = None) -> None:
    """x is a tensor of `ndim` dims (of exactly `shape` if given), of one of `dtypes`, on `device` (None: any;
    `ref` names the argument that device is taken from)."""
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dims, got shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} shape {tuple(x.shape)} must be {tuple(shape)}")
    if x.dtype not in dtypes:
        raise InputTypeError(f"{op}: {name} dtype {x.dtype} not in [{dtype_names(dtypes)}]")
    if device is not None and x.device != device:
        of = f" (the device of {ref})" if ref else ""
        raise ValueError(f"{op}: {name} is on {x.device}, expected {device}{of}")


def check_number(op: str, name: str, x, low: float | None = None, high: float | None = None,
                 high_open: bool = False) -> None:
    """x is a Python number (reading a tensor would sync) in [low, high]; [low, high) with high_open."""
    # Sym*: a value torch.compile made dynamic
    if isinstance(x, bool) or not isinstance(x, (numbers.Real, torch.SymInt, torch.SymFloat)):
        raise InputTypeError(f"{op}: {name} must be a float, got {type(x).__name__}")
    below = low is not None and not x >= low   # `not >=`: NaN fails too
    if below or (high is not None and not (x < high if high_open else x <= high)):
        lo, hi = "-inf" if low is None else low, "inf" if high is None else high
        raise ValueError(f"{op}: {name}={x} must be in [{lo}, {hi}{')' if high_open else ']'}")
