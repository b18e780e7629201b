"""Every chunk_kda kernel (the defaults and the chunk.TUNING alternatives) compiles for sm_90.

The interpreter tier runs kernels as Python and cannot see compiler failures. In session 3 an empty
`while` loop in the sub-chunk scores kernel (chunk 16) crashed Triton's coalesce pass while every
interpreter test passed. `scripts/ptxas_report.py` compiles each kernel with Triton's bundled ptxas
(no GPU needed) and prints registers / stack bytes, or the exception's name when a compile fails.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("K,chunk", [(40, 16), (96, 32), (128, 64)])
def test_kernels_compile_for_sm90(K, chunk):
    # the report needs real @triton.jit functions: run it without the interpreter flag
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "scripts/ptxas_report.py", str(K), "--warps", "8", "--chunk", str(chunk)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines()[2:] if line.strip()]
    assert len(rows) >= 25, r.stdout
    failed = [line for line in rows if not re.search(r"\d+ / \d+\s*$", line)]
    assert not failed, "kernels that did not compile for sm_90:\n" + "\n".join(failed)
