"""Decode-step timings of `fused_recurrent_kda` (one token per call, fp32 state updated in place).

Per shape: the Triton kernel, the torch reference `naive_recurrent_kda` measured in the same run,
and fla's `fused_recurrent_kda` only if `import fla` works. A decode step reads and writes the whole
fp32 state, so the figure of merit is state bytes moved (2·B·HV·K·V·4) per second, printed beside a
device copy measured now. On CPU the kernel runs in the Triton interpreter: tiny shapes, and those
times say nothing about a GPU.
"""
from __future__ import annotations

import os

import torch

from k3cli.ops.kda.bench import copy_ceiling_gbps, time_fn
from k3cli.ops.kda.naive import naive_kda_gate, naive_recurrent_kda
from k3cli.ops.norm import l2norm

# (B, H, HV, K = V)
SHAPES = {"gpu": [(1, 32, 32, 128), (32, 32, 32, 128), (256, 32, 32, 128)],
          "cpu": [(1, 2, 2, 16), (4, 2, 4, 32)]}


def _fla_fused_recurrent():
    try:
        from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda
    except ImportError:
        return None
    return fla_fused_recurrent_kda


def _inputs(B, H, HV, K, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, H, K, generator=gen)
    k = torch.randn(B, 1, H, K, generator=gen)
    v = torch.randn(B, 1, HV, K, generator=gen)
    g_raw = torch.randn(B, 1, HV, K, generator=gen)
    beta = torch.sigmoid(torch.randn(B, 1, HV, generator=gen))
    state = 0.1 * torch.randn(B, HV, K, K, generator=gen)
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV, K)
    low = [x.to(device=device, dtype=dtype) for x in (q, k, v, g_raw, beta)]
    return (*low, *(x.to(device) for x in (state, A_log, dt_bias)))


def _steps(B, H, HV, K, dtype, dev, fla) -> dict:
    """One decode token per implementation, as zero-argument callables on shared inputs."""
    from k3cli.ops.kda.fused_recurrent import fused_recurrent_kda

    q, k, v, g_raw, beta, state, A_log, dt_bias = _inputs(B, H, HV, K, dtype, dev)
    g = naive_kda_gate(g_raw, A_log, dt_bias)

    def triton_step():
        fused_recurrent_kda(q, k, v, g_raw, beta, initial_state=state, inplace_state=True,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)

    def torch_step():
        qn, kn = l2norm(q.float()), l2norm(k.float())   # the layer's and the kernel's normalisation
        naive_recurrent_kda(qn, kn, v, naive_kda_gate(g_raw, A_log, dt_bias), beta, initial_state=state,
                            output_final_state=True)

    def fla_step():
        fla(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)

    steps = {"triton": triton_step, "torch": torch_step}
    if fla is not None:
        steps["fla"] = fla_step
    return steps


def bench_decode(shapes: list[tuple[int, int, int, int]] | None = None, device: str | None = None,
                 dtype: torch.dtype | None = None, with_fla: bool = True) -> list[dict]:
    """Time one decode token per shape (B, H, HV, K = V). Defaults: CUDA with bf16 inputs at the
    (1 | 32 | 256, 32, 32, 128) shapes, else CPU (Triton interpreter, fp32) at tiny shapes.
    Returns one dict per shape: ms and state GB/s for 'triton', 'torch' and 'fla' (absent = not run)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("bench_decode on CPU needs TRITON_INTERPRET=1 set before Python starts")
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    shapes = shapes or SHAPES["gpu" if dev.type == "cuda" else "cpu"]
    fla = _fla_fused_recurrent() if with_fla else None
    ceiling = copy_ceiling_gbps(dev)
    rows = []
    for B, H, HV, K in shapes:
        state_bytes = 2 * B * HV * K * K * 4
        row = {"B": B, "H": H, "HV": HV, "K": K, "V": K, "dtype": str(dtype).replace("torch.", ""),
               "device": str(dev), "copy_GBps": ceiling}
        with torch.no_grad():
            for name, fn in _steps(B, H, HV, K, dtype, dev, fla).items():
                try:
                    ms = time_fn(fn, dev, reps=5 if dev.type == "cpu" else 10)[0]
                except Exception as e:  # fla's signature may differ between versions: report, don't die
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    continue
                row[f"{name}_ms"] = ms
                row[f"{name}_GBps"] = state_bytes / (ms * 1e-3) / 1e9
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    head = f"{'B':>4} {'HV':>3} {'K=V':>4}  {'triton ms':>10} {'GB/s':>7}  {'torch ms':>9} {'GB/s':>7}  " \
           f"{'fla ms':>8} {'GB/s':>7}"
    lines = [head]
    for r in rows:
        cells = []
        for name in ("triton", "torch", "fla"):
            ms = r.get(f"{name}_ms")
            cells.append(f"{ms:>9.4f} {r[f'{name}_GBps']:>7.3g}" if ms is not None else f"{'-':>9} {'-':>7}")
        lines.append(f"{r['B']:>4} {r['HV']:>3} {r['K']:>4}  " + "  ".join(cells))
    if rows:
        lines.append(f"({rows[0]['device']}, {rows[0]['dtype']} inputs, fp32 state; GB/s = state read+write; "
                     f"device copy {rows[0]['copy_GBps']:.1f} GB/s)")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(format_rows(bench_decode()))
