"""What a run is built from: its device, model, optimiser and schedule, and the parallel layout."""
from __future__ import annotations

import math

import torch

from k3cli import distributed as par
from k3cli.config import RunConfig
from k3cli.models.causal_lm import CausalLM

# parameters named like this take no weight decay (besides every parameter with ndim < 2)
NO_DECAY_NAMES = ("norm", "bias", "A_log", "dt_bias", "attnres", "query", "gain")


def resolve_device(name: str) -> torch.device:
    """auto | cpu | cuda | cuda:N as a device this machine has; ValueError otherwise."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise ValueError(f"unknown device '{name}'; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} requested but torch sees no CUDA device")
    if device.index is not None and device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def flush_denormals(device: torch.device) -> None:
    """On CPU, flush denormals to zero: the chunked KDA reference multiplies by exp(Γ) down to
    ~1e-35, and denormal arithmetic made a k3-toy step 10x slower (5.2 s vs 0.6 s measured)."""
    if device.type == "cpu":
        torch.set_flush_denormal(True)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or any(k in name for k in NO_DECAY_NAMES):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to `min_ratio` at `total` steps."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_model(cfg: RunConfig) -> CausalLM:
    """The run's model at step 0: seeded with train.seed right before construction, so the same seed
    gives the same weights whatever ran before (`k3 study` checks its variants' base weights with it)."""
    torch.manual_seed(cfg.train.seed)
    return CausalLM(cfg.model)


def build_optimizer(model: torch.nn.Module, cfg: RunConfig):
    """(AdamW, warmup/cosine LambdaLR) of `cfg.train`. Build it after `parallel.parallelize`: FSDP2
    replaces the parameters with its shards."""
    tc = cfg.train
    # fused (one pass per parameter): k3-toy's CPU AdamW step 17.7 -> 3.3 ms, k3-0.5b's compiled H200 step 117.7 -> 112.8 ms
    opt = torch.optim.AdamW(param_groups(model, tc.weight_decay), lr=tc.lr, betas=(tc.beta1, tc.beta2),
                            eps=1e-8, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, tc.warmup_steps, tc.steps, tc.min_lr_ratio))
    return opt, sched


def check_parallel(cfg: RunConfig, world_size: int) -> tuple[str, int]:
    """(wrapper from `train.parallel`, micro-steps per optimiser step) for `world_size` processes,
    or a one-line ValueError: the global batch must split into whole micro-batches on every rank."""
    tc = cfg.train
    mode = par.resolve_parallel(tc.parallel, world_size)
    if mode == "fsdp" and tc.compile and tc.compile_mode == "reduce-overhead":
        # CUDA graphs would capture the all-gathered buffers FSDP2 frees and refills every step
        raise ValueError("train.compile_mode reduce-overhead (CUDA graphs) does not work with train.parallel "
                         "fsdp; use another compile mode or ddp")
    if tc.compile and tc.compile_mode == "reduce-overhead" and cfg.data.document_mask:
        # a replayed graph repeats the recorded launches, but the masked KDA's launches follow each batch's documents
        raise ValueError("train.compile_mode reduce-overhead (CUDA graphs) does not work with data.document_mask: "
                         "the KDA kernels' launches depend on each batch's documents; set data.document_mask=false "
                         "or use another compile mode")
    per_pass = tc.micro_batch_size * world_size
    if tc.global_batch_size % per_pass:
        raise ValueError(f"train.global_batch_size ({tc.global_batch_size}) must be a multiple of "
                         f"micro_batch_size x processes ({tc.micro_batch_size} x {world_size} = {per_pass}) "
                         "so that every optimiser step sees the same sequences at any number of processes")
    return mode, tc.global_batch_size // per_pass
