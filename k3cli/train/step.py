"""One optimiser step, without a host synchronisation: the function `k3 train` loops over and
`k3 bench-train` times.

Micro-batches are accumulated (gradients reduced over ranks in the last one's backward), the
gradient norm clipped, the MoE loads summed over ranks, then AdamW steps. The step's scalars (loss,
gradient norm, MoE imbalance) stay on the device for the caller to read when it logs. A non-finite
loss or gradient norm is found on the device too: fused AdamW's `found_inf` then skips that step's
update (its step count included), so no weight ever becomes non-finite, and the caller stops the
run when it reads the scalars.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from k3cli import distributed as par
from k3cli.layers.moe import max_over_mean
from k3cli.train.batches import Batch


def moe_imbalance(layers: list) -> torch.Tensor | None:
    """Max over MoE layers of `max_over_mean` of their loads since the last bias update, as a 0-dim
    tensor on the device; None without MoE layers."""
    if not layers:
        return None
    return max_over_mean(torch.stack([m.load_counts for m in layers])).max()


class TrainStep:
    """`step(next_batch)` runs one optimiser step on `accum` micro-batches from `next_batch()` and
    returns its scalars as one fp64 device tensor: [loss, gradient norm] (+ [MoE imbalance]).

    `forward` is the model or its compiled / parallel form; `model` the module itself (parameters,
    MoE layers). The loss is the mean over micro-batches (and ranks) of the model's mean token loss."""

    def __init__(self, model: torch.nn.Module, forward: Callable, opt: torch.optim.Optimizer, sched,
                 accum: int, grad_clip: float, device: torch.device):
        self.model, self.forward, self.opt, self.sched = model, forward, opt, sched
        self.accum, self.device = accum, device
        self.max_norm = grad_clip if grad_clip > 0 else float("inf")
        self.autocast = torch.bfloat16 if device.type == "cuda" else None
        self.moe = model.moe_layers()
        self.tokens = 0   # this process's tokens over all steps

    def __call__(self, next_batch: Callable[[], Batch]) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        # fp64 on the device, the same sums as adding Python floats
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(self.accum):
            batch = next_batch()
            # gradients are reduced over ranks once a step, in the last micro-step's backward
            with par.grad_sync(self.forward, enabled=i == self.accum - 1):
                with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
                    out = self.forward(batch.ids, labels=batch.ids, segments=batch.segments)
                (out.loss / self.accum).backward()
            loss += out.loss.detach().float().double() / self.accum
            self.tokens += batch.ids.numel()
        grad_norm = par.clip_grad_norm_(self.model.parameters(), self.max_norm)
        par.all_reduce_moe_loads(self.model)   # the global loads: the same router biases on every rank
        imbalance = moe_imbalance(self.moe)
        loss = par.all_reduce_mean(loss)
        scalars = torch.stack([loss, grad_norm.double()] + ([] if imbalance is None else [imbalance]))
        # equal on every rank (the loss is reduced, the norm is global): all skip together
        self.opt.found_inf = (~torch.isfinite(scalars[:2]).all()).float()
        self.opt.step()
        self.sched.step()
        for m in self.moe:
            m.update_bias()
        return scalars
