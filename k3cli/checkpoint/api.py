"""What the rest of k3 calls: `save`, `load`, `latest`, `prune`, each picking the format itself (sharded
under a process group, single-process otherwise; any saved format loads into any parallel mode and world
size), and the weights of a checkpoint read in one process (`load_weights`, `load_full_model_state`,
`export_consolidated`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from k3cli.checkpoint import sharded, single
from k3cli.checkpoint.folder import (
    MARKER,
    MODEL_FILE,
    _set_rng_state,
    _unwrap,
    delete_checkpoint,
    is_complete,
    list_checkpoints,
)
from k3cli.checkpoint.sharded import (
    DCP_FORMAT,
    _broadcast,
    _check_complete,
    _group,
    _model_entries,
    _read_state,
    _single_process_ok,
    is_sharded,
)
from k3cli.errors import CheckpointError, last_line
from k3cli.files import fsync_dir, fsync_file


def save(run_dir: str | os.PathLike, step: int, model: nn.Module, optimizer=None, scheduler=None,
         loader_state: dict | None = None, extra: dict | None = None) -> Path:
    """Write checkpoint `step` of `run_dir` and return its folder: under a process group every rank
    writes its shards (`sharded.save`, a collective), else one process writes `single.save`'s format.
    `model`: plain, compiled, DDP or FSDP2."""
    if dist.is_available() and dist.is_initialized():
        return sharded.save(run_dir, step, model, optimizer, scheduler, loader_state, extra=extra)
    return single.save(run_dir, step, model, optimizer, scheduler, loader_state, extra=extra)


def latest(run_dir: str | os.PathLike, verify: bool = True) -> Path | None:
    """The newest complete checkpoint of `run_dir` in either format, or None; temp folders and
    folders without a matching marker are skipped. Under a process group rank 0 looks (and hashes)
    and every rank gets its answer."""
    rank, _, _ = _group()
    found = None
    if rank == 0:
        found = next((p for _, p in reversed(list_checkpoints(run_dir)) if is_complete(p, verify)), None)
    found = _broadcast(None if found is None else str(found))
    return None if found is None else Path(found)


def prune(run_dir: str | os.PathLike, keep_last: int, newest: Path | None = None) -> list[Path]:
    """Delete complete checkpoints older than
    the newest `keep_last` complete ones (at least one kept, and always the newest verified one;
    `newest`: one just saved, taken as that). Incomplete and temp folders stay. Rank 0 deletes;
    the other ranks return []."""
    if _group()[0] != 0:
        return []
    complete = [p for _, p in list_checkpoints(run_dir) if is_complete(p, verify=False)]
    latest = Path(newest) if newest is not None else next(
        (p for p in reversed(complete) if is_complete(p, verify=True)), None)
    doomed = [p for p in complete[:-max(1, keep_last)] if p != latest]
    for p in doomed:
        delete_checkpoint(p)
    return doomed


def _has_dtensor(model: nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def _full_optimizer_state(model: nn.Module, optimizer, saved: dict) -> dict:
    """A single-process `optimizer.state_dict()` (parameters by position) → the FQN-keyed form
    `set_optimizer_state_dict` takes. Positions follow the param groups as this optimizer has them,
    so it must be built the same way (same groups, same order) as the one that was saved."""
    names = {p: n for n, p in _unwrap(model).named_parameters()}
    groups, saved_groups = optimizer.param_groups, saved["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in saved_groups]:
        raise CheckpointError("the saved optimizer's parameter groups do not match this optimizer's "
                              f"({[len(g['params']) for g in saved_groups]} vs {[len(g['params']) for g in groups]})")
    fqn = {i: names[p] for g, sg in zip(groups, saved_groups) for i, p in zip(sg["params"], g["params"])}
    return {"state": {fqn[i]: s for i, s in saved["state"].items()},
            "param_groups": [{**sg, "params": [fqn[i] for i in sg["params"]]} for sg in saved_groups]}


def load(path: str | os.PathLike, model: nn.Module, optimizer=None, scheduler=None,
                      restore_rng: bool = True, verify: bool = True) -> dict:
    """Resume from a checkpoint of either format into a model of any parallel mode and world size.
    Returns {'step', 'loader', 'extra', 'path'}.

    - sharded: `sharded.load` (model and optimizer resharded by DCP; each rank its own RNG when the world
      size is unchanged, else rank 0's);
    - single-process, plain or DDP model: `single.load` on every rank (full weights each);
    - single-process into FSDP2: the full weights and the full optimizer state are read on every
      rank and each keeps its shards (`set_*_state_dict(full_state_dict=True)`); the optimizer must
      be built with the same param groups in the same order as the saved one (train.param_groups)."""
    path = Path(path)
    _check_complete(path, verify)
    if is_sharded(path):
        state = sharded.load(path, model, optimizer, scheduler, restore_rng, verify=False)
        return {"step": state["step"], "loader": state["loader"], "extra": state["extra"], "path": path}
    if not _has_dtensor(model):
        return single.load(path, model, optimizer, scheduler, restore_rng=restore_rng, verify=False)
    state = _read_state(path)
    full = safetensors.torch.load_file(str(path / MODEL_FILE))
    try:
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=True))
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: weights do not fit this model ({last_line(e, 200)})") from None
    if optimizer is not None:
        if state["optimizer"] is None:
            raise CheckpointError(f"{path} holds no optimizer state")
        set_optimizer_state_dict(model, optimizer, _full_optimizer_state(model, optimizer, state["optimizer"]),
                                 options=StateDictOptions(full_state_dict=True))
    if scheduler is not None:
        if state["scheduler"] is None:
            raise CheckpointError(f"{path} holds no scheduler state")
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        _set_rng_state(state["rng"])
    return {"step": state["step"], "loader": state["loader"], "extra": state["extra"], "path": path}


def load_full_model_state(path: str | os.PathLike, verify: bool = True) -> dict[str, torch.Tensor]:
    """{name: full CPU tensor} of a complete checkpoint of either format, read in this process
    alone (no process group, no collective even if one is up)."""
    path = Path(path)
    if not is_complete(path, verify):
        raise CheckpointError(f"{path} is not a complete checkpoint (missing or mismatched {MARKER})")
    if not is_sharded(path):
        return safetensors.torch.load_file(str(path / MODEL_FILE))
    entries = _model_entries(path)
    sd = {name: torch.empty(md.size, dtype=md.properties.dtype) for name, (_, md) in entries.items()}
    with _single_process_ok():
        dcp.load({"model": sd}, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return sd


def export_consolidated(path: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False,
                        check: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    """Write the weights of checkpoint `path` (DCP or single-process) as one `out_dir/model.safetensors`
    (full tensors, plain names; metadata: step, source format), atomically. No process group needed.
    Refuses to replace an existing file unless `overwrite`. `check`: called with the loaded weights
    before anything is written (it raises to write nothing). Returns the file."""
    path, out_dir = Path(path), Path(out_dir)
    out = out_dir / MODEL_FILE
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists; refusing to overwrite it")
    sd = load_full_model_state(path)
    if check is not None:
        check(sd)
    step = json.loads((path / MARKER).read_text()).get("step")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{MODEL_FILE}.tmp-{os.getpid()}"
    safetensors.torch.save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp),
                                metadata={"step": str(step), "source_format": DCP_FORMAT if is_sharded(path) else "single"})
    fsync_file(tmp)
    os.replace(tmp, out)
    fsync_dir(out_dir)
    return out



def load_weights(path: str | os.PathLike, model: nn.Module, verify: bool = True) -> dict:
    """Only the weights of a checkpoint of either format (any world size) into a plain model, in this
    process alone; no RNG is touched. Returns {'step', 'loader', 'extra', 'path'}."""
    if is_sharded(path):
        return sharded.load_weights(path, model, verify=verify)
    return single.load(path, model, restore_rng=False, verify=verify)
