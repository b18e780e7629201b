"""chunk_kda against fla's chunk_kda in one process on one GPU, bf16, printing as it goes.

    python scripts/kda_vs_fla.py [B,T,H,HV,K ...]     # default: the issue's three acceptance shapes

Order: our forward and forward+backward at every shape, then fla's forward at every shape, then
fla's forward+backward at every shape — fla compiles its backward for minutes (session 3: > 100 s per
new shape), so a time-boxed run keeps everything before that. Same inputs and timer
(triton.testing.do_bench medians, warm-up excluded) as `k3 bench-kernel`; each line is one JSON row.
"""
import json
import sys
import time

import torch
import triton

from k3cli.ops.kda import chunk_kda
from k3cli.ops.kda.bench import _fla_chunk_kda, _fwd_bwd_fns, _inputs

SHAPES = [(8, 2048, 16, 16, 128), (1, 16384, 16, 16, 128), (8, 2048, 8, 8, 16)]


def timed(name, shape, fn, which):
    args = _inputs(*shape, torch.bfloat16, torch.device("cuda"))
    fwd, fwd_bwd = _fwd_bwd_fns(fn, args, torch.device("cuda"))
    f = fwd if which == "fwd" else fwd_bwd
    t0 = time.perf_counter()
    f()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    ms = triton.testing.do_bench(f)
    print(json.dumps({"impl": name, "shape": shape, "pass": which, "ms": round(ms, 4),
                      "first_call_s": round(first, 2)}), flush=True)


def main(shapes):
    fla = _fla_chunk_kda()
    for s in shapes:
        for which in ("fwd", "fwd_bwd"):
            timed("k3", s, chunk_kda, which)
    if fla is None:
        print(json.dumps({"impl": "fla", "error": "fla not importable"}), flush=True)
        return
    for which in ("fwd", "fwd_bwd"):
        for s in shapes:
            timed("fla", s, lambda *a: fla(*a), which)


if __name__ == "__main__":
    main([tuple(int(x) for x in a.split(",")) for a in sys.argv[1:]] or SHAPES)
