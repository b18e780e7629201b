"""Which implementation of the KDA ops a layer runs: the one place `kda.backend` (auto | triton | torch) is read."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # no torch import: the config imports this module for `k3 --help`
    import torch

BACKENDS = ("auto", "triton", "torch")


def kda_triton_op(backend: str, device: torch.device, name: str = "chunk_kda"):
    """The Triton op `name` (chunk_kda | fused_recurrent_kda | short_conv: entry points of the k3:: custom ops,
    opaque nodes under torch.compile) for `backend` on `device`, or None for the torch path. auto: Triton on
    CUDA when it imports; triton: always (an error when it cannot import); torch: never."""
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return None
    try:
        from k3cli.ops import kda
        return getattr(kda, name)
    except ImportError as e:
        if backend == "triton":
            raise RuntimeError(f"kda.backend=triton but the Triton {name} is unavailable: {e}") from None
        return None
