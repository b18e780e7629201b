"""`k3 export`: one training checkpoint (sharded DCP or single-process) as a consolidated model folder.

OUT/ holds
  model.safetensors  full tensors under plain parameter names (any safetensors reader opens it)
  config.yaml        the run's resolved config
  tokenizer.json     the run's tokenizer
  EXPORT             JSON {step, source, files: {name: {bytes, sha256}}}, written last

Before anything is written, every tensor's name, shape and dtype is checked against the model that
config.yaml builds (on the meta device: no memory), so an export whose config does not fit its weights
is never written. It is built in a temp folder beside OUT and renamed into place, so OUT is either
complete or absent.
`k3 eval` and `k3 generate` read it with `--run OUT` or `--ckpt OUT`, on one device, without a
process group; no optimiser state is kept, so it does not resume training.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

from k3cli.checkpoint.api import export_consolidated
from k3cli.checkpoint.folder import EXPORT_MARKER, MODEL_FILE, hash_files
from k3cli.config import load_config
from k3cli.errors import CheckpointError
from k3cli.files import build_folder, is_free, sha256_file
from k3cli.models.causal_lm import CausalLM

__all__ = ["EXPORT_MARKER", "is_export", "export_checkpoint", "check_fits", "load_export_into"]

RUN_FILES = ("config.yaml", "tokenizer.json")


def is_export(path: str | os.PathLike) -> bool:
    """`path` is a folder written by `export_checkpoint` (complete or not: see `load_export_into`)."""
    return (Path(path) / EXPORT_MARKER).is_file()


def export_checkpoint(run_dir: str | os.PathLike, ckpt: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Write checkpoint `ckpt` of `run_dir` as the folder `out` (see the module docstring); returns
    its EXPORT marker. Refuses (CheckpointError) an `out` that exists and is not an empty folder."""
    run_dir, ckpt, out = Path(run_dir), Path(ckpt), Path(out)
    if not is_free(out):
        raise CheckpointError(f"{out} already exists; refusing to overwrite it (choose a new --out)")
    for name in RUN_FILES:
        if not (run_dir / name).is_file():
            raise CheckpointError(f"{run_dir} has no {name}; not a k3 run directory")
    config = run_dir / "config.yaml"
    with torch.device("meta"):
        expected = CausalLM(load_config(str(config)).model).state_dict()

    def fill(tmp: Path) -> dict:
        # verifies the checkpoint's checksums, then its tensors against the config, before writing
        export_consolidated(ckpt, tmp, check=lambda sd: check_fits(sd, expected, f"{ckpt} does not fit {config}"))
        for name in RUN_FILES:
            shutil.copyfile(run_dir / name, tmp / name)
        step = json.loads((ckpt / "COMPLETE").read_text()).get("step")
        marker = {"step": step, "source": str(ckpt.resolve()), "files": hash_files(tmp, [MODEL_FILE, *RUN_FILES])}
        with open(tmp / EXPORT_MARKER, "w") as f:
            json.dump(marker, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        return marker

    return build_folder(out, fill)


def check_fits(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    """CheckpointError (one line, starting with `what`) unless `state` has exactly the tensor names,
    shapes and dtypes of `expected` (a model's state dict, on the meta device or not)."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    odd = [f"{len(names)} tensor(s) {where} ({', '.join(names[:3])}{', …' if len(names) > 3 else ''})"
           for names, where in ((missing, "of the config's model are not in the checkpoint"),
                                (unexpected, "of the checkpoint are not in the config's model")) if names]
    if odd:
        raise CheckpointError(f"{what}: {'; '.join(odd)}; nothing was written")
    for name, want in expected.items():
        got = state[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise CheckpointError(f"{what}: {name} is {tuple(got.shape)} {got.dtype} in the checkpoint, "
                                  f"{tuple(want.shape)} {want.dtype} in the config's model; nothing was written")


def _marker(path: Path, verify: bool) -> dict:
    try:
        marker = json.loads((path / EXPORT_MARKER).read_text())
        files = marker["files"]
    except (OSError, ValueError, KeyError, TypeError):
        files, marker = None, None
    ok = isinstance(files, dict) and set(files) == {MODEL_FILE, *RUN_FILES}
    for name, meta in (files or {}).items() if ok else ():
        f = path / name
        if not f.is_file() or f.stat().st_size != meta.get("bytes") or (verify and sha256_file(f) != meta.get("sha256")):
            ok = False
            break
    if not ok:
        raise CheckpointError(f"{path} is not a complete export (missing or mismatched {EXPORT_MARKER})")
    return marker


def load_export_into(path: str | os.PathLike, model: nn.Module, verify: bool = True) -> dict:
    """Load an export's weights into a plain model (names and shapes must match exactly); returns
    {'step', 'path'}."""
    path = Path(path)
    marker = _marker(path, verify)
    state = safetensors.torch.load_file(str(path / MODEL_FILE))
    try:
        with torch.no_grad():
            model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise CheckpointError(f"{path}: weights do not fit this model ({lines[-1][:200]})") from None
    return {"step": marker["step"], "path": path}
