"""The model wrapped for several processes: `resolve_parallel` picks none, DDP or FSDP2, `parallelize` wraps
(compiling each unit), `grad_sync` and `clip_grad_norm_` serve gradient accumulation.

Parameter names (what `named_parameters()` / `state_dict()` show):
- none: the model itself, plain names; with compile_mode the returned callable is
  `compile_model(model)` and its own state_dict has `_orig_mod.` prefixes (checkpoint `model`);
- ddp: the DistributedDataParallel wrapper prefixes `module.`; `model` (= `wrapper.module`) keeps
  plain names;
- fsdp: `fully_shard` changes the model in place (its class becomes an FSDP subclass, parameters
  become DTensor shards) and keeps plain names; the returned module is `model` itself.
Compiled blocks (ddp / fsdp) never add `_orig_mod.`: only each unit's `forward` is compiled.
`torch.distributed.checkpoint.state_dict.get_state_dict` strips `module.` and `_orig_mod.`, so the
sharded checkpoints (`k3cli.checkpoint.sharded`) always hold plain names.
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from k3cli.config import COMPILE_MODES, PARALLEL_MODES
from k3cli.distributed.compile import compile_forward, compile_model
from k3cli.distributed.env import is_distributed
from k3cli.models.causal_lm import CausalLM


def resolve_parallel(mode: str, world_size: int) -> str:
    """`train.parallel` → the wrapper to use. auto: fsdp with more than one process, else none.
    ddp / fsdp with one process are valid (a 1-process FSDP run writes the same sharded format);
    none with several processes is refused: each would train its own copy into the same folder."""
    if mode not in PARALLEL_MODES:
        raise ValueError(f"unknown train.parallel '{mode}'; valid: {', '.join(PARALLEL_MODES)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if mode == "auto":
        return "fsdp" if world_size > 1 else "none"
    if mode == "none" and world_size > 1:
        raise ValueError(f"train.parallel=none with {world_size} processes would train {world_size} "
                         "independent copies; use ddp, fsdp or auto")
    return mode


def fsdp_units(model: CausalLM) -> list[nn.Module]:
    """The modules sharded (and compiled) one by one: every decoder block; with AttnRes on, every
    block's attn and ffn instead, since the mixer calls those (and reads the pre-norm weights,
    which stay with the root) and never the block's own forward."""
    if getattr(model, "attnres", None) is None:
        return list(model.blocks)
    return [m for block in model.blocks for m in (block.attn, block.ffn)]


@torch.no_grad()
def _broadcast_module_(module: nn.Module) -> None:
    # FSDP2 shards whatever each rank holds; start every rank from rank 0's weights and buffers
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=0)


def parallelize(model: CausalLM, mode: str, device: torch.device, compile_mode: str | None = None,
                mixed_precision: bool = True) -> nn.Module:
    """Wrap `model` for `mode` (from `resolve_parallel`) and return the module to call for the
    forward and backward; build the optimizer afterwards, from `model.named_parameters()`.

    - none: `model`, or `compile_model(model, compile_mode)` (one full graph, as without this module);
    - ddp: DistributedDataParallel(model) (device_ids on CUDA). Buffers are not re-broadcast at
      every forward: that would overwrite each rank's MoE `load_counts` with rank 0's
      (`all_reduce_moe_loads` keeps the router biases equal instead);
    - fsdp: FSDP2 `fully_shard` on each unit of `fsdp_units(model)`, then on the root (embedding,
      final norm, head, AttnRes). On CUDA with `mixed_precision`: MixedPrecisionPolicy(param_dtype=
      bf16, reduce_dtype=fp32) — every parameter, norms and router included, computes in bf16; fp32
      on CPU. Ranks start from rank 0's weights (broadcast before sharding).
    With `compile_mode` (ddp / fsdp): each unit's forward is compiled (fullgraph, static shapes)
    before wrapping. Needs a process group for ddp / fsdp (`init_distributed`)."""
    if mode not in ("none", "ddp", "fsdp"):
        raise ValueError(f"parallelize: mode must be none, ddp or fsdp (resolve_parallel first), got '{mode}'")
    if compile_mode is not None and compile_mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode '{compile_mode}'; valid: {', '.join(COMPILE_MODES)}")
    model = model.to(device)
    if mode == "none":
        return compile_model(model, compile_mode) if compile_mode is not None else model
    if not is_distributed():
        raise RuntimeError(f"parallelize({mode}) needs a process group: call init_distributed first "
                           "(single_process_group=True for a 1-process run)")
    if mode == "fsdp" and compile_mode == "reduce-overhead":
        # CUDA graphs would capture the all-gathered buffers FSDP2 frees and refills every step
        raise ValueError("compile mode reduce-overhead (CUDA graphs) is not supported with fsdp")
    if compile_mode is not None:
        for unit in fsdp_units(model):
            compile_forward(unit, compile_mode)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else None
        # newer torch names the switch forward_sync_buffers (buffers still synced once at init: fine)
        no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                   else {"broadcast_buffers": False})
        return DDP(model, device_ids=ids, **no_sync)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _broadcast_module_(model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if device.type == "cuda" and mixed_precision else MixedPrecisionPolicy())
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


@contextlib.contextmanager
def grad_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Inside, a backward reduces gradients across ranks only when `enabled`: wrap every micro-step
    of a gradient-accumulation step, enabled on the last one (the earlier ones accumulate locally,
    one reduction per step). DDP: `no_sync()`; FSDP2: `set_requires_gradient_sync` (the unsharded
    gradients are then kept until the last micro-step: more memory); plain modules: nothing."""
    if enabled or not hasattr(module, "set_requires_gradient_sync") and not hasattr(module, "no_sync"):
        yield
    elif hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        with module.no_sync():
            yield


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` returning a plain tensor: under FSDP2 the total norm (over
    every rank's shards) comes back as a replicated DTensor, which would not stack with plain tensors."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@torch.no_grad()
def all_reduce_moe_loads(model: nn.Module) -> None:
    """Sum every LatentMoE's `load_counts` over ranks (one collective for all layers), so that the
    following `update_bias()` sees the global loads and leaves the same router bias on every rank.
    Call it on every rank, every step, after the last backward and before `update_bias()`."""
    from k3cli.layers.moe import LatentMoE

    layers = [m for m in model.modules() if isinstance(m, LatentMoE)]
    if not layers or not is_distributed() or dist.get_world_size() == 1:
        return
    counts = torch.stack([m.load_counts for m in layers])                       # (layers, experts)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    for m, c in zip(layers, counts):
        m.load_counts.copy_(c)
