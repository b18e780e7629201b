"""The KDA layer (docs/math.md §2.4): projections, short convs, lower-bound gate, chunked KDA, gated output.

The op itself lives in k3cli/ops/kda (Triton `chunk_kda` on CUDA, `torch_chunk_kda` otherwise); this
file only prepares its inputs. Short conv and the output gate are switchable (the seeds mark both as
differing from the seeds: they come from Kimi Linear / K3).

Decode (docs/math.md §2.5): with a `KDACache`, the first call (prefill) runs the chunked op and keeps its
final state plus the last short_conv − 1 conv inputs; later calls run the recurrence on that state
(`fused_recurrent_kda` on the Triton backend, `naive_recurrent_kda` otherwise).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3cli.layers.linear import fused_linear
from k3cli.layers.norm import RMSNorm, l2norm
from k3cli.layers.segments import Segments
from k3cli.ops.backend import kda_triton_op


def _dt_bias_init(n: int, dt_min: float = 1e-3, dt_max: float = 0.1) -> torch.Tensor:
    """inverse-softplus of dt ~ log-uniform[dt_min, dt_max] (the Mamba / fla KDA init).

    With A_log = 0 this starts the per-step decay g = -5·sigmoid(dt_bias) spread over roughly
    (-0.5, -0.005): a mix of fast and slow channels instead of one uniform -2.5 decay.
    """
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return dt + torch.log(-torch.expm1(-dt))


def _short_conv(x: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv + SiLU. x [B, T, C], weight [C, 1, n] -> [B, T, C]. With `pos` [B, T] (each
    token's position in its document) a tap j steps back is used only where pos >= j: no document reads the
    one before it. Eagerly and without `pos`, F.conv1d (forward+backward 1.8x faster than the shifted sum
    on CPU at [4, 2048, 1024]); otherwise a sum of shifted rows, which torch.compile fuses into one pass
    (cuDNN's depthwise conv and its transposes took 16 of 113 ms of a compiled k3-0.5b step on an H200)."""
    n = weight.shape[-1]
    if pos is None and not torch.compiler.is_compiling():
        y = F.conv1d(F.pad(x.transpose(1, 2), (n - 1, 0)), weight, groups=x.shape[-1])   # (B, C, T)
        return F.silu(y.transpose(1, 2))
    w = weight[:, 0]                                                                   # (C, n)
    y = x * w[:, n - 1]
    for j in range(1, n):
        back = F.pad(x, (0, 0, j, 0))[:, :x.shape[1]]                                  # x_{t−j}, zeros before 0
        tap = back * w[:, n - 1 - j]
        y = y + (tap if pos is None else tap * (pos >= j).unsqueeze(-1).to(x.dtype))
    # bf16 x times the fp32 weight computes in fp32; the output keeps x's dtype, as conv1d under autocast
    return F.silu(y).to(x.dtype)


def _short_conv_step(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None):
    """Causal conv + SiLU continuing from the previous inputs. x [B, T, C]; window [B, n − 1, C] (the
    last n − 1 inputs before x, zeros at the sequence start, None = start) -> (y [B, T, C], new window)."""
    n = weight.shape[-1]
    if window is None:
        window = x.new_zeros(x.shape[0], n - 1, x.shape[-1])
    xs = torch.cat([window, x], dim=1)                                              # (B, n − 1 + T, C)
    y = F.conv1d(xs.transpose(1, 2), weight, groups=x.shape[-1])                    # (B, C, T)
    return F.silu(y.transpose(1, 2)), xs[:, xs.shape[1] - (n - 1):]


@dataclass
class KDACache:
    """Decode cache of one KDA layer (docs/math.md §2.5); all None before prefill.

    state: [B, HV, K, V] fp32 (fp64 for an fp64 model); conv_q, conv_k: [B, n − 1, H·K] and
    conv_v: [B, n − 1, HV·V], the last n − 1 = short_conv − 1 inputs of each short conv.
    """
    state: torch.Tensor | None = None
    conv_q: torch.Tensor | None = None
    conv_k: torch.Tensor | None = None
    conv_v: torch.Tensor | None = None


GATES = ("lower_bound", "softplus")


class KDAAttention(nn.Module):
    """Kimi Delta Attention layer with GVA (HV = G·H value heads). No linear biases.

    Parameters: q_proj D→H·K, k_proj D→H·K, v_proj D→HV·V; if short_conv = n > 0 depthwise
    q_conv [H·K,1,n], k_conv [H·K,1,n], v_conv [HV·V,1,n]; f_a D→K, f_b K→HV·K (low-rank gate);
    b_proj D→HV; A_log [HV]; dt_bias [HV·K]; if output_gate g_a D→V, g_b V→HV·V;
    o_norm [V] (shared by all heads); o_proj HV·V→D.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, short_conv: int = 4, output_gate: bool = True,
                 lower_bound: float = -5.0, chunk_size: int = 64, backend: str = "auto",
                 norm_eps: float = 1e-6, gate: str = "lower_bound"):
        super().__init__()
        D, H, HV, K, V = hidden_size, num_heads, num_v_heads, head_k_dim, head_v_dim
        if HV % H:
            raise ValueError(f"num_v_heads ({HV}) must be a multiple of num_heads ({H})")
        self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim = H, HV, K, V
        if gate not in GATES:
            raise ValueError(f"unknown KDA gate '{gate}'; valid: {', '.join(GATES)}")
        self.lower_bound, self.chunk_size, self.backend, self.gate = lower_bound, chunk_size, backend, gate
        # what the kernels take: the lower-bound gate's L, or None for the softplus gate (unbounded decay)
        self.kernel_bound = None if gate == "softplus" else lower_bound
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, HV * V, bias=False)
        self.short_conv = short_conv
        if short_conv > 0:
            self.q_conv = nn.Conv1d(H * K, H * K, short_conv, groups=H * K, bias=False)
            self.k_conv = nn.Conv1d(H * K, H * K, short_conv, groups=H * K, bias=False)
            self.v_conv = nn.Conv1d(HV * V, HV * V, short_conv, groups=HV * V, bias=False)
        self.f_a = nn.Linear(D, K, bias=False)
        self.f_b = nn.Linear(K, HV * K, bias=False)
        self.b_proj = nn.Linear(D, HV, bias=False)
        # A_log = 0 → rate 1 (docs/math.md §2.3); A_log and dt_bias take no weight decay
        self.A_log = nn.Parameter(torch.zeros(HV))
        self.dt_bias = nn.Parameter(_dt_bias_init(HV * K))
        self.output_gate = output_gate
        if output_gate:
            self.g_a = nn.Linear(D, V, bias=False)
            self.g_b = nn.Linear(V, HV * V, bias=False)
        self.o_norm = RMSNorm(V, norm_eps)
        self.o_proj = nn.Linear(HV * V, D, bias=False)

    def new_cache(self) -> KDACache:
        return KDACache()

    def forward(self, x: torch.Tensor, cache: KDACache | None = None, segments: Segments | None = None) -> torch.Tensor:
        """x [B, T, D] (pre-normed) -> [B, T, D]. With `cache`: prefill (empty cache) or decode the
        next T tokens after it; the cache is updated in place. With `segments` (packed documents, no
        cache): each document runs as if alone."""
        B, T, _ = x.shape
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if segments is not None and cache is not None:
            raise ValueError("KDAAttention: segments (packed documents) and a decode cache do not combine")
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        normed = False   # q and k L2-normalised already
        if self.short_conv > 0 and cache is None:
            pos = None if segments is None else segments.pos
            # the fused kernel takes widths up to the SPEC's 4; wider convs run in torch
            conv = self._triton_op(q, "short_conv") if self.short_conv <= 4 else None
            if conv is not None:
                # conv, SiLU and q's and k's L2 norm in one kernel each way (k3cli/ops/kda/README.md §10)
                q = conv(q, self.q_conv.weight[:, 0], pos, norm_dim=K)
                k = conv(k, self.k_conv.weight[:, 0], pos, norm_dim=K)
                v = conv(v, self.v_conv.weight[:, 0], pos)
                normed = True
            else:
                q = _short_conv(q, self.q_conv.weight, pos)
                k = _short_conv(k, self.k_conv.weight, pos)
                v = _short_conv(v, self.v_conv.weight, pos)
        elif self.short_conv > 0:
            q, cache.conv_q = _short_conv_step(q, self.q_conv.weight, cache.conv_q)
            k, cache.conv_k = _short_conv_step(k, self.k_conv.weight, cache.conv_k)
            v, cache.conv_v = _short_conv_step(v, self.v_conv.weight, cache.conv_v)
        q, k = q.view(B, T, H, K), k.view(B, T, H, K)                              # (B, T, H, K)
        v = v.view(B, T, HV, V)                                                    # (B, T, HV, V)
        # the narrow projections of x (gate, β, output gate) as one matmul (layers/linear.py)
        small = fused_linear(x, self.f_a, self.b_proj, *((self.g_a,) if self.output_gate else ()))
        g_raw = self.f_b(small[0]).view(B, T, HV, K)                               # (B, T, HV, K)
        beta = torch.sigmoid(small[1])                                             # (B, T, HV)
        fused = None if cache is None or cache.state is None else self._triton_op(q, "fused_recurrent_kda")
        if fused is not None:
            # decode on the Triton backend: L2 norm, gate, recurrence and read in one launch
            o = fused(q, k, v, g_raw, beta, initial_state=cache.state, inplace_state=True,
                      use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log,
                      dt_bias=self.dt_bias.view(HV, K), lower_bound=self.kernel_bound)[0]
        else:
            o = self._kda(q if normed else l2norm(q), k if normed else l2norm(k), v, g_raw, beta, cache,
                          segments)                                                # (B, T, HV, V)
        o = self.o_norm(o)
        if self.output_gate:
            o = o * torch.sigmoid(self.g_b(small[2])).view(B, T, HV, V)
        return self.o_proj(o.reshape(B, T, HV * V))

    def _kda(self, q, k, v, g_raw, beta, cache: KDACache | None = None, segments: Segments | None = None) -> torch.Tensor:
        """Gate + chunked KDA by `backend`: auto → Triton on CUDA if importable, else torch
        (`torch_chunk_kda`: the reference's algebra with matmul scores, tested against `naive_chunk_kda`).
        With a filled cache: the torch recurrence from cache.state (decode off the Triton backend).

        q, k [B, T, H, K] (L2-normalised); v [B, T, HV, V]; g_raw [B, T, HV, K]; beta [B, T, HV].
        """
        HV, K = self.num_v_heads, self.head_k_dim
        dt_bias = self.dt_bias.view(HV, K)
        from k3cli.ops.kda import torch_chunk
        from k3cli.ops.kda.naive import naive_chunk_kda, naive_kda_gate, naive_recurrent_kda

        if cache is not None and cache.state is not None:
            g = self._gate(g_raw)                                                  # (B, T, HV, K) fp32
            o, cache.state = naive_recurrent_kda(q, k, v, g, beta, initial_state=cache.state,
                                                 output_final_state=True)
            return o
        chunk_kda = self._triton_op(q)
        if segments is not None or (self.gate == "softplus" and chunk_kda is None):
            return self._kda_packed(q, k, v, g_raw, beta, segments, cache)
        # prefill also returns the final state
        extra = {} if cache is None else {"output_final_state": True}
        if chunk_kda is not None:
            # the fused gate kernel runs inside chunk_kda (docs/math.md §2.3)
            o, state = chunk_kda(q, k, v, g_raw, beta, use_gate_in_kernel=True, A_log=self.A_log,
                                 dt_bias=dt_bias, lower_bound=self.kernel_bound, chunk_size=self.chunk_size,
                                 **extra)
        else:
            g = naive_kda_gate(g_raw, self.A_log, dt_bias, self.lower_bound)       # (B, T, HV, K) fp32
            # chosen from the gate bound, not the data: no later token can switch an earlier output
            # to the other path's rounding
            if torch_chunk.covers_gate(self.lower_bound, self.chunk_size):
                o, state = torch_chunk.torch_chunk_kda(q, k, v, g, beta, chunk_size=self.chunk_size,
                                                       reach_checked=True, **extra)
            else:
                o, state = naive_chunk_kda(q, k, v, g, beta, chunk_size=self.chunk_size, **extra)
        if cache is not None:
            cache.state = state
        return o

    def _gate(self, g_raw: torch.Tensor) -> torch.Tensor:
        """g [B, T, HV, K] fp32 from the raw gate projection, by the layer's gate kind."""
        from k3cli.ops.kda.naive import naive_kda_gate

        return naive_kda_gate(g_raw, self.A_log, self.dt_bias.view(self.num_v_heads, self.head_k_dim), self.kernel_bound)

    def _kda_packed(self, q, k, v, g_raw, beta, segments: Segments | None, cache: KDACache | None = None) -> torch.Tensor:
        """_kda over packed documents: the batch flattened to one row that segments.cu_seqlens cuts, so each
        document starts from a zero state (docs/math.md §10). Also the softplus gate's torch path (segments
        None: the rows are the documents): the torch chunked form checks its anchors' reach on the data and
        falls back to the exact reference, returning each row's final state into `cache` for a prefill."""
        B, T = q.shape[:2]
        HV, K = self.num_v_heads, self.head_k_dim
        dt_bias = self.dt_bias.view(HV, K)
        row = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g_raw, beta)]
        cu_seqlens = segments.cu_seqlens if segments is not None else torch.arange(B + 1, dtype=torch.int32) * T
        chunk_kda = self._triton_op(q)
        final = cache is not None
        if chunk_kda is not None:
            o, _ = chunk_kda(*row, use_gate_in_kernel=True, A_log=self.A_log, dt_bias=dt_bias,
                             lower_bound=self.kernel_bound, chunk_size=self.chunk_size, cu_seqlens=cu_seqlens)
        else:
            from k3cli.ops.kda import naive_chunk_kda_varlen, torch_chunk
            from k3cli.ops.kda.chunk import chunk_kda_varlen_op
            row[3] = self._gate(row[3])
            checked = self.gate == "lower_bound" and torch_chunk.covers_gate(self.lower_bound, self.chunk_size)
            if torch.compiler.is_compiling():
                # the op's torch implementation: opaque to the compiler, which cannot trace the torch path's
                # cu_seqlens-dependent shapes
                o, state = chunk_kda_varlen_op(*row, None, cu_seqlens, K ** -0.5, self.chunk_size, final, True)
            elif checked or self.gate == "softplus":   # softplus: the reach is checked on the data, with a fallback
                o, state = torch_chunk.torch_chunk_kda_varlen(*row, cu_seqlens, chunk_size=self.chunk_size,
                                                              output_final_state=final, reach_checked=checked)
            else:
                o, state = naive_chunk_kda_varlen(*row, cu_seqlens, chunk_size=self.chunk_size,
                                                  output_final_state=final)
            if final:
                cache.state = state
        return o.view(B, T, *o.shape[2:])

    def _triton_op(self, q: torch.Tensor, name: str = "chunk_kda"):
        return kda_triton_op(self.backend, q.device, name)
