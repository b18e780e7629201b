"""More than one process: the process environment (`env`), the model wrapped for DDP / FSDP2
(`parallelize`), the one compile policy of one and many processes (`compile`), and `k3 train --nproc`'s
torchrun launcher (`launch`). Without torchrun's environment everything runs as one process."""

from k3cli.distributed.env import (
    DistInfo,
    PeerFailed,
    all_reduce_mean,
    all_reduce_sum_,
    barrier,
    broadcast_object,
    destroy,
    env_rank,
    env_world_size,
    eval_rows,
    init_distributed,
    is_distributed,
    main_first,
    shard_batch,
)
from k3cli.distributed.parallelize import (
    all_reduce_moe_loads,
    clip_grad_norm_,
    fsdp_units,
    grad_sync,
    parallelize,
    resolve_parallel,
)

__all__ = [
    "DistInfo", "PeerFailed", "all_reduce_mean", "all_reduce_moe_loads", "all_reduce_sum_", "barrier",
    "broadcast_object", "clip_grad_norm_", "destroy", "env_rank", "env_world_size", "eval_rows", "fsdp_units",
    "grad_sync", "init_distributed", "is_distributed", "main_first", "parallelize", "resolve_parallel",
    "shard_batch",
]
