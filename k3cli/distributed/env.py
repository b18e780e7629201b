"""The process environment: torchrun's variables, the process group, collectives on scalars and objects,
and `main_first` (rank 0 runs a section — filling caches, writing the run's files — before the others).
Without torchrun's environment everything here runs as one process and the collectives are no-ops."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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

