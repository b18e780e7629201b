"""Finding and opening what `k3 eval`, `k3 generate` and `k3 export` read: a run directory (its newest
checkpoint that verifies), a checkpoint folder, or an export, loaded into one process on one device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from k3cli.checkpoint import MARKER, latest, list_checkpoints, load_weights, why_incomplete
from k3cli.checkpoint.export import is_export, load_export_into
from k3cli.config import RunConfig, load_config
from k3cli.data import load_tokenizer
from k3cli.errors import CheckpointError, ConfigError
from k3cli.models.causal_lm import CausalLM
from k3cli.train import flush_denormals, resolve_device


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
    path = latest(run_dir)
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
    else:
        state = load_weights(ckpt, model, verify=verify)
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
    # --run: latest has just checksummed the checkpoint (an export is not looked at before)
    cfg, model, step = load_model(run_dir, ckpt_dir, dev, verify=run is None or is_export(ckpt_dir))
    return OpenedRun(run_dir, ckpt_dir, dev, cfg, model, step, tok)



@dataclass
class Loaded:
    """A trained model ready to use from Python: what `k3cli.load` returns."""

    model: CausalLM       # eval mode, on `device`
    tokenizer: object     # tokenizers.Tokenizer with bos_id, eos_id (<|endoftext|>, id 0, for k3's own)
    config: RunConfig
    step: int             # the optimiser step of the checkpoint
    path: Path            # the checkpoint (or export) folder read
    device: torch.device

    def encode(self, text: str) -> torch.Tensor:
        """input_ids [1, T] of `text` on the model's device, the start token first, as in training."""
        return torch.tensor([[self.tokenizer.bos_id] + self.tokenizer.encode(text).ids], device=self.device)

    def generate(self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0) -> str:
        """The continuation of `prompt` (greedy at temperature 0), as `k3 generate` samples it."""
        from k3cli.evaluation.generate import generate

        return generate(self.model, self.tokenizer, prompt, max_new_tokens, temperature, top_k, top_p, seed).text


def load(path: str | Path, device: str = "auto") -> Loaded:
    """A run directory (its newest checkpoint that verifies), a checkpoint folder or an export, loaded."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"no such folder: {path}")
    if is_export(p) or (p / "config.yaml").is_file():
        opened = open_run(str(p), None, device)
    elif (p / MARKER).is_file():
        opened = open_run(None, str(p), device)
    else:
        raise ConfigError(f"{path} is not a k3 run directory, checkpoint folder or export")
    return Loaded(opened.model, opened.tokenizer, opened.cfg, opened.step, opened.ckpt_dir, opened.device)
