"""The training loop: AdamW + warmup/cosine, gradient accumulation, MoE bias balancing,
periodic evaluation, atomic checkpoints and exact resume, in one process or several.

The loop never waits on the device in a steady-state step: batches come from a worker process
(`batches.Prefetcher`), the step keeps its scalars on the device (`step.TrainStep`), and they are
read at *read steps* only — log, evaluation, checkpoint and stop steps — all pending steps' scalars
in one transfer. A non-finite loss or gradient norm skips that step's update on the device and stops
the run at the next read, naming the step where it first happened.

Under torchrun every rank runs `train`: the same global batches in the same order (each rank
trains on its slice, `k3cli.distributed`), gradient accumulation sized so that an optimiser step sees
`train.global_batch_size` sequences at any world size; rank 0 alone writes the run's files, logs
and reports, and the logged loss, gradient norm and MoE imbalance are the global ones.
"""
from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from k3cli import checkpoint
from k3cli import distributed as par
from k3cli.config import RunConfig, config_to_dict, dump_config
from k3cli.data import cache_root, check_token_ids
from k3cli.distributed.compile import CompileWatch, use_compile_cache
from k3cli.errors import CheckpointError, first_line
from k3cli.files import write_text_atomic
from k3cli.train.batches import Prefetcher
from k3cli.train.build import build_model, build_optimizer, check_parallel, flush_denormals, resolve_device
from k3cli.train.metrics import StepRecords, Throughput, format_record, rounded
from k3cli.train.rundir import (
    check_out,
    init_weights,
    prepare_run_data,
    restore,
    truncate_metrics,
    weights_source,
    write_new_run,
)
from k3cli.train.step import TrainStep
from k3cli.train.stops import Stops, StopSignals, TrainingInterrupted, TrainingStopped
from k3cli.train.validation import evaluate_loss


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    train_loss: float
    val_loss: float | None


def train(cfg: RunConfig, run_dir: Path, resume: bool = False, log: Callable[[str], None] = print,
          progress=None, wandb_mode: str = "off", stop_at: int | None = None, restart: bool = False,
          init_from: Path | None = None) -> TrainResult:
    """Train `cfg` into `run_dir`. With `resume`, continue from the newest complete checkpoint; with
    `restart`, start over a run that has no checkpoint yet; with `stop_at`, stop (with a checkpoint)
    after that step without changing the schedule; with `init_from` (a run, checkpoint or export), a new
    run starts from those weights and their tokenizer. `run_dir` must pass `rundir.check_out`.
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
        run = Run(cfg, run_dir, info, mode, accum, log, progress, resume, restart, init_from)
        return run.loop(resume, wandb_mode, stop_at, signals)
    finally:
        signals.restore()
        if owns_group:
            par.destroy()


class Run:
    """One training run's state: built in `__init__` (data, model, optimiser), advanced by `loop`."""

    def __init__(self, cfg: RunConfig, run_dir: Path, info: par.DistInfo, mode: str, accum: int, log, progress,
                 resume: bool, restart: bool, init_from: Path | None = None):
        tc, device = cfg.train, info.device
        self.cfg, self.run_dir, self.info, self.mode, self.log, self.progress = cfg, run_dir, info, mode, log, progress
        # every rank looks before any rank writes, so all find the same and take the same branch
        self.resuming = check_out(run_dir, resume, restart)
        par.barrier()
        run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(tc.seed)
        flush_denormals(device)
        # rank 0 first: it fills the data cache (tokenizer, token streams), the others then read it
        # resolved on every rank before main_first: finding a run's newest checkpoint is a collective
        source = weights_source(init_from) if init_from is not None else None
        data = par.main_first(lambda: prepare_run_data(cfg, run_dir, self.resuming, log,
                                                       source.tokenizer if source else None))
        if info.is_main and not self.resuming:
            write_new_run(cfg, run_dir, data)
        log(f"run directory: {run_dir}")
        log(f"data: {data.n_train_docs} train / {data.n_val_docs} val documents, {len(data.train_tokens):,} / "
            f"{len(data.val_tokens):,} tokens, {data.bytes_per_token_val:.2f} bytes per val token")

        self.model = model = build_model(cfg).to(device)   # the same seed on every rank: the same weights
        model.activation_checkpointing = tc.activation_checkpointing
        if source is not None:   # every rank, before any wrapping shards them; a resumed checkpoint overwrites them
            init_weights(model, source, log)
        log(f"model: {cfg.model.arch}, {model.num_parameters():,} parameters "
            f"({model.num_active_parameters():,} active per token), device {device}")
        if mode != "none":
            log(f"parallel: {mode} over {info.world_size} process{'es' if info.world_size > 1 else ''}; per step "
                f"{accum} micro-batch{'es' if accum > 1 else ''} of {tc.micro_batch_size} sequences on each "
                f"({tc.global_batch_size} in all)")
        if tc.compile:
            use_compile_cache(cache_root() / "compile")
        self.forward = par.parallelize(model, mode, device, tc.compile_mode if tc.compile else None)
        self.speed = Throughput(cfg, device, info.world_size)
        log(self.speed.describe())
        opt, self.sched = build_optimizer(model, cfg)
        self.step_fn = TrainStep(model, self.forward, opt, self.sched, accum, tc.grad_clip, device)
        # one global order on every rank; each reads only its rows of every global micro-batch
        self.loader = data.train_loader(tc.micro_batch_size * info.world_size, seed=tc.seed,
                                        rows_per_step=tc.global_batch_size, rank=info.rank,
                                        world_size=info.world_size)
        self.val = data.val_batches(cfg.eval.batches, cfg.eval.batch_size)
        self.start_id = data.start_id
        for batch in self.val:   # the same batches on every rank
            check_token_ids(batch, cfg.model.vocab_size, every_rank=True)

    def evaluate(self) -> float:
        return evaluate_loss(self.forward, self.val, self.info.device, self.step_fn.autocast, module=self.model,
                             rank=self.info.rank, world_size=self.info.world_size,
                             document_mask=self.cfg.data.document_mask, start_id=self.start_id)

    def save(self, step: int, loader_state: dict, extra: dict) -> Path:
        try:
            path = checkpoint.save(self.run_dir, step, self.forward, self.step_fn.opt, self.sched, loader_state,
                                   extra=extra)
        except CheckpointError as e:   # a sharded save raises on every rank alike, so all can look together
            last = checkpoint.latest(self.run_dir)
            raise type(e)(f"{e}. Last complete checkpoint: {last or 'none'}; make room or fix the folder, "
                          "then continue with --resume auto") from None
        checkpoint.prune(self.run_dir, self.cfg.train.keep_last, newest=path)
        self.log(f"checkpoint: {path}")
        return path

    def loop(self, resume: bool, wandb_mode: str, stop_at: int | None, signals: StopSignals) -> TrainResult:
        cfg, tc, log, main, run_dir = self.cfg, self.cfg.train, self.log, self.info.is_main, self.run_dir
        step, loss, val_loss, time_before = 0, float("nan"), None, 0.0
        if resume:
            state = restore(run_dir, self.model if self.mode == "none" else self.forward, self.step_fn.opt,
                            self.sched, self.loader, main, log)
            if state is not None:
                step, loss, val_loss = state["step"], state.get("train_loss", loss), state.get("val_loss")
                time_before = state.get("time_s", 0.0)
            if self.resuming and main:  # only keys that may change on resume differ; record them now
                write_text_atomic(run_dir / "config.yaml", dump_config(cfg))
        metrics_path = run_dir / "metrics.jsonl"
        if main:
            truncate_metrics(metrics_path, step)
        if stop_at is not None and step >= stop_at:
            log(f"already at step {step} (--until {stop_at}); nothing to do")
            return TrainResult(run_dir, step, loss, val_loss)
        wb = _wandb_init(wandb_mode, cfg, run_dir) if main else None
        self.model.train()
        device = self.info.device
        feed = Prefetcher(self.loader, cfg.model.vocab_size, cfg.data.document_mask, device,
                          depth=2 * self.step_fn.accum, chunk_sizes=self.model.layout_chunk_sizes(),
                          start_id=self.start_id)
        records, stops, watch = StepRecords(), Stops(tc.time_limit_s, signals, self.info.device), CompileWatch(tc.compile)
        if self.progress is not None:
            self.progress.start(total=tc.steps, completed=step)
        # aside_s: evaluation and checkpoint seconds since the last log line, kept out of its throughput
        t_last, tokens_last, aside_s, step_first = time.time(), 0, 0.0, step
        signals.arm()   # from here a signal waits for the end of the step (before, Ctrl-C stops at once)
        try:
            while step < tc.steps:
                if step == step_first and (starting := watch.starting()):
                    log(starting)
                scalars = self.step_fn(feed.next_batch)
                step += 1
                if step == step_first + 1 and (done := watch.finished()):
                    log(done)
                records.add({"step": step, "lr": self.sched.get_last_lr()[0],
                             "time_s": round(time_before + time.time() - stops.t_start, 3)}, scalars)
                self.speed.steps += 1
                last, paused = step == tc.steps, stop_at is not None and step >= stop_at
                evaluating = (tc.eval_every and step % tc.eval_every == 0) or last
                saving = (tc.ckpt_every and step % tc.ckpt_every == 0) or last or paused
                logging = step % tc.log_every == 0
                if not (logging or evaluating or saving or stops.early()):
                    if self.progress is not None:
                        self.progress.update(step)
                    continue

                # a read step: the pending steps' scalars in one transfer
                stop_signal, out_of_time = stops.agreed()
                rows, bad = records.read()
                if bad is not None:
                    self._write(metrics_path, wb, rows[:rows.index(bad)])
                    key, what = ("loss", "loss") if not math.isfinite(bad["loss"]) else ("grad_norm", "gradient norm")
                    last_ckpt = checkpoint.latest(run_dir)   # every rank stops here together (the scalars are global)
                    raise TrainingStopped(f"non-finite {what} ({bad[key]}) at step {bad['step']}; stopped before its "
                                          f"update. Last good checkpoint: {last_ckpt or 'none'}")
                row, loss = rows[-1], rows[-1]["loss"]
                if evaluating or out_of_time:
                    t_eval = time.time()
                    val_loss = row["val_loss"] = self.evaluate()
                    aside_s += time.time() - t_eval
                row["time_s"] = round(time_before + time.time() - stops.t_start, 3)
                if logging or "val_loss" in row:
                    now = time.time()
                    tokens = self.step_fn.tokens
                    row.update(self.speed.window(tokens - tokens_last, now - t_last - aside_s, feed.wait_s))
                    t_last, tokens_last, aside_s, feed.wait_s = now, tokens, 0.0, 0.0
                    log(format_record(row))
                self._write(metrics_path, wb, rows)
                if self.progress is not None:
                    self.progress.update(step, loss=loss, tokens_per_s=row.get("tokens_per_s"))
                if saving or out_of_time or stop_signal:
                    t_save = time.time()
                    path = self.save(step, feed.loader_state, {"val_loss": val_loss, "train_loss": loss,
                                                               "time_s": row["time_s"]})
                    aside_s += time.time() - t_save
                if stop_signal and not last:
                    raise TrainingInterrupted(f"{signal.Signals(stop_signal).name}: stopped at step {step} after "
                                              f"its checkpoint {path}", stop_signal)
                if out_of_time and not last:
                    log(f"time limit of {tc.time_limit_s:.0f} s reached at step {step}; resume with --resume auto")
                    break
                if paused and not last:
                    log(f"stopped at step {step} as asked (--until); resume with --resume auto")
                    break
        finally:
            feed.close()
            if wb is not None:
                wb.finish()
        if self.progress is not None:
            self.progress.stop()
        return TrainResult(run_dir, step, loss, val_loss)

    def _write(self, metrics_path: Path, wb, rows: list[dict]) -> None:
        if not self.info.is_main or not rows:
            return
        rows = [rounded(r) for r in rows]
        with metrics_path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        if wb is not None:
            for r in rows:
                wb.log(r, step=r["step"])


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
