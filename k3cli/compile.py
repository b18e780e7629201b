"""torch.compile for training and eval: one full graph per (mode, input shape), no graph breaks.

The model traces whole: the MoE dispatch has static shapes, the KDA torch path checks its reach
bound from the config rather than the data, and the Triton kernels are torch.library custom ops
(opaque nodes with fake implementations). `fullgraph=True` turns any future graph break into an
error instead of a silent slowdown; `dynamic=False` compiles each distinct batch shape once (the
training batch, the validation batch, a shorter last validation batch) rather than a dynamic graph.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

# torch.compile modes `train.compile_mode` accepts (config.py lists the same choices)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_model(model: nn.Module, mode: str = "default") -> Callable:
    """The compiled forward of `model`. The module itself stays uncompiled, so its state_dict (and
    every checkpoint) keeps plain parameter names, without `_orig_mod.` prefixes."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode '{mode}'; valid: {', '.join(COMPILE_MODES)}")
    # each model instance, train/eval switch and batch shape is a cache entry of the one forward code
    # object; past the limit Dynamo would quietly run eager, so raise the limit and make hitting it an error
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(model, mode=mode, fullgraph=True, dynamic=False)


@contextlib.contextmanager
def uncompiled(forward: Callable, model: nn.Module) -> Iterator[Callable]:
    """`forward` (the model, `compile_model(model)` or a parallel wrapper of the model) with nothing
    compiled for the duration: the model itself in place of its compiled form, and every module whose
    own forward was compiled (the ddp / fsdp units) back on its class's forward."""
    saved = {m: m.__dict__.pop("forward") for m in model.modules()
             if hasattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable")}
    try:
        yield model if isinstance(forward, OptimizedModule) else forward
    finally:
        for m, f in saved.items():
            m.forward = f
