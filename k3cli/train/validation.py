"""The validation loss, as the training loop, `k3 eval` and `k3 study` compute it."""
from __future__ import annotations

import contextlib

import torch

from k3cli import distributed as par
from k3cli.data import EOT_ID
from k3cli.distributed.compile import uncompiled
from k3cli.models.causal_lm import CausalLM
from k3cli.ops.transfer import to_device
from k3cli.train.batches import document_segments


@torch.no_grad()
def evaluate_loss(forward, batches: list[torch.Tensor], device: torch.device,
                  autocast_dtype: torch.dtype | None, module: CausalLM | None = None,
                  rank: int = 0, world_size: int = 1, document_mask: bool = False, start_id: int = EOT_ID) -> float:
    """Mean validation loss over `batches`; `forward` is the model or its compiled / wrapped form
    (then `module` is the model, whose train/eval mode is switched). With several ranks (all call
    it) each evaluates its rows of every batch and the sums are added over ranks. `document_mask`:
    as training does (data.document_mask), documents starting at `start_id`; on CUDA it evaluates with nothing
    compiled."""
    model = forward if module is None else module
    was_training = model.training
    model.eval()
    # fp64 on the device: the same sums as adding Python floats, one read-back at the end
    total = torch.zeros(2, dtype=torch.float64, device=device)
    # Inductor's no-grad FlexAttention kernel faults on an H200 (torch 2.11, docs/performance.md)
    eager = document_mask and device.type == "cuda"
    with uncompiled(forward, model) if eager else contextlib.nullcontext(forward) as forward:
        for ids in batches:
            ids, counted = par.eval_rows(ids, rank, world_size)
            segments = document_segments(ids, device, document_mask, start_id)
            ids = to_device(ids, device)
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                out = forward(ids, labels=ids, segments=segments)
            if counted:
                total[0] += out.loss.float().double() * ids.numel()
                total[1] += ids.numel()
    par.all_reduce_sum_(total)
    model.train(was_training)
    loss_sum, n = total.tolist()
    return loss_sum / max(1, n)
