"""The single-process checkpoint format: in a step folder (`folder.py`'s protocol)
  model.safetensors  weights (shared / tied tensors stored once, see `safetensors.torch.save_model`)
  state.pt           optimizer, scheduler, data-loader state, Python/NumPy/torch(/CUDA) RNG, step, extra
  COMPLETE           JSON {step, files: {name: {bytes, sha256}}}, written last
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

from k3cli.checkpoint.folder import (
    _NUMPY_SAFE,
    MARKER,
    MODEL_FILE,
    STATE_FILE,
    _rng_state,
    _set_rng_state,
    _unwrap,
    check_free_space,
    hash_files,
    is_complete,
    raise_interrupt,
    remove_leftovers,
    state_error,
    tensor_bytes,
    write_failure,
)
from k3cli.errors import CheckpointError
from k3cli.files import fsync_dir


def save(run_dir: str | os.PathLike, step: int, model: nn.Module, optimizer=None, scheduler=None,
                    loader_state: dict | None = None, extra: dict | None = None) -> Path:
    """Write checkpoint `step` of `run_dir` atomically and return its folder.

    Refuses (CheckpointError) to replace an existing `step_XXXXXXXX` folder: it may be the user's.
    A write that fails (full disk, read-only folder) raises CheckpointError and removes its temp
    folder; nothing else is touched. Where the disk says how much is free, a save that cannot fit
    the model and optimizer tensors is refused before anything is written."""
    opt_state = optimizer.state_dict() if optimizer is not None else None

    def weights(path: Path) -> None:
        safetensors.torch.save_model(_unwrap(model), str(path), metadata={"step": str(step)})

    return _publish(run_dir, step, weights, tensor_bytes(_unwrap(model).state_dict(), opt_state), {
        "optimizer": opt_state, "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "loader": loader_state, "extra": extra or {}})


def save_weights(run_dir: str | os.PathLike, step: int, write_weights: Callable[[Path], None], nbytes: int,
                 extra: dict | None = None) -> Path:
    """Checkpoint `step` of `run_dir` holding weights only (no optimizer, scheduler or loader state), its
    model.safetensors written by `write_weights(path)`: for weights streamed in without a model in memory."""
    return _publish(run_dir, step, write_weights, nbytes,
                    {"optimizer": None, "scheduler": None, "loader": None, "extra": extra or {}})


def _publish(run_dir, step: int, write_weights: Callable[[Path], None], nbytes: int, state: dict) -> Path:
    parent = Path(run_dir) / "checkpoints"
    final = parent / f"step_{step:08d}"
    if final.exists():
        raise CheckpointError(f"checkpoint {final} already exists; refusing to overwrite it")
    state = {"step": step, **state, "rng": _rng_state()}
    tmp = parent / f"{final.name}.tmp-{os.getpid()}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        check_free_space(parent, nbytes, final)
        remove_leftovers(run_dir)
        if tmp.exists():  # left by an earlier crashed save of this same process id: ours by name
            shutil.rmtree(tmp)
        tmp.mkdir()
        _write_files(tmp, step, write_weights, state)
        os.rename(tmp, final)
        fsync_dir(parent)
    except (OSError, RuntimeError, SafetensorError) as e:
        raise_interrupt(e)
        why = write_failure(e)
        if why is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint {final}: {why}") from None
    return final


def _write_files(tmp: Path, step: int, write_weights: Callable[[Path], None], state: dict) -> None:
    write_weights(tmp / MODEL_FILE)
    with open(tmp / STATE_FILE, "wb") as f:  # a file object: torch.save then keeps the OSError as the cause
        torch.save(state, f)
    files = hash_files(tmp, [MODEL_FILE, STATE_FILE])
    with open(tmp / MARKER, "w") as f:
        json.dump({"step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)


def load(path: str | os.PathLike, model: nn.Module, optimizer=None, scheduler=None,
                    restore_rng: bool = True, verify: bool = True) -> dict:
    """Load weights into `model` (on its own device) and, when given, the optimizer and scheduler
    state; restore the RNG states. Returns {'step', 'loader', 'extra', 'path'}. `verify=False` skips
    the checksums (marker and sizes are still checked) for a path `latest` just verified."""
    path = Path(path)
    if not is_complete(path, verify=verify):
        raise CheckpointError(f"{path} is not a complete checkpoint (missing or mismatched {MARKER})")
    try:
        safetensors.torch.load_model(_unwrap(model), str(path / MODEL_FILE), strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not fit this model "
                              f"({str(e).strip().splitlines()[-1].strip()})") from None
    # weights_only: no pickled code runs. NumPy's array reconstructor is allowed so that checkpoints
    # written before the RNG key was stored as a tensor still load.
    try:
        with torch.serialization.safe_globals(_NUMPY_SAFE):
            state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"{path}: cannot read {STATE_FILE} ({state_error(e)})") from None
    if optimizer is not None:
        if state["optimizer"] is None:
            raise CheckpointError(f"{path} holds no optimizer state")
        optimizer.load_state_dict(state["optimizer"])  # moves state to each parameter's device
    if scheduler is not None:
        if state["scheduler"] is None:
            raise CheckpointError(f"{path} holds no scheduler state")
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        _set_rng_state(state["rng"])
    return {"step": state["step"], "loader": state["loader"], "extra": state["extra"], "path": path}

