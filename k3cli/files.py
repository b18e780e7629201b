"""File helpers every writer shares: atomic text writes, fsync of files and folders, SHA-256 of files."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


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
