"""Atomic, verifiable training checkpoints.

Layout: `run_dir/checkpoints/step_{step:08d}/` holding
  model.safetensors  weights (shared / tied tensors stored once, see `safetensors.torch.save_model`)
  state.pt           optimizer, scheduler, data-loader state, Python/NumPy/torch(/CUDA) RNG, step, extra
  COMPLETE           JSON {step, files: {name: {bytes, sha256}}}, written last

A save goes into `step_XXXXXXXX.tmp-<pid>` beside the final folder, every file is fsynced, and one
`os.rename` publishes it, so a crash leaves either a temp folder or nothing, never a half checkpoint
under the final name. Readers trust only folders whose COMPLETE marker matches the files on disk.
Nothing here deletes a checkpoint except `prune_checkpoints`, and it never removes the newest one;
it renames a folder to `step_XXXXXXXX.deleting-<pid>` before deleting it, so a crash mid-delete
leaves no half checkpoint under a step name either. `remove_leftovers` (called by every save and
on resume) deletes what crashed saves and prunes of processes that are gone left behind, and
publishes a temp folder that a crash left complete but not yet renamed.
Multi-process runs write the sharded format of `k3cli.dist_checkpoint` into the same folders;
`is_complete`, `find_latest_checkpoint` and `load_checkpoint` accept it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

__all__ = ["CheckpointError", "save_checkpoint", "find_latest_checkpoint", "load_checkpoint",
           "prune_checkpoints", "list_checkpoints", "is_complete", "tensor_bytes", "check_free_space",
           "write_failure", "remove_leftovers", "delete_checkpoint", "why_incomplete"]

MODEL_FILE, STATE_FILE, MARKER = "model.safetensors", "state.pt", "COMPLETE"
EXPORT_MARKER = "EXPORT"   # a `k3 export` folder's marker; here so that training can refuse one without importing export
TEMP_TAG, DELETING_TAG = ".tmp-", ".deleting-"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
# a save's temp folder (DCP adds a time stamp to the pid) or a pruned folder being deleted
_LEFTOVER = re.compile(r"^step_\d{8,}\.(tmp|deleting)-(\d+)(?:-\d+)?$")


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read; the message is one line naming the folder."""


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP wraps in .module, torch.compile in ._orig_mod; both would prefix every key
    while True:
        inner = getattr(model, "module", None)
        inner = inner if isinstance(inner, nn.Module) else getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    # makes a rename / new entry durable; not every platform lets a folder be opened
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_NUMPY_SAFE = [(getattr(np, "_core", None) or np.core).multiarray._reconstruct, np.ndarray, np.dtype,
               type(np.dtype(np.uint32))]


def state_error(e: BaseException) -> str:
    """Why torch.load(weights_only=True) refused a state file, in a few words."""
    text = str(e).strip()
    if "Weights only load failed" in text:  # torch's own message is a paragraph about its defaults
        return "it holds pickled objects other than tensors and plain containers; refused, since loading them could run code"
    return (text.splitlines() or [type(e).__name__])[0][:160]


def tensor_bytes(*states) -> int:
    """Bytes of the tensors in nested dicts / lists / tuples, each tensor once (tied weights share
    one), DTensors at their global size: what a checkpoint of them writes, headers and RNG aside."""
    seen, total, todo = set(), 0, list(states)
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, torch.Tensor):
            key = id(x) if type(x).__name__ == "DTensor" else (x.data_ptr(), x.nbytes)
            if key not in seen:
                seen.add(key)
                total += x.numel() * x.element_size()
    return total


def check_free_space(folder: Path, need: int, final: Path) -> None:
    """Raise CheckpointError before a save of `need` bytes into `folder` that cannot fit; silent
    where the file system does not say how much is free."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if need > free:
        raise CheckpointError(f"cannot write checkpoint {final}: not enough disk space (need {need / 1e6:.1f} MB, "
                              f"{free / 1e6:.1f} MB free in {folder})")


def write_failure(e: BaseException) -> str | None:
    """Why a checkpoint write failed, in a few words, when an I/O error caused it (torch.save hides
    it behind a RuntimeError, safetensors names its errno); None for any other error."""
    cause = e if isinstance(e, OSError) else e.__context__ if isinstance(e.__context__, OSError) else None
    if cause is not None:
        return cause.strerror or str(cause)
    code = re.search(r"os error (\d+)", str(e)) if isinstance(e, SafetensorError) else None
    return os.strerror(int(code.group(1))) if code else None


def raise_interrupt(e: BaseException) -> None:
    """Re-raise the KeyboardInterrupt behind e: a second Ctrl-C inside torch.save's write to a file object
    surfaces as its zip writer's RuntimeError on close ("unexpected pos"), with the interrupt as context."""
    if isinstance(e.__context__, KeyboardInterrupt):
        raise e.__context__ from None


def _rng_state() -> dict:
    # numpy's key array is stored as a tensor so that state.pt loads with weights_only=True
    # (no pickled objects: a checkpoint from someone else cannot run code when loaded)
    name, key, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, key, pos, has_gauss, gauss = state["numpy"]
    key = key.numpy() if isinstance(key, torch.Tensor) else key  # older checkpoints hold an ndarray
    np.random.set_state((name, key.astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # a resume on fewer GPUs restores the devices that exist
        for i, s in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def save_checkpoint(run_dir: str | os.PathLike, step: int, model: nn.Module, optimizer=None, scheduler=None,
                    loader_state: dict | None = None, extra: dict | None = None) -> Path:
    """Write checkpoint `step` of `run_dir` atomically and return its folder.

    Refuses (CheckpointError) to replace an existing `step_XXXXXXXX` folder: it may be the user's.
    A write that fails (full disk, read-only folder) raises CheckpointError and removes its temp
    folder; nothing else is touched. Where the disk says how much is free, a save that cannot fit
    the model and optimizer tensors is refused before anything is written."""
    parent = Path(run_dir) / "checkpoints"
    final = parent / f"step_{step:08d}"
    if final.exists():
        raise CheckpointError(f"checkpoint {final} already exists; refusing to overwrite it")
    state = {
        "step": step,
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "loader": loader_state,
        "rng": _rng_state(),
        "extra": extra or {},
    }
    tmp = parent / f"{final.name}.tmp-{os.getpid()}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        check_free_space(parent, tensor_bytes(_unwrap(model).state_dict(), state["optimizer"]), final)
        remove_leftovers(run_dir)
        if tmp.exists():  # left by an earlier crashed save of this same process id: ours by name
            shutil.rmtree(tmp)
        tmp.mkdir()
        _write_files(tmp, step, model, state)
        os.rename(tmp, final)
        _fsync_dir(parent)
    except (OSError, RuntimeError, SafetensorError) as e:
        raise_interrupt(e)
        why = write_failure(e)
        if why is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint {final}: {why}") from None
    return final


def _write_files(tmp: Path, step: int, model: nn.Module, state: dict) -> None:
    safetensors.torch.save_model(_unwrap(model), str(tmp / MODEL_FILE), metadata={"step": str(step)})
    with open(tmp / STATE_FILE, "wb") as f:  # a file object: torch.save then keeps the OSError as the cause
        torch.save(state, f)
    files = {}
    for name in (MODEL_FILE, STATE_FILE):
        _fsync_file(tmp / name)
        files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
    with open(tmp / MARKER, "w") as f:
        json.dump({"step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)


def _marker(path: Path) -> dict | None:
    try:
        marker = json.loads((path / MARKER).read_text())
        return marker if isinstance(marker.get("files"), dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def is_complete(path: str | os.PathLike, verify: bool = True) -> bool:
    """True when `path` has a COMPLETE marker whose sizes (and, with verify, sha256) match its files:
    this format's two files, or a sharded checkpoint (`k3cli.dist_checkpoint`, format "dcp") with
    its DCP metadata and state.pt among them. A save's temp folder (`.tmp-` in its name) never is."""
    path = Path(path)
    return TEMP_TAG not in path.name and _mismatch(path, verify) is None


def why_incomplete(path: str | os.PathLike, verify: bool = True) -> str | None:
    """Why `path` fails `is_complete` (a missing marker, a file missing or of another size or SHA-256
    than COMPLETE records), in a few words; None when it is complete."""
    path = Path(path)
    return "a save's temp folder" if TEMP_TAG in path.name else _mismatch(path, verify)


def _mismatch(path: Path, verify: bool) -> str | None:
    marker = _marker(path)
    if marker is None:
        return f"no readable {MARKER} marker"
    names = set(marker["files"])
    if marker.get("format") == "dcp":
        if not {".metadata", STATE_FILE} <= names:
            return f"{MARKER} does not list .metadata and {STATE_FILE}"
    elif names != {MODEL_FILE, STATE_FILE}:
        return f"{MARKER} lists {', '.join(sorted(names)) or 'no files'}, not {MODEL_FILE} and {STATE_FILE}"
    for name, meta in marker["files"].items():
        f = path / name
        if not isinstance(meta, dict):
            return f"{MARKER} has no size and checksum for {name}"
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != meta.get("bytes"):
            return f"{name} has {f.stat().st_size} bytes, {MARKER} records {meta.get('bytes')}"
        if verify and _sha256(f) != meta.get("sha256"):
            return f"{name} does not match the SHA-256 {MARKER} records"
    return None


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every `step_XXXXXXXX` folder, oldest first; temp folders are not listed."""
    parent = Path(run_dir) / "checkpoints"
    if not parent.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in parent.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def find_latest_checkpoint(run_dir: str | os.PathLike, verify: bool = True) -> Path | None:
    """The newest checkpoint folder whose COMPLETE marker matches its files, or None.

    Temp folders of interrupted saves and folders without (or with a stale) marker are skipped;
    checksums are computed newest-first, so usually only one checkpoint is read in full."""
    for _, path in reversed(list_checkpoints(run_dir)):
        if is_complete(path, verify=verify):
            return path
    return None


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer=None, scheduler=None,
                    restore_rng: bool = True, verify: bool = True) -> dict:
    """Load weights into `model` (on its own device) and, when given, the optimizer and scheduler
    state; restore the RNG states. Returns {'step', 'loader', 'extra', 'path'}. `verify=False` skips
    the checksums (marker and sizes are still checked) for a path find_latest_checkpoint just verified.
    A sharded (DCP) checkpoint is read by `k3cli.dist_checkpoint.resume_checkpoint`."""
    path = Path(path)
    if not is_complete(path, verify=verify):
        raise CheckpointError(f"{path} is not a complete checkpoint (missing or mismatched {MARKER})")
    if (_marker(path) or {}).get("format") == "dcp":
        from k3cli.dist_checkpoint import resume_checkpoint  # it builds on this module

        return resume_checkpoint(path, model, optimizer, scheduler, restore_rng=restore_rng, verify=False)
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


def prune_checkpoints(run_dir: str | os.PathLike, keep_last: int, newest: Path | None = None) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep_last` complete ones (at least one is
    always kept, and so is the newest one that passes the checksum test); incomplete folders and temp
    folders are left alone. Returns the deleted folders. `newest`: a checkpoint the caller has just
    saved (and so checksummed) — taken as the newest verified one instead of hashing it again."""
    complete = [p for _, p in list_checkpoints(run_dir) if is_complete(p, verify=False)]
    latest = Path(newest) if newest is not None else find_latest_checkpoint(run_dir)
    doomed = [p for p in complete[:-max(1, keep_last)] if p != latest]
    for p in doomed:
        delete_checkpoint(p)
    return doomed


def delete_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder: renamed out of the step names first, so a crash mid-delete leaves a
    folder no reader lists, which `remove_leftovers` deletes later."""
    doomed = path.with_name(f"{path.name}{DELETING_TAG}{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed)


def remove_leftovers(run_dir: str | os.PathLike) -> dict[Path, str]:
    """Tidy what interrupted saves and prunes left in `run_dir/checkpoints`, each only when the
    process named in it is gone (or is this one): a temp folder whose files match its COMPLETE
    marker (a crash between the marker and the rename) is published under its step name when that
    name is free; other temp folders and folders being deleted are deleted. Everything with another
    name is left alone. Returns {folder: "published" | "deleted"}."""
    parent = Path(run_dir) / "checkpoints"
    done = {}
    for path in sorted(parent.iterdir()) if parent.is_dir() else []:
        m = _LEFTOVER.match(path.name)
        if not m or not path.is_dir() or _saving_elsewhere(int(m.group(2))):
            continue
        if m.group(1) == "tmp" and _mismatch(path, verify=True) is None:
            final = path.with_name(path.name.split(".")[0])
            if not final.exists():
                with contextlib.suppress(OSError):   # a read-only folder keeps it as it is
                    os.rename(path, final)
                    _fsync_dir(parent)
                    done[path] = "published"
        else:
            shutil.rmtree(path, ignore_errors=True)   # a read-only folder keeps them
            if not path.exists():
                done[path] = "deleted"
    return done


def _saving_elsewhere(pid: int) -> bool:
    """Whether process `pid`, named in a temp folder, may still be writing into it."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process nobody has reaped yet still answers kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
