"""`k3 eval`: validation loss, perplexity, bits per byte and throughput of a trained run."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import torch

from k3cli.data import prepare_data
from k3cli.errors import DataError
from k3cli.evaluation.runs import open_run
from k3cli.train import evaluate_loss


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
    loss = evaluate_loss(model, val, dev, autocast, document_mask=cfg.data.document_mask, start_id=prepared.start_id)
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
