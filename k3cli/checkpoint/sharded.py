"""The sharded checkpoint format, through torch.distributed.checkpoint (DCP), beside the single-process
format of `single.py`, in the same step folders (`folder.py`).

Layout: `run_dir/checkpoints/step_{step:08d}/` (the same folder names as the single-process format)
  .metadata, __<rank>_<i>.distcp   DCP files of {"model", "optimizer"}: every rank writes its own
                                   FSDP2 shards (nothing is gathered to rank 0); replicated tensors once
  state.pt                         scheduler, loader state, RNG (rank 0's and every rank's), step, world
                                   size, extra — from rank 0
  COMPLETE                         JSON {step, format: "dcp", world_size, files: {name: {bytes, sha256}}}

A save goes into `step_XXXXXXXX.tmp-<token>` (one token, chosen by rank 0, for all ranks); every rank
hashes the files it wrote after they are fsynced; rank 0 writes COMPLETE once it has every rank's
list (so only when all have finished), then renames the folder. Readers trust only folders whose
marker matches the files; temp folders are never listed. No step folder is ever overwritten.

Names inside are plain parameter names (`get_state_dict` strips DDP's `module.` and compile's
`_orig_mod.`), and tensors are stored with their global shapes, so DCP reshards on load: a
checkpoint of N ranks loads under M ranks, into a plain model in one process, or into nothing but a
state dict (`load_full_model_state`, `export_consolidated`, no process group needed).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from k3cli.checkpoint.folder import (
    _NUMPY_SAFE,
    MARKER,
    STATE_FILE,
    TEMP_TAG,
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
from k3cli.errors import CheckpointError, SharedCheckpointError, last_line
from k3cli.files import fsync_dir

DCP_FORMAT, DCP_METADATA = "dcp", ".metadata"



def _group() -> tuple[int, int, bool]:
    """(rank, world size, whether collectives run)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dist.get_world_size() > 1
    return 0, 1, False


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_ok():
    # DCP warns on every save/load without a process group, which is a use we intend here
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _broadcast(obj):
    rank, world, on = _group()
    if not on:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(obj) -> list:
    rank, world, on = _group()
    if not on:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _raise_if(error: str | None) -> None:
    if error:
        raise SharedCheckpointError(error)


def _dcp_marker(path: Path) -> dict | None:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != DCP_FORMAT or not isinstance(marker.get("files"), dict):
        return None
    return marker


def is_sharded(path: str | os.PathLike) -> bool:
    """`path` is a DCP checkpoint folder (complete or not): its marker says so, or it has DCP's
    .metadata file (a folder whose save did not finish)."""
    path = Path(path)
    return _dcp_marker(path) is not None or (path / DCP_METADATA).is_file()


def save(run_dir: str | os.PathLike, step: int, model: nn.Module, optimizer=None, scheduler=None,
             loader_state: dict | None = None, extra: dict | None = None) -> Path:
    """Write checkpoint `step` of `run_dir` in the DCP format, on every rank (a collective: all
    ranks call it with the same step), and return its folder. `model`: the wrapped or plain model
    (FSDP2, DDP, compiled or not); `loader_state` must be the same on every rank (rank 0's is kept;
    a difference raises). Refuses (CheckpointError, on every rank) to replace an existing folder.
    Without a process group it writes the same format from one process."""
    rank, world, _ = _group()
    parent = Path(run_dir) / "checkpoints"
    final = parent / f"step_{step:08d}"
    optimizers = (optimizer,) if optimizer is not None else ()
    model_sd, optim_sd = get_state_dict(model, optimizers)
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optim_sd
    error, tmp_name = None, None
    if rank == 0:
        if final.exists():
            error = f"checkpoint {final} already exists; refusing to overwrite it"
        else:
            tmp_name = f"{final.name}{TEMP_TAG}{os.getpid()}-{time.time_ns()}"
            try:
                parent.mkdir(parents=True, exist_ok=True)
                remove_leftovers(run_dir)
                # global sizes: DCP writes each shard once and replicated tensors once
                check_free_space(parent, tensor_bytes(state), final)
                (parent / tmp_name).mkdir()
            except OSError as e:
                error = f"cannot write checkpoint {final}: {write_failure(e)}"
            except CheckpointError as e:
                error = str(e)
    # every rank learns rank 0's decision, so none raises alone and leaves the others waiting
    error, tmp_name = _broadcast((error, tmp_name))
    _raise_if(error)
    tmp = parent / tmp_name

    try:
        with _single_process_ok():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True), no_dist=_no_dist())
    except dcp.CheckpointException as e:
        # DCP hands every rank the failure of any rank; the temp folder is never listed
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SharedCheckpointError(f"cannot write checkpoint {final}: the save failed on rank(s) "
                                    f"{sorted(e.failures)} ({last_line(e, 200)})") from None

    rng, hashes, error = _rng_state(), {}, None
    try:
        hashes = hash_files(tmp, sorted(n for n in os.listdir(tmp) if n.startswith(f"__{rank}_")))
    except OSError as e:
        error = f"{final}: rank {rank} cannot read back its files ({e})"
    gathered = _all_gather((hashes, rng, loader_state, error))
    # the gather is the barrier: rank 0 is past it only once every rank has written and hashed
    error = next((g[3] for g in gathered if g[3]), None)
    if error and rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _raise_if(error)
    if rank == 0:
        try:
            if any(g[2] != loader_state for g in gathered):
                raise CheckpointError(f"{final}: the ranks' loader states differ; every rank must read "
                                      "the same global batches (shard_batch) for one saved loader state")
            with open(tmp / STATE_FILE, "wb") as f:  # a file object: torch.save then keeps the OSError as the cause
                torch.save({
                    "step": step, "format": DCP_FORMAT, "world_size": world,
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "loader": loader_state, "rng": rng, "rng_ranks": [g[1] for g in gathered],
                    "extra": extra or {}, "has_optimizer": optimizer is not None,
                }, f)
            files = {name: meta for g in gathered for name, meta in g[0].items()}
            files.update(hash_files(tmp, sorted(n for n in os.listdir(tmp) if n not in files)))
            with open(tmp / MARKER, "w") as f:
                json.dump({"step": step, "format": DCP_FORMAT, "world_size": world, "files": files}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            os.rename(tmp, final)
            fsync_dir(parent)
        except CheckpointError as e:
            error = str(e)
        except (OSError, RuntimeError) as e:
            raise_interrupt(e)
            why = write_failure(e)
            if why is None:
                raise
            error = f"cannot write checkpoint {final}: {why}"
        if error:
            shutil.rmtree(tmp, ignore_errors=True)
    _raise_if(_broadcast(error))
    return final


def _read_state(path: Path) -> dict:
    try:
        with torch.serialization.safe_globals(_NUMPY_SAFE):
            return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read {STATE_FILE} ({state_error(e)})") from None


def _check_complete(path: Path, verify: bool, dcp_only: bool = False) -> None:
    """Raise on every rank unless rank 0 finds `path` complete (only rank 0 hashes)."""
    ok = None
    if _group()[0] == 0:
        ok = (_dcp_marker(path) is not None or not dcp_only) and is_complete(path, verify)
    if not _broadcast(ok):
        raise SharedCheckpointError(f"{path} is not a complete checkpoint (missing or mismatched {MARKER})")


def _restore_rng(state: dict) -> None:
    rank, world, _ = _group()
    ranks = state.get("rng_ranks") or []
    # the same world size: each rank continues its own streams; otherwise all take rank 0's
    _set_rng_state(ranks[rank] if len(ranks) == world else state["rng"])


def load(path: str | os.PathLike, model: nn.Module, optimizer=None, scheduler=None,
             restore_rng: bool = True, verify: bool = True) -> dict:
    """Load a DCP checkpoint into `model` (FSDP2, DDP or plain; any world size, resharded by DCP)
    and, when given, the optimizer and scheduler; restore the RNG. A collective under a process
    group (every rank calls it); works without one. Returns the state.pt dict (step, loader, extra,
    scheduler, rng, world_size, ...) plus 'path'."""
    path = Path(path)
    _check_complete(path, verify, dcp_only=True)
    state = _read_state(path)
    if optimizer is not None and not state.get("has_optimizer", True):
        raise CheckpointError(f"{path} holds no optimizer state")
    if scheduler is not None and state["scheduler"] is None:
        raise CheckpointError(f"{path} holds no scheduler state")
    optimizers = (optimizer,) if optimizer is not None else ()
    # a fresh optimizer gets zero-initialised state here (get_state_dict steps it with lr 0), so
    # DCP has tensors to load into
    model_sd, optim_sd = get_state_dict(model, optimizers)
    target = {"model": model_sd}
    if optimizer is not None:
        target["optimizer"] = optim_sd
    try:
        with _single_process_ok():
            dcp.load(target, storage_reader=dcp.FileSystemReader(str(path)), no_dist=_no_dist())
    except (dcp.CheckpointException, RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: does not fit this model / optimizer ({last_line(e, 200)})") from None
    set_state_dict(model, optimizers, model_state_dict=model_sd,
                   optim_state_dict=optim_sd if optimizer is not None else {})
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        _restore_rng(state)
    return {**state, "path": path}


def _model_entries(path: Path) -> dict[str, tuple[str, object]]:
    """{parameter name: (DCP key, tensor metadata)} of the model part of a DCP checkpoint."""
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    out = {}
    for key, md in meta.state_dict_metadata.items():
        where = (meta.planner_data or {}).get(key)
        if where is not None and len(where) == 2 and where[0] == "model" and hasattr(md, "size"):
            out[where[1]] = (key, md)
    return out


def load_weights(path: str | os.PathLike, model: nn.Module, verify: bool = True) -> dict:
    """Load only the weights of a DCP checkpoint (any world size) into a plain, unwrapped model
    (on any device, in place) in this process alone (no process group needed; none used if one is
    up): for eval, generate and export. Names and shapes must match exactly. Returns {'step',
    'loader', 'extra', 'path'} as `single.load` does; no RNG is touched."""
    path = Path(path)
    if _dcp_marker(path) is None or not is_complete(path, verify):
        raise CheckpointError(f"{path} is not a complete DCP checkpoint (missing or mismatched {MARKER})")
    target = _unwrap(model)
    sd = target.state_dict()
    saved = _model_entries(path)
    missing, unexpected = sorted(set(sd) - set(saved)), sorted(set(saved) - set(sd))
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not fit this model (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]})")
    for name, t in sd.items():
        if tuple(t.shape) != tuple(saved[name][1].size):
            raise CheckpointError(f"{path}: {name} has shape {tuple(saved[name][1].size)} in the checkpoint, "
                                  f"{tuple(t.shape)} in this model")
    with _single_process_ok():
        dcp.load({"model": sd}, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    state = _read_state(path)
    return {"step": state["step"], "loader": state["loader"], "extra": state["extra"], "path": path}

