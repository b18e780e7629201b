"""Host-made tensors (index tables, token batches) onto the device without holding the host."""
from __future__ import annotations

import torch


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """`x` (CPU) on `device`. To a GPU through pinned memory, asynchronously: a copy from pageable memory
    synchronises the stream, so the host could not enqueue more work while the GPU runs."""
    device = torch.device("cpu" if device is None else device)
    return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)
