"""Multi-process training on torch.distributed: process group, wrappers, reductions, batch shards.

Launch with `torchrun --nproc-per-node N -m k3cli train ...` (or `k3 train --nproc N`); without torchrun's environment everything
here runs as one process and the collectives are no-ops. The pieces the training loop needs:

- `init_distributed(device_type)` → `DistInfo`; `destroy()` at the end;
- `resolve_parallel(train.parallel, world_size)` → "none" | "ddp" | "fsdp";
- `parallelize(model, mode, device, compile_mode)` → the module to run forward/backward on;
- `grad_sync(module, enabled)` around gradient-accumulation micro-steps, `clip_grad_norm_`;
- `all_reduce_moe_loads(model)` before `update_bias()`, `all_reduce_mean` for logged scalars;
- `shard_batch(batch, rank, world_size)`: each rank's rows of one global batch; `eval_rows` for
  validation batches that do not split evenly;
- `main_first(fn)`: rank 0 runs `fn` (filling caches, writing the run's files) before the others.

Parameter names (what `named_parameters()` / `state_dict()` show):
- none: the model itself, plain names; with compile_mode the returned callable is
  `compile_model(model)` and its own state_dict has `_orig_mod.` prefixes (checkpoint `model`);
- ddp: the DistributedDataParallel wrapper prefixes `module.`; `model` (= `wrapper.module`) keeps
  plain names;
- fsdp: `fully_shard` changes the model in place (its class becomes an FSDP subclass, parameters
  become DTensor shards) and keeps plain names; the returned module is `model` itself.
Compiled blocks (ddp / fsdp) never add `_orig_mod.`: only each unit's `forward` is compiled.
`torch.distributed.checkpoint.state_dict.get_state_dict` strips `module.` and `_orig_mod.`, so the
sharded checkpoints of `k3cli.dist_checkpoint` always hold plain names.
"""
from __future__ import annotations

import contextlib
import datetime
import inspect
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from k3cli.compile import COMPILE_MODES, compile_model
from k3cli.models.causal_lm import CausalLM

__all__ = ["DistInfo", "PARALLEL_MODES", "init_distributed", "destroy", "env_world_size", "env_rank",
           "resolve_parallel", "parallelize", "fsdp_units", "grad_sync", "clip_grad_norm_", "all_reduce_sum_",
           "all_reduce_mean", "all_reduce_moe_loads", "barrier", "broadcast_object", "shard_batch", "eval_rows",
           "main_first", "PeerFailed", "is_distributed"]

PARALLEL_MODES = ("auto", "none", "ddp", "fsdp")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: rank of world_size, its GPU index on the host, its device."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, writes metrics and the run's files."""
        return self.rank == 0


def is_distributed() -> bool:
    """A process group is up (possibly of one process)."""
    return dist.is_available() and dist.is_initialized()


def env_world_size() -> int:
    """WORLD_SIZE as torchrun sets it; 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    """RANK as torchrun sets it; 0 without torchrun."""
    return int(os.environ.get("RANK", "0"))


def init_distributed(device_type: str, timeout_s: float = 300, single_process_group: bool = False) -> DistInfo:
    """Join torchrun's process group when WORLD_SIZE > 1: NCCL on CUDA (this process's GPU is
    LOCAL_RANK), gloo on CPU. `timeout_s` bounds every collective, so a dead rank makes the others
    fail with an error instead of hanging. Without torchrun's environment: one process, no group,
    unless `single_process_group` (for a 1-process ddp/fsdp run, whose wrappers need a group): then
    a group of one on an in-process store. Calling it again returns the existing group's info."""
    world = env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device cuda requested but torch sees no CUDA device")
        if world > 1 or single_process_group:
            torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank) if world > 1 or single_process_group else torch.device("cuda")
    else:
        device = torch.device(device_type)
    if is_distributed():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)
    if world <= 1 and not single_process_group:
        return DistInfo(0, 1, 0, device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    # device_id binds NCCL to this GPU up front (eager init, barrier() knows the device)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if world > 1:
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def destroy() -> None:
    """Leave the process group and every group made from it (a no-op without one)."""
    global _CONTROL_GROUP
    _CONTROL_GROUP = None
    if is_distributed():
        dist.destroy_process_group()


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


def _compile_forward(module: nn.Module, mode: str) -> None:
    # only forward is compiled: FSDP's unshard/reshard hooks stay eager around it (they are
    # dynamo-disabled anyway) and no `_orig_mod.` enters the parameter names
    module.forward = torch.compile(module.forward, mode=mode, fullgraph=True, dynamic=False)


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
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
        for unit in fsdp_units(model):
            _compile_forward(unit, compile_mode)
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


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks in place and return it (unchanged without a process group)."""
    if is_distributed() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """The mean of `tensor` over ranks, as a new floating tensor (`tensor` is left as it is)."""
    out = tensor.detach().clone() if tensor.is_floating_point() else tensor.detach().double()
    if is_distributed() and dist.get_world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        out /= dist.get_world_size()
    return out


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


def barrier() -> None:
    """Wait for every rank (a no-op without a process group)."""
    if is_distributed() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """`obj` as rank `src` has it, on every rank (picklable objects; `obj` itself without a group)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def shard_batch(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s rows of a global batch [B, ...]: the contiguous slice rows [r·B/W, (r+1)·B/W).
    Every row goes to exactly one rank; B must be a multiple of world_size (the caller sizes it)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"shard_batch: rank {rank} is not in [0, {world_size})")
    rows = batch.shape[0]
    if rows % world_size:
        raise ValueError(f"shard_batch: {rows} rows do not split evenly over {world_size} ranks; "
                         "make the global micro-batch a multiple of the number of processes")
    n = rows // world_size
    return batch[rank * n:(rank + 1) * n]


def eval_rows(batch: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, bool]:
    """Rank `rank`'s part of a validation batch and whether it counts: contiguous, near-even parts
    (`torch.tensor_split`), so any batch size works. A rank left without rows gets the batch's
    first row, not counted: under FSDP every rank must run every forward (the all-gathers)."""
    part = torch.tensor_split(batch, world_size)[rank]
    return (part, True) if part.shape[0] else (batch[:1], False)


class PeerFailed(RuntimeError):
    """Rank 0 failed in a `main_first` section and has reported it; this rank stops quietly with
    the same exit code (`code`), so the error is printed once."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


_CONTROL_GROUP = None
# rank 0 may tokenise a large corpus inside main_first; the others wait this long, not the collective timeout
MAIN_FIRST_TIMEOUT_S = 6 * 3600


def _control_group():
    # a gloo group of its own: a long timeout for this one wait, and CPU objects whatever the backend
    global _CONTROL_GROUP
    if _CONTROL_GROUP is None:
        _CONTROL_GROUP = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=MAIN_FIRST_TIMEOUT_S))
    return _CONTROL_GROUP


def main_first(fn):
    """`fn()` on rank 0, then (once it returned) on the other ranks; its result on every rank.
    When rank 0 raises, it re-raises there and the others raise PeerFailed with the exit code the
    CLI gives that error (`code` attribute, else 2 for ValueError / FileNotFoundError, else 1)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return fn()
    group = _control_group()
    box = [None]
    if dist.get_rank() == 0:
        try:
            result = fn()
        except BaseException as e:
            code = getattr(e, "code", None)
            code = code if isinstance(code, int) else 2 if isinstance(e, (ValueError, FileNotFoundError)) else 1
            box[0] = (f"rank 0 failed: {type(e).__name__}", code)
            dist.broadcast_object_list(box, src=0, group=group)
            raise
        dist.broadcast_object_list(box, src=0, group=group)
        return result
    dist.broadcast_object_list(box, src=0, group=group)
    if box[0] is not None:
        raise PeerFailed(*box[0])
    return fn()
