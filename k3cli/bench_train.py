"""`k3 bench-train`: time whole training steps (forward, backward, AdamW) on synthetic tokens.

Every variant is measured in the same run, interleaved step by step so that drift hits them alike:
`eager` (the reference), `compiled` (with --compile), on CUDA with the Triton backend `torch-backend`
(the same model on the torch ops) and, with --compile, `torch-compiled`, and `document-mask` (eager with
the packed-document mask of docs/math.md §10 on rows cut into documents of mean length T/4), so the
compiled/eager, triton/torch and mask/no-mask ratios come from one process; with --compare-attnres the
variants are instead eager (and compiled) per AttnRes overlay. Warm-up steps (compilation included) are
excluded. FLOPs per token are the analytic count of docs/math.md §9; MFU is against the
device's dense bf16 peak (or --peak-tflops).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from k3cli.compile import compile_model
from k3cli.config import RunConfig
from k3cli.data import EOT_ID
from k3cli.models.flops import device_peak_tflops, flops_per_token
from k3cli.train import (
    build_model,
    document_segments,
    flush_denormals,
    param_groups,
    peak_memory_bytes,
    resolve_device,
)


@dataclass
class Variant:
    name: str
    backend: str
    compiled: bool
    masked: bool = False
    attnres: str | None = None      # with --compare-attnres: the overlay this variant's model uses
    cfg: RunConfig | None = None
    attnres_impl: str | None = None   # the AttnRes mixer's implementation; None: two_phase on the torch ops, else auto
    model: torch.nn.Module = None
    forward: object = None
    opt: torch.optim.Optimizer = None
    times: list[float] = field(default_factory=list)
    peak_mem: int = 0


def plan_attnres_variants(configs: dict[str, RunConfig], backend: str, compile: bool) -> list[Variant]:
    """With --compare-attnres: eager (and compiled) per AttnRes overlay, nothing else, so the overlays'
    ratios come from one run."""
    out = []
    for mode, cfg in configs.items():
        out.append(Variant(f"eager attnres={mode}", backend, False, attnres=mode, cfg=cfg))
        if compile:
            out.append(Variant(f"compiled attnres={mode}", backend, True, attnres=mode, cfg=cfg))
    return out


def plan_variants(backend: str, compile: bool) -> list[Variant]:
    """The variants one run times: eager on `backend`; compiled with --compile; with the Triton ops also the
    torch ops (eager, and compiled with --compile, so each mode has its triton/torch ratio); the mask."""
    variants = [Variant("eager", backend, False)]
    if compile:
        variants.append(Variant("compiled", backend, True))
    if backend == "triton":
        variants.append(Variant("torch-backend", "torch", False))
        if compile:
            variants.append(Variant("torch-compiled", "torch", True))
    variants.append(Variant("document-mask", backend, False, masked=True))
    return variants


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_variant(cfg: RunConfig, v: Variant, device: torch.device) -> None:
    """v's model (on v's ops, compiled if v says so) and the training loop's fused AdamW, on `device`."""
    cfg.model.kda.backend = v.backend
    v.model = build_model(cfg).to(device).train()
    v.model.activation_checkpointing = cfg.train.activation_checkpointing
    impl = v.attnres_impl or ("two_phase" if v.backend == "torch" else None)   # torch ops: no Triton mix
    if impl is not None and v.model.attnres is not None:
        v.model.attnres.impl = impl
    tc = cfg.train
    v.opt = torch.optim.AdamW(param_groups(v.model, tc.weight_decay), lr=tc.lr, betas=(tc.beta1, tc.beta2),
                              eps=1e-8, fused=True)   # the training loop's optimizer
    v.forward = compile_model(v.model, cfg.train.compile_mode) if v.compiled else v.model


def timed_step(v: Variant, ids: torch.Tensor, device: torch.device, autocast, segments=None) -> float:
    """One forward, backward and AdamW step of v on `ids` (labels = ids), synchronised: its seconds."""
    _sync(device)
    t0 = time.perf_counter()
    v.opt.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        loss = v.forward(ids, labels=ids, segments=segments if v.masked else None).loss
    loss.backward()
    v.opt.step()
    _sync(device)
    return time.perf_counter() - t0


def time_variants(variants: list[Variant], cfg: RunConfig, ids: torch.Tensor, device: torch.device, autocast,
                  steps: int, warmup: int, segments=None, log=print) -> None:
    """Build each variant (from its own config, else `cfg`) and run its warm-up steps, then time `steps`
    rounds of one step per variant: fills each variant's times and peak memory."""
    for v in variants:
        log(f"bench-train: building {v.name} ({v.backend} ops{', torch.compile' if v.compiled else ''})")
        build_variant(v.cfg or cfg, v, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for _ in range(warmup):
            timed_step(v, ids, device, autocast, segments)
        log(f"bench-train: {v.name} warm-up {warmup} steps in {time.perf_counter() - t0:.1f} s")
        v.peak_mem = peak_memory_bytes(device)
    for _ in range(steps):   # round by round: drift (clocks, other load) hits every variant alike
        for v in variants:
            if device.type == "cuda":   # per variant: the process-wide peak would be the largest variant's
                torch.cuda.reset_peak_memory_stats(device)
            v.times.append(timed_step(v, ids, device, autocast, segments))
            if device.type == "cuda":
                v.peak_mem = max(v.peak_mem, torch.cuda.max_memory_allocated(device))


def bench_train(cfg: RunConfig, steps: int = 10, warmup: int = 3, compile: bool = False,
                backend: str = "auto", log=print, attnres_configs: dict[str, RunConfig] | None = None) -> dict:
    """Median step time with spread, tokens/s, TFLOP/s, MFU and peak memory per variant. With
    `attnres_configs` (overlay -> config, the first the reference) the variants are those overlays'."""
    device = resolve_device(cfg.train.device)
    flush_denormals(device)
    if backend == "triton" and device.type != "cuda":
        raise ValueError("--backend triton needs a CUDA device (on CPU the model runs the torch ops)")
    backend = ("triton" if device.type == "cuda" else "torch") if backend == "auto" else backend
    variants = (plan_variants(backend, compile) if attnres_configs is None
                else plan_attnres_variants(attnres_configs, backend, compile))
    B, T = cfg.train.micro_batch_size, cfg.train.seq_len
    g = torch.Generator().manual_seed(cfg.train.seed)
    ids = torch.randint(1, cfg.model.vocab_size, (B, T), generator=g)
    # separators at random: documents of mean length T / 4, several to a row
    ids = torch.where(torch.rand(B, T, generator=g) < 4 / T, EOT_ID, ids)
    segments = document_segments(ids, device, True)
    ids = ids.to(device)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    time_variants(variants, cfg, ids, device, autocast, steps, warmup, segments, log)
    fpt_of = {v.name: flops_per_token((v.cfg or cfg).model, T)["total"] for v in variants}
    fpt = fpt_of[variants[0].name]
    peak, peak_name = cfg.train.peak_tflops or None, "--peak-tflops"
    if peak is None and device.type == "cuda":
        found = device_peak_tflops(torch.cuda.get_device_name(device))
        if found is not None:
            peak, peak_name = found[0], f"{found[1]} dense bf16"
    rows = []
    ref = statistics.median(variants[0].times)
    for v in variants:
        med = statistics.median(v.times)
        tflops = B * T * fpt_of[v.name] / med / 1e12
        rows.append({"variant": v.name, "backend": v.backend, "compiled": v.compiled, "attnres": v.attnres,
                     "step_ms": 1e3 * med, "min_ms": 1e3 * min(v.times), "max_ms": 1e3 * max(v.times),
                     "tokens_per_s": B * T / med, "tflops": tflops, "mfu": tflops / peak if peak else None,
                     "peak_mem_gb": v.peak_mem / 2**30, "speedup_vs_eager": ref / med})
    by = {r["variant"]: r["step_ms"] for r in rows}
    ratios = {}
    if "compiled" in by:
        ratios["compiled_vs_eager"] = by["eager"] / by["compiled"]     # > 1: compiling made the step faster
    if "torch-backend" in by:
        ratios["triton_vs_torch"] = by["torch-backend"] / by["eager"]  # > 1: the Triton ops are faster
    if "torch-compiled" in by:
        ratios["compiled_vs_torch_compiled"] = by["torch-compiled"] / by["compiled"]   # the same, both compiled
    if "document-mask" in by:
        ratios["document_mask_cost"] = by["document-mask"] / by["eager"]    # > 1: the mask made the step slower
    if attnres_configs is not None:
        ref = next(iter(attnres_configs))
        for kind in ("eager", "compiled"):
            for mode in attnres_configs:
                if mode != ref and f"{kind} attnres={mode}" in by:   # > 1: the overlay's step is faster
                    ratios[f"{kind}_{mode}_vs_{ref}"] = by[f"{kind} attnres={ref}"] / by[f"{kind} attnres={mode}"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return {"device": name, "device_type": device.type, "batch": B, "seq_len": T, "steps": steps,
            "attnres": None if attnres_configs is None else list(attnres_configs),
            "documents_per_row": (len(torch.nonzero(segments.cu_seqlens[1:] - segments.cu_seqlens[:-1])) / B),
            "warmup": warmup, "flops_per_token": fpt, "peak_tflops": peak, "peak_source": peak_name if peak else None,
            "threads": torch.get_num_threads(), "rows": rows, "ratios": ratios}
