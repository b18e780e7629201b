"""Every chunk_kda and short_conv kernel, as it ships, compiles for sm_90 (no GPU needed).

The interpreter tier runs kernels as Python and cannot see compiler failures (an empty `while` loop in the
score kernel at chunk 16 once crashed Triton's coalesce pass while every interpreter test passed).
`scripts/ptxas_report.py` compiles each launch of chunk_kda's plan (and the short conv's kernels) with Triton's bundled ptxas and prints
registers / stack bytes, exiting non-zero when a kernel fails to compile.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("K,chunk", [(40, 16), (96, 32), (128, 64)])
def test_kernels_compile_for_sm90(K, chunk):
    # the report needs real @triton.jit functions: run it without the interpreter flag
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "scripts/ptxas_report.py", "--K", str(K), "--chunk", str(chunk)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines()[1:] if line.strip()]
    assert len(rows) >= 10, r.stdout
    assert all(re.search(r"REG / STACK +\d+ / \d+$", line) for line in rows), r.stdout
