"""Where stage 1 of chunk_kda spends its time: the key-blocked stage-1 kernel launched part by part.

    python scripts/kda_stage1_parts.py      # CUDA, bf16

PART 1 = scores (+ the gated operands), 2 = the in-place (I + Akk)^-1 solve, 3 = W and U; 0 = all in
one launch (what chunk_kda runs by default with 2-byte buffers); and the block-pair scores kernel
(chunk.TUNING fwd_scores "pairs") with its solve + W, U launch (PART 4), at 2 / 4 / 8 warps. Medians of triton.testing.do_bench,
one line per (shape, key block). Not a correctness check (parts 1-3 run on the same buffers in order
once before timing, so each timed launch sees valid inputs).
"""
from __future__ import annotations

import torch
import triton

from k3cli.ops.kda.bench import _inputs
from k3cli.ops.kda.chunk_fwd import (
    _kda_fwd_intra_kblock_kernel,
    _kda_fwd_scores_pairs_kernel,
    dot_precision,
    kda_fwd_intra,
)


def main() -> None:
    for shape in ((8, 2048, 16, 16, 128), (1, 16384, 16, 16, 128), (8, 2048, 8, 8, 16)):
        B, T, H, HV, K = shape
        q, k, v, g, b = _inputs(*shape, torch.bfloat16, torch.device("cuda"))
        prec = dot_precision(v.dtype)
        BT, NT = 64, triton.cdiv(T, 64)
        for bk in sorted({K, min(K, 32)}, reverse=True):
            # key_block None with 2-byte gated buffers: the key-blocked kernel at BK = K
            it = kda_fwd_intra(q, k, v, g, b, K ** -0.5, BT, v.dtype, v.dtype, precision=prec,
                               key_block=None if bk == K else bk)
            # the second it.tm: the unused Mkk pointer (STORE_MKK off)
            args = (q, k, v, g, b, *it[:2], it.qg, it.kd, it.eg, it.aqk, it.tm, it.tm, K ** -0.5, T, NT)

            meta = dict(H=H, HV=HV, K=K, V=K, BT=BT, BC=16, BK=bk, BV=min(64, K), PREC=prec, STORE_MKK=False,
                        num_warps=8, num_stages=1)

            def launch(part, grid=(NT, B * HV), args=args, meta=meta):
                return lambda: _kda_fwd_intra_kblock_kernel[grid](*args, PART=part, **meta)
            t = {p: triton.testing.do_bench(launch(p)) for p in (1, 2, 3, 0)}
            print(f"{shape} BK {bk}: scores {t[1]:.3f}  solve {t[2]:.3f}  W,U {t[3]:.3f}  "
                  f"(sum {t[1] + t[2] + t[3]:.3f})  one launch {t[0]:.3f} ms", flush=True)
            if bk == K:
                pargs = (q, k, g, b, it.qg, it.kd, it.eg, it.aqk, it.tm, it.tm, K ** -0.5, T, NT)
                pm = dict(H=H, HV=HV, K=K, BT=BT, BC=16, BK=bk, PREC=prec, STORE_MKK=False, num_stages=1)
                tp = {w: triton.testing.do_bench(lambda w=w, grid=(NT, B * HV), pargs=pargs, pm=pm:
                                                 _kda_fwd_scores_pairs_kernel[grid](*pargs, num_warps=w, **pm))
                      for w in (2, 4, 8)}
                t4 = triton.testing.do_bench(launch(4))
                print(f"{shape} pairs scores (2/4/8 warps) {tp[2]:.3f} / {tp[4]:.3f} / {tp[8]:.3f}  "
                      f"solve + W,U {t4:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
