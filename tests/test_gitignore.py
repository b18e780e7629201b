"""`.gitignore` covers every folder the README's and docs' examples write into, and no source folder."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WRITTEN = re.compile(r"--(?:out|run|report|ckpt|plot)[ =]([^\s`|)\]]+)")


def _ignored(path: str) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode == 0


def test_gitignore_covers_what_the_examples_create():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    paths = {m for d in docs for line in d.read_text().splitlines() if "k3 " in line for m in WRITTEN.findall(line)}
    relative = {p for p in paths if not p.startswith(("/", "~", "$")) and not p.isupper()}
    assert {"runs/a", "models/big", "studies/ar", "data/corpus"} <= relative   # the parse finds the examples
    relative |= {"runs/k3-toy-block-20250101-000000", "studies/k3-toy-20250101-000000"}   # train's and study's defaults
    assert [p for p in sorted(relative) if not _ignored(f"{p}/file")] == []
    assert not any(_ignored(f"{src}/new_file.py") for src in ("k3cli/models", "tests/models", "k3cli/ops/kda"))
