"""The training loop: AdamW + warmup/cosine, gradient accumulation, MoE bias balancing,
periodic evaluation, atomic checkpoints and exact resume, in one process or several.

Everything a run needs to continue bit-for-bit lives in its directory: `config.yaml`,
`tokenizer.json`, `metrics.jsonl` and `checkpoints/step_*/` (model safetensors + optimiser,
scheduler, loader and RNG state; sharded DCP files when the run is DDP / FSDP).

Under torchrun every rank runs `train`: the same global batches in the same order (each rank
trains on its slice, `k3cli.parallel`), gradient accumulation sized so that an optimiser step sees
`train.global_batch_size` sequences at any world size; rank 0 alone writes the run's files, logs
and reports, and the logged loss, gradient norm and MoE imbalance are the global ones.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from k3cli import parallel as par
from k3cli.checkpoint import CheckpointError, list_checkpoints, remove_leftovers, save_checkpoint
from k3cli.compile import uncompiled
from k3cli.config import RunConfig, config_to_dict, dump_config, flatten, load_config
from k3cli.data import (
    check_token_ids,
    document_starts,
    first_line,
    load_tokenizer,
    prepare_data,
    save_tokenizer,
    write_text_atomic,
)
from k3cli.dist_checkpoint import SharedCheckpointError, find_latest, prune, resume_checkpoint, save_dcp
from k3cli.layers.moe import max_over_mean
from k3cli.layers.segments import Segments
from k3cli.models.causal_lm import CausalLM
from k3cli.models.flops import device_peak_tflops, flops_per_token
from k3cli.ops.transfer import to_device

# parameters named like this take no weight decay (besides every parameter with ndim < 2)
NO_DECAY_NAMES = ("norm", "bias", "A_log", "dt_bias", "attnres", "query", "gain")


class TrainingStopped(RuntimeError):
    """Raised on a non-finite loss; `code` is the CLI exit code. Every rank raises it together."""

    code = 3
    on_every_rank = True


class TrainingInterrupted(RuntimeError):
    """Raised after SIGINT / SIGTERM once the step's checkpoint is written; `code` is 128 + the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.code = 128 + signum


class StopSignals:
    """Once armed, SIGINT and SIGTERM only set a flag that the loop reads at each step's end, so
    training stops after a checkpoint of that step; a second SIGINT raises KeyboardInterrupt at once.
    Handlers are installed from the main thread only; `restore` puts the previous ones back."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def arm(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt   # the user insists; a checkpoint save in flight is atomic anyway
        if self.signum is None:   # a repeated SIGTERM is ignored: scancel and torchrun may each send one
            self.signum = signum

    def poll(self, device: torch.device) -> int | None:
        """The signal that stops training now, the same on every rank (any rank's signal stops all)."""
        if not (par.is_distributed() and par.env_world_size() > 1):
            return self.signum
        seen = torch.tensor([self.signum == s for s in self.SIGNALS], dtype=torch.float32, device=device)
        hit = [s for s, n in zip(self.SIGNALS, par.all_reduce_sum_(seen).tolist()) if n > 0]
        if hit and self.signum is None:
            self.signum = hit[0]
        return hit[0] if hit else None


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


def document_segments(ids: torch.Tensor, device: torch.device, document_mask: bool) -> Segments | None:
    """The packed documents of a CPU batch ids [B, T] for the model (data.document_mask), else None."""
    return Segments.from_starts(document_starts(ids), device) if document_mask else None


@torch.no_grad()
def evaluate_loss(forward, batches: list[torch.Tensor], device: torch.device,
                  autocast_dtype: torch.dtype | None, module: CausalLM | None = None,
                  rank: int = 0, world_size: int = 1, document_mask: bool = False) -> float:
    """Mean validation loss over `batches`; `forward` is the model or its compiled / wrapped form
    (then `module` is the model, whose train/eval mode is switched). With several ranks (all call
    it) each evaluates its rows of every batch and the sums are added over ranks. `document_mask`:
    as training does (data.document_mask); on CUDA it evaluates with nothing compiled."""
    model = forward if module is None else module
    was_training = model.training
    model.eval()
    # fp64 on the device: the same sums as adding Python floats, one read-back at the end
    total = torch.zeros(2, dtype=torch.float64, device=device)
    # Inductor's no-grad FlexAttention kernel faults on an H200 (torch 2.11, docs/performance.md)
    eager = document_mask and device.type == "cuda"
    with uncompiled(forward, model) if eager else contextlib.nullcontext(forward) as forward:
        for ids in batches:
            ids, counted = par.eval_rows(ids, rank, world_size)
            segments = document_segments(ids, device, document_mask)
            ids = to_device(ids, device)
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                out = forward(ids, labels=ids, segments=segments)
            if counted:
                total[0] += out.loss.float().double() * ids.numel()
                total[1] += ids.numel()
    par.all_reduce_sum_(total)
    model.train(was_training)
    loss_sum, n = total.tolist()
    return loss_sum / max(1, n)


class Throughput:
    """Per log window: tokens/s, step and data-wait time, model TFLOP/s, MFU and peak memory.

    FLOPs per token are the analytic training count (`k3cli.models.flops`, docs/math.md §9); MFU
    is against `train.peak_tflops`, else the device's dense bf16 peak from the table (none on CPU).
    `window` takes this process's tokens: tokens/s is for all `world_size` processes together,
    TFLOP/s, MFU and memory are per process (per GPU)."""

    def __init__(self, cfg: RunConfig, device: torch.device, world_size: int = 1):
        self.device, self.world_size = device, world_size
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)["total"]
        self.peak, self.peak_name = cfg.train.peak_tflops or None, "train.peak_tflops"
        if self.peak is None and device.type == "cuda":
            found = device_peak_tflops(torch.cuda.get_device_name(device))
            if found is not None:
                self.peak, self.peak_name = found[0], f"{found[1]} dense bf16"
        self.steps, self.data_s = 0, 0.0

    def describe(self) -> str:
        peak = (f"MFU against {self.peak:g} TFLOP/s ({self.peak_name})" if self.peak else
                "no MFU (no peak known for this device; give one with --peak-tflops)")
        per = (f"; tokens/s of all {self.world_size} processes, TFLOP/s, MFU and memory per process"
               if self.world_size > 1 else "")
        return f"throughput: {self.flops_per_token / 1e6:.1f} MFLOP per token (forward+backward); {peak}{per}"

    def window(self, tokens: int, seconds: float) -> dict:
        seconds = max(seconds, 1e-9)
        tflops = tokens * self.flops_per_token / seconds / 1e12
        out = {"tokens_per_s": round(tokens * self.world_size / seconds, 1), "step_ms": round(1e3 * seconds / max(1, self.steps), 2),
               "data_ms": round(1e3 * self.data_s / max(1, self.steps), 3), "tflops": _sig(tflops)}
        if self.peak:
            out["mfu"] = _sig(tflops / self.peak)
        out["peak_mem_gb"] = round(peak_memory_bytes(self.device) / 2**30, 3)
        self.steps, self.data_s = 0, 0.0
        return out


def _sig(x: float, digits: int = 5) -> float:
    """x rounded to `digits` significant digits (TFLOP/s on a CPU are 1e-3, on a GPU 1e2)."""
    return float(f"{x:.{digits}g}")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: the CUDA caching allocator's high-water mark, or the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


def moe_imbalance(layers: list) -> torch.Tensor | None:
    """Max over MoE layers of `max_over_mean` of their loads since the last bias update, as a 0-dim
    tensor (the caller reads it back with the step's other scalars); None without MoE layers."""
    if not layers:
        return None
    return max_over_mean(torch.stack([m.load_counts for m in layers])).max()


def build_model(cfg: RunConfig) -> CausalLM:
    """The run's model at step 0: seeded with train.seed right before construction, so the same seed
    gives the same weights whatever ran before (`k3 study` checks its variants' base weights with it)."""
    torch.manual_seed(cfg.train.seed)
    return CausalLM(cfg.model)


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    train_loss: float
    val_loss: float | None


def check_parallel(cfg: RunConfig, world_size: int) -> tuple[str, int]:
    """(wrapper from `train.parallel`, micro-steps per optimiser step) for `world_size` processes,
    or a one-line ValueError: the global batch must split into whole micro-batches on every rank."""
    tc = cfg.train
    mode = par.resolve_parallel(tc.parallel, world_size)
    if mode == "fsdp" and tc.compile and tc.compile_mode == "reduce-overhead":
        # CUDA graphs would capture the all-gathered buffers FSDP2 frees and refills every step
        raise ValueError("train.compile_mode reduce-overhead (CUDA graphs) does not work with train.parallel "
                         "fsdp; use another compile mode or ddp")
    per_pass = tc.micro_batch_size * world_size
    if tc.global_batch_size % per_pass:
        raise ValueError(f"train.global_batch_size ({tc.global_batch_size}) must be a multiple of "
                         f"micro_batch_size x processes ({tc.micro_batch_size} x {world_size} = {per_pass}) "
                         "so that every optimiser step sees the same sequences at any number of processes")
    return mode, tc.global_batch_size // per_pass


def train(cfg: RunConfig, run_dir: Path, resume: bool = False, log: Callable[[str], None] = print,
          progress=None, wandb_mode: str = "off", stop_at: int | None = None) -> TrainResult:
    """Train `cfg` into `run_dir`. With `resume`, continue from the newest complete checkpoint;
    with `stop_at`, stop (with a checkpoint) after that step without changing the schedule.
    Under torchrun every rank calls it (it joins the process group, or uses the caller's); only
    rank 0 logs, reports progress and writes the run's files."""
    device = resolve_device(cfg.train.device)
    mode, accum = check_parallel(cfg, par.env_world_size())
    owns_group = not par.is_distributed()
    info = par.init_distributed(device.type, single_process_group=mode != "none")
    signals = StopSignals()
    try:
        if not info.is_main:
            log, progress = (lambda msg: None), None
        return _train(cfg, run_dir, info, mode, accum, resume, log, progress, wandb_mode, stop_at, signals)
    finally:
        signals.restore()
        if owns_group:
            par.destroy()


def _prepare(cfg: RunConfig, run_dir: Path, resuming: bool, log):
    if resuming:
        # the run's own files stay untouched until its checkpoint has loaded
        check_resume_config(load_config(str(run_dir / "config.yaml")), cfg)
        return prepare_data(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, progress=log,
                            tokenizer=load_tokenizer(run_dir))
    return prepare_data(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, progress=log)


def _train(cfg: RunConfig, run_dir: Path, info: par.DistInfo, mode: str, accum: int, resume: bool, log,
           progress, wandb_mode: str, stop_at: int | None, signals: StopSignals) -> TrainResult:
    tc, device, main = cfg.train, info.device, info.is_main
    rank, world = info.rank, info.world_size
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(tc.seed)
    flush_denormals(device)

    # rank 0's view, taken before it writes anything: every rank takes the same branch
    resuming = par.broadcast_object(resume and (run_dir / "config.yaml").is_file())
    # rank 0 first: it fills the data cache (tokenizer, token streams), the others then read it
    data = par.main_first(lambda: _prepare(cfg, run_dir, resuming, log))
    if main and not resuming:
        save_tokenizer(data.tokenizer, run_dir)
        write_text_atomic(run_dir / "config.yaml", dump_config(cfg))
    log(f"data: {data.n_train_docs} train / {data.n_val_docs} val documents, {len(data.train_tokens):,} / "
        f"{len(data.val_tokens):,} tokens, {data.bytes_per_token_val:.2f} bytes per val token")

    model = build_model(cfg).to(device)   # the same seed on every rank: the same initial weights
    model.activation_checkpointing = tc.activation_checkpointing
    log(f"model: {cfg.model.arch}, {model.num_parameters():,} parameters "
        f"({model.num_active_parameters():,} active per token), device {device}")
    if mode != "none":
        log(f"parallel: {mode} over {world} process{'es' if world > 1 else ''}; per step {accum} "
            f"micro-batch{'es' if accum > 1 else ''} of {tc.micro_batch_size} sequences on each "
            f"({tc.global_batch_size} in all)")
    forward = par.parallelize(model, mode, device, tc.compile_mode if tc.compile else None)
    if tc.compile:
        log(f"compile: torch.compile mode {tc.compile_mode}, full graph"
            + (" per block" if mode != "none" else "") + " (the first steps include compiling)")
    speed = Throughput(cfg, device, world)
    log(speed.describe())
    # built after parallelize: FSDP2 replaces the parameters with its shards.
    # fused (one pass per parameter): k3-toy's CPU AdamW step 17.7 -> 3.3 ms, k3-0.5b's compiled H200 step 117.7 -> 112.8 ms
    opt = torch.optim.AdamW(param_groups(model, tc.weight_decay), lr=tc.lr, betas=(tc.beta1, tc.beta2),
                            eps=1e-8, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, tc.warmup_steps, tc.steps, tc.min_lr_ratio))
    # one global order on every rank; each reads only its rows of every global micro-batch
    loader = data.train_loader(tc.micro_batch_size * world, seed=tc.seed, rows_per_step=tc.global_batch_size,
                               rank=rank, world_size=world)
    val = data.val_batches(cfg.eval.batches, cfg.eval.batch_size)
    for batch in val:   # the same batches on every rank
        check_token_ids(batch, cfg.model.vocab_size, every_rank=True)

    step, loss_val, val_loss, time_before = 0, float("nan"), None, 0.0
    if resume:
        if main:
            if removed := remove_leftovers(run_dir):
                log("left by interrupted saves / prunes: " + ", ".join(f"{p.name} ({how})" for p, how in removed.items()))
        ckpt = find_latest(run_dir)
        if ckpt is None and par.broadcast_object(bool(list_checkpoints(run_dir))):
            raise SharedCheckpointError(f"{run_dir} has checkpoint folders but none verifies; nothing was changed. "
                             "Move them aside to start over, or resume from a copy that is intact")
        if ckpt is not None:
            # either format, saved at any world size; just verified by find_latest
            state = resume_checkpoint(ckpt, model if mode == "none" else forward, opt, sched, verify=False)
            loader.load_state_dict(state["loader"])
            step = state["step"]
            loss_val = state["extra"].get("train_loss", loss_val)
            val_loss = state["extra"].get("val_loss")
            time_before = state["extra"].get("time_s", 0.0)
            if main:
                _set_aside_unverified(run_dir, step, log)
            par.barrier()
            log(f"resumed from {ckpt} at step {step}")
        else:
            log(f"no checkpoint in {run_dir} yet; starting from step 0")
        if resuming and main:  # only keys that may change on resume differ; record them now
            write_text_atomic(run_dir / "config.yaml", dump_config(cfg))

    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    metrics_path = run_dir / "metrics.jsonl"
    if main:
        _truncate_metrics(metrics_path, step)
    wb = _wandb_init(wandb_mode, cfg, run_dir) if main else None
    model.train()
    t_start = time.time()
    # aside_s: evaluation and checkpoint seconds since the last log line, kept out of its throughput
    t_last, tokens_since, aside_s = time.time(), 0, 0.0
    if stop_at is not None and step >= stop_at:
        log(f"already at step {step} (--until {stop_at}); nothing to do")
        return TrainResult(run_dir, step, loss_val, val_loss)
    if progress is not None:
        progress.start(total=tc.steps, completed=step)

    moe = model.moe_layers()
    signals.arm()   # from here a signal waits for the end of the step (before, Ctrl-C stops at once)
    while step < tc.steps:
        opt.zero_grad(set_to_none=True)
        # fp64 on the device, the same sums as adding Python floats
        loss_acc = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(accum):
            t_data = time.perf_counter()
            ids = next(loader)   # this rank's rows of the global micro-batch
            check_token_ids(ids, cfg.model.vocab_size)
            segments = document_segments(ids, device, cfg.data.document_mask)
            ids = to_device(ids, device)
            speed.data_s += time.perf_counter() - t_data
            # gradients are reduced over ranks once a step, in the last micro-step's backward
            with par.grad_sync(forward, enabled=i == accum - 1):
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    out = forward(ids, labels=ids, segments=segments)
                (out.loss / accum).backward()
            loss_acc += out.loss.detach().float().double() / accum
            tokens_since += ids.numel()
        grad_norm = par.clip_grad_norm_(model.parameters(), tc.grad_clip if tc.grad_clip > 0 else float("inf"))
        par.all_reduce_moe_loads(model)   # the global loads: the same router biases on every rank
        imb = moe_imbalance(moe)
        loss_acc = par.all_reduce_mean(loss_acc)
        # the step's scalars in one read-back (one host sync), checked before the update
        vals = torch.stack([loss_acc, grad_norm.double()] + ([] if imb is None else [imb])).tolist()
        loss_sum, grad_norm, imbalance = vals[0], vals[1], (vals[2] if imb is not None else None)
        if not math.isfinite(loss_sum):
            _stop(run_dir, f"non-finite loss ({loss_sum}) at step {step + 1}; stopped")
        if not math.isfinite(grad_norm):  # stepping would write NaN weights into the next checkpoint
            _stop(run_dir, f"non-finite gradient norm ({grad_norm}) at step {step + 1}; stopped before the update")
        opt.step()
        sched.step()
        for m in moe:
            m.update_bias()
        step += 1
        loss_val = loss_sum

        # time_s: training-loop seconds since step 0, summed over resumed segments (wall-clock comparisons)
        record = {"step": step, "loss": round(loss_val, 6), "lr": sched.get_last_lr()[0],
                  "grad_norm": round(grad_norm, 6)}
        if imbalance is not None:
            record["moe_imbalance"] = round(imbalance, 4)
        last_step = step == tc.steps
        out_of_time = tc.time_limit_s > 0 and time.time() - t_start >= tc.time_limit_s
        if tc.time_limit_s > 0:
            out_of_time = par.broadcast_object(out_of_time)   # rank 0's clock stops every rank
        paused = stop_at is not None and step >= stop_at
        stop_signal = signals.poll(device)
        speed.steps += 1
        if (tc.eval_every and step % tc.eval_every == 0) or last_step or out_of_time:
            t_eval = time.time()
            val_loss = evaluate_loss(forward, val, device, autocast_dtype, module=model, rank=rank, world_size=world,
                                     document_mask=cfg.data.document_mask)
            record["val_loss"] = round(val_loss, 6)
            aside_s += time.time() - t_eval
        record["time_s"] = round(time_before + time.time() - t_start, 3)
        if step % tc.log_every == 0 or "val_loss" in record:
            now = time.time()
            record.update(speed.window(tokens_since, now - t_last - aside_s))
            t_last, tokens_since, aside_s = now, 0, 0.0
            log(_format(record))
        if main:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if wb is not None:
            wb.log(record, step=step)
        if progress is not None:
            progress.update(step, loss=loss_val, tokens_per_s=record.get("tokens_per_s"))
        if (tc.ckpt_every and step % tc.ckpt_every == 0) or last_step or out_of_time or paused or stop_signal:
            t_save = time.time()
            extra = {"val_loss": val_loss, "train_loss": loss_val, "time_s": record["time_s"]}
            try:
                if mode == "none":
                    path = save_checkpoint(run_dir, step, model, opt, sched, loader.state_dict(), extra=extra)
                else:   # every rank writes its shards
                    path = save_dcp(run_dir, step, forward, opt, sched, loader.state_dict(), extra=extra)
            except CheckpointError as e:   # save_dcp raises on every rank alike, so all can look together
                last = find_latest(run_dir)
                raise type(e)(f"{e}. Last complete checkpoint: {last or 'none'}; make room or fix the folder, "
                              "then continue with --resume auto") from None
            prune(run_dir, tc.keep_last, newest=path)
            log(f"checkpoint: {path}")
            aside_s += time.time() - t_save
        if stop_signal and not last_step:
            name = signal.Signals(stop_signal).name
            log(f"{name} received: stopped at step {step} after its checkpoint; resume with --resume auto")
            if wb is not None:
                wb.finish()
            raise TrainingInterrupted(f"{name}: stopped at step {step}; checkpoint {path}", stop_signal)
        if out_of_time and not last_step:
            log(f"time limit of {tc.time_limit_s:.0f} s reached at step {step}; resume with --resume auto")
            break
        if paused and not last_step:
            log(f"stopped at step {step} as asked (--until); resume with --resume auto")
            break

    if progress is not None:
        progress.stop()
    if wb is not None:
        wb.finish()
    return TrainResult(run_dir, step, loss_val, val_loss)


# keys a resumed run may change; anything else would silently not apply (optimiser and loader
# state come from the checkpoint) or would not fit the checkpoint at all
RESUMABLE_KEYS = ("train.steps", "train.device", "train.log_every", "train.eval_every", "train.ckpt_every",
                  "train.keep_last", "train.time_limit_s", "train.compile", "train.activation_checkpointing",
                  "train.peak_tflops", "train.parallel", "eval.")


def check_resume_config(saved: RunConfig, new: RunConfig) -> None:
    a, b = flatten(config_to_dict(saved)), flatten(config_to_dict(new))
    changed = [k for k in sorted(a) if a[k] != b.get(k) and not k.startswith(RESUMABLE_KEYS)]
    if changed:
        shown = ", ".join(f"{k} ({a[k]!r} -> {b.get(k)!r})" for k in changed[:4])
        raise ValueError(f"cannot resume with a changed {shown}{' …' if len(changed) > 4 else ''}; only "
                         "train.steps/device/log_every/eval_every/ckpt_every/keep_last/time_limit_s/compile*/"
                         "activation_checkpointing/peak_tflops/parallel (and the number of processes) and eval.* "
                         "may change. Train into a new --out instead")


def _set_aside_unverified(run_dir: Path, step: int, log) -> None:
    """Rename checkpoint folders newer than `step` that failed verification (kept, not deleted),
    so that training can write that step again."""
    for s, path in list_checkpoints(run_dir):
        if s > step:
            aside = path.with_name(f"{path.name}.unverified-{time.strftime('%Y%m%d-%H%M%S')}")
            path.rename(aside)
            log(f"checkpoint {path} failed verification; kept as {aside}")


def _stop(run_dir: Path, why: str) -> None:
    last = find_latest(run_dir)   # every rank stops here together (the loss and norm are global)
    raise TrainingStopped(f"{why}. Last good checkpoint: {last if last else 'none'}")


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines after `step` (written after the checkpoint we resume from), so a resumed
    run's metrics.jsonl has each step once; the old file is replaced atomically."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):  # a line cut by a crash mid-write
            continue
    write_text_atomic(path, "".join(line + "\n" for line in keep))


def _format(r: dict) -> str:
    parts = [f"step {r['step']}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.3f}"]
    if "tokens_per_s" in r:
        parts.append(f"{r['tokens_per_s']:.0f} tok/s")
        parts.append(f"{r['step_ms']:.1f} ms/step (data {r['data_ms']:.2f})")
        parts.append(f"{r['tflops']:.3g} TFLOP/s" + (f" MFU {100 * r['mfu']:.1f}%" if "mfu" in r else ""))
        parts.append(f"mem {r['peak_mem_gb']:.2f} GB")
    if "moe_imbalance" in r:
        parts.append(f"moe max/mean {r['moe_imbalance']:.2f}")
    if "val_loss" in r:
        parts.append(f"val_loss {r['val_loss']:.4f}")
    return " | ".join(parts)


def require_wandb(mode: str):
    """The wandb module when `mode` is not "off" (None then); a clear ValueError when it is missing."""
    if mode == "off":
        return None
    try:
        import wandb  # optional extra: pip install 'k3cli[wandb]'
    except ImportError:
        raise ValueError("--wandb needs the wandb package: pip install 'k3cli[wandb]'") from None
    return wandb


def _wandb_init(mode: str, cfg: RunConfig, run_dir: Path):
    wandb = require_wandb(mode)
    if wandb is None:
        return None
    try:
        return wandb.init(project="k3", dir=str(run_dir), mode=mode, config=config_to_dict(cfg))
    except Exception as e:   # wandb's own errors (no API key, no network) are plain Exceptions
        raise ValueError(f"--wandb {mode}: wandb could not start the run ({first_line(e).strip()[:200]})") from None
