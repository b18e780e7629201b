"""Input validation shared by the public KDA entry points (`chunk_kda`, `fused_recurrent_kda`); the generic
checks are k3cli/ops/checks.py (shapes, dtypes, devices only: no data is read).

Every message starts with the op's name and names the offending argument. What is accepted (README.md,
"Input contract"): q, k, v, g, beta fp32 / fp16 / bf16 (chunk_kda: q, k, v one dtype), initial_state fp32,
all on q's device; B, T, H, HV, V >= 1 (empty inputs are rejected), 1 <= K <= 256, HV a multiple of H.
"""
from __future__ import annotations

import torch

from k3cli.ops.checks import FLOATS, InputTypeError, check_number, check_tensor

__all__ = ["FLOATS", "InputTypeError", "check_kda_inputs", "check_tensor"]


def check_kda_inputs(op: str, q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias,
                     lower_bound, same_dtype: bool) -> tuple[int, int, int, int, int, int]:
    """Shapes, dtypes and devices of the KDA arguments; returns (B, T, H, K, HV, V)."""
    check_tensor(op, "q", q, 4)
    for name, x, ndim in (("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        check_tensor(op, name, x, ndim, q.device, ref="q")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"{op}: k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)}")
    if same_dtype and (k.dtype != q.dtype or v.dtype != q.dtype):
        raise InputTypeError(f"{op}: q, k, v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"{op}: v shape {tuple(v.shape)} must start with (B, T) = {(B, T)} of q")
    HV, V = v.shape[2], v.shape[3]
    if not 1 <= K <= 256:
        raise ValueError(f"{op}: q key dim K={K} must be in [1, 256] (q shape {tuple(q.shape)})")
    # before the GVA check, which would divide by H = 0
    if B == 0 or T == 0 or H == 0:
        raise ValueError(f"{op}: q shape {tuple(q.shape)} is empty: B, T, H must be >= 1 (empty inputs are "
                         "rejected)")
    if HV == 0 or V == 0:
        raise ValueError(f"{op}: v shape {tuple(v.shape)} is empty: HV, V must be >= 1 (empty inputs are "
                         "rejected)")
    if HV % H != 0:
        raise ValueError(f"{op}: v heads HV={HV} must be a multiple of q/k heads H={H} (GVA)")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"{op}: g shape {tuple(g.shape)} must be (B, T, HV, K) = {(B, T, HV, K)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"{op}: beta shape {tuple(beta.shape)} must be (B, T, HV) = {(B, T, HV)}")
    if initial_state is not None:
        check_tensor(op, "initial_state", initial_state, 4, q.device, (torch.float32,), ref="q")
        if initial_state.shape != (B, HV, K, V):
            raise ValueError(f"{op}: initial_state shape {tuple(initial_state.shape)} must be "
                             f"(B, HV, K, V) = {(B, HV, K, V)}")
    if scale is not None:
        check_number(op, "scale", scale)
    if lower_bound is not None:   # None: the softplus gate, or a g without lower bound
        check_number(op, "lower_bound", lower_bound, -5.0, 0.0, high_open=True)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError(f"{op}: A_log is required when use_gate_in_kernel=True")
        check_tensor(op, "A_log", A_log, 1, q.device, ref="q")
        if A_log.shape != (HV,):
            raise ValueError(f"{op}: A_log shape {tuple(A_log.shape)} must be (HV,) = {(HV,)}")
        if dt_bias is not None:
            check_tensor(op, "dt_bias", dt_bias, 2, q.device, ref="q")
            if dt_bias.shape != (HV, K):
                raise ValueError(f"{op}: dt_bias shape {tuple(dt_bias.shape)} must be (HV, K) = {(HV, K)}")
    return B, T, H, K, HV, V
