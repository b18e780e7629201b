"""Stage-1 kernels of chunk_kda by launch, with the warp counts and key blocks the sweep varies (H200).

    python scripts/kda_stage1_sub.py      # CUDA, bf16

Times (medians of triton.testing.do_bench, ms): the block-pair scores kernel (TUNING fwd_scores "pairs")
at 1 / 2 / 4 warps; the Γ kernel and the per-sub-chunk scores kernel (TUNING fwd_scores "sub") per warps
and key block; the solve (PART 2), W, U (PART 3) and both in one launch (PART 4) per warps and key
block. The Γ kernel stores β K e^Γ and W reads it (KG, TUNING fwd_tail_kg as shipped). Not a correctness check: the launches run once in pipeline order first, so each timed launch
sees valid inputs.
"""
from __future__ import annotations

import torch
import triton

from k3cli.ops.kda.bench import _inputs
from k3cli.ops.kda.chunk_fwd import (
    _kda_fwd_gamma_kernel,
    _kda_fwd_intra_kblock_kernel,
    _kda_fwd_scores_pairs_kernel,
    _kda_fwd_scores_sub_kernel,
    dot_precision,
    kda_fwd_intra,
)


def bench(fn) -> float:
    return triton.testing.do_bench(fn)


def main() -> None:
    for shape in ((8, 2048, 16, 16, 128), (8, 2048, 8, 8, 16)):
        one_shape(shape)


def one_shape(shape) -> None:
    B, T, H, HV, K = shape
    q, k, v, g, b = _inputs(*shape, torch.bfloat16, torch.device("cuda"))
    prec = dot_precision(v.dtype)
    BT, NT, BC, scale = 64, triton.cdiv(T, 64), 16, K ** -0.5
    it = kda_fwd_intra(q, k, v, g, b, scale, BT, v.dtype, v.dtype, precision=prec, sub=True, store_mkk=True)
    gc = torch.empty(B * HV, NT * BT, K, device=q.device, dtype=torch.float32)
    grid = (NT, B * HV)
    res = []
    for w in (1, 2, 4):
        res.append((f"pairs w{w}", bench(lambda w=w: _kda_fwd_scores_pairs_kernel[grid](
            q, k, g, b, it.qg, it.kd, it.eg, it.aqk, it.tm, it.mkk, scale, T, NT, H=H, HV=HV, K=K, BT=BT,
            BC=BC, BK=max(16, K), PREC=prec, STORE_MKK=True, num_warps=w, num_stages=1))))
    for bk in sorted({min(32, K), min(64, K)}):
        for w in (2, 4, 8):
            res.append((f"gamma BK{bk} w{w}", bench(lambda bk=bk, w=w: _kda_fwd_gamma_kernel[
                (NT, B * HV, triton.cdiv(K, bk))](q, k, g, b, gc, it.qg, it.kd, it.eg, it.w, scale, T, NT, 0, H=H, HV=HV,
                                                  K=K, BT=BT, BK=bk, KG=True, num_warps=w, num_stages=1))))
    for bk in sorted({min(16, K), min(32, K), min(64, K)}):
        for w in (1, 2, 4):
            res.append((f"scores sub BK{bk} w{w}", bench(lambda bk=bk, w=w: _kda_fwd_scores_sub_kernel[
                (NT * (BT // BC), B * HV)](q, k, gc, b, it.aqk, it.tm, it.mkk, scale, T, NT, 0, H=H, HV=HV, K=K,
                                           BT=BT, BC=BC, BK=bk, PREC=prec, STORE_MKK=True, num_warps=w,
                                           num_stages=1))))
    args = (q, k, v, g, b, it.w, it.u, it.qg, it.kd, it.eg, it.aqk, it.tm, it.mkk, scale, T, NT)
    tm0 = it.tm.clone()
    for part in (2, 3, 4):
        for bk in sorted({min(32, K), min(64, K), max(16, K)}):
            if part == 2 and bk != max(16, K):
                continue   # the solve does not read key columns
            for w in (2, 4, 8):
                def launch(part=part, bk=bk, w=w):
                    if part != 3:
                        it.tm.copy_(tm0)   # the solve works in place
                    _kda_fwd_intra_kblock_kernel[grid](*args, H=H, HV=HV, K=K, V=K, BT=BT, BC=BC, BK=bk,
                                                       BV=min(64, max(16, K)), PREC=prec, PART=part,
                                                       STORE_MKK=True, KG=True, num_warps=w, num_stages=1)
                res.append((f"part{part} BK{bk} w{w}", bench(launch)))
    copy = bench(lambda: it.tm.copy_(tm0))
    print(f"{shape}: " + "  ".join(f"{n} {t:.3f}" for n, t in res) + f"  (tm copy {copy:.3f}, included in parts 2, 4)",
          flush=True)


if __name__ == "__main__":
    main()
