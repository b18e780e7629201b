"""Triton AttnRes, full form: `fused_attnres` (forward + backward; derivation in README.md).

One program per token tile: BT tokens × the whole hidden row (BD = next power of two ≥ D, masked),
so each source is read from memory exactly once and the online softmax over sources runs in
registers. Sources come either as one stacked buffer [n, B, T, D] (slot i at base + i·stride) or as
a list of [B, T, D] tensors whose addresses travel in an int64 pointer table loaded in-kernel.

Loops over sources are `while` loops: under TRITON_INTERPRET=1 with numpy ≥ 2.4, `range(n)` over a
runtime int fails (the interpreter calls int() on a 1-element array); `while` works in both modes.

Block-form kernels (phase 1, merge) live in block.py and share the helpers here. Each entry point is a
custom op (`k3::fused_attnres` and its `_bwd` here; README.md, "Custom ops").
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3cli.ops.checks import InputTypeError, check_number, check_tensor
from k3cli.ops.custom import absent, reference_vjp, triton_runs

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_SOURCES = 32
# the whole row lives in registers: BD = 16384 fp32 is 64 values per thread at 8 warps
MAX_D = 16384


def _configs(options: list[tuple[int, int]]) -> list[triton.Config]:
    """(BT, num_warps) options on GPU; exactly one config under the interpreter."""
    if INTERPRET:
        return [triton.Config({"BT": 16}, num_warps=4)]
    return [triton.Config({"BT": bt}, num_warps=w) for bt, w in options]


def _prune_by_registers(configs, named_args, **kwargs):
    # keep 4..32 fp32 row values per thread: ptxas (sm_90, bf16) showed no spills for the forward
    # in that range and at most 56 B of stack for the backward at BD = 8192
    bd = kwargs.get("BD", named_args.get("BD"))
    kept = [c for c in configs if 4 <= c.kwargs["BT"] * bd // (32 * c.num_warps) <= 32]
    return kept or configs[:1]


# (BT, num_warps) candidates; the pruner keeps the ones that fit the row width
ROW_OPTIONS = [(1, 4), (1, 8), (1, 16), (1, 32), (2, 8), (2, 16), (4, 4), (8, 4)]


@triton.jit
def _src_ptr(x, ptrs, i, stride_n, USE_TABLE: tl.constexpr):
    """Base pointer of source i: an address from the int64 table, or slot i of the stacked buffer."""
    if USE_TABLE:
        # Sources guarantees 16-byte aligned addresses; without the hint loads are 2-byte scalars
        # (PTX: ld.global.b16 instead of ld.global.v4; measured 1.6-2.1x slower)
        return tl.multiple_of(tl.load(ptrs + i).to(tl.pointer_type(x.dtype.element_ty)), 16)
    else:
        return x + i.to(tl.int64) * stride_n


@triton.jit
def _rms_score(b_v, b_w, m_t, D, eps):
    """Per token: rstd r = 1/sqrt(mean(v²)+eps) and score s = r · (w̃ · v); 0 on masked tokens."""
    # padded tokens (all zeros) would give rsqrt(0) when eps = 0: give them r = 0
    b_r = tl.where(m_t, tl.rsqrt(tl.where(m_t, tl.sum(b_v * b_v, 1) / D + eps, 1.)), 0.)
    return b_r, tl.sum(b_v * b_w[None, :], 1) * b_r


@triton.jit
def _src_tile(x, ptrs, i, n, stride_n, o_td, m_td, USE_TABLE: tl.constexpr):
    """Tile o_td of source i in its stored dtype; zeros for i >= n (the prefetch past the last
    source reads nothing: its index is clamped and its mask off)."""
    return tl.load(_src_ptr(x, ptrs, tl.minimum(i, n - 1), stride_n, USE_TABLE) + o_td, mask=m_td & (i < n),
                   other=0.)


@triton.jit
def _dh_tile(h, dh, dy, nw, stat_rh, o_td, o_t, o_d, m_t, m_td, m_d, D, HAS_NORM: tl.constexpr,
             HAS_DH: tl.constexpr, HAS_DY: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """A backward's tile of h (fp32) and the gradient reaching it: dh, plus the fused output
    norm's share when y was used; and that tile's dnw (zeros without the norm)."""
    b_h = tl.load(h + o_td, mask=m_td, other=0.).to(tl.float32)
    b_dh = tl.zeros([BT, BD], tl.float32)
    if HAS_DH:
        b_dh = tl.load(dh + o_td, mask=m_td, other=0.).to(tl.float32)
    b_dnw = tl.zeros([BD], tl.float32)
    if HAS_NORM and HAS_DY:
        b_dh, b_dnw = _norm_bwd(b_h, b_dh, dy, nw, stat_rh, o_td, o_t, o_d, m_t, m_td, m_d, D, HAS_DH)
    return b_h, b_dh, b_dnw


@triton.jit
def _norm_bwd(b_h, b_dh, dy, nw, stat_rh, o_td, o_t, o_d, m_t, m_td, m_d, D,
              HAS_DH: tl.constexpr):
    """Add RMSNorm's backward (y = h·r_h·nw) to dh; return (dh_total, this tile's dnw)."""
    b_dy = tl.load(dy + o_td, mask=m_td, other=0.).to(tl.float32)
    b_rh = tl.load(stat_rh + o_t, mask=m_t, other=0.)
    b_nw = tl.load(nw + o_d, mask=m_d, other=0.).to(tl.float32)
    b_dnw = tl.sum(b_dy * b_h * b_rh[:, None], 0)
    b_gy = b_dy * b_nw[None, :]
    b_c = tl.sum(b_gy * b_h, 1) / D
    b_dn = b_rh[:, None] * (b_gy - b_h * (b_rh * b_rh * b_c)[:, None])
    if HAS_DH:
        b_dn += b_dh
    return b_dn, b_dnw


@triton.autotune(configs=_configs(ROW_OPTIONS), key=["D", "NORMALIZE", "HAS_NORM", "USE_TABLE"],
                 prune_configs_by={"early_config_prune": _prune_by_registers})
@triton.jit
def attnres_fwd_kernel(x, ptrs, wt, out, y, nw, m_out, l_out, stat,
                       M, D, n, stride_n, eps, norm_eps,
                       USE_TABLE: tl.constexpr, NORMALIZE: tl.constexpr, HAS_NORM: tl.constexpr,
                       BT: tl.constexpr, BD: tl.constexpr):
    """Program (i_q, i_t): query i_q against all n sources for tokens [i_t·BT, i_t·BT + BT).

    NORMALIZE (full form): write h = o / l (sources' dtype), lse = m + log l, and with HAS_NORM
    y = RMSNorm(h)·nw and its rstd. Otherwise (phase 1): write fp32 m, l, o of query i_q.
    """
    i_q, i_t = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_t, m_d = o_t < M, o_d < D
    m_td = m_t[:, None] & m_d[None, :]
    o_td = o_t.to(tl.int64)[:, None] * D + o_d[None, :]
    b_w = tl.load(wt + i_q * D + o_d, mask=m_d, other=0.)
    b_m = tl.full([BT], float("-inf"), tl.float32)
    b_l = tl.zeros([BT], tl.float32)
    b_o = tl.zeros([BT, BD], tl.float32)
    # software prefetch: source i + 1 is in flight while source i is reduced (the while loop is
    # not pipelined by the compiler, and one row per program leaves too few bytes in flight)
    i = n * 0
    b_next = _src_tile(x, ptrs, i, n, stride_n, o_td, m_td, USE_TABLE)
    while i < n:
        b_v = b_next.to(tl.float32)
        b_next = _src_tile(x, ptrs, i + 1, n, stride_n, o_td, m_td, USE_TABLE)
        _, b_s = _rms_score(b_v, b_w, m_t, D, eps)
        b_mn = tl.maximum(b_m, b_s)
        b_a = tl.exp(b_m - b_mn)
        b_p = tl.exp(b_s - b_mn)
        b_l = b_l * b_a + b_p
        b_o = b_o * b_a[:, None] + b_p[:, None] * b_v
        b_m = b_mn
        i += 1
    if NORMALIZE:
        b_h = b_o / b_l[:, None]
        tl.store(out + o_td, b_h.to(out.dtype.element_ty), mask=m_td)
        tl.store(stat + o_t, b_m + tl.log(b_l), mask=m_t)
        if HAS_NORM:
            b_rh = tl.rsqrt(tl.sum(b_h * b_h, 1) / D + norm_eps)
            b_nw = tl.load(nw + o_d, mask=m_d, other=0.).to(tl.float32)
            tl.store(y + o_td, (b_h * b_rh[:, None] * b_nw[None, :]).to(y.dtype.element_ty), mask=m_td)
            tl.store(stat + M + o_t, b_rh, mask=m_t)
    else:
        base = i_q.to(tl.int64) * M
        tl.store(out + base * D + o_td, b_o, mask=m_td)
        tl.store(m_out + base + o_t, b_m, mask=m_t)
        tl.store(l_out + base + o_t, b_l, mask=m_t)


@triton.autotune(configs=_configs(ROW_OPTIONS), key=["D", "HAS_NORM", "HAS_DH", "HAS_DY", "USE_TABLE"],
                 prune_configs_by={"early_config_prune": _prune_by_registers})
@triton.jit
def attnres_bwd_kernel(x, ptrs, wt, h, dh, dy, nw, stat, dx, dw_part, dnw_part,
                       M, D, n, stride_n, eps,
                       USE_TABLE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_DH: tl.constexpr,
                       HAS_DY: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Grid-stride over token tiles; program p writes dx for its tiles and its partial sums of
    dw̃ and dnw (row p of dw_part / dnw_part, reduced on the host)."""
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_w = tl.load(wt + o_d, mask=m_d, other=0.)
    acc_dw = tl.zeros([BD], tl.float32)
    acc_dnw = tl.zeros([BD], tl.float32)
    n_tiles = tl.cdiv(M, BT)
    i_t = i_p
    while i_t < n_tiles:
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < M
        m_td = m_t[:, None] & m_d[None, :]
        o_td = o_t.to(tl.int64)[:, None] * D + o_d[None, :]
        b_h, b_dh, b_dnw = _dh_tile(h, dh, dy, nw, stat + M, o_td, o_t, o_d, m_t, m_td, m_d, D, HAS_NORM,
                                    HAS_DH, HAS_DY, BT, BD)
        acc_dnw += b_dnw
        b_lse = tl.load(stat + o_t, mask=m_t, other=0.)
        b_delta = tl.sum(b_dh * b_h, 1)
        i = n * 0
        b_next = _src_tile(x, ptrs, i, n, stride_n, o_td, m_td, USE_TABLE)
        while i < n:
            b_v = b_next.to(tl.float32)
            b_next = _src_tile(x, ptrs, i + 1, n, stride_n, o_td, m_td, USE_TABLE)
            b_r, b_s = _rms_score(b_v, b_w, m_t, D, eps)
            b_a = tl.where(m_t, tl.exp(b_s - b_lse), 0.)
            b_dsr = b_a * (tl.sum(b_dh * b_v, 1) - b_delta) * b_r
            b_dv = b_a[:, None] * b_dh + b_dsr[:, None] * (b_w[None, :] - (b_s * b_r / D)[:, None] * b_v)
            tl.store(dx + i.to(tl.int64) * M * D + o_td, b_dv.to(dx.dtype.element_ty), mask=m_td)
            acc_dw += tl.sum(b_dsr[:, None] * b_v, 0)
            i += 1
        i_t += n_p
    tl.store(dw_part + i_p * D + o_d, acc_dw, mask=m_d)
    if HAS_NORM and HAS_DY:
        tl.store(dnw_part + i_p * D + o_d, acc_dnw, mask=m_d)


# ------------------------------------------------------------------ host side, shared with block.py
def check_sources(sources, op: str) -> tuple[list[torch.Tensor], tuple]:
    """Shapes, dtypes and devices of a list of n [B, T, D] sources or one stacked [n, B, T, D] buffer
    (no data is read: also run while tracing; `op` names the entry point in the messages). Returns the ops'
    `Tensor[]` form ([buffer] when stacked, a list of 3-D tensors otherwise) and the shape [B, T, D] of one
    source. Sources are fp32 / fp16 / bf16 (the kernels compute in fp32: fp64 is the naive references'),
    1 <= n <= 32, B, T, D >= 1 (empty inputs are rejected), D <= MAX_D."""
    if isinstance(sources, torch.Tensor):
        if sources.dim() != 4:
            raise ValueError(f"{op}: sources must be [n, B, T, D] or a list of [B, T, D], got shape "
                             f"{tuple(sources.shape)}")
        check_tensor(op, "sources", sources, 4)
        srcs, n, shape = [sources], sources.shape[0], tuple(sources.shape[1:])
    else:
        if not isinstance(sources, (list, tuple)):
            raise InputTypeError(f"{op}: sources must be a list of [B, T, D] tensors or one [n, B, T, D] "
                                 f"tensor, got {type(sources).__name__}")
        srcs = list(sources)
        if not srcs:
            raise ValueError(f"{op}: sources: needs at least one source")
        check_tensor(op, "sources[0]", srcs[0], 3)
        for i, s in enumerate(srcs[1:], 1):
            check_tensor(op, f"sources[{i}]", s, 3, srcs[0].device, (srcs[0].dtype,), tuple(srcs[0].shape),
                         ref="sources[0]")
        n, shape = len(srcs), tuple(srcs[0].shape)
    if not 1 <= n <= MAX_SOURCES:
        raise ValueError(f"{op}: sources: {n} sources; supported 1..{MAX_SOURCES}")
    if 0 in shape:
        raise ValueError(f"{op}: sources: source shape {shape} is empty: B, T, D must be >= 1 (empty inputs "
                         "are rejected)")
    if shape[-1] > MAX_D:
        raise ValueError(f"{op}: sources: D = {shape[-1]} > {MAX_D} (the row must fit in registers)")
    return srcs, shape


def is_stacked(srcs: list[torch.Tensor]) -> bool:
    """Whether an op's `Tensor[]` sources are one stacked [n, B, T, D] buffer (else n [B, T, D] tensors)."""
    return len(srcs) == 1 and srcs[0].dim() == 4


def source_count_shape(srcs: list[torch.Tensor]) -> tuple[int, tuple]:
    """(n, [B, T, D]) of an op's `Tensor[]` sources."""
    return (srcs[0].shape[0], tuple(srcs[0].shape[1:])) if is_stacked(srcs) else (len(srcs), tuple(srcs[0].shape))


class Sources:
    """An op's `Tensor[]` sources (checked by `check_sources`) resolved for a launch: `x` is the stacked
    buffer or sources[0], `ptrs` the address table (list input) or None, `flat` the tensors read."""

    def __init__(self, srcs: list[torch.Tensor]):
        if is_stacked(srcs):
            x = srcs[0] if srcs[0][0].is_contiguous() else srcs[0].contiguous()
            self.stacked, self.x, self.ptrs, self.flat = True, x, None, [x]
            self.n, self.shape, self.stride_n = x.shape[0], tuple(x.shape[1:]), x.stride(0)
        else:
            # the kernel assumes 16-byte aligned table addresses: copy the rare misaligned view
            srcs = [s.contiguous() for s in srcs]
            srcs = [s if s.data_ptr() % 16 == 0 else s.clone() for s in srcs]
            # the table holds bare addresses: `flat` keeps any copies alive while a Sources is in use
            self.stacked, self.x, self.flat = False, srcs[0], srcs
            self.ptrs = address_table(srcs)
            self.n, self.shape, self.stride_n = len(srcs), tuple(srcs[0].shape), 0
        self.D = self.shape[-1]
        self.M = self.shape[0] * self.shape[1]

    @property
    def table(self) -> torch.Tensor:
        # the kernel ignores ptrs when USE_TABLE is off; any tensor does as a placeholder
        return self.ptrs if self.ptrs is not None else self.x


def source_grads(srcs: list[torch.Tensor], dx: torch.Tensor) -> list[torch.Tensor]:
    """dx [n, B, T, D] -> the gradients of an op's `Tensor[]` sources, one per tensor."""
    return [dx] if is_stacked(srcs) else list(dx.unbind(0))


def reference_sources(srcs: list[torch.Tensor]):
    """An op's `Tensor[]` sources as the torch references take them (the stacked buffer, or the list)."""
    return srcs[0] if is_stacked(srcs) else srcs


def stacked_grad(srcs: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    """The reference's source gradients as the kernels' one [n, B, T, D] dx."""
    return grads[0] if is_stacked(srcs) else torch.stack(grads)


# Address tables by (device, stream, pointers). A table's contents are the pointers themselves, so a
# hit is correct whatever tensor now lives at those addresses; in training the caching allocator hands
# out the same addresses step after step, so steady state reuses tables instead of paying a pinned
# host copy per call (AttnRes calls the kernels ~2x per sublayer per step).
_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_TABLES_MAX = 512


def address_table(srcs: list[torch.Tensor]) -> torch.Tensor:
    """int64 data pointers of srcs, on their device (pinned + non-blocking: no host sync on CUDA);
    cached per (device, current stream, pointers)."""
    ptrs = tuple(s.data_ptr() for s in srcs)
    dev = srcs[0].device
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    key = (str(dev), stream, ptrs)
    table = _TABLES.get(key)
    if table is not None:
        _TABLES.move_to_end(key)
        return table
    table = torch.tensor(ptrs, dtype=torch.int64)
    if dev.type == "cuda":
        table = table.pin_memory().to(dev, non_blocking=True)
    _TABLES[key] = table
    if len(_TABLES) > _TABLES_MAX:
        _TABLES.popitem(last=False)
    return table


def w_tilde(query: torch.Tensor, gain: torch.Tensor | None) -> torch.Tensor:
    """The scoring vector(s) w̃ = query ⊙ gain in fp32 and contiguous (the kernels index rows as
    i·D + d); gain None: query is w̃ already."""
    return (query.float() if gain is None else query.float() * gain.float()).contiguous()


def w_tilde_grads(dwt: torch.Tensor, query: torch.Tensor, gain: torch.Tensor | None):
    """(d query, d gain) from d w̃ (d gain None when gain is None)."""
    if gain is None:
        return dwt.to(query.dtype), None
    return (dwt * gain.float()).to(query.dtype), (dwt * query.float()).to(gain.dtype)


def check_vector(op: str, name: str, t: torch.Tensor | None, shape: tuple, device) -> None:
    """t is None or an fp32 / fp16 / bf16 tensor of exactly `shape` on the sources' `device`."""
    if t is not None:
        check_tensor(op, name, t, len(shape), device, shape=shape, ref="the sources")


def check_eps(op: str, **eps) -> None:
    for name, x in eps.items():
        check_number(op, name, x, low=0.0)


def dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """t with unit strides, as the kernels index it (element d of a vector at offset d), or None."""
    return None if t is None else t.contiguous()


def block_d(D: int) -> int:
    return triton.next_power_of_2(D)


def num_programs(M: int, device: torch.device) -> int:
    """Grid size of the grid-stride backward kernels: ~4 programs per SM, ≥ 16 tokens each."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 2
    return max(1, min(target, triton.cdiv(M, 16)))


def attnres_fwd(src: Sources, wt: torch.Tensor, eps: float, norm_weight, norm_eps: float):
    """Full form forward launcher. Returns h, y (or None), stat [2, M] fp32 (lse, rstd of h; [1, M] without
    the norm, which leaves the rstd row unwritten)."""
    x, M, D = src.x, src.M, src.D
    norm_weight = dense(norm_weight)
    h = torch.empty(src.shape, dtype=x.dtype, device=x.device)
    y = torch.empty_like(h) if norm_weight is not None else None
    stat = torch.empty(1 + (norm_weight is not None), M, dtype=torch.float32, device=x.device)
    grid = lambda meta: (1, triton.cdiv(M, meta["BT"]))
    attnres_fwd_kernel[grid](x, src.table, wt, h, h if y is None else y,
                             wt if norm_weight is None else norm_weight, stat, stat, stat,
                             M, D, src.n, src.stride_n, eps, norm_eps,
                             USE_TABLE=not src.stacked, NORMALIZE=True, HAS_NORM=norm_weight is not None,
                             BD=block_d(D))
    return h, y, stat


def attnres_bwd(src: Sources, wt, h, dh, dy, norm_weight, stat, eps: float):
    """Full form backward launcher. Returns dx [n, B, T, D], dw̃ [D] fp32, dnw [D] fp32 or None."""
    x, M, D = src.x, src.M, src.D
    norm_weight = dense(norm_weight)
    G = num_programs(M, x.device)
    dx = torch.empty((src.n, *src.shape), dtype=x.dtype, device=x.device)
    dw_part = torch.empty(G, D, dtype=torch.float32, device=x.device)
    has_dy = norm_weight is not None and dy is not None
    dnw_part = torch.empty(G, D, dtype=torch.float32, device=x.device) if has_dy else dw_part
    attnres_bwd_kernel[(G,)](x, src.table, wt, h, h if dh is None else dh, h if dy is None else dy,
                             wt if norm_weight is None else norm_weight, stat, dx, dw_part, dnw_part,
                             M, D, src.n, src.stride_n, eps,
                             USE_TABLE=not src.stacked, HAS_NORM=norm_weight is not None,
                             HAS_DH=dh is not None, HAS_DY=dy is not None, BD=block_d(D))
    dnw = dnw_part.sum(0) if has_dy else (torch.zeros_like(wt) if norm_weight is not None else None)
    return dx, dw_part.sum(0), dnw


def _fused_reference(srcs, query, gain, norm_weight, eps: float, norm_eps: float):
    from k3cli.ops.attnres.naive import naive_attnres
    out = naive_attnres(reference_sources(srcs), query, gain, eps, norm_weight=norm_weight, norm_eps=norm_eps)
    return (out, None) if norm_weight is None else out


@torch.library.custom_op("k3::fused_attnres", mutates_args=(), device_types=("cuda", "cpu"))
def fused_attnres_op(sources: list[Tensor], query: Tensor, gain: Tensor | None, norm_weight: Tensor | None,
                     eps: float, norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """`fused_attnres` on checked inputs: (h, y, stat); y an empty fp32 tensor without norm_weight, stat
    [2, B*T] fp32 (lse, rstd of h; [1, B*T] without norm_weight) for the Triton backward, empty on the torch
    reference path. `sources`:
    n [B, T, D] tensors, or [the stacked [n, B, T, D] buffer]."""
    if triton_runs(query.device):
        h, y, stat = attnres_fwd(Sources(sources), w_tilde(query, gain), eps, norm_weight, norm_eps)
    else:
        (h, y), stat = _fused_reference(sources, query, gain, norm_weight, eps, norm_eps), None
    return (*(absent(query) if t is None else t.contiguous() for t in (h, y)), absent(query) if stat is None
            else stat)


@fused_attnres_op.register_fake
def _(sources, query, gain, norm_weight, eps, norm_eps):
    _, shape = source_count_shape(sources)
    h = torch.empty(shape, dtype=sources[0].dtype, device=query.device)
    y = absent(query) if norm_weight is None else torch.empty_like(h)
    rows = 1 + (norm_weight is not None)
    return h, y, torch.empty(rows, shape[0] * shape[1], dtype=torch.float32, device=query.device) \
        if triton_runs(query.device) else absent(query)


@torch.library.custom_op("k3::fused_attnres_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def fused_attnres_bwd_op(sources: list[Tensor], query: Tensor, gain: Tensor | None, norm_weight: Tensor | None,
                         h: Tensor, stat: Tensor, dh: Tensor | None, dy: Tensor | None, eps: float,
                         norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """k3::fused_attnres's backward: (dx [n, B, T, D] in the sources' dtype, dw̃ [D] fp32, dnw [D] fp32 or
    empty without norm_weight), for dh and / or dy (None: no gradient reached that output)."""
    wt = w_tilde(query, gain)
    if triton_runs(query.device):
        dx, dwt, dnw = attnres_bwd(Sources(sources), wt, h, None if dh is None else dh.contiguous(),
                                   None if dy is None else dy.contiguous(), norm_weight, stat, eps)
    else:
        dsrc, dwt, dnw = reference_vjp(lambda s, w, nw: _fused_reference(s, w, None, nw, eps, norm_eps),
                                       (reference_sources(sources), wt, norm_weight), (dh, dy))
        dx, dnw = stacked_grad(sources, dsrc if isinstance(dsrc, list) else [dsrc]), \
            None if dnw is None else dnw.float()
    return dx, dwt, absent(query) if dnw is None else dnw


@fused_attnres_bwd_op.register_fake
def _(sources, query, gain, norm_weight, h, stat, dh, dy, eps, norm_eps):
    n, shape = source_count_shape(sources)
    D = shape[-1]
    dnw = absent(query) if norm_weight is None else torch.empty(D, dtype=torch.float32, device=query.device)
    return (torch.empty((n, *shape), dtype=sources[0].dtype, device=query.device),
            torch.empty(D, dtype=torch.float32, device=query.device), dnw)


def _fused_setup_context(ctx, inputs, output):
    sources, query, gain, norm_weight, eps, norm_eps = inputs
    h, y, stat = output
    ctx.mark_non_differentiable(stat, *(() if norm_weight is not None else (y,)))
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(query, gain, norm_weight, h, stat, *sources)
    ctx.eps, ctx.norm_eps = eps, norm_eps


def _fused_backward(ctx, dh, dy, _):
    query, gain, norm_weight, h, stat, *sources = ctx.saved_tensors
    dy = dy if norm_weight is not None else None
    if dh is None and dy is None:
        return None, None, None, None, None, None
    dx, dwt, dnw = fused_attnres_bwd_op(sources, query, gain, norm_weight, h, stat, dh, dy, ctx.eps, ctx.norm_eps)
    dq, dg = w_tilde_grads(dwt, query, gain)
    return (source_grads(sources, dx), dq, dg, None if norm_weight is None else dnw.to(norm_weight.dtype),
            None, None)


fused_attnres_op.register_autograd(_fused_backward, setup_context=_fused_setup_context)


def fused_attnres(sources, query: torch.Tensor, gain: torch.Tensor, eps: float = 1e-6,
                  norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6):
    """Full-form AttnRes mix in one pass over the sources (docs/math.md §5; same math as `naive_attnres`).

    Args:
        sources: list of n tensors [B, T, D] (read in place through a pointer table; each gets its
            gradient) or one stacked [n, B, T, D] buffer (one gradient [n, B, T, D]); 1 ≤ n ≤ 32.
        query, gain: [D]; scores are (query ⊙ gain) · RMS(v_i), softmax over i in fp32. gain may be
            None: query is then w̃ = query ⊙ gain itself (the mixer forms all rows in one product).
        eps: RMS eps of the scores.
        norm_weight: [D] or None; if given, also return y = RMSNorm(h) · norm_weight (eps norm_eps).
    Returns:
        h [B, T, D] in the sources' dtype, and y [B, T, D] if norm_weight is given.
    """
    srcs, shape = check_sources(sources, "fused_attnres")
    if query is None:
        raise ValueError("fused_attnres: query is required")
    for name, t in (("query", query), ("gain", gain), ("norm_weight", norm_weight)):
        check_vector("fused_attnres", name, t, (shape[-1],), srcs[0].device)
    check_eps("fused_attnres", eps=eps, norm_eps=norm_eps)
    h, y, _ = fused_attnres_op(srcs, query, gain, norm_weight, float(eps), float(norm_eps))
    return h if norm_weight is None else (h, y)
