"""`k3 bench-train`: time the training loop's own step (`k3cli.train.TrainStep`: forward, backward,
clipping, AdamW, MoE balancing) on synthetic tokens.

Every variant is measured in the same run, interleaved step by step so that drift hits them alike:
`eager` (the reference), `compiled` (with --compile), on CUDA with the Triton backend `torch-backend`
(the same model on the torch ops) and, with --compile, `torch-compiled`; these follow the config's
`data.document_mask` as `k3 train` does (rows cut into documents of mean length T/4, docs/math.md §10),
and one more eager variant with the mask the other way (`no-document-mask` or `document-mask`), so the
compiled/eager, triton/torch and mask/no-mask ratios come from one process; with --compare-attnres the
variants are instead eager (and compiled) per AttnRes overlay. With --loader the batches come through the
loop's input pipeline (`k3cli.train.Prefetcher`) instead of one batch kept on the device. Warm-up steps
(compilation included) are excluded. FLOPs per token are the analytic count of docs/math.md §9; MFU is
against the device's dense bf16 peak (or --peak-tflops).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from k3cli.config import RunConfig
from k3cli.data import EOT_ID, PackedLoader, cache_root
from k3cli.distributed.compile import compile_model, use_compile_cache
from k3cli.models.flops import device_peak_tflops, flops_per_token
from k3cli.train import (
    Batch,
    Prefetcher,
    TrainStep,
    build_model,
    build_optimizer,
    document_segments,
    flush_denormals,
    peak_memory_bytes,
    resolve_device,
)


@dataclass
class Variant:
    name: str
    backend: str
    compiled: bool
    masked: bool = True               # the document mask on the batch
    attnres: str | None = None      # with --compare-attnres: the overlay this variant's model uses
    cfg: RunConfig | None = None
    attnres_impl: str | None = None   # the AttnRes mixer's implementation; None: two_phase on the torch ops, else auto
    model: torch.nn.Module = None
    step: TrainStep = None
    feed: Prefetcher | None = None    # with --loader: the training loop's input pipeline
    times: list[float] = field(default_factory=list)
    host_times: list[float] = field(default_factory=list)   # the host's part: until the step call returns
    peak_mem: int = 0


def plan_attnres_variants(configs: dict[str, RunConfig], backend: str, compile: bool, masked: bool) -> list[Variant]:
    """With --compare-attnres: eager (and compiled) per AttnRes overlay, nothing else, so the overlays'
    ratios come from one run."""
    out = []
    for mode, cfg in configs.items():
        out.append(Variant(f"eager attnres={mode}", backend, False, masked, attnres=mode, cfg=cfg))
        if compile:
            out.append(Variant(f"compiled attnres={mode}", backend, True, masked, attnres=mode, cfg=cfg))
    return out


def plan_variants(backend: str, compile: bool, masked: bool) -> list[Variant]:
    """The variants one run times, with the document mask when `masked` (as the config trains): eager on
    `backend`; compiled with --compile; with the Triton ops also the torch ops (eager, and compiled with
    --compile, so each mode has its triton/torch ratio); then eager with the mask the other way."""
    variants = [Variant("eager", backend, False, masked)]
    if compile:
        variants.append(Variant("compiled", backend, True, masked))
    if backend == "triton":
        variants.append(Variant("torch-backend", "torch", False, masked))
        if compile:
            variants.append(Variant("torch-compiled", "torch", True, masked))
    variants.append(Variant("no-document-mask" if masked else "document-mask", backend, False, not masked))
    return variants


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_variant(cfg: RunConfig, v: Variant, device: torch.device) -> None:
    """v's model (on v's ops, compiled if v says so) and the training loop's own step (AdamW, clipping, MoE
    balancing), on `device`."""
    cfg.model.kda.backend = v.backend
    v.model = build_model(cfg).to(device).train()
    v.model.activation_checkpointing = cfg.train.activation_checkpointing
    impl = v.attnres_impl or ("two_phase" if v.backend == "torch" else None)   # torch ops: no Triton mix
    if impl is not None and v.model.attnres is not None:
        v.model.attnres.impl = impl
    forward = compile_model(v.model, cfg.train.compile_mode) if v.compiled else v.model
    opt, sched = build_optimizer(v.model, cfg)
    v.step = TrainStep(v.model, forward, opt, sched, accum=1, grad_clip=cfg.train.grad_clip, device=device)


def timed_step(v: Variant, batch: Batch, device: torch.device) -> tuple[float, float]:
    """One training step of v (the loop's `TrainStep`) on `batch`, or on the next batch of v's input
    pipeline when it has one, from an idle device: (its seconds, synchronised; the seconds until the step
    call returned, the host's time to enqueue it). Equal on a CPU; on a GPU a host time near the step time
    means the step is host-bound (or launched more kernels than the driver queues, which also waits)."""
    _sync(device)
    t0 = time.perf_counter()
    v.step(v.feed.next_batch if v.feed is not None else lambda: batch)
    t_host = time.perf_counter() - t0
    _sync(device)
    return time.perf_counter() - t0, t_host


def synthetic_tokens(cfg: RunConfig, windows: int) -> torch.Tensor:
    """`windows` × T random tokens with separators at random: documents of mean length T / 4."""
    T = cfg.train.seq_len
    g = torch.Generator().manual_seed(cfg.train.seed)
    ids = torch.randint(1, cfg.model.vocab_size, (windows, T), generator=g)
    return torch.where(torch.rand(windows, T, generator=g) < 4 / T, EOT_ID, ids)


def synthetic_batch(cfg: RunConfig, windows: int, device: torch.device) -> Batch:
    """`synthetic_tokens` on `device` with their documents (the document mask's segments)."""
    ids = synthetic_tokens(cfg, windows)
    return Batch(ids.to(device), document_segments(ids, device, True))


def loader_feed(cfg: RunConfig, v: Variant, device: torch.device) -> Prefetcher:
    """The training loop's input pipeline (worker process, one copy per batch) for built variant v, over a stream of
    `synthetic_tokens`: batches of cfg's micro-batch size and sequence length, fresh each step."""
    B, T = cfg.train.micro_batch_size, cfg.train.seq_len
    stream = synthetic_tokens(cfg, 4 * B).flatten().numpy()
    return Prefetcher(PackedLoader(stream, T, B, seed=cfg.train.seed), cfg.model.vocab_size, v.masked, device,
                      chunk_sizes=v.model.layout_chunk_sizes())


def time_variants(variants: list[Variant], cfg: RunConfig, batches: dict[bool, Batch], device: torch.device,
                  steps: int, warmup: int, log=print, loader: bool = False) -> None:
    """Build each variant (from its own config, else `cfg`) and run its warm-up steps, then time `steps`
    rounds of one step per variant: fills each variant's times and peak memory. `batches`: the device batch
    without (False) and with (True) the document mask; with `loader`, each variant instead reads the
    training loop's input pipeline over a synthetic token stream."""
    for v in variants:
        log(f"bench-train: building {v.name} ({v.backend} ops{', torch.compile' if v.compiled else ''})")
        build_variant(v.cfg or cfg, v, device)
        if loader:
            v.feed = loader_feed(cfg, v, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for _ in range(warmup):
            timed_step(v, batches[v.masked], device)
        log(f"bench-train: {v.name} warm-up {warmup} steps in {time.perf_counter() - t0:.1f} s")
        v.peak_mem = peak_memory_bytes(device)
    try:
        for _ in range(steps):   # round by round: drift (clocks, other load) hits every variant alike
            for v in variants:
                if device.type == "cuda":   # per variant: the process-wide peak would be the largest variant's
                    torch.cuda.reset_peak_memory_stats(device)
                step_s, host_s = timed_step(v, batches[v.masked], device)
                v.times.append(step_s)
                v.host_times.append(host_s)
                if device.type == "cuda":
                    v.peak_mem = max(v.peak_mem, torch.cuda.max_memory_allocated(device))
    finally:
        for v in variants:
            if v.feed is not None:
                v.feed.close()


def bench_train(cfg: RunConfig, steps: int = 10, warmup: int = 3, compile: bool = False,
                backend: str = "auto", log=print, attnres_configs: dict[str, RunConfig] | None = None,
                loader: bool = False, only: list[str] | None = None) -> dict:
    """Median step time with spread, tokens/s, TFLOP/s, MFU and peak memory per variant. With
    `attnres_configs` (overlay -> config, the first the reference) the variants are those overlays'; with
    `loader`, batches come through the training loop's input pipeline instead of staying on the device;
    `only`: the variants of these names alone (ValueError for a name the run would not time)."""
    device = resolve_device(cfg.train.device)
    flush_denormals(device)
    if backend == "triton" and device.type != "cuda":
        raise ValueError("--backend triton needs a CUDA device (on CPU the model runs the torch ops)")
    backend = ("triton" if device.type == "cuda" else "torch") if backend == "auto" else backend
    if compile:
        use_compile_cache(cache_root() / "compile")   # the same compiled step as `k3 train` caches
    masked = cfg.data.document_mask
    variants = (plan_variants(backend, compile, masked) if attnres_configs is None
                else plan_attnres_variants(attnres_configs, backend, compile, masked))
    if only:
        names = [v.name for v in variants]
        if unknown := [n for n in only if n not in names]:
            raise ValueError(f"--variants: this run has no variant {', '.join(map(repr, unknown))}; "
                             f"it times {', '.join(names)}")
        variants = [v for v in variants if v.name in only]
    B, T = cfg.train.micro_batch_size, cfg.train.seq_len
    documents = synthetic_batch(cfg, B, device)
    segments = documents.segments
    batches = {False: Batch(documents.ids, None), True: documents}
    time_variants(variants, cfg, batches, device, steps, warmup, log, loader)
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
                     "host_ms": 1e3 * statistics.median(v.host_times),
                     "tokens_per_s": B * T / med, "tflops": tflops, "mfu": tflops / peak if peak else None,
                     "peak_mem_gb": v.peak_mem / 2**30, "speedup_vs_eager": ref / med})
    by = {r["variant"]: r["step_ms"] for r in rows}
    ratios = {}
    pairs = {"compiled_vs_eager": ("eager", "compiled"),             # > 1: compiling made the step faster
             "triton_vs_torch": ("torch-backend", "eager"),          # > 1: the Triton ops are faster
             "compiled_vs_torch_compiled": ("torch-compiled", "compiled"),   # the same, both compiled
             "document_mask_cost": ("document-mask", "eager") if "document-mask" in by   # > 1: the mask costs
             else ("eager", "no-document-mask")}
    for name_, (a, b) in pairs.items():
        if a in by and b in by:
            ratios[name_] = by[a] / by[b]
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
            "warmup": warmup, "document_mask": masked, "loader": loader, "flops_per_token": fpt, "peak_tflops": peak,
            "peak_source": peak_name if peak else None,
            "threads": torch.get_num_threads(), "rows": rows, "ratios": ratios}
