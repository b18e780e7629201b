"""Fused KDA gate (docs/math.md §2.3): bias add -> gate -> chunk-local cumsum, one pass.

g = L * sigmoid(exp(A_log) * (g_raw + dt_bias)) (the lower-bound gate), or with L = None
g = -exp(A_log) * softplus(g_raw + dt_bias) (the softplus gate, no lower bound), then optionally the
inclusive cumsum inside each chunk of `chunk_size` tokens. Backward gives d g_raw, dA_log (sum over B, T, K) and d dt_bias
(sum over B, T); per-program partial sums are reduced in torch (deterministic, no atomics).
Custom ops `k3::kda_gate` / `k3::kda_gate_bwd` (README.md, "Custom ops").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3cli.ops.checks import FLOATS, check_number, check_tensor
from k3cli.ops.custom import absent, eager_function, reference_vjp, triton_runs

# g_raw, A_log, dt_bias: the kernels' dtypes and float64 (read as fp32; the output is fp32 anyway)
GATE_FLOATS = (*FLOATS, torch.float64)


@triton.jit
def softplus(x):
    """log(1 + e^x) in fp32 to a few ulp for any x: max(x, 0) + log1p(e^-|x|), log1p by u = 1 + e,
    log(u) * e / (u - 1) (exact where 1 + e rounds, so tiny values keep their size)."""
    e = tl.exp(-tl.abs(x))
    u = 1. + e
    one = u == 1.
    return tl.maximum(x, 0.) + tl.where(one, e, tl.log(u) * e / tl.where(one, 1., u - 1.))


@triton.jit
def _kda_gate_fwd_kernel(g_raw, a_log, dt_bias, out, lower_bound, T,
                         HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         HAS_BIAS: tl.constexpr, CUMSUM: tl.constexpr, SOFTPLUS: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    o_t = i_n * BT + tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m = (o_t < T)[:, None] & (o_k < K)[None, :]
    p = (i_b * T + o_t).to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    b_x = tl.load(g_raw + p, mask=m, other=0.).to(tl.float32)
    if HAS_BIAS:
        b_x += tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.).to(tl.float32)[None, :]
    b_rate = tl.exp(tl.load(a_log + i_hv).to(tl.float32))
    if SOFTPLUS:
        b_y = -b_rate * softplus(b_x)
    else:
        b_y = lower_bound * tl.sigmoid(b_rate * b_x)
    b_y = tl.where(m, b_y, 0.)
    if CUMSUM:
        b_y = tl.cumsum(b_y, 0)
    tl.store(out + p, b_y, mask=m)


@triton.jit
def _kda_gate_bwd_kernel(g_raw, a_log, dt_bias, dout, dg_raw, da_part, db_part, lower_bound, T, NT,
                         HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         HAS_BIAS: tl.constexpr, CUMSUM: tl.constexpr, SOFTPLUS: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    o_t = i_n * BT + tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m = (o_t < T)[:, None] & m_k[None, :]
    p = (i_b * T + o_t).to(tl.int64)[:, None] * (HV * K) + i_hv * K + o_k[None, :]
    b_x = tl.load(g_raw + p, mask=m, other=0.).to(tl.float32)
    if HAS_BIAS:
        b_x += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.).to(tl.float32)[None, :]
    b_rate = tl.exp(tl.load(a_log + i_hv).to(tl.float32))
    b_dy = tl.load(dout + p, mask=m, other=0.).to(tl.float32)
    if CUMSUM:
        b_dy = tl.cumsum(b_dy, 0, reverse=True)
    i_part = (i_b * NT + i_n).to(tl.int64) * HV + i_hv
    if SOFTPLUS:
        # y = -rate * softplus(x): dy/dx = -rate * sigmoid(x), dy/dA_log = y
        b_dx = tl.where(m, -b_dy * b_rate * tl.sigmoid(b_x), 0.)
        b_da = tl.sum(tl.sum(tl.where(m, b_dy * softplus(b_x), 0.), 1), 0) * -b_rate
    else:
        b_s = tl.sigmoid(b_rate * b_x)
        # d/dz of L*sigmoid(z) at z = rate * x
        b_dz = tl.where(m, b_dy * lower_bound * b_s * (1. - b_s), 0.)
        b_dx = b_dz * b_rate
        # dA_log = Σ dz * rate * x  (d rate / d A_log = rate)
        b_da = tl.sum(tl.sum(b_dz * b_x, 1), 0) * b_rate
    tl.store(dg_raw + p, b_dx.to(dg_raw.dtype.element_ty), mask=m)
    tl.store(da_part + i_part, b_da)
    tl.store(db_part + i_part * K + o_k, tl.sum(b_dx, 0), mask=m_k)


def _launch_meta(g_raw, chunk_size):
    B, T, HV, K = g_raw.shape
    BK = triton.next_power_of_2(K)
    return B, T, HV, K, chunk_size, triton.cdiv(T, chunk_size), BK


def _forward(g_raw, A_log, dt_bias, lower_bound: float | None, chunk_size: int, cumsum: bool):
    g_raw = g_raw.contiguous()
    B, T, HV, K, BT, NT, BK = _launch_meta(g_raw, chunk_size)
    out = torch.empty(B, T, HV, K, device=g_raw.device, dtype=torch.float32)
    if out.numel() == 0:   # an empty grid (and BK = 0 for K = 0) is not launched
        return out
    _kda_gate_fwd_kernel[(NT, B * HV)](g_raw, A_log.contiguous(), _contiguous(dt_bias), out, lower_bound or 0., T,
                                       HV=HV, K=K, BT=BT, BK=BK, HAS_BIAS=dt_bias is not None, CUMSUM=cumsum,
                                       SOFTPLUS=lower_bound is None)
    return out


def _backward(g_raw, A_log, dt_bias, dout, lower_bound: float | None, chunk_size: int, cumsum: bool):
    g_raw = g_raw.contiguous()
    B, T, HV, K, BT, NT, BK = _launch_meta(g_raw, chunk_size)
    dev = g_raw.device
    dg_raw = torch.empty_like(g_raw)
    if g_raw.numel() == 0:
        return dg_raw, torch.zeros_like(A_log), absent(g_raw) if dt_bias is None else torch.zeros_like(dt_bias)
    da_part = torch.empty(B * NT, HV, device=dev, dtype=torch.float32)
    db_part = torch.empty(B * NT, HV, K, device=dev, dtype=torch.float32)
    _kda_gate_bwd_kernel[(NT, B * HV)](g_raw, A_log.contiguous(), _contiguous(dt_bias), dout.contiguous(), dg_raw,
                                       da_part, db_part, lower_bound or 0., T, NT, HV=HV, K=K, BT=BT, BK=BK,
                                       HAS_BIAS=dt_bias is not None, CUMSUM=cumsum, SOFTPLUS=lower_bound is None)
    dA_log = da_part.sum(0).to(A_log.dtype)
    ddt_bias = absent(g_raw) if dt_bias is None else db_part.sum(0).to(dt_bias.dtype)
    return dg_raw, dA_log, ddt_bias


def _reference(g_raw, A_log, dt_bias, lower_bound: float | None, chunk_size: int, cumsum: bool):
    """The torch gate (CPU without the interpreter), fp32 as the kernel's output."""
    from k3cli.ops.kda.naive import chunk_local_cumsum, naive_kda_gate
    g = naive_kda_gate(g_raw, A_log, dt_bias, lower_bound)
    return (chunk_local_cumsum(g, chunk_size) if cumsum else g).float().contiguous()


def _contiguous(x):
    return None if x is None else x.contiguous()


def _gate_impl(g_raw, A_log, dt_bias, lower_bound, chunk_size, cumsum):
    if triton_runs(g_raw.device):
        return _forward(g_raw, A_log, dt_bias, lower_bound, chunk_size, cumsum)
    return _reference(g_raw, A_log, dt_bias, lower_bound, chunk_size, cumsum)


@torch.library.custom_op("k3::kda_gate", mutates_args=(), device_types=("cuda", "cpu"))
def kda_gate_op(g_raw: Tensor, A_log: Tensor, dt_bias: Tensor | None, lower_bound: float | None, chunk_size: int,
                cumsum: bool) -> Tensor:
    """`kda_gate` on checked inputs: [B, T, HV, K] fp32."""
    return _gate_impl(g_raw, A_log, dt_bias, lower_bound, chunk_size, cumsum)


@kda_gate_op.register_fake
def _(g_raw, A_log, dt_bias, lower_bound, chunk_size, cumsum):
    return torch.empty(g_raw.shape, device=g_raw.device, dtype=torch.float32)


@torch.library.custom_op("k3::kda_gate_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def kda_gate_bwd_op(g_raw: Tensor, A_log: Tensor, dt_bias: Tensor | None, dout: Tensor, lower_bound: float | None,
                    chunk_size: int, cumsum: bool) -> tuple[Tensor, Tensor, Tensor]:
    """k3::kda_gate's backward: (d g_raw, dA_log, d dt_bias), the last an empty fp32 tensor without dt_bias."""
    return _gate_bwd_impl(g_raw, A_log, dt_bias, dout, lower_bound, chunk_size, cumsum)


def _gate_bwd_impl(g_raw, A_log, dt_bias, dout, lower_bound, chunk_size, cumsum):
    if triton_runs(g_raw.device):
        return _backward(g_raw, A_log, dt_bias, dout, lower_bound, chunk_size, cumsum)
    dg_raw, dA_log, ddt_bias = reference_vjp(
        lambda x, a, b: _reference(x, a, b, lower_bound, chunk_size, cumsum), (g_raw, A_log, dt_bias), (dout,))
    return dg_raw, dA_log, absent(g_raw) if ddt_bias is None else ddt_bias


@kda_gate_bwd_op.register_fake
def _(g_raw, A_log, dt_bias, dout, lower_bound, chunk_size, cumsum):
    return (torch.empty(g_raw.shape, device=g_raw.device, dtype=g_raw.dtype), torch.empty_like(A_log),
            absent(g_raw) if dt_bias is None else torch.empty(dt_bias.shape, device=dt_bias.device,
                                                              dtype=dt_bias.dtype))


def _setup_context(ctx, inputs, output):
    g_raw, A_log, dt_bias, lower_bound, chunk_size, cumsum = inputs
    ctx.save_for_backward(g_raw, A_log, dt_bias)
    ctx.lower_bound, ctx.chunk_size, ctx.cumsum = lower_bound, chunk_size, cumsum


def _autograd_backward(ctx, dout, bwd=None):
    """The backward of k3::kda_gate (through its backward op) and of _KDAGate (`bwd`)."""
    g_raw, A_log, dt_bias = ctx.saved_tensors
    dg_raw, dA_log, ddt_bias = (bwd or kda_gate_bwd_op)(g_raw, A_log, dt_bias, dout, ctx.lower_bound,
                                                        ctx.chunk_size, ctx.cumsum)
    return dg_raw, dA_log, None if dt_bias is None else ddt_bias, None, None, None


kda_gate_op.register_autograd(_autograd_backward, setup_context=_setup_context)
# eagerly without the dispatcher, as chunk_kda (k3cli/ops/kda/README.md, "Custom ops")
_KDAGate = eager_function("_KDAGate", _gate_impl, _setup_context, _autograd_backward, _gate_bwd_impl)


def kda_gate(g_raw, A_log, dt_bias=None, lower_bound=-5.0, chunk_size=64, cumsum=True):
    """Fused gate, lower-bound or softplus (+ chunk-local cumsum).

    Args:
        g_raw: [B, T, HV, K] gate projection output (fp32 / fp16 / bf16 / fp64); empty (any dim 0): an empty
            result, zero gradients for A_log and dt_bias.
        A_log: [HV] log rate; dt_bias: [HV, K] or None (same dtypes, on g_raw's device).
        lower_bound: L in [-5, 0) for the lower-bound gate, or None for the softplus gate (no lower bound);
            chunk_size: cumsum restarts every chunk_size tokens (power of 2).
        cumsum: False returns the per-step gate g itself.
    Returns:
        [B, T, HV, K] fp32: g, or its chunk-local inclusive cumsum.
    """
    check_tensor("kda_gate", "g_raw", g_raw, 4, dtypes=GATE_FLOATS)
    _, _, HV, K = g_raw.shape
    check_tensor("kda_gate", "A_log", A_log, 1, g_raw.device, GATE_FLOATS, shape=(HV,), ref="g_raw")
    if dt_bias is not None:
        check_tensor("kda_gate", "dt_bias", dt_bias, 2, g_raw.device, GATE_FLOATS, shape=(HV, K), ref="g_raw")
    if lower_bound is not None:
        check_number("kda_gate", "lower_bound", lower_bound, -5.0, 0.0, high_open=True)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, torch.SymInt)) or chunk_size < 1 \
            or chunk_size & (chunk_size - 1):
        raise ValueError(f"kda_gate: chunk_size={chunk_size!r} must be a power of 2")
    gate = kda_gate_op if torch.compiler.is_compiling() else _KDAGate.apply
    return gate(g_raw, A_log, dt_bias, None if lower_bound is None else float(lower_bound), int(chunk_size),
                bool(cumsum))
