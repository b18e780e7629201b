"""A run directory: what a new run writes first, and how a resumed run checks and restores it.

Everything a run needs to continue bit-for-bit lives there: `run.json` (the marker that makes the folder
a k3 run, written first), `config.yaml`, `tokenizer.json`, `metrics.jsonl` and `checkpoints/step_*/`
(model safetensors + optimiser, scheduler, loader and RNG state; sharded DCP files when the run is DDP /
FSDP). Training writes into a folder only when `check_out` says it is new, empty or such a run.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import NamedTuple

from k3cli import distributed as par
from k3cli.checkpoint import (
    EXPORT_MARKER,
    MARKER,
    latest,
    list_checkpoints,
    load,
    load_weights,
    remove_leftovers,
)
from k3cli.checkpoint.export import is_export, load_export_into
from k3cli.config import RunConfig, config_to_dict, dump_config, flatten, load_config
from k3cli.data import MANIFEST, PreparedData, load_tokenizer, prepare_data, save_tokenizer
from k3cli.errors import RunDirError, SharedCheckpointError
from k3cli.files import write_text_atomic

RUN_MARKER, RUN_FORMAT = "run.json", 1
# keys a resumed run may change; anything else would silently not apply (optimiser and loader
# state come from the checkpoint) or would not fit the checkpoint at all. micro_batch_size only splits
# the global batch, whose position the loader keeps (global_batch_size itself may not change)
RESUMABLE_KEYS = ("train.steps", "train.device", "train.log_every", "train.eval_every", "train.ckpt_every",
                  "train.keep_last", "train.time_limit_s", "train.compile", "train.activation_checkpointing",
                  "train.peak_tflops", "train.parallel", "train.micro_batch_size", "eval.")


def is_run(run_dir: Path) -> bool:
    """`run_dir` holds a run `k3 train` wrote: its marker, or (runs written before the marker existed)
    config.yaml and tokenizer.json with metrics.jsonl or checkpoints/, and no export or prepare marker."""
    if (run_dir / EXPORT_MARKER).exists() or (run_dir / MANIFEST).exists():
        return False
    if (run_dir / RUN_MARKER).is_file():
        try:
            marker = json.loads((run_dir / RUN_MARKER).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        if isinstance(marker, dict) and marker.get("k3") == "run":
            if marker.get("format") != RUN_FORMAT:
                raise RunDirError(f"{run_dir} holds a run of format {marker.get('format')!r}; this k3 reads "
                                  f"format {RUN_FORMAT}: use the k3 that wrote it")
            return True
    return (all((run_dir / n).is_file() for n in ("config.yaml", "tokenizer.json"))
            and ((run_dir / "metrics.jsonl").is_file() or (run_dir / "checkpoints").is_dir()))


def check_out(run_dir: Path, resume: bool, restart: bool = False) -> bool:
    """Whether training into `run_dir` continues a run there (True) or starts one (False); RunDirError,
    before anything is written, when it may do neither: a file, an export, a prepared-data folder, any
    other non-empty folder, a run without --resume auto or --restart, or a run with checkpoints under
    --restart (which only starts over a run that has none, its old files replaced)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"--out {run_dir} is a file; choose a folder")
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return False
    if (run_dir / EXPORT_MARKER).exists():
        raise RunDirError(f"{run_dir} is a `k3 export` folder (weights only, no optimiser or data state); training "
                          "never writes into one: continue the run it was exported from (k3 train --out RUN "
                          "--resume auto) or train a new run into another --out (nothing was changed)")
    if (run_dir / MANIFEST).exists():
        raise RunDirError(f"{run_dir} is a `k3 data prepare` folder: train on it with --data {run_dir} and choose "
                          "another --out (nothing was changed)")
    if not is_run(run_dir):
        raise RunDirError(f"{run_dir} is not empty and holds no k3 run (no {RUN_MARKER}); choose a new or empty "
                          "folder for --out (nothing was changed)")
    has_ckpt = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    if restart and has_ckpt:
        raise RunDirError(f"{run_dir} has checkpoints; --restart starts over only a run with none: continue it with "
                          "--resume auto, or train into another --out (nothing was changed)")
    if restart:
        return False
    if not resume:
        raise RunDirError(f"{run_dir} already holds checkpoints; pass --resume auto to continue it, or choose another "
                          "--out" if has_ckpt else
                          f"{run_dir} holds a run with no checkpoint yet; pass --resume auto to continue it, --restart "
                          "to start it over, or choose another --out")
    # a run killed between its marker and its config has nothing to continue: it starts again
    return (run_dir / "config.yaml").is_file()


def check_resume_config(saved: RunConfig, new: RunConfig) -> None:
    a, b = flatten(config_to_dict(saved)), flatten(config_to_dict(new))
    changed = [k for k in sorted(a) if a[k] != b.get(k) and not k.startswith(RESUMABLE_KEYS)]
    if changed:
        shown = ", ".join(f"{k} ({a[k]!r} -> {b.get(k)!r})" for k in changed[:4])
        may = ", ".join(k + "*" if k.endswith((".", "compile")) else k for k in RESUMABLE_KEYS)
        raise ValueError(f"cannot resume with a changed {shown}{' …' if len(changed) > 4 else ''}; only {may} "
                         "(and the number of processes) may change. Train into a new --out instead")


def check_resume(run_dir: Path, cfg: RunConfig) -> None:
    """`cfg` may continue the run in `run_dir`; a refusal of a run with no checkpoint yet names --restart."""
    try:
        check_resume_config(load_config(str(run_dir / "config.yaml")), cfg)
    except ValueError as e:
        if list_checkpoints(run_dir):
            raise
        raise ValueError(f"{e}, or pass --restart: the run has no checkpoint yet") from None


def prepare_run_data(cfg: RunConfig, run_dir: Path, resuming: bool, log,
                     tokenizer_from: Path | None = None) -> PreparedData:
    """The run's token streams. A resumed run checks its config first and keeps its own tokenizer;
    its files stay untouched until its checkpoint has loaded. A run started from another's weights
    takes that one's tokenizer (`tokenizer_from`, a folder): the weights know its token ids."""
    if resuming:
        check_resume(run_dir, cfg)
        return prepare_data(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, progress=log,
                            tokenizer=load_tokenizer(run_dir))
    if tokenizer_from is not None:
        return prepare_data(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, progress=log,
                            tokenizer=load_tokenizer(tokenizer_from))
    return prepare_data(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, progress=log)


class WeightsSource(NamedTuple):
    """What `--init-from PATH` names: the folder with its tokenizer, the one with its weights, and whether
    those weights were just checksummed (a run directory's newest checkpoint)."""

    tokenizer: Path
    weights: Path
    verified: bool


def weights_source(path: Path) -> WeightsSource:
    """`--init-from PATH` resolved: a run directory (its newest checkpoint that verifies), one checkpoint
    folder, or an export. Every rank calls it (under a process group rank 0 alone hashes)."""
    path = Path(path)
    if is_export(path):
        return WeightsSource(path, path, False)
    if (path / MARKER).is_file():
        return WeightsSource(path.parent.parent, path, False)
    if (path / "config.yaml").is_file():
        ckpt = latest(path)
        if ckpt is None:
            raise RunDirError(f"--init-from {path}: the run has no complete checkpoint")
        return WeightsSource(path, ckpt, True)
    raise RunDirError(f"--init-from {path}: not a run directory, checkpoint folder or export")


def init_weights(model, source: WeightsSource, log) -> None:
    """Load `--init-from`'s weights into `model` (plain, before any wrapping); the architecture must match
    (one error line naming the first tensor that does not fit)."""
    if is_export(source.weights):
        state = load_export_into(source.weights, model, verify=not source.verified)
    else:
        state = load_weights(source.weights, model, verify=not source.verified)
    log(f"weights: from {source.weights} (step {state['step']}); a fresh optimiser and schedule")


def mark_run(run_dir: Path) -> None:
    """The run marker: written first, so whatever follows in the folder is this run's."""
    write_text_atomic(run_dir / RUN_MARKER, json.dumps({"k3": "run", "format": RUN_FORMAT}) + "\n")


def write_new_run(cfg: RunConfig, run_dir: Path, data: PreparedData) -> None:
    """The marker first (whatever follows is then this run's), the tokenizer, the config; a started-over
    run's old metrics go."""
    mark_run(run_dir)
    save_tokenizer(data.tokenizer, run_dir)
    write_text_atomic(run_dir / "config.yaml", dump_config(cfg))
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)


def restore(run_dir: Path, model, opt, sched, loader, main: bool, log) -> dict | None:
    """Load the newest complete checkpoint of `run_dir` into model (or its parallel wrapper), optimiser,
    scheduler and loader; its `step` and `extra` (train_loss, val_loss, time_s), or None when the run
    has no checkpoint yet. Left-overs of interrupted saves go; newer checkpoints that fail verification
    are set aside (kept)."""
    if main and (removed := remove_leftovers(run_dir)):
        log("left by interrupted saves / prunes: " + ", ".join(f"{p.name} ({how})" for p, how in removed.items()))
    ckpt = latest(run_dir)
    if ckpt is None and par.broadcast_object(bool(list_checkpoints(run_dir))):
        raise SharedCheckpointError(f"{run_dir} has checkpoint folders but none verifies; nothing was changed. "
                                    "Move them aside to start over, or resume from a copy that is intact")
    if ckpt is None:
        log(f"no checkpoint in {run_dir} yet; starting from step 0")
        return None
    # either format, saved at any world size; just verified by latest
    state = load(ckpt, model, opt, sched, verify=False)
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


def new_run_dir(preset: str, mode: str) -> Path:
    """runs/PRESET-MODE-TIMESTAMP, created here so that two runs started together never share one."""
    base = Path("runs") / f"{preset}-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    for i in range(1000):
        path = base if i == 0 else base.with_name(f"{base.name}-{i}")
        try:
            path.mkdir(parents=True, exist_ok=False)
            return path
        except FileExistsError:
            continue
    raise RunDirError(f"could not create a fresh run directory next to {base}")


def newest_run(preset: str, mode: str | None) -> Path | None:
    """The newest runs/PRESET-MODE-* folder (any mode when None): what `--resume auto` without --out continues."""
    pattern = f"{Path(preset).stem}-{mode or '*'}-*"
    runs = sorted(Path("runs").glob(pattern), key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None
