"""Fused recurrent KDA for decoding (docs/math.md §2.1, §2.5): a few tokens per call on a cached fp32 state.

One program per (value block, batch * value head) keeps its [K, BV] slice of the state in registers
and walks the T tokens: optional L2 norm of q, k and the lower-bound gate (§2.3) in-kernel, then
decay, delta write, read. Columns of S are independent (p = Sᵀk is per value column), so splitting
V over programs needs no reduction across them.

The kernel is forward only (decode is inference): the custom op `k3::fused_recurrent_kda` registers as
its backward `k3::fused_recurrent_kda_bwd`, autograd through the torch reference (`naive_recurrent_kda`
plus the torch gate / L2 norm); `inplace_state` (`k3::fused_recurrent_kda_inplace`) is refused under
grad. On CPU without the interpreter the forward is that reference too (README.md, "Custom ops").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3cli.ops.custom import absent, eager_function, reference_vjp, triton_runs
from k3cli.ops.kda.checks import check_kda_inputs
from k3cli.ops.kda.chunk_fwd import interpreting, pick_configs
from k3cli.ops.kda.gate import softplus
from k3cli.ops.norm import l2norm

# The one tolerance table of this op (its tests and verify): relative RMS error of o and the final
# state against the fp32 recurrence fed the same inputs, by input dtype. fp32: summation order only;
# half: o is stored in the input dtype, whose rounding dominates (bf16 bound, fp16 has 3 more bits).
TOL = {torch.float32: 1e-5, torch.bfloat16: 0.02, torch.float16: 0.02}

# autotuned: narrow value blocks give the small-batch case B*HV*V/BV programs, wide ones give large
# batches (B = 256) fewer, longer-lived programs
CONFIGS = [triton.Config({"BV": bv}, num_warps=nw) for bv in (32, 16, 64, 128) for nw in (4, 2, 1, 8)]


def prune_configs(configs, named_args, **kwargs):
    """Clamp BV to the padded value width and drop the duplicates that clamping makes."""
    V = named_args.get("V", kwargs.get("V"))
    cap = max(16, triton.next_power_of_2(V))
    out, seen = [], set()
    for c in configs:
        key = (min(c.kwargs["BV"], cap), c.num_warps)
        if key not in seen:
            seen.add(key)
            out.append(triton.Config({"BV": key[0]}, num_warps=key[1]))
    return out


_tuning_copy: dict[str, torch.Tensor] = {}


def _save_state(kwargs, reset_only=False):
    # autotuning reruns the kernel: an in-place state (ht is h0) must be restored between trials;
    # triton's restore_value cannot skip h0 = None
    if not reset_only and kwargs.get("h0") is not None:
        _tuning_copy["h0"] = kwargs["h0"].clone()


def _restore_state(kwargs, exception):
    saved = _tuning_copy.pop("h0", None)
    if saved is not None:
        kwargs["h0"].copy_(saved)


@triton.jit
def _step(q, k, v, g, beta, o, b_h, b_rate, b_bias, scale, lower_bound, i_b, i_h, i_hv, t, T, o_k, o_v,
          m_k, m_v, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
          USE_QK_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """One token: (gate,) decay, delta write, read; returns the updated [BK, BV] state."""
    i_bt = (i_b * T + t).to(tl.int64)
    b_q = tl.load(q + (i_bt * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_k = tl.load(k + (i_bt * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_v = tl.load(v + (i_bt * HV + i_hv) * V + o_v, mask=m_v, other=0.).to(tl.float32)
    b_g = tl.load(g + (i_bt * HV + i_hv) * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_beta = tl.load(beta + i_bt * HV + i_hv).to(tl.float32)
    if USE_QK_L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    if USE_GATE:
        if HAS_DT_BIAS:
            b_g = b_g + b_bias
        if SOFTPLUS:
            b_g = tl.where(m_k, -b_rate * softplus(b_g), 0.)
        else:
            b_g = tl.where(m_k, lower_bound * tl.sigmoid(b_rate * b_g), 0.)
    b_h *= tl.exp(b_g)[:, None]
    # delta rule: write the residual of the decayed state's prediction for k
    b_p = tl.sum(b_h * b_k[:, None], 0)
    b_h += b_k[:, None] * (b_beta * (b_v - b_p))[None, :]
    b_o = tl.sum(b_h * (b_q * scale)[:, None], 0)
    tl.store(o + (i_bt * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    return b_h


@triton.autotune(configs=pick_configs(CONFIGS), key=["K", "V", "NBH"],
                 prune_configs_by={"early_config_prune": prune_configs},
                 pre_hook=_save_state, post_hook=_restore_state)
@triton.jit
def _fused_recurrent_kda_fwd_kernel(q, k, v, g, beta, o, h0, ht, a_log, dt_bias, scale, lower_bound,
                                    T, NBH,
                                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                                    BK: tl.constexpr, BV: tl.constexpr,
                                    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
                                    USE_QK_L2NORM: tl.constexpr, USE_GATE: tl.constexpr,
                                    HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, INTERPRET: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    # GVA: value head hv reads q/k head hv // G
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_state = i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + p_state, mask=m_kv, other=0.)
    b_rate = 1.
    b_bias = tl.zeros([BK], dtype=tl.float32)
    if USE_GATE:
        b_rate = tl.exp(tl.load(a_log + i_hv).to(tl.float32))
        if HAS_DT_BIAS:
            b_bias = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.).to(tl.float32)
    if INTERPRET:
        # the interpreter cannot take a runtime bound in range() with numpy >= 2.4 (as in chunk_fwd.py)
        t = 0
        while t < T:
            b_h = _step(q, k, v, g, beta, o, b_h, b_rate, b_bias, scale, lower_bound, i_b, i_h, i_hv, t, T,
                        o_k, o_v, m_k, m_v, H, HV, K, V, USE_QK_L2NORM, USE_GATE, HAS_DT_BIAS, SOFTPLUS)
            t += 1
    else:
        for t in range(T):
            b_h = _step(q, k, v, g, beta, o, b_h, b_rate, b_bias, scale, lower_bound, i_b, i_h, i_hv, t, T,
                        o_k, o_v, m_k, m_v, H, HV, K, V, USE_QK_L2NORM, USE_GATE, HAS_DT_BIAS, SOFTPLUS)
    if STORE_FINAL_STATE:
        tl.store(ht + p_state, b_h, mask=m_kv)


def fused_recurrent_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                            use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                            inplace_state):
    """Launch the kernel on validated inputs. Returns (o [B, T, HV, V] in v.dtype, state or None)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = torch.empty_like(v)
    if inplace_state:
        ht = initial_state
    elif output_final_state:
        ht = torch.empty(B, HV, K, V, device=q.device, dtype=torch.float32)
    else:
        ht = None
    h0 = initial_state
    if h0 is not None and not inplace_state:
        h0 = h0.contiguous()
    if use_gate_in_kernel:
        A_log = A_log.contiguous()
        dt_bias = None if dt_bias is None else dt_bias.contiguous()
    BK = triton.next_power_of_2(K)

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), B * HV)

    _fused_recurrent_kda_fwd_kernel[grid](
        q, k, v, g, beta, o, h0, ht, A_log, dt_bias, float(scale), float(lower_bound or 0.), T, B * HV,
        H=H, HV=HV, K=K, V=V, BK=BK,
        USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=ht is not None,
        USE_QK_L2NORM=use_qk_l2norm_in_kernel, USE_GATE=use_gate_in_kernel,
        HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=lower_bound is None, INTERPRET=interpreting(q))
    return o, ht


def _validate(q, k, v, g, beta, scale, initial_state, output_final_state, use_gate_in_kernel, A_log,
              dt_bias, lower_bound, inplace_state):
    check_kda_inputs("fused_recurrent_kda", q, k, v, g, beta, scale, initial_state, use_gate_in_kernel,
                     A_log, dt_bias, lower_bound, same_dtype=False)
    if inplace_state:
        if initial_state is None:
            raise ValueError("fused_recurrent_kda: inplace_state=True needs an initial_state to update")
        if not initial_state.is_contiguous():
            raise ValueError("fused_recurrent_kda: inplace_state=True needs a contiguous initial_state")


def _reference(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
               use_gate_in_kernel, A_log, dt_bias, lower_bound):
    """The same computation in torch (differentiable): the torch l2norm and gate, then the recurrence."""
    from k3cli.ops.kda.naive import naive_kda_gate, naive_recurrent_kda

    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        g = naive_kda_gate(g, A_log, dt_bias, lower_bound)
    return naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state)


def _forward(q, k, v, g, beta, h0, A_log, dt_bias, scale, lower_bound, output_final_state, l2norm_in, gate_in):
    if triton_runs(q.device):
        o, ht = fused_recurrent_kda_fwd(q, k, v, g, beta, scale, h0, output_final_state, l2norm_in, gate_in, A_log,
                                        dt_bias, lower_bound, inplace_state=False)
    else:
        o, ht = _reference(q, k, v, g, beta, scale, h0, output_final_state, l2norm_in, gate_in, A_log, dt_bias,
                           lower_bound)
        o, ht = o.contiguous(), None if ht is None else ht.contiguous()
    return o, absent(v) if ht is None else ht


@torch.library.custom_op("k3::fused_recurrent_kda", mutates_args=(), device_types=("cuda", "cpu"))
def fused_recurrent_kda_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                           A_log: Tensor | None, dt_bias: Tensor | None, scale: float, lower_bound: float | None,
                           output_final_state: bool, use_qk_l2norm_in_kernel: bool,
                           use_gate_in_kernel: bool) -> tuple[Tensor, Tensor]:
    """`fused_recurrent_kda` on checked inputs: (o, final state), the state an empty fp32 tensor unless
    output_final_state. The Triton kernel on CUDA and under the interpreter, else `_reference`."""
    return _forward(q, k, v, g, beta, initial_state, A_log, dt_bias, scale, lower_bound, output_final_state,
                    use_qk_l2norm_in_kernel, use_gate_in_kernel)


@fused_recurrent_kda_op.register_fake
def _(q, k, v, g, beta, initial_state, A_log, dt_bias, scale, lower_bound, output_final_state, l2norm_in, gate_in):
    B, HV, K, V = q.shape[0], v.shape[2], q.shape[3], v.shape[3]
    o = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    return o, torch.empty(B, HV, K, V, device=v.device, dtype=torch.float32) if output_final_state else absent(v)


@torch.library.custom_op("k3::fused_recurrent_kda_inplace", mutates_args=("state",), device_types=("cuda", "cpu"))
def fused_recurrent_kda_inplace_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                                   A_log: Tensor | None, dt_bias: Tensor | None, scale: float, lower_bound: float | None,
                                   use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool) -> Tensor:
    """The decode step on a cached state: o, with `state` (contiguous fp32) advanced over the T tokens in
    place. No autograd (`fused_recurrent_kda` refuses inplace_state under grad)."""
    return _inplace_impl(q, k, v, g, beta, state, A_log, dt_bias, scale, lower_bound, use_qk_l2norm_in_kernel,
                         use_gate_in_kernel)


def _inplace_impl(q, k, v, g, beta, state, A_log, dt_bias, scale, lower_bound, use_qk_l2norm_in_kernel,
                  use_gate_in_kernel):
    if triton_runs(q.device):
        return fused_recurrent_kda_fwd(q, k, v, g, beta, scale, state, True, use_qk_l2norm_in_kernel,
                                       use_gate_in_kernel, A_log, dt_bias, lower_bound, inplace_state=True)[0]
    o, ht = _reference(q, k, v, g, beta, scale, state, True, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log,
                       dt_bias, lower_bound)
    state.copy_(ht)
    return o.contiguous()


@fused_recurrent_kda_inplace_op.register_fake
def _(q, k, v, g, beta, state, A_log, dt_bias, scale, lower_bound, l2norm_in, gate_in):
    return torch.empty(v.shape, device=v.device, dtype=v.dtype)


_BWD_OUT = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@torch.library.custom_op("k3::fused_recurrent_kda_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def fused_recurrent_kda_bwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Tensor | None, A_log: Tensor | None, dt_bias: Tensor | None,
                               do: Tensor | None, dht: Tensor | None, scale: float, lower_bound: float | None,
                               use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool) -> _BWD_OUT:
    """k3::fused_recurrent_kda's backward, on every device by autograd through `_reference` (decode has no
    Triton backward): (dq, dk, dv, dg, dbeta, dh0, dA_log, d dt_bias), empty fp32 tensors for absent inputs."""
    return _bwd_impl(q, k, v, g, beta, initial_state, A_log, dt_bias, do, dht, scale, lower_bound,
                     use_qk_l2norm_in_kernel, use_gate_in_kernel)


@fused_recurrent_kda_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, A_log, dt_bias, do, dht, scale, lower_bound, l2norm_in, gate_in):
    return tuple(absent(v) if x is None else torch.empty(x.shape, device=x.device, dtype=x.dtype)
                 for x in (q, k, v, g, beta, initial_state, A_log, dt_bias))


def _setup_context(ctx, inputs, output):
    *tensors, scale, lower_bound, output_final_state, l2norm_in, gate_in = inputs
    if not output_final_state:
        ctx.mark_non_differentiable(output[1])   # the empty stand-in
    ctx.save_for_backward(*tensors)
    ctx.args, ctx.has_ht = (scale, lower_bound, l2norm_in, gate_in), output_final_state
    ctx.set_materialize_grads(False)


def _bwd_impl(q, k, v, g, beta, initial_state, A_log, dt_bias, do, dht, scale, lower_bound, use_qk_l2norm_in_kernel,
              use_gate_in_kernel):
    def fwd(q, k, v, g, beta, h0, A_log, dt_bias):
        return _reference(q, k, v, g, beta, scale, h0, True, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log,
                          dt_bias, lower_bound)
    grads = reference_vjp(fwd, (q, k, v, g, beta, initial_state, A_log, dt_bias), (do, dht))
    return tuple(absent(v) if d is None else d for d in grads)


def _autograd_backward(ctx, do, dht, bwd=None):
    """The backward of k3::fused_recurrent_kda (through its backward op) and of _FusedRecurrentKDA (`bwd`)."""
    tensors = ctx.saved_tensors
    grads = (bwd or fused_recurrent_kda_bwd_op)(*tensors, do, dht if ctx.has_ht else None, *ctx.args)
    return (*(None if x is None else d for x, d in zip(tensors, grads)), None, None, None, None, None)


fused_recurrent_kda_op.register_autograd(_autograd_backward, setup_context=_setup_context)
# eagerly without the dispatcher, as chunk_kda (README.md, "Custom ops"): a decode step is host-bound
_FusedRecurrentKDA = eager_function("_FusedRecurrentKDA", _forward, _setup_context, _autograd_backward, _bwd_impl)


def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                        lower_bound=-5.0, inplace_state=False):
    """Recurrent Kimi Delta Attention (docs/math.md §2.1) in one Triton launch, for decoding.

    Through the custom op `k3::fused_recurrent_kda` (`k3::fused_recurrent_kda_inplace` with inplace_state)
    under torch.compile; eagerly their implementations, without the dispatcher.
    Its backward differentiates the torch reference by autograd (slow: decode is inference); under grad
    mode with an input that requires grad, `inplace_state` is an error.

    Args:
        q, k: [B, T, H, K] (fp32 / fp16 / bf16); v: [B, T, HV, V], HV = G * H (value head hv uses
            q/k head hv // G).
        g: [B, T, HV, K] per-step log-decay (<= 0), or the raw gate input g_raw when
            use_gate_in_kernel (then g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias)), or with
            lower_bound None the softplus gate g = -exp(A_log) * softplus(g_raw + dt_bias)).
        beta: [B, T, HV] write strength (already through its sigmoid).
        scale: query scale, default K ** -0.5.
        initial_state: [B, HV, K, V] fp32 or None (zeros).
        output_final_state: return the state after the T tokens.
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6) in the kernel.
        A_log: [HV]; dt_bias: [HV, K] or None; lower_bound: L in [-5, 0), or None (the softplus gate).
        inplace_state: write the final state into initial_state (contiguous) and return it.
    Every tensor on q's device; any strides but the in-place state's; B, T, H, HV, V >= 1: empty inputs,
    wrong ranks, shapes, dtypes or devices raise a ValueError naming the argument (README.md, "Input
    contract"). Any g <= 0 stays finite here (no chunk anchoring); the keys' bound is chunk_kda's.
    Returns:
        o [B, T, HV, V] in v.dtype, final state [B, HV, K, V] fp32 (or None).
    """
    _validate(q, k, v, g, beta, scale, initial_state, output_final_state, use_gate_in_kernel, A_log,
              dt_bias, lower_bound, inplace_state)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    A_log, dt_bias = (A_log, dt_bias) if use_gate_in_kernel else (None, None)
    args = (A_log, dt_bias, scale, None if lower_bound is None else float(lower_bound))
    eager = not torch.compiler.is_compiling()   # eagerly the implementations, not the ops
    flags = (bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel))
    if inplace_state:
        tensors = (q, k, v, g, beta, initial_state, A_log, dt_bias)
        if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
            raise ValueError("fused_recurrent_kda: inplace_state=True cannot be differentiated; call it "
                             "under torch.no_grad() (decode) or pass inplace_state=False")
        step = _inplace_impl if eager else fused_recurrent_kda_inplace_op
        return step(q, k, v, g, beta, initial_state, *args, *flags), initial_state
    fwd = _FusedRecurrentKDA.apply if eager else fused_recurrent_kda_op
    o, ht = fwd(q, k, v, g, beta, initial_state, *args, bool(output_final_state), *flags)
    return o, ht if output_final_state else None
