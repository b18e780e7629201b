"""File helpers every writer shares: atomic text writes and folders, fsync of files and folders, SHA-256 of files."""
from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def write_text_atomic(path: Path, text: str) -> None:
    # temp name + rename: a concurrent reader sees the old file or the whole new one, never half
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
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


def is_free(path: Path) -> bool:
    """`path` may become a new folder: it does not exist, or is an empty folder."""
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def build_folder(out: Path, fill: Callable[[Path], T]) -> T:
    """The folder `out` (absent or empty) written whole or not at all: `fill` writes into a temp folder beside
    it, which one rename puts in place; a failure removes the temp folder. Returns what `fill` returns."""
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    if tmp.exists():   # left by an earlier crashed build of this same process id: ours by name
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
        result = fill(tmp)
        fsync_dir(tmp)
        if out.is_dir():
            out.rmdir()   # empty: the callers check
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result
