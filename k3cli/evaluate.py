"""`k3 eval`: validation loss, perplexity, bits per byte and throughput of a trained run."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from k3cli.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, why_incomplete
from k3cli.config import ConfigError, RunConfig, load_config
from k3cli.data import DataError, load_tokenizer, prepare_data
from k3cli.dist_checkpoint import find_latest, is_dcp, load_dcp_model_into
from k3cli.export import is_export, load_export_into
from k3cli.models.causal_lm import CausalLM
from k3cli.train import evaluate_loss, flush_denormals, resolve_device


def locate(run: str | None, ckpt: str | None, warn: Callable[[str], None] | None = None) -> tuple[Path, Path]:
    """(run_dir, checkpoint_dir) from `--run DIR` (newest complete checkpoint) or `--ckpt PATH`;
    a `k3 export` folder is both (its own config and tokenizer beside the weights). `--run` names
    the newest checkpoint when it fails verification: an error when none verifies, else to `warn`."""
    if (run is None) == (ckpt is None):
        raise ConfigError("give exactly one of --run DIR or --ckpt PATH")
    if ckpt is not None:
        path = Path(ckpt)
        if is_export(path):
            return path, path
        if not (path / "COMPLETE").is_file():
            raise ConfigError(f"not a complete checkpoint directory: {ckpt}")
        return path.parent.parent, path
    run_dir = Path(run)
    if is_export(run_dir):
        return run_dir, run_dir
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"not a k3 run directory (no config.yaml): {run}")
    path = find_latest(run_dir)
    found = [p for _, p in list_checkpoints(run_dir)]
    newer = found[found.index(path) + 1:] if path is not None else found
    if newer and path is None:
        raise CheckpointError(f"no checkpoint of run {run} verifies: the newest, {newer[-1]}, fails "
                              f"({why_incomplete(newer[-1])})")
    if path is None:
        raise ConfigError(f"run {run} has no complete checkpoint yet")
    if newer and warn is not None:
        warn(f"warning: {newer[-1]} fails verification ({why_incomplete(newer[-1])}); using {path.name}, "
             "the newest checkpoint that verifies")
    return run_dir, path


def load_model(run_dir: Path, ckpt: Path, device: torch.device,
               verify: bool = True) -> tuple[RunConfig, CausalLM, int]:
    """The model of checkpoint `ckpt` (single-process, sharded DCP of any world size, or an export)
    on `device`, in eval mode, read in this one process."""
    cfg = load_config(str(run_dir / "config.yaml"))
    model = CausalLM(cfg.model).to(device)
    if is_export(ckpt):
        state = load_export_into(ckpt, model, verify=verify)
    elif is_dcp(ckpt):
        state = load_dcp_model_into(ckpt, model, verify=verify)
    else:
        state = load_checkpoint(ckpt, model, restore_rng=False, verify=verify)
    model.eval()
    return cfg, model, state["step"]


class OpenedRun(NamedTuple):
    run_dir: Path
    ckpt_dir: Path
    device: torch.device
    cfg: RunConfig
    model: CausalLM
    step: int
    tokenizer: object


def open_run(run: str | None, ckpt: str | None, device: str = "auto",
             warn: Callable[[str], None] | None = None) -> OpenedRun:
    """What `k3 eval` and `k3 generate` start from: the checkpoint (`--run`: its newest verified one,
    checksummed once), the device, the model in eval mode and the run's tokenizer."""
    run_dir, ckpt_dir = locate(run, ckpt, warn)
    dev = resolve_device(device)
    flush_denormals(dev)
    tok = load_tokenizer(run_dir)
    # --run: find_latest has just checksummed the checkpoint (an export is not looked at before)
    cfg, model, step = load_model(run_dir, ckpt_dir, dev, verify=run is None or is_export(ckpt_dir))
    return OpenedRun(run_dir, ckpt_dir, dev, cfg, model, step, tok)


def unigram_entropy(tokens) -> float:
    """Entropy (nats/token) of the empirical token distribution: the loss of the best model
    that ignores context, the baseline a trained model must beat."""
    counts = torch.bincount(torch.as_tensor(np.asarray(tokens, dtype=np.int64))).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def evaluate_run(run: str | None = None, ckpt: str | None = None, batches: int | None = None,
                 batch_size: int | None = None, device: str = "auto", data: str | None = None, log=print) -> dict:
    """`k3 eval`: the checkpoint's loss on the validation split of the run's data, or of `data` (any
    source `k3 train` takes, tokenized with the run's tokenizer; a prepared folder must hold that one's
    tokens). Fewer batches than asked is a warning; the result records those used."""
    run_dir, ckpt_dir, dev, cfg, model, step, tok = open_run(run, ckpt, device, warn=log)
    source = data or cfg.data.source
    if data is None and _moved(source):
        raise DataError(f"the run's data {source} does not exist (moved or deleted?); give it, or any other "
                        "source, with --data SRC")
    data_cfg = dataclasses.replace(cfg.data, source=source)
    prepared = prepare_data(data_cfg, cfg.model.vocab_size, cfg.train.seq_len, tokenizer=tok, progress=log)
    n, bs = batches or cfg.eval.batches, batch_size or cfg.eval.batch_size
    val = prepared.val_batches(n, bs)
    if len(val) < n:
        log(f"warning: the validation split of {source} holds {sum(b.shape[0] for b in val)} sequences of "
            f"{val[0].shape[1]} tokens, {len(val)} batch(es) of {bs}, fewer than the {n} asked; evaluating on those")
    autocast = torch.bfloat16 if dev.type == "cuda" else None
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = evaluate_loss(model, val, dev, autocast, document_mask=cfg.data.document_mask)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(b.numel() for b in val)
    return {
        "unigram_entropy": unigram_entropy(prepared.val_tokens),
        "run": str(run_dir), "checkpoint": str(ckpt_dir), "step": step, "data": source,
        "val_loss": loss, "perplexity": math.exp(loss),
        "bits_per_byte": loss / math.log(2) / prepared.bytes_per_token_val,
        "bytes_per_token": prepared.bytes_per_token_val,
        "batches": len(val), "batches_asked": n, "batch_size": bs,
        "tokens": tokens, "tokens_per_s": tokens / dt, "device": str(dev),
    }


def _moved(source: str) -> bool:
    """A path source that is no longer where the run's config says (stdlib and hf: are not paths)."""
    return source != "stdlib" and not source.startswith("hf:") and not Path(source).expanduser().exists()
