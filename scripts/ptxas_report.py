"""Registers and spill stack of every chunk_kda, fused gate and short conv kernel as it ships, compiled for sm_90 (H100/H200), no GPU needed.

    .venv/bin/python scripts/ptxas_report.py [--K 16 32 64 128] [--chunk 64] [--dtype bf16]

For each K = V and chunk size, the kernels and meta-parameters chunk_kda launches (its launch plan for that
shape on CUDA, `k3cli.ops.kda.chunk.plan`), with the buffer dtypes the plan picks; the autotuned scans once per
config their autotuner may pick; then the short conv's three kernels for q / k (norm over heads of K, packed
documents) and for v (no norm). Triton compiles each for sm_90 with its bundled ptxas and `cuobjdump -res-usage`
reads the cubin. REG 255 with a non-zero STACK means spills. A proxy for occupancy, not a timing. Run it without
TRITON_INTERPRET (the kernels must be real @triton.jit functions). Exits non-zero if any kernel fails to compile.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.autotuner import Autotuner

from k3cli.ops.kda import chunk_bwd as B
from k3cli.ops.kda import chunk_fwd as F
from k3cli.ops.kda import conv
from k3cli.ops.kda import gate as G
from k3cli.ops.kda.chunk import plan

_TY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_SCALARS = {"scale": "fp32", "eps": "fp32"}


def compile_report(fn, ptr_types: dict, const: dict, num_warps: int, num_stages: int = 1) -> tuple[int, int]:
    """(registers, stack bytes) of `fn` compiled for sm_90: pointer arguments typed by `ptr_types`
    (name -> "fp32" / "bf16" / ...), scalars as fp32 (scale) or i32, `const` as its constexprs."""
    fn = getattr(fn, "jit", fn)   # launch.FastLaunch wraps the (autotuned) kernel; .jit is its JITFunction
    fn = fn.fn if isinstance(fn, Autotuner) else fn
    # constexpr parameters left out take their defaults (unlisted, they would compile as pointer arguments)
    const = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty},
             **const}
    sig = {n: "constexpr" if n in const else ("*" + ptr_types[n] if n in ptr_types else _SCALARS.get(n, "i32"))
           for n in fn.arg_names}
    kern = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return int(m.group(1)), int(m.group(2))


def _scan_configs(ptr_types: dict, V: int, BK: int, BT: int, prec: str, kd_t: bool | None):
    """The STATE_CONFIGS entries the scan's autotuner may pick for these buffers (as on a GPU)."""
    dt = {v: k for k, v in _TY.items()}
    named = {n: torch.empty(1, dtype=dt[ptr_types[n]]) for n in ("w", "kd", "qg", "aqk") if n in ptr_types}
    named.update(V=V, BK=BK, BT=BT, PREC=prec, **({} if kd_t is None else {"KD_T": kd_t}))
    return F.prune_state_configs(F.STATE_CONFIGS, named)


def rows(K: int, BT: int, dtype: torch.dtype = torch.bfloat16):
    """(label, kernel, pointer types, constexprs, warps, stages) of every launch chunk_kda makes at K = V."""
    V, H = K, 16
    p = plan(1, 16384, H, K, V, BT, dtype, cuda=True)
    x, f32 = _TY[dtype], "fp32"
    inter, gated, aqk = _TY[p.inter_dtype], _TY[p.gated_dtype], _TY[p.aqk_dtype]
    BK = max(16, triton.next_power_of_2(K))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    BC = min(16, BT)
    io = dict(q=x, k=x, v=x, beta=x, do=x, o=x, dv=x, dq=x, dk=x, g=f32)
    stage1 = dict(io, gc=f32, qg=gated, kd=gated, eg=f32, w=inter, u=inter, aqk=aqk, tm=f32, mkk=f32, rows="i32")
    out = []
    for gather in (False, True):   # packed sequences: inputs read through the layout's token map
        tag = " varlen" if gather else ""
        no_rows = {} if gather else {"rows": None}   # launched with rows=None: a constexpr, as Triton binds it
        out.append((f"fwd gamma{tag}", F._kda_fwd_gamma_kernel, stage1,
                    dict(H=H, HV=H, K=K, BT=BT, BK=min(BK, F.GAMMA_BK), GATHER=gather, **no_rows), F.GAMMA_WARPS, 1))
        # exact: the pair-by-pair diagonal blocks of a decay without lower bound (lower_bound=None)
        for store_mkk, exact in ((True, False), (False, False), (True, True)):
            out.append((f"fwd scores {'per pair' if p.per_pair else 'per sub-chunk'}{'' if store_mkk else ' no Mkk'}"
                        f"{' exact diagonal' if exact else ''}{tag}", F._kda_fwd_scores_kernel, stage1,
                        dict(H=H, HV=H, K=K, BT=BT, BC=BC, BK=min(BK, F.SCORES_BK), PREC=p.prec,
                             STORE_MKK=store_mkk, PER_PAIR=p.per_pair, GATHER=gather, EXACT=exact, **no_rows),
                        F.SCORES_WARPS, p.score_stages))
        out.append((f"fwd tail{tag}", F._kda_fwd_tail_kernel, stage1,
                    dict(HV=H, K=K, V=V, BT=BT, BC=BC, BK=min(BK, F.TAIL_BK), BV=BV, PREC=p.prec, GATHER=gather,
                         **no_rows),
                    F.TAIL_WARPS, 1))
    scan = dict(stage1, h0=f32, ht=f32, h=f32, vn=f32, seqs="i32")
    for name, store_o in (("fwd scan", True), ("bwd re-scan", False)):
        for c in _scan_configs(scan, V, BK, BT, p.scan_prec, kd_t=store_o):
            out.append((f"{name} BV{c.kwargs['BV']} {c.num_warps}w {c.num_stages}s", F._kda_fwd_state_kernel, scan,
                        dict(HV=H, K=K, V=V, BT=BT, BK=BK, BV=c.kwargs["BV"], USE_H0=False, STORE_HT=False,
                             STORE_O=store_o, STORE_H=not store_o, INTERPRET=False, PREC=p.scan_prec, KD_T=store_o,
                             VARLEN=False, GATHER=False, rows=None),
                        c.num_warps, c.num_stages))
            if store_o:   # packed sequences: one program per sequence, from and to its states
                out.append((f"{name} varlen BV{c.kwargs['BV']} {c.num_warps}w {c.num_stages}s",
                            F._kda_fwd_state_kernel, scan,
                            dict(HV=H, K=K, V=V, BT=BT, BK=BK, BV=c.kwargs["BV"], USE_H0=True, STORE_HT=True,
                                 STORE_O=True, STORE_H=False, INTERPRET=False, PREC=p.scan_prec, KD_T=True,
                                 VARLEN=True, GATHER=True),
                            c.num_warps, c.num_stages))
    bwd = dict(stage1, dht=f32, dh=f32, dvn=f32, dh0=f32, h=f32, vn=f32, dy=f32, dqk=f32, dkk=f32, dbeta_v=f32,
               dqs=f32, dks=f32, dgs=f32, dg=f32, dbeta=f32, seqs="i32")
    state_prec = B.state_precision(p.prec)
    for c in _scan_configs(bwd, V, BK, BT, state_prec, kd_t=None):
        out.append((f"bwd reverse scan BV{c.kwargs['BV']} {c.num_warps}w {c.num_stages}s", B._kda_bwd_state_kernel,
                    bwd, dict(HV=H, K=K, V=V, BT=BT, BK=BK, BV=c.kwargs["BV"], USE_DHT=False, STORE_DH0=False,
                              INTERPRET=False, PREC=state_prec, VARLEN=False), c.num_warps, c.num_stages))
        out.append((f"bwd reverse scan varlen BV{c.kwargs['BV']} {c.num_warps}w {c.num_stages}s",
                    B._kda_bwd_state_kernel, bwd,
                    dict(HV=H, K=K, V=V, BT=BT, BK=BK, BV=c.kwargs["BV"], USE_DHT=True, STORE_DH0=True,
                         INTERPRET=False, PREC=state_prec, VARLEN=True), c.num_warps, c.num_stages))
    out.append(("bwd V side", B._kda_bwd_vside_kernel, bwd, dict(HV=H, V=V, BT=BT, BV=BV, PREC=p.prec),
                B.SIDE_WARPS, 1))
    for exact in (False, True):
        out.append((f"bwd scores{' exact diagonal' if exact else ''}", B._kda_bwd_scores_kernel, bwd,
                    dict(H=H, HV=H, K=K, BT=BT, BC=BC, BK=min(BK, B.SCORES_BK), PREC=p.prec, EXACT=exact),
                    B.SCORES_WARPS, 1))
    out.append(("bwd key side", B._kda_bwd_kside_kernel, bwd,
                dict(H=H, HV=H, K=K, V=V, BT=BT, BK=min(BK, B.MAX_BK), BV=BV, PREC=p.prec), B.SIDE_WARPS, 1))
    return out + gate_rows(K, BT, dtype) + conv_rows(K, dtype)


def gate_rows(K: int, BT: int, dtype: torch.dtype = torch.bfloat16):
    """The fused gate's kernels as chunk_kda launches them (per-step g, no cumsum), lower-bound and softplus."""
    ptrs = dict(g_raw=_TY[dtype], a_log="fp32", dt_bias="fp32", out="fp32", dout="fp32", dg_raw=_TY[dtype],
                da_part="fp32", db_part="fp32")
    out = []
    for softplus in (False, True):
        const = dict(HV=16, K=K, BT=BT, BK=max(16, triton.next_power_of_2(K)), HAS_BIAS=True, CUMSUM=False,
                     SOFTPLUS=softplus)
        tag = "softplus" if softplus else "lower bound"
        out.append((f"gate fwd, {tag}", G._kda_gate_fwd_kernel, ptrs, const, 4, 1))
        out.append((f"gate bwd, {tag}", G._kda_gate_bwd_kernel, ptrs, const, 4, 1))
    return out


def conv_rows(K: int, dtype: torch.dtype = torch.bfloat16):
    """The short conv's kernels with the meta-parameters `short_conv` launches them with (width 4): q / k, L2
    norm over heads of K with packed documents, and v without either."""
    x = _TY[dtype]
    ptrs = dict(x=x, w="fp32", pos="i64", y=x, dy=x, da=x, dx=x, dw_part="fp32")
    out = []
    for norm in (True, False):
        G, BC = conv._groups(1024, K if norm else 0)
        tag = f"norm {K}, documents" if norm else "no norm"
        common = dict(W=4, HAS_POS=norm)
        out.append((f"short conv fwd, {tag}", conv._short_conv_fwd_kernel, ptrs,
                    dict(common, G=G, BT=conv._BT, BC=BC, NORM=norm), 4, 1))
        out.append((f"short conv bwd da, {tag}", conv._short_conv_bwd_da_kernel, ptrs,
                    dict(common, STEPS=8, G=G, BT=conv._BT_DA, BC=BC, NORM=norm), conv._WARPS_DA, 1))
        out.append((f"short conv bwd dx, {tag}", conv._short_conv_bwd_dx_kernel, ptrs,
                    dict(common, BT=conv._BT, BC=conv._BC), 4, 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--K", type=int, nargs="+", default=[16, 32, 64, 128], help="K = V of each report")
    ap.add_argument("--chunk", type=int, nargs="+", default=[64], help="chunk sizes (16, 32, 64)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    failed = 0
    for K in args.K:
        for BT in args.chunk:
            print(f"K = V = {K}, chunk {BT}, {args.dtype} inputs, sm_90")
            for label, fn, ptrs, const, warps, stages in rows(K, BT, dtype):
                try:
                    reg, stack = compile_report(fn, ptrs, const, warps, stages)
                    cell = f"{reg:>4d} / {stack}"
                except Exception as e:  # report, keep going
                    failed += 1
                    cell = f"FAILED {type(e).__name__}"
                print(f"  {label:40s} {warps:>2d} warps  REG / STACK {cell}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
