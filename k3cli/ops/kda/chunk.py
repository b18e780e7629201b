"""Triton chunked KDA: the launch plan, the custom ops `k3::chunk_kda` / `k3::chunk_kda_bwd` (README.md,
"Custom ops") and the public entry point `chunk_kda` (kernels in chunk_fwd.py, chunk_bwd.py).

Forward: stage 1 (Γ with the gated operands, the intra-chunk scores, the solve with W and U), then the
state scan; on CUDA, for few long sequences, both per chunk range with the scans on a high-priority side
stream (`plan`). Backward: the forward scan re-run for S_n and Vn (on a side stream on CUDA, concurrent
with the reverse scan, which does not read it), the reverse scan, then the per-chunk gradients, and with
GVA the group sum of dq, dk in torch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from k3cli.ops import launch
from k3cli.ops.custom import absent, eager_function, reference_vjp, triton_runs
from k3cli.ops.kda.checks import check_kda_inputs, check_tensor
from k3cli.ops.kda.chunk_bwd import kda_bwd_intra, kda_bwd_state
from k3cli.ops.kda.chunk_fwd import Intra, intra_buffers, kda_fwd_intra, kda_fwd_state, torch_allows_tf32
from k3cli.ops.kda.torch_chunk import torch_chunk_kda, torch_chunk_kda_varlen
from k3cli.ops.kda.varlen import VarlenLayout, varlen_layout
from k3cli.ops.norm import l2norm
from k3cli.ops.rows import gather_rows

_CHUNK_SIZES = (16, 32, 64)


class Plan(NamedTuple):
    """How one chunk_kda call runs: everything that depends on the input's shape, dtype and device."""
    prec: str                  # tl.dot input precision of stage 1 and the per-chunk backward
    scan_prec: str             # of the forward state scan (and the backward's re-scan)
    inter_dtype: torch.dtype   # W, U
    gated_dtype: torch.dtype   # Q e^Γ, K e^(γ-Γ)
    aqk_dtype: torch.dtype     # scale·Aqk
    per_pair: bool             # score launch: one program per 16 x 16 block pair, not per query sub-chunk
    score_stages: int          # its pipeline stages
    ranges: int                # chunk ranges of the forward (0: one launch per stage)
    bounded: bool              # g >= -5 per step: anchored diagonal score blocks (else pair by pair)


def plan(B: int, T: int, HV: int, K: int, V: int, chunk_size: int, dtype: torch.dtype, cuda: bool,
         tf32: bool = False, bounded: bool = True) -> Plan:
    """The launch plan for inputs of these sizes and `dtype` (`cuda`: on a GPU, not the interpreter; `tf32`:
    torch allows TF32 matmuls; `bounded`: every g >= -5, README.md "Exponents"). Each rule is the measured
    winner (H200, bf16):
    - dots: fp32 inputs take "tf32x3" (about fp32 accuracy; plain TF32 put a whole fp32 model's chunked
      forward 1.4e-2 away from its exact decode, "ieee" spills at K = 128) unless TF32 is allowed; 16-bit
      inputs "tf32" (they carry less precision than TF32 already). The solve is always fp32 ("ieee").
    - the forward scan multiplies operands rounded to the input dtype, as fla's does (B8 T2048 H16 K=V=128
      forward 1.073 -> 0.981 ms), on CUDA where V >= 64 (narrower V would need value blocks below 64, not
      measured there); scale·Aqk is then stored in that dtype, which the scan rounds it to anyway.
    - K > 64: W, U, Q e^Γ, K e^(γ-Γ) in the input dtype (B1 T16384 H16 K=V=128 forward 3.049 -> 2.207 ms;
      at the toy K = 16 2-byte buffers were slower, 0.266 against 0.209 ms), and the scores per block pair
      with 2 pipeline stages (1.079 -> 0.980 ms at B8 T2048 H16 K128); one key block needs neither.
    - 4 chunk ranges where the scan has few programs (B*HV*V/64 <= 32) and many chunks (>= 32): the scan of
      range i overlaps stage 1 of the later ranges (B1 T16384 H16 K=V=128 forward 1.461 -> 1.191 ms; at
      B8 T2048 H16, 256 programs, 1.083 -> 1.466, so not there; 8 ranges varied 1.04-1.54 ms)."""
    sixteen = dtype in (torch.bfloat16, torch.float16)
    prec = "tf32" if sixteen or tf32 else "tf32x3"
    scan_prec = ("bf16" if dtype == torch.bfloat16 else "fp16") if sixteen and (V >= 64 or not cuda) else prec
    wide = K > 64
    buf = dtype if wide else torch.float32
    aqk = dtype if scan_prec in ("bf16", "fp16") else torch.float32
    NT = -(-T // chunk_size)
    few = B * HV * -(-V // 64) <= 32 and NT >= 32
    return Plan(prec, scan_prec, buf, buf, aqk, wide, 2 if wide else 1, 4 if cuda and few else 0, bounded)


def segment_ranges(NT: int, n: int) -> list[tuple[int, int]] | None:
    """`n` nearly equal chunk ranges covering [0, NT), or None for fewer than 2."""
    n = min(n, NT)
    if n < 2:
        return None
    cuts = [NT * i // n for i in range(n + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device, high_priority: bool = False):
    """One side CUDA stream per device and priority, reused by every call: the caching allocator keeps blocks
    per allocating stream, so a new stream per call could pin a copy of what was allocated on each."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), high_priority)
    if key not in _SIDE_STREAMS:
        prio = torch.cuda.Stream.priority_range()[1] if high_priority else 0
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device, priority=prio)
    return _SIDE_STREAMS[key]


class _Overlap:
    """Stream hooks of the ranged forward: stage 1 on the current stream, an event after each range, the
    scan of a range on a high-priority side stream after that event, so that a range's few scan programs
    are dispatched ahead of the later ranges' pending stage-1 programs. Only the current stream allocates."""

    def __init__(self, device: torch.device):
        self.main = torch.cuda.current_stream(device)
        self.side = _side_stream(device, high_priority=True)
        self.side.wait_stream(self.main)   # the inputs and buffers were made on the main stream
        self.events = {}

    def stage1_done(self, n0, n1):
        self.events[n0] = self.main.record_event()

    def scan_start(self, n0, n1):
        # the scan's buffers were allocated on the main stream: launch on the side stream (join() puts the
        # main stream behind it before anything reads or frees them)
        torch.cuda.set_stream(self.side)
        self.side.wait_event(self.events[n0])

    def join(self):
        torch.cuda.set_stream(self.main)
        self.main.wait_stream(self.side)


def _forward(q, k, v, g, beta, h0, scale: float, C: int, output_final_state: bool, store_mkk: bool,
             bounded: bool = True):
    """The Triton forward: (o, final state or absent, the stage-1 buffers the backward reads)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = None if h0 is None else h0.contiguous()
    launch.configure()   # a profiler's launch hook may have been set since the last call
    B, T, HV, V = v.shape
    p = plan(B, T, HV, q.shape[-1], V, C, v.dtype, v.is_cuda, torch_allows_tf32(), bounded)
    ranges = segment_ranges(-(-T // C), p.ranges)
    ov = _Overlap(q.device) if ranges and q.is_cuda else None
    try:
        it = kda_fwd_intra(q, k, v, g, beta, scale, C, p, store_mkk=store_mkk, ranges=ranges,
                           on_range=ov and ov.stage1_done)
        o, ht, _, _ = kda_fwd_state(it, B, T, HV, C, h0, p.scan_prec, v.dtype, output_final_state,
                                    ranges=ranges, on_range=ov and ov.scan_start)
    finally:
        if ov is not None:
            ov.join()   # the current stream again, after all of stage 1 (also when a launch raised)
    # Γ (it.gc) is not returned: freed now, not earlier (the side stream may still have been reading it)
    return (o, absent(v) if ht is None else ht, *it[:-2], absent(v) if it.mkk is None else it.mkk)


def _forward_reference(q, k, v, g, beta, h0, scale: float, C: int, output_final_state: bool):
    """The torch forward (CPU without the interpreter): `torch_chunk_kda`, no kernel buffers."""
    o, ht = torch_chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0,
                            output_final_state=output_final_state, chunk_size=C)
    return (o.contiguous(), absent(v) if ht is None else ht.contiguous(), *(absent(v) for _ in Intra._fields[:-1]))


_FWD_OUT = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _chunk_kda_impl(q, k, v, g, beta, initial_state, scale, chunk_size, output_final_state, store_mkk, bounded):
    if triton_runs(v.device):
        return _forward(q, k, v, g, beta, initial_state, scale, chunk_size, output_final_state, store_mkk, bounded)
    return _forward_reference(q, k, v, g, beta, initial_state, scale, chunk_size, output_final_state)


@torch.library.custom_op("k3::chunk_kda", mutates_args=(), device_types=("cuda", "cpu"))
def chunk_kda_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                 scale: float, chunk_size: int, output_final_state: bool, store_mkk: bool,
                 bounded: bool) -> _FWD_OUT:
    """Returns (o, final state, w, u, qg, kd, eg, aqk, tm, mkk): the final state an empty fp32 tensor unless
    output_final_state, mkk one unless store_mkk; w .. mkk are the stage-1 buffers (`Intra`) the backward
    reads (empty on the torch reference path). Inputs as `chunk_kda`'s, already checked, gated and normed;
    `bounded`: every g >= -5 (`plan`)."""
    return _chunk_kda_impl(q, k, v, g, beta, initial_state, scale, chunk_size, output_final_state, store_mkk,
                           bounded)


@chunk_kda_op.register_fake
def _(q, k, v, g, beta, initial_state, scale, chunk_size, output_final_state, store_mkk, bounded):
    B, T, HV, V = v.shape
    K = q.shape[-1]
    o = torch.empty(B, T, HV, V, device=v.device, dtype=v.dtype)
    ht = torch.empty(B, HV, K, V, device=v.device, dtype=torch.float32) if output_final_state else absent(v)
    if not triton_runs(v.device):
        return (o, ht, *(absent(v) for _ in Intra._fields[:-1]))
    # the buffers' dtypes do not depend on the TF32 setting (only the dot precisions do)
    it = intra_buffers(B, T, HV, K, V, chunk_size, plan(B, T, HV, K, V, chunk_size, v.dtype, v.is_cuda),
                       store_mkk, v.device)
    return (o, ht, *it[:-2], absent(v) if it.mkk is None else it.mkk)


def _backward(q, k, v, g, beta, h0, it: Intra, do, dht, scale: float, C: int, bounded: bool = True):
    """The Triton backward: (dq, dk, dv, dg, dbeta, dh0 or absent)."""
    # the kernels index dense [B, T, heads, X] rows (chunk_kda passes contiguous inputs: no copies then)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = None if h0 is None else h0.contiguous()
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    p = plan(B, T, HV, K, V, C, v.dtype, v.is_cuda, torch_allows_tf32(), bounded)
    do = do.contiguous()
    dht = None if dht is None else dht.contiguous().float()
    launch.configure()
    if q.is_cuda:
        # the re-scan (S_n, Vn) and the reverse scan (dS_n, dVn) do not read each other's outputs: the
        # re-scan on a side stream lets the two sequential kernels share the GPU (fwd+bwd 5.962 -> 5.475 ms
        # at B1 T16384 H16 K=V=128)
        main = torch.cuda.current_stream(q.device)
        side = _side_stream(q.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _, _, h, vn = kda_fwd_state(it, B, T, HV, C, h0, p.scan_prec)
        h.record_stream(main)    # made on the side stream, read on the main one
        vn.record_stream(main)
    else:
        _, _, h, vn = kda_fwd_state(it, B, T, HV, C, h0, p.scan_prec)
    dh, dvn, dh0 = kda_bwd_state(it, do, dht, B, T, HV, C, h0 is not None, p.prec)
    if q.is_cuda:
        main.wait_stream(side)
    dq, dk, dv, dg, dbeta = kda_bwd_intra(q, k, v, g, beta, do, it, (h, vn, dh, dvn), scale, C, p.prec, bounded)
    if HV != H:
        # GVA: value head hv used q/k head hv // G, so sum each group's gradients
        dq = dq.view(B, T, H, HV // H, K).sum(3).to(q.dtype)
        dk = dk.view(B, T, H, HV // H, K).sum(3).to(k.dtype)
    return dq, dk, dv, dg.to(g.dtype), dbeta.to(beta.dtype), absent(v) if dh0 is None else dh0


def _backward_reference(q, k, v, g, beta, h0, do, dht, scale: float, C: int):
    """The torch backward: autograd through `torch_chunk_kda`."""
    def fwd(q, k, v, g, beta, h0):
        return torch_chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                               chunk_size=C)
    *grads, dh0 = reference_vjp(fwd, (q, k, v, g, beta, h0), (do, dht))
    return (*grads, absent(v) if dh0 is None else dh0)


_BWD_OUT = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _chunk_kda_bwd_impl(q, k, v, g, beta, initial_state, w, u, qg, kd, eg, aqk, tm, mkk, do, dht, scale,
                        chunk_size, bounded):
    if triton_runs(v.device):
        return _backward(q, k, v, g, beta, initial_state, Intra(w, u, qg, kd, eg, aqk, tm, mkk, gc=None), do,
                         dht, scale, chunk_size, bounded)
    return _backward_reference(q, k, v, g, beta, initial_state, do, dht, scale, chunk_size)


@torch.library.custom_op("k3::chunk_kda_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def chunk_kda_bwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                     w: Tensor, u: Tensor, qg: Tensor, kd: Tensor, eg: Tensor, aqk: Tensor, tm: Tensor,
                     mkk: Tensor, do: Tensor, dht: Tensor | None, scale: float, chunk_size: int,
                     bounded: bool) -> _BWD_OUT:
    """k3::chunk_kda's backward: (dq, dk, dv, dg, dbeta, dh0), dh0 an empty fp32 tensor without an initial
    state; w .. mkk as the forward returned them (with store_mkk); dht None where no gradient reaches the
    final state."""
    return _chunk_kda_bwd_impl(q, k, v, g, beta, initial_state, w, u, qg, kd, eg, aqk, tm, mkk, do, dht, scale,
                               chunk_size, bounded)


@chunk_kda_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, w, u, qg, kd, eg, aqk, tm, mkk, do, dht, scale, chunk_size, bounded):
    dh0 = absent(v) if initial_state is None else torch.empty_like(initial_state, memory_format=torch.contiguous_format)
    return (*(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta)), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, h0, scale, chunk_size, output_final_state, store_mkk, bounded = inputs
    buffers = output[2:]
    ctx.mark_non_differentiable(*buffers, *(() if output_final_state else output[1:2]))
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, g, beta, h0, *buffers)
    ctx.scale, ctx.chunk_size, ctx.store_mkk, ctx.has_ht = scale, chunk_size, store_mkk, output_final_state
    ctx.bounded = bounded


def _autograd_backward(ctx, do, dht, *_, bwd=None):
    """The backward of k3::chunk_kda (through the op `chunk_kda_bwd_op`) and of _ChunkKDA (`bwd`)."""
    if not ctx.store_mkk:
        raise RuntimeError("k3::chunk_kda ran with store_mkk=False, which keeps nothing for a backward")
    q, k, v, g, beta, h0, *buffers = ctx.saved_tensors
    if do is None:   # only the final state reached the loss
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, dh0 = (bwd or chunk_kda_bwd_op)(q, k, v, g, beta, h0, *buffers, do,
                                                           dht if ctx.has_ht else None, ctx.scale, ctx.chunk_size,
                                                           ctx.bounded)
    return dq, dk, dv, dg, dbeta, None if h0 is None else dh0, None, None, None, None, None


chunk_kda_op.register_autograd(_autograd_backward, setup_context=_setup_context)


# eagerly: the implementations without the dispatcher and torch.library's autograd wrapper, host time a
# launch-bound call pays (docs/performance.md, the toy row); torch.compile traces the op
_ChunkKDA = eager_function("_ChunkKDA", _chunk_kda_impl, _setup_context, _autograd_backward, _chunk_kda_bwd_impl)


def _lay_out(x: Tensor, lay: VarlenLayout) -> Tensor:
    """varlen.lay_out by the Triton copy kernel."""
    return gather_rows(x[0], lay.src)[None]


def _forward_varlen(q, k, v, g, beta, h0, cu: Tensor, scale: float, C: int, output_final_state: bool,
                    keep: bool = False, bounded: bool = True):
    """The Triton forward over chunk-aligned sequences: (o [1, total_T, HV, V], final states [N, HV, K, V]); with
    `keep`, also the stage-1 buffers (`Intra`, Mkk stored, no Γ) for `_backward_varlen`. Its kernels read the
    inputs and store O in place, through the layout's token map: no copy either way."""
    lay = varlen_layout(cu, C, q.device)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = None if h0 is None else h0.contiguous()
    launch.configure()
    T, HV, V = lay.tok.numel(), v.shape[2], v.shape[3]
    p = plan(1, T, HV, q.shape[-1], V, C, v.dtype, v.is_cuda, torch_allows_tf32(), bounded)
    it = kda_fwd_intra(q, k, v, g, beta, scale, C, p, store_mkk=keep, rows=lay.tok)
    o, ht, _, _ = kda_fwd_state(it, 1, T, HV, C, h0, p.scan_prec, v.dtype, output_final_state, seqs=lay.seqs,
                                n_run=lay.n_run, rows=lay.tok, n_tokens=v.shape[1])
    return (o, ht, it._replace(gc=None)) if keep else (o, ht)


def _backward_varlen(q, k, v, g, beta, h0, cu: Tensor, do, dht, scale: float, C: int, it: Intra | None = None,
                     bounded: bool = True):
    """The Triton backward over chunk-aligned sequences, on laid-out copies of the inputs and dO. With `it` (the
    forward's stage-1 buffers, eagerly) it runs no stage 1; without, stage 1 is recomputed (the op's path: its
    buffers have the layout's data-dependent length, so the forward op cannot return them)."""
    lay = varlen_layout(cu, C, q.device)
    q, k, v, g, beta, do = (_lay_out(x, lay) for x in (q, k, v, g, beta, do))
    h0 = None if h0 is None else h0.contiguous()
    dht = None if dht is None else dht.contiguous().float()
    launch.configure()
    _, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    p = plan(1, T, HV, K, V, C, v.dtype, v.is_cuda, torch_allows_tf32(), bounded)
    if it is None:
        it = kda_fwd_intra(q, k, v, g, beta, scale, C, p, store_mkk=True)
    _, _, h, vn = kda_fwd_state(it, 1, T, HV, C, h0, p.scan_prec, seqs=lay.seqs, n_run=lay.n_run)
    dh, dvn, dh0 = kda_bwd_state(it, do, dht, 1, T, HV, C, h0 is not None, p.prec, seqs=lay.seqs,
                                 n_run=lay.n_run)
    dq, dk, dv, dg, dbeta = kda_bwd_intra(q, k, v, g, beta, do, it, (h, vn, dh, dvn), scale, C, p.prec, bounded)
    if HV != H:
        dq = dq.view(1, T, H, HV // H, K).sum(3).to(q.dtype)
        dk = dk.view(1, T, H, HV // H, K).sum(3).to(k.dtype)
    grads = (gather_rows(x[0], lay.dst, like.dtype)[None] for x, like in zip((dq, dk, dv, dg, dbeta), (q, k, v, g, beta)))
    return (*grads, absent(v) if dh0 is None else dh0)


@torch.library.custom_op("k3::chunk_kda_varlen", mutates_args=(), device_types=("cuda", "cpu"))
def chunk_kda_varlen_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                        cu_seqlens: Tensor, scale: float, chunk_size: int,
                        output_final_state: bool, reference: bool = False,
                        bounded: bool = True) -> tuple[Tensor, Tensor]:
    """(o, final states [N, HV, K, V] or an empty fp32 tensor) of the sequences cu_seqlens cuts [1, total_T]
    into; inputs as `chunk_kda`'s, already checked, gated and normed. cu_seqlens is read on the host.
    `reference`: the torch implementation on any device and chunk size (the KDA layer's CPU path under
    torch.compile, which cannot trace its cu_seqlens-dependent shapes). `bounded`: every g >= -5 (`plan`)."""
    return _chunk_kda_varlen_impl(q, k, v, g, beta, initial_state, cu_seqlens, scale, chunk_size,
                                  output_final_state, reference, bounded=bounded)


def _chunk_kda_varlen_impl(q, k, v, g, beta, initial_state, cu_seqlens, scale, chunk_size, output_final_state,
                           reference=False, bounded=True, keep=False):
    """The op's (o, ht); with `keep` (Triton path only) also `_forward_varlen`'s stage-1 buffers."""
    kept = ()
    if triton_runs(v.device) and not reference:
        o, ht, *kept = _forward_varlen(q, k, v, g, beta, initial_state, cu_seqlens, scale, chunk_size,
                                       output_final_state, keep, bounded)
    else:
        o, ht = torch_chunk_kda_varlen(q, k, v, g, beta, cu_seqlens, scale, initial_state, output_final_state,
                                       chunk_size)
        o = o.contiguous()
    return (o, absent(v) if ht is None else ht.contiguous(), *kept)


@chunk_kda_varlen_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, chunk_size, output_final_state, reference=False,
      bounded=True):
    N, HV, K, V = cu_seqlens.shape[0] - 1, v.shape[2], q.shape[-1], v.shape[3]
    ht = torch.empty(N, HV, K, V, device=v.device, dtype=torch.float32) if output_final_state else absent(v)
    return torch.empty_like(v, memory_format=torch.contiguous_format), ht


@torch.library.custom_op("k3::chunk_kda_varlen_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def chunk_kda_varlen_bwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                            cu_seqlens: Tensor, do: Tensor, dht: Tensor | None, scale: float,
                            chunk_size: int, reference: bool = False, bounded: bool = True) -> _BWD_OUT:
    """k3::chunk_kda_varlen's backward: (dq, dk, dv, dg, dbeta, dh0 [N, HV, K, V] or an empty fp32 tensor)."""
    return _chunk_kda_varlen_bwd_impl(q, k, v, g, beta, initial_state, cu_seqlens, do, dht, scale, chunk_size,
                                      reference, bounded)


def _chunk_kda_varlen_bwd_impl(q, k, v, g, beta, initial_state, cu_seqlens, do, dht, scale, chunk_size,
                               reference=False, bounded=True):
    if triton_runs(v.device) and not reference:
        return _backward_varlen(q, k, v, g, beta, initial_state, cu_seqlens, do, dht, scale, chunk_size,
                                bounded=bounded)

    def fwd(q, k, v, g, beta, h0):
        return torch_chunk_kda_varlen(q, k, v, g, beta, cu_seqlens, scale, h0, True, chunk_size)
    *grads, dh0 = reference_vjp(fwd, (q, k, v, g, beta, initial_state), (do, dht))
    return (*grads, absent(v) if dh0 is None else dh0)


@chunk_kda_varlen_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, do, dht, scale, chunk_size, reference=False, bounded=True):
    dh0 = absent(v) if initial_state is None else torch.empty_like(initial_state, memory_format=torch.contiguous_format)
    return (*(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta)), dh0)


def _setup_varlen(ctx, inputs, output, saved=None):
    """Saves the inputs, or `saved` (_ChunkKDAVarlen's laid-out inputs and buffers)."""
    q, k, v, g, beta, h0, cu_seqlens, scale, chunk_size, output_final_state, reference, bounded = inputs
    if not output_final_state:
        ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*(saved or (q, k, v, g, beta, h0, cu_seqlens)))
    ctx.scale, ctx.chunk_size, ctx.has_ht, ctx.reference = scale, chunk_size, output_final_state, reference
    ctx.bounded = bounded


def _varlen_autograd_backward(ctx, do, dht, bwd=None):
    """The backward of k3::chunk_kda_varlen (through its backward op) and of _ChunkKDAVarlen (`bwd`)."""
    q, k, v, g, beta, h0, cu_seqlens = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, dh0 = (bwd or chunk_kda_varlen_bwd_op)(q, k, v, g, beta, h0, cu_seqlens, do,
                                                                  dht if ctx.has_ht else None, ctx.scale,
                                                                  ctx.chunk_size, ctx.reference, ctx.bounded)
    return dq, dk, dv, dg, dbeta, None if h0 is None else dh0, None, None, None, None, None, None


chunk_kda_varlen_op.register_autograd(_varlen_autograd_backward, setup_context=_setup_varlen)


class _ChunkKDAVarlen(torch.autograd.Function):
    """k3::chunk_kda_varlen's eager autograd (as _ChunkKDA is k3::chunk_kda's), which also keeps what the op
    cannot: on the Triton path, when a backward will run, the stage-1 buffers, so that the backward does not
    recompute stage 1 (README.md §9)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cu_seqlens, scale, chunk_size, output_final_state, reference, bounded):
        inputs = (q, k, v, g, beta, h0, cu_seqlens, scale, chunk_size, output_final_state, reference, bounded)
        ctx.keep = triton_runs(v.device) and not reference and any(ctx.needs_input_grad[:6])
        o, ht, *kept = _chunk_kda_varlen_impl(*inputs, keep=ctx.keep)
        saved = None
        if ctx.keep:
            saved = (q, k, v, g, beta, h0, cu_seqlens, *kept[0][:-1])
        _setup_varlen(ctx, inputs, (o, ht), saved)
        ctx.o_shape = o.shape
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        if not ctx.keep:
            return _varlen_autograd_backward(ctx, do, dht, bwd=_chunk_kda_varlen_bwd_impl)
        q, k, v, g, beta, h0, cu_seqlens, *buffers = ctx.saved_tensors
        if do is None:   # only the final states reached the loss
            do = v.new_zeros(ctx.o_shape)
        dq, dk, dv, dg, dbeta, dh0 = _backward_varlen(q, k, v, g, beta, h0, cu_seqlens, do,
                                                      dht if ctx.has_ht else None, ctx.scale, ctx.chunk_size,
                                                      Intra(*buffers, gc=None), ctx.bounded)
        return dq, dk, dv, dg, dbeta, None if h0 is None else dh0, None, None, None, None, None, None


def check_cu_seqlens(op: str, cu_seqlens, q: Tensor, initial_state, HV: int, V: int) -> None:
    """cu_seqlens: int32 / int64, [N + 1], 0 = cu[0] <= cu[1] <= ... <= cu[N] = total_T, with B = 1 inputs and an
    initial_state of [N, HV, K, V]. Reads cu_seqlens (a device read when it lives on the GPU), except while
    torch.compile traces, where only its dtype and shape are checked."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"{op}: cu_seqlens must be a tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: cu_seqlens dtype {cu_seqlens.dtype} must be torch.int32 or torch.int64")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{op}: cu_seqlens shape {tuple(cu_seqlens.shape)} must be [N + 1] with N >= 1")
    batch, total, K = q.shape[0], q.shape[1], q.shape[-1]
    if batch != 1:
        raise ValueError(f"{op}: with cu_seqlens the inputs must be flattened to B = 1, got B = {batch}")
    N = cu_seqlens.shape[0] - 1
    if not torch.compiler.is_compiling():
        # vectorised: the training layers pass B·T + 1 entries per KDA layer and step (0.7 ms as a list)
        first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
        if first != 0 or last != total:
            raise ValueError(f"{op}: cu_seqlens must start at 0 and end at total_T = {total}, got {first} .. {last}")
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError(f"{op}: cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}"[:300])
    if initial_state is not None:
        check_tensor(op, "initial_state", initial_state, 4, q.device, (torch.float32,), ref="q")
        if initial_state.shape != (N, HV, K, V):
            raise ValueError(f"{op}: initial_state shape {tuple(initial_state.shape)} must be "
                             f"(N, HV, K, V) = {(N, HV, K, V)} with cu_seqlens")


def _validate(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias, lower_bound,
              chunk_size, cu_seqlens=None):
    check_kda_inputs("chunk_kda", q, k, v, g, beta, scale, None if cu_seqlens is not None else initial_state,
                     use_gate_in_kernel, A_log, dt_bias, lower_bound, same_dtype=True)
    if cu_seqlens is not None:
        check_cu_seqlens("chunk_kda", cu_seqlens, q, initial_state, v.shape[2], v.shape[3])
    if chunk_size not in _CHUNK_SIZES:
        raise ValueError(f"chunk_kda: chunk_size={chunk_size} must be one of {_CHUNK_SIZES}")


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
              lower_bound=-5.0, chunk_size=64, cu_seqlens=None):
    """Chunked Kimi Delta Attention (docs/math.md §2.2) with Triton forward and backward: the custom ops
    `k3::chunk_kda` / `k3::chunk_kda_bwd` under torch.compile, their implementations directly when eager
    (README.md, "Custom ops").

    Args:
        q, k: [B, T, H, K] (fp32 / fp16 / bf16, one dtype with v); v: [B, T, HV, V], HV = G * H.
        g: [B, T, HV, K] per-step log-decay <= 0, or the raw gate input g_raw when use_gate_in_kernel (then
            A_log [HV], dt_bias [HV, K] apply the gate of §2.3 that lower_bound names).
        lower_bound: L in [-5, 0): g >= -5 per step (the lower-bound gate L·sigmoid(..) with
            use_gate_in_kernel), which the fast intra-chunk scores need (below -5 their anchored exponents
            overflow: inf / NaN, unchecked since checking would read the data). None: any g <= 0 (with
            use_gate_in_kernel the softplus gate -exp(A_log)·softplus(..)): the diagonal score blocks are
            formed pair by pair, exact for any decay (README.md "Exponents").
        beta: [B, T, HV] write strength (already through its sigmoid), in [0, 1].
        scale: query scale, default K ** -0.5.
        initial_state: [B, HV, K, V] fp32 or None.
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6) before the recurrence. Without it the keys
            must keep β‖k‖² <= 2, else the state grows geometrically (in any dtype, the reference too).
        cu_seqlens: int32 / int64 [N + 1], 0 = cu[0] < ... < cu[N] = T, or None: the B = 1 inputs hold N
            independent sequences [cu[i], cu[i+1]); each starts from initial_state[i] (then [N, HV, K, V]) or
            zeros and ends in its own final state (returned [N, HV, K, V]), as if run alone. Read on the host:
            keep it on the CPU to spare a device read (README.md, "Variable-length sequences").
    Every tensor on q's device; any strides (dense copies are made once); B, T, H, HV, V >= 1: empty inputs,
    wrong ranks, shapes, dtypes or devices raise a ValueError naming the argument (README.md, "Input
    contract").
    Returns:
        o [B, T, HV, V] in v.dtype, final state [B, HV, K, V] fp32 (or None).
    """
    _validate(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias, lower_bound,
              chunk_size, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    bounded = lower_bound is not None
    if use_qk_l2norm_in_kernel:
        # dense first: torch's reduction order (so the rounding) depends on the layout, the kernels' does not
        q, k = l2norm(q.contiguous()), l2norm(k.contiguous())
    if use_gate_in_kernel:
        from k3cli.ops.kda.gate import kda_gate
        g = kda_gate(g, A_log, dt_bias, lower_bound=lower_bound, chunk_size=chunk_size, cumsum=False)
    # contiguous here, so that the copies (of the short convs' transposed outputs) are the ones saved
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    # eagerly the ops' implementations under a plain autograd.Function (less host time per call)
    eager = not torch.compiler.is_compiling()
    if cu_seqlens is not None:
        varlen = _ChunkKDAVarlen.apply if eager else chunk_kda_varlen_op
        o, ht = varlen(q, k, v, g, beta, initial_state, cu_seqlens, scale, chunk_size, output_final_state, False,
                       bounded)
        return o, ht if output_final_state else None
    # Mkk is stored for the backward only: the op cannot see whether autograd will need one
    store_mkk = torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                                for x in (q, k, v, g, beta, initial_state))
    o, ht, *_ = (_ChunkKDA.apply if eager else chunk_kda_op)(q, k, v, g, beta, initial_state, scale, chunk_size,
                                                             output_final_state, store_mkk, bounded)
    return o, ht if output_final_state else None
