"""The checkpoint folder protocol, shared by both formats.

Layout: `run_dir/checkpoints/step_{step:08d}/` holding the format's files and a `COMPLETE` marker, JSON
{step, [format,] files: {name: {bytes, sha256}}}, written last. A save goes into a temp folder
(`step_XXXXXXXX.tmp-<token>`) beside the final one, every file is fsynced, and one `os.rename`
publishes it, so a crash leaves either a temp folder or nothing, never a half checkpoint under the
final name. Readers trust only folders whose marker matches the files on disk. Nothing deletes a
checkpoint except `prune`, which never removes the newest one and renames a folder to
`step_XXXXXXXX.deleting-<pid>` before deleting it. `remove_leftovers` (called by every save and on
resume) deletes what crashed saves and prunes of processes that are gone left behind, and publishes a
temp folder that a crash left complete but not yet renamed.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from torch import nn

from k3cli.errors import CheckpointError
from k3cli.files import fsync_dir, fsync_file, sha256_file

MODEL_FILE, STATE_FILE, MARKER = "model.safetensors", "state.pt", "COMPLETE"


EXPORT_MARKER = "EXPORT"   # a `k3 export` folder's marker; here so that training can refuse one without importing export


TEMP_TAG, DELETING_TAG = ".tmp-", ".deleting-"


_STEP_DIR = re.compile(r"^step_(\d{8,})$")


# a save's temp folder (DCP adds a time stamp to the pid) or a pruned folder being deleted
_LEFTOVER = re.compile(r"^step_\d{8,}\.(tmp|deleting)-(\d+)(?:-\d+)?$")



def _unwrap(model: nn.Module) -> nn.Module:
    # DDP wraps in .module, torch.compile in ._orig_mod; both would prefix every key
    while True:
        inner = getattr(model, "module", None)
        inner = inner if isinstance(inner, nn.Module) else getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


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


def _marker(path: Path) -> dict | None:
    try:
        marker = json.loads((path / MARKER).read_text())
        return marker if isinstance(marker.get("files"), dict) else None
    except (OSError, ValueError, AttributeError):
        return None



def hash_files(folder: Path, names: list[str]) -> dict:
    """{name: {bytes, sha256}} of files just written (each fsynced first): a COMPLETE marker's `files`."""
    out = {}
    for name in names:
        fsync_file(folder / name)
        out[name] = {"bytes": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)}
    return out


def is_complete(path: str | os.PathLike, verify: bool = True) -> bool:
    """True when `path` has a COMPLETE marker whose sizes (and, with verify, sha256) match its files:
    the single format's two files, or a sharded checkpoint (`sharded.py`, format "dcp") with
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
        if verify and sha256_file(f) != meta.get("sha256"):
            return f"{name} does not match the SHA-256 {MARKER} records"
    return None


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every `step_XXXXXXXX` folder, oldest first; temp folders are not listed."""
    parent = Path(run_dir) / "checkpoints"
    if not parent.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in parent.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


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
                    fsync_dir(parent)
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

