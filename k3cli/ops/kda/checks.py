"""Input validation shared by the public KDA entry points (`chunk_kda`, `fused_recurrent_kda`).

Every message starts with the op's name and names the offending argument.
"""
from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(op: str, name: str, x, ndim: int, device, dtypes=FLOATS) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dims, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        raise TypeError(f"{op}: {name} dtype {x.dtype} not in {[str(d) for d in dtypes]}")
    if x.device != device:
        raise ValueError(f"{op}: {name} is on {x.device}, expected {device} (the device of q)")


def check_kda_inputs(op: str, q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias,
                     lower_bound, same_dtype: bool) -> tuple[int, int, int, int, int, int]:
    """Shapes, dtypes and devices of the KDA arguments; returns (B, T, H, K, HV, V)."""
    check_tensor(op, "q", q, 4, getattr(q, "device", None))
    B, T, H, K = q.shape
    for name, x, ndim in (("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        check_tensor(op, name, x, ndim, q.device)
    if k.shape != q.shape:
        raise ValueError(f"{op}: k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)}")
    if same_dtype and (k.dtype != q.dtype or v.dtype != q.dtype):
        raise TypeError(f"{op}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"{op}: v shape {tuple(v.shape)} must start with (B, T) = {(B, T)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"{op}: v heads HV={HV} must be a multiple of q/k heads H={H} (GVA)")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"{op}: g shape {tuple(g.shape)} must be (B, T, HV, K) = {(B, T, HV, K)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"{op}: beta shape {tuple(beta.shape)} must be (B, T, HV) = {(B, T, HV)}")
    if not 1 <= K <= 256:
        raise ValueError(f"{op}: key dim K={K} must be in [1, 256]")
    if B == 0 or T == 0 or V == 0:
        raise ValueError(f"{op}: empty input (B={B}, T={T}, V={V})")
    if initial_state is not None:
        check_tensor(op, "initial_state", initial_state, 4, q.device, (torch.float32,))
        if initial_state.shape != (B, HV, K, V):
            raise ValueError(f"{op}: initial_state shape {tuple(initial_state.shape)} must be "
                             f"(B, HV, K, V) = {(B, HV, K, V)}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: scale must be a float or None, got {type(scale).__name__}")
    if not (-5.0 <= lower_bound < 0.0):
        raise ValueError(f"{op}: lower_bound={lower_bound} must be in [-5, 0)")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError(f"{op}: A_log is required when use_gate_in_kernel=True")
        check_tensor(op, "A_log", A_log, 1, q.device)
        if A_log.shape != (HV,):
            raise ValueError(f"{op}: A_log shape {tuple(A_log.shape)} must be (HV,) = {(HV,)}")
        if dt_bias is not None:
            check_tensor(op, "dt_bias", dt_bias, 2, q.device)
            if dt_bias.shape != (HV, K):
                raise ValueError(f"{op}: dt_bias shape {tuple(dt_bias.shape)} must be (HV, K) = {(HV, K)}")
    return B, T, H, K, HV, V
