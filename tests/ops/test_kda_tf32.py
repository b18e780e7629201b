"""chunk_kda under the GPU's TF32 products, emulated on the CPU.

On a GPU, 16-bit inputs run the kernels' non-solve products at TF32 (10-bit mantissa operands); the
interpreter computes them exactly, so it cannot see an error that only TF32 rounding causes. Here the
kernels' `_dot` is replaced by one that rounds both operands to TF32 (round to nearest) before an exact
product, and fp16 inputs must stay within the op's 16-bit table (k3cli/ops/kda/verify.py TOL). The
case: every g_t = -5, where the intra-chunk score gradients' diagonal terms (equal and opposite in dΓ)
are ~150× the true dΓ; cancelled inside two different TF32 products they left dg 7 % off (bf16 on an
H200, and 7.4e-2 here), against 4.9e-4 with the diagonal kept out of the products (kda/README.md,
"Backward"). Interpreter only: on a GPU the kernels are compiled with the real `_dot`.
"""
import os

import pytest
import torch
import triton
import triton.language as tl

from k3cli.ops.kda import chunk_bwd, chunk_fwd
from k3cli.ops.kda.verify import TOL
from k3cli.testing import assert_close, relative_rms_error

from .test_extremes import C16, PATHS, _const, cast, kda_case, reference, run_kda, table_name

pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="emulates TF32 in the interpreter")]


@triton.jit
def _dot_tf32(a, b, PREC: tl.constexpr):
    """chunk_fwd._dot with PREC "tf32" rounding both fp32 operands to TF32 (10 mantissa bits) first."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    elif PREC == "tf32":
        ai = a.to(tl.float32).to(tl.int32, bitcast=True)
        bi = b.to(tl.float32).to(tl.int32, bitcast=True)
        ai = ((ai + 0x1000) & -8192).to(tl.float32, bitcast=True)
        bi = ((bi + 0x1000) & -8192).to(tl.float32, bitcast=True)
        return tl.dot(ai, bi, input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@pytest.mark.parametrize("case", [dict(g=_const(-5.0)), dict()], ids=["g=-5", "random-g"])
def test_chunk_kda_fp16_within_its_table_under_tf32_products(case, monkeypatch):
    monkeypatch.setattr(chunk_fwd, "_dot", _dot_tf32)
    monkeypatch.setattr(chunk_bwd, "_dot", _dot_tf32)
    x = cast(kda_case(**case), torch.float16)
    ref = run_kda(reference, cast(x, torch.float64), **C16)
    out = run_kda(PATHS["chunk_kda"], x, **C16)
    for name, r in ref.items():
        assert_close(f"chunk_kda {name}", out[name], r, TOL[table_name(name, C16)], relative_rms_error)
