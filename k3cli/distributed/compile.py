"""torch.compile for training and eval: one full graph per (mode, input shape), no graph breaks.

The model traces whole: the MoE dispatch has static shapes, the KDA torch path checks its reach
bound from the config rather than the data, and the Triton kernels are torch.library custom ops
(opaque nodes with fake implementations). `fullgraph=True` turns any future graph break into an
error instead of a silent slowdown; `dynamic=False` compiles each distinct batch shape once (the
training batch, the validation batch, a shorter last validation batch) rather than a dynamic graph.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from k3cli.config import COMPILE_MODES


def _policy(mode: str) -> dict:
    """The one compile policy of one process and of every rank: checks `mode`, and returns torch.compile's
    arguments (one full graph per input shape)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode '{mode}'; valid: {', '.join(COMPILE_MODES)}")
    # each model instance, train/eval switch and batch shape is a cache entry of the one forward code
    # object; past the limit Dynamo would quietly run eager, so raise the limit and make hitting it an error
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return {"mode": mode, "fullgraph": True, "dynamic": False}


def compile_model(model: nn.Module, mode: str = "default") -> Callable:
    """The compiled forward of `model`. The module itself stays uncompiled, so its state_dict (and
    every checkpoint) keeps plain parameter names, without `_orig_mod.` prefixes."""
    return torch.compile(model, **_policy(mode))


def compile_forward(module: nn.Module, mode: str) -> None:
    """Compile `module.forward` in place (a DDP / FSDP unit): its parameter names stay plain, and
    FSDP's unshard / reshard hooks stay eager around it."""
    module.forward = torch.compile(module.forward, **_policy(mode))


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


def use_compile_cache(root) -> None:
    """Keep Inductor's and AOTAutograd's caches under `root` (unless TORCHINDUCTOR_CACHE_DIR names another
    folder), so a second run or a resume reuses the compiled step. Call before the first compilation."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # importing torch already sets the variable to its default, so a user's own value is any other one
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.fspath(root)
    # the fp32 router's `autocast(enabled=False)` puts these calls in the graph, and AOTAutograd's cache
    # bypasses any graph with a function it does not list; their arguments are constants of the graph's code
    for name in ("_enter_autocast", "_exit_autocast"):
        torch._inductor.config.unsafe_marked_cacheable_functions.setdefault(
            f"torch.amp.autocast_mode.{name}", torch.__version__)
    # the model's own autograd.Functions (MoE's row gather) are pure torch, traced into the graph both ways
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True


class CompileWatch:
    """The console lines around the first step, which compiles the model: when it starts and how long it
    took, with how many graphs came from the caches."""

    KEYS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
            ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"),
            ("aot_autograd", "autograd_cache_bypass"))

    def __init__(self, enabled: bool):
        self.enabled, self._t0, self._before = enabled, 0.0, {}

    def _counts(self) -> dict:
        from torch._dynamo.utils import counters

        return {k: counters[group][k] for group, k in self.KEYS}

    def starting(self) -> str | None:
        if not self.enabled:
            return None
        self._t0, self._before = time.time(), self._counts()
        return "compile: compiling the training step (torch.compile, full graph) in the first step"

    def finished(self) -> str | None:
        if not self.enabled:
            return None
        n = {k: v - self._before[k] for k, v in self._counts().items()}
        return (f"compile: first step done in {time.time() - self._t0:.1f} s; Inductor cache "
                f"{n['fxgraph_cache_hit']} hit / {n['fxgraph_cache_miss']} miss, AOTAutograd cache "
                f"{n['autograd_cache_hit']} hit / {n['autograd_cache_miss']} miss"
                + (f" / {n['autograd_cache_bypass']} bypass" if n["autograd_cache_bypass"] else ""))
