"""Registers and spill stack of the chunk_kda kernels as compiled for sm_90 (H100/H200), without a GPU.

    .venv/bin/python scripts/ptxas_report.py [K] [--warps 16 8 4] [--chunk 64] [--maxnreg 128] [--only TEXT]

Triton compiles each kernel for the target here (its bundled ptxas), then `cuobjdump -res-usage`
reads the cubin. REG 255 with a non-zero STACK means spills and one 8-warp block per SM (session 2's
ncu run: the K = 128 stage-1 and backward kernels sat there). A proxy for occupancy, not a timing.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.autotuner import Autotuner

from k3cli.ops.kda import chunk_bwd as B
from k3cli.ops.kda import chunk_fwd as F

INPUTS = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "g": "*bf16", "beta": "*bf16", "do": "*bf16", "dv": "*bf16",
          "o": "*bf16"}
SCALARS = {"scale": "fp32", "T": "i32", "NT": "i32", "NBT": "i32", "NBH": "i32", "N0": "i32", "N1": "i32", "L": "i32",
           "SEG_STRIDE": "i32", "SEG_STRIDE_M": "i32", "SEG_STRIDE_E": "i32", "NPROG": "i32"}


def compile_report(fn, const: dict, num_warps: int, maxnreg: int | None = None) -> tuple[int, int]:
    fn = getattr(fn, "jit", fn)   # launch.FastLaunch wraps the (autotuned) kernel; .jit is its JITFunction
    fn = fn.fn if isinstance(fn, Autotuner) else fn   # autotuned kernels wrap the JITFunction
    const = dict(const)
    stages = const.pop("_stages", 1)   # a launch option, not a kernel parameter
    # constexpr parameters left out take their defaults (unlisted, they would compile as pointer arguments)
    const = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty},
             **const}
    sig = {}
    for n in fn.arg_names:
        sig[n] = "constexpr" if n in const else SCALARS.get(n, INPUTS.get(n, "*fp32"))
    kern = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": stages, "maxnreg": maxnreg})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return int(m.group(1)), int(m.group(2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("K", type=int, nargs="?", default=128)
    ap.add_argument("--warps", type=int, nargs="+", default=[16, 8, 4])
    ap.add_argument("--chunk", type=int, default=64, help="BT, the chunk size")
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap per thread (ptxas .maxnreg)")
    ap.add_argument("--only", default=None, help="report only the kernels whose row name contains this text")
    ap.add_argument("--prec", default="tf32", choices=["tf32", "tf32x3", "ieee", "bf16", "fp16", "bf16n"], help="tl.dot input precision")
    args = ap.parse_args()
    K = V = args.K
    BKf = max(16, triton.next_power_of_2(K))
    BT = args.chunk
    base = dict(H=16, HV=16, K=K, V=V, BT=BT, BC=min(16, BT), PREC=args.prec)
    cases = [("fwd_intra whole-K", F._kda_fwd_intra_kernel, dict(base, BK=BKf, BV=min(64, BKf), STORE_MKK=False))]
    for bk in (64, 32, 16):
        if bk < BKf:
            cases.append((f"fwd_intra kblock BK{bk}", F._kda_fwd_intra_kblock_kernel,
                          dict(base, BK=bk, BV=min(64, BKf), PART=0, STORE_MKK=False)))
    cases.append(("fwd scores pairs (whole K)", F._kda_fwd_scores_pairs_kernel,
                  dict(H=16, HV=16, K=K, BT=BT, BC=min(16, BT), BK=BKf, PREC=args.prec, STORE_MKK=True)))
    for bk in sorted({min(64, BKf), min(32, BKf)}):
        cases.append((f"fwd gamma BK{bk}", F._kda_fwd_gamma_kernel, dict(H=16, HV=16, K=K, BT=BT, BK=bk)))
        cases.append((f"fwd gamma BK{bk} KG", F._kda_fwd_gamma_kernel, dict(H=16, HV=16, K=K, BT=BT, BK=bk, KG=True)))
    for bk in sorted({min(64, BKf), BKf}):
        cases.append((f"fwd scores sub BK{bk}", F._kda_fwd_scores_sub_kernel,
                      dict(H=16, HV=16, K=K, BT=BT, BC=min(16, BT), BK=bk, PREC=args.prec, STORE_MKK=True,
                           PER_PAIR=False)))
        cases.append((f"fwd scores per pair BK{bk}", F._kda_fwd_scores_sub_kernel,
                      dict(H=16, HV=16, K=K, BT=BT, BC=min(16, BT), BK=bk, PREC=args.prec, STORE_MKK=True,
                           PER_PAIR=True)))
        cases.append((f"fwd scores per pair BK{bk} 2 stages", F._kda_fwd_scores_sub_kernel,
                      dict(H=16, HV=16, K=K, BT=BT, BC=min(16, BT), BK=bk, PREC=args.prec, STORE_MKK=True,
                           PER_PAIR=True, _stages=2)))
    cases.append((f"fwd_intra solve + W,U BK{BKf}", F._kda_fwd_intra_kblock_kernel,
                  dict(base, BK=BKf, BV=min(64, BKf), PART=4, STORE_MKK=False)))
    cases.append(("fwd_intra solve + W,U BK32", F._kda_fwd_intra_kblock_kernel,
                  dict(base, BK=min(32, BKf), BV=min(64, BKf), PART=4, STORE_MKK=False)))
    cases.append(("fwd_intra solve + W,U BK32 KG", F._kda_fwd_intra_kblock_kernel,
                  dict(base, BK=min(32, BKf), BV=min(64, BKf), PART=4, STORE_MKK=False, KG=True)))
    for bk in (BKf, 32):
        cases.append((f"fwd_intra solve / W,U BK{bk}", F._kda_fwd_intra_kblock_kernel,
                      dict(base, BK=min(bk, BKf), BV=min(64, BKf), PART=3, STORE_MKK=False)))
    for part, what in ((1, "scores"), (2, "solve"), (3, "W, U")):
        cases.append((f"fwd_intra split {what} BK32", F._kda_fwd_intra_kblock_kernel,
                      dict(base, BK=min(32, BKf), BV=min(64, BKf), PART=part, STORE_MKK=False)))
    state = dict(HV=16, K=K, V=V, BT=BT, BK=BKf, PREC=args.prec)
    for bv in (64, 32, 16):
        for kd_t in (True, False):   # K_d^T loaded as a [BK, BT] tile (TUNING scan_kd_t, the default) or transposed
            cases.append((f"fwd_state BV{bv}{'' if kd_t else ' K_d transposed'}", F._kda_fwd_state_kernel,
                          dict(state, BV=bv, USE_H0=False, STORE_HT=False, STORE_O=True, STORE_H=False,
                               INTERPRET=False, KD_T=kd_t)))
    for bv in (64, 32):
        cases.append((f"bwd_state BV{bv}", B._kda_bwd_state_kernel,
                      dict(state, BV=bv, USE_DHT=False, STORE_DH0=False, INTERPRET=False)))
    for bv in (64, 32):
        cases.append((f"fwd_state BV{bv} no O, store S, K_d transposed", F._kda_fwd_state_kernel,
                      dict(state, BV=bv, USE_H0=False, STORE_HT=False, STORE_O=False, STORE_H=True, INTERPRET=False,
                           KD_T=False)))
        cases.append((f"fwd run summary BV{bv}", F._kda_fwd_seg_summary_kernel,
                      dict(K=K, V=V, BT=BT, BK=BKf, BV=bv, INTERPRET=False, PREC=args.prec)))
        cases.append((f"fwd O BV{bv}", F._kda_fwd_o_kernel, dict(HV=16, K=K, V=V, BT=BT, BK=BKf, BV=bv, PREC=args.prec)))
    for bk, bv in ((64, 64), (32, 64), (32, 32)):
        bk, bv = min(bk, BKf), min(bv, BKf)
        for stored in (False, True):
            tag = " stored Mkk" if stored else ""
            cases.append((f"bwd_intra BK{bk} BV{bv}{tag}", B._kda_bwd_intra_kernel,
                          dict(base, BK=bk, BV=bv, STORED_MKK=stored)))
            cases.append((f"bwd kside BK{bk} BV{bv}{tag}", B._kda_bwd_kside_kernel,
                          dict(base, BK=bk, BV=bv, STORED_MKK=stored, SCORES_DONE=False, GC=False)))
    for gc in (False, True):
        cases.append((f"bwd scores sub-chunk BK32{' stored Γ' if gc else ''}", B._kda_bwd_scores_subchunk_kernel,
                      dict(H=16, HV=16, K=K, BT=BT, BC=min(16, BT), BK=min(32, BKf), PREC=args.prec, GC=gc)))
    for bk, bv in ((64, 64), (32, 32)):
        bk, bv = min(bk, BKf), min(bv, BKf)
        for gc in (False, True):
            cases.append((f"bwd kside BK{bk} BV{bv} scores done{' stored Γ' if gc else ''}", B._kda_bwd_kside_kernel,
                          dict(base, BK=bk, BV=bv, STORED_MKK=True, SCORES_DONE=True, GC=gc)))
    for bv in (64, 32):
        cases.append((f"bwd vside BV{min(bv, BKf)}", B._kda_bwd_vside_kernel,
                      dict(HV=16, V=V, BT=BT, BV=min(bv, BKf), PREC=args.prec)))
    print(f"K = V = {K}, BT = {BT}, bf16 inputs, sm_90, maxnreg {args.maxnreg}, dots {args.prec}")
    print(f"{'kernel':34s} " + " ".join(f"{f'{w} warps REG/STACK':>20s}" for w in args.warps))
    seen = set()
    for name, fn, const in cases:
        if name in seen or (args.only is not None and args.only not in name):
            continue
        seen.add(name)
        cols = []
        for w in args.warps:
            try:
                reg, stack = compile_report(fn, const, w, args.maxnreg)
                cols.append(f"{reg:>10d} / {stack:<7d}")
            except Exception as e:  # report, keep going
                cols.append(f"{type(e).__name__:>20s}")
        print(f"{name:34s} " + " ".join(f"{c:>20s}" for c in cols), flush=True)


if __name__ == "__main__":
    main()
