"""A run directory: what a new run writes first, and how a resumed run checks and restores it.

Everything a run needs to continue bit-for-bit lives there: `config.yaml`, `tokenizer.json`,
`metrics.jsonl` and `checkpoints/step_*/` (model safetensors + optimiser, scheduler, loader and RNG
state; sharded DCP files when the run is DDP / FSDP).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from k3cli import parallel as par
from k3cli.checkpoint import list_checkpoints, remove_leftovers
from k3cli.config import RunConfig, config_to_dict, dump_config, flatten, load_config
from k3cli.data import PreparedData, load_tokenizer, prepare_data, save_tokenizer, write_text_atomic
from k3cli.dist_checkpoint import SharedCheckpointError, find_latest, resume_checkpoint

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


def prepare_run_data(cfg: RunConfig, run_dir: Path, resuming: bool, log) -> PreparedData:
    """The run's token streams. A resumed run checks its config first and keeps its own tokenizer;
    its files stay untouched until its checkpoint has loaded."""
    if resuming:
        check_resume_config(load_config(str(run_dir / "config.yaml")), cfg)
        return prepare_data(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, progress=log,
                            tokenizer=load_tokenizer(run_dir))
    return prepare_data(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, progress=log)


def write_new_run(cfg: RunConfig, run_dir: Path, data: PreparedData) -> None:
    save_tokenizer(data.tokenizer, run_dir)
    write_text_atomic(run_dir / "config.yaml", dump_config(cfg))


def restore(run_dir: Path, model, opt, sched, loader, main: bool, log) -> dict | None:
    """Load the newest complete checkpoint of `run_dir` into model (or its parallel wrapper), optimiser,
    scheduler and loader; its `step` and `extra` (train_loss, val_loss, time_s), or None when the run
    has no checkpoint yet. Left-overs of interrupted saves go; newer checkpoints that fail verification
    are set aside (kept)."""
    if main and (removed := remove_leftovers(run_dir)):
        log("left by interrupted saves / prunes: " + ", ".join(f"{p.name} ({how})" for p, how in removed.items()))
    ckpt = find_latest(run_dir)
    if ckpt is None and par.broadcast_object(bool(list_checkpoints(run_dir))):
        raise SharedCheckpointError(f"{run_dir} has checkpoint folders but none verifies; nothing was changed. "
                                    "Move them aside to start over, or resume from a copy that is intact")
    if ckpt is None:
        log(f"no checkpoint in {run_dir} yet; starting from step 0")
        return None
    # either format, saved at any world size; just verified by find_latest
    state = resume_checkpoint(ckpt, model, opt, sched, verify=False)
    loader.load_state_dict(state["loader"])
    if main:
        _set_aside_unverified(run_dir, state["step"], log)
    par.barrier()
    log(f"resumed from {ckpt} at step {state['step']}")
    return {"step": state["step"], **state["extra"]}


def _set_aside_unverified(run_dir: Path, step: int, log) -> None:
    """Rename checkpoint folders newer than `step` that failed verification (kept, not deleted),
    so that training can write that step again."""
    for s, path in list_checkpoints(run_dir):
        if s > step:
            aside = path.with_name(f"{path.name}.unverified-{time.strftime('%Y%m%d-%H%M%S')}")
            path.rename(aside)
            log(f"checkpoint {path} failed verification; kept as {aside}")


def truncate_metrics(path: Path, step: int) -> None:
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
