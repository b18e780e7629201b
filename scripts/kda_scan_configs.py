"""Time the forward state scan (`_kda_fwd_state_kernel`) per launch config, outside the autotuner.

    python scripts/kda_scan_configs.py [B,T,H,HV,K ...]     # CUDA, bf16; default the two K = 128 shapes

For each shape: stage 1 once (chunk.TUNING as shipped), then each STATE_CONFIGS entry that fits (BV,
warps, stages) timed with triton.testing.do_bench on the same buffers, with O stored (the forward) and
without O but storing S_n, Vn (the backward's re-scan, and TUNING fwd_output "split"), both with K_d^T read
as chunk.TUNING scan_kd_t says (the forward scan's setting; the re-scan's own is rescan_kd_t); the config the
autotuner picked; the stage-1 total. The scan's products at the shipped precision (chunk.scan_precision:
16-bit operands for bf16 inputs at V >= 64, whose configs keep BV 64 only unless scan_kd_t: at BV 32 they
hit an illegal memory access on the H200 with the register transpose, sessions 4 and 6). Also a few configs
outside STATE_CONFIGS (EXTRA: BV 64 at 4 warps / 1 stage and at 16 warps), candidates for the few-program scans (B1 T16384 H16:
32 programs at BV 64, each about an SM's registers at 8 warps). scripts/kda_scan_bv.py runs narrower blocks
each in its own process.
"""
from __future__ import annotations

import sys

import torch
import triton

from k3cli.ops.kda import chunk as C_
from k3cli.ops.kda import chunk_fwd as F
from k3cli.ops.kda.bench import _inputs

EXTRA = [triton.Config({"BV": 64}, num_warps=nw, num_stages=ns) for nw, ns in ((4, 1), (4, 2), (16, 1))]


def time_config(it, o, h, vn, B, T, HV, K, V, BT, prec, cfg, store_o: bool, kd_t: bool = False) -> float:
    NT = triton.cdiv(T, BT)
    bv, nw, ns = cfg.kwargs["BV"], cfg.num_warps, cfg.num_stages

    def launch():
        F._kda_fwd_state_kernel.fn[(triton.cdiv(V, bv), B * HV, 1)](
            it.qg, it.kd, it.eg, it.w, it.u, it.aqk, o if store_o else None, None, None,
            None if store_o else h, None if store_o else vn, T, NT, 0, 0, NT, NT, 0, HV=HV, K=K, V=V,
            BT=BT, BK=max(16, triton.next_power_of_2(K)), BV=bv, USE_H0=False, STORE_HT=False, STORE_O=store_o,
            STORE_H=not store_o, INTERPRET=False, PREC=prec, KD_T=kd_t, num_warps=nw, num_stages=ns)
    return triton.testing.do_bench(launch)


def bench_shape(shape) -> None:
    dev = torch.device("cuda")
    B, T, H, HV, K = shape
    V, BT = K, 64
    q, k, v, g, b = _inputs(*shape, torch.bfloat16, dev)
    prec = F.dot_precision(v.dtype)
    sprec = C_.scan_precision(prec, v)
    NT = triton.cdiv(T, BT)
    it = C_.fwd_intra(q, k, v, g, b, K ** -0.5, BT, prec)
    o = torch.empty(B, T, HV, V, device=dev, dtype=v.dtype)
    h = torch.empty(B * HV, NT, K, V, device=dev, dtype=torch.float32)
    vn = torch.empty(B * HV, NT * BT, V, device=dev, dtype=torch.float32)
    t1 = triton.testing.do_bench(lambda: C_.fwd_intra(q, k, v, g, b, K ** -0.5, BT, prec))
    kd_t = C_.TUNING["scan_kd_t"]   # the forward scan as chunk_kda runs it (the re-scan: TUNING rescan_kd_t)
    seen = set(F._kda_fwd_state_kernel.cache)
    F.kda_fwd_state(it, B, T, HV, BT, None, v.dtype, False, precision=sprec, kd_t=kd_t)
    picked = [str(c) for key, c in F._kda_fwd_state_kernel.cache.items() if key not in seen]
    print(f"{shape}: stage 1 {t1:.3f} ms; autotuner picked {picked} (scan_kd_t {kd_t})", flush=True)
    named = {"w": it.w, "kd": it.kd, "qg": it.qg, "aqk": it.aqk, "V": V, "BK": max(16, triton.next_power_of_2(K)),
             "BT": BT, "PREC": sprec, "KD_T": kd_t}
    for cfg in F.prune_state_configs(F.STATE_CONFIGS + EXTRA, named):
        t = [time_config(it, o, h, vn, B, T, HV, K, V, BT, sprec, cfg, s, kd_t) for s in (True, False)]
        print(f"  BV{cfg.kwargs['BV']:3d} w{cfg.num_warps} s{cfg.num_stages}: with O {t[0]:7.3f} / "
              f"S,Vn only {t[1]:7.3f} ms", flush=True)


def main() -> None:
    shapes = [tuple(int(x) for x in a.split(",")) for a in sys.argv[1:]] or [(8, 2048, 16, 16, 128),
                                                                             (1, 16384, 16, 16, 128)]
    for shape in shapes:
        bench_shape(shape)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
