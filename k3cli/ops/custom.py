"""What the `k3::` custom ops (torch.library) share: where their Triton kernels run, the placeholder for
an output a call does not produce, and the torch references' backward by autograd.

Every kernel entry point the model uses is a custom op with a real implementation, a fake one (shapes and
dtypes only, for torch.compile and FakeTensor) and registered autograd whose backward is itself a custom op,
so that a compiled graph holds forward and backward as opaque nodes. The real implementation runs the Triton
kernel on CUDA, and on CPU too under TRITON_INTERPRET=1 (the interpreter: the tests compare the real
kernels); on CPU otherwise it runs the op's torch reference, whose backward op differentiates that
reference by autograd.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

_AUTOGRAD_KEYS = tuple(getattr(torch._C.DispatchKey, k) for k in
                       ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView"))


def triton_runs(device: torch.device) -> bool:
    """Whether the ops run their Triton kernels for tensors on `device` (else the torch reference): on CUDA,
    and on CPU under Triton's interpreter. The fake implementations ask the same, so shapes always agree."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def absent(like: torch.Tensor) -> torch.Tensor:
    """The fixed-schema stand-in for an output the call does not produce (no final state, no norm output, a
    reference run's kernel buffers): an empty fp32 tensor on `like`'s device."""
    return like.new_empty(0, dtype=torch.float32)


def _autograd_back_on():
    # an op's implementation runs below the autograd dispatch keys: put them back for the reference's graph
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def reference_vjp(fn: Callable, inputs: Sequence, cotangents: Sequence) -> list:
    """Gradients of `fn(*inputs)` (a torch reference) for `cotangents` (one per output, None where none
    flows), by autograd, from inside a custom op's implementation. `inputs` are tensors, tensor lists or
    other values; every floating tensor is differentiated. Returns, per input, its gradient (zeros where the
    output does not depend on it, contiguous; a list for a tensor list) or None for a non-tensor."""
    with _autograd_back_on(), torch.enable_grad():
        leaves, args = [], []
        for x in inputs:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                x = x.detach().requires_grad_(True)
                leaves.append(x)
            elif isinstance(x, (list, tuple)):
                x = [t.detach().requires_grad_(True) for t in x]
                leaves.extend(x)
            args.append(x)
        outs = fn(*args)
        outs = outs if isinstance(outs, (list, tuple)) else (outs,)
        pairs = [(o, c) for o, c in zip(outs, cotangents) if c is not None and o is not None and o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs],
                                    allow_unused=True) if pairs else [None] * len(leaves)
    grads = [torch.zeros_like(x) if d is None else d.contiguous() for x, d in zip(leaves, grads)]
    out, i = [], 0
    for x in args:
        if isinstance(x, list):
            out.append(grads[i:i + len(x)])
            i += len(x)
        elif isinstance(x, torch.Tensor) and x.requires_grad:
            out.append(grads[i])
            i += 1
        else:
            out.append(None)
    return out


def eager_function(name: str, impl, setup_context, backward, bwd_impl) -> type[torch.autograd.Function]:
    """An autograd.Function that runs a custom op's implementation `impl` with the op's own `setup_context` and
    `backward` (called with `bwd=bwd_impl`, the backward op's implementation): the op's autograd without the
    dispatcher, for eager calls. Same saved tensors and gradients; torch.compile should trace the op instead."""
    def forward(ctx, *inputs):
        output = impl(*inputs)
        setup_context(ctx, inputs, output)
        return output

    def grad(ctx, *grads):
        return backward(ctx, *grads, bwd=bwd_impl)
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(grad)})
