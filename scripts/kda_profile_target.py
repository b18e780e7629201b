"""A fixed chunk_kda forward+backward workload for Nsight Compute (ncu) or ptxas-report runs.

    ncu --clock-control none --kernel-name regex:_kda_ --launch-skip 12 --launch-count 6 \
        python3 scripts/kda_profile_target.py 8 2048 16 16 128

Runs three warm-up iterations (compile, autotune) and then three timed-by-nothing iterations, and
prints each Triton kernel's register count and spill size as compiled for this shape.
"""
import sys

import torch

from k3cli.ops.kda import chunk_kda
from k3cli.ops.kda.bench import _inputs


def main(argv):
    B, T, H, HV, K = (int(x) for x in (argv or ["8", "2048", "16", "16", "128"]))
    q, k, v, g, beta = (x.requires_grad_(True) for x in _inputs(B, T, H, HV, K, torch.bfloat16, torch.device("cuda")))
    do = torch.randn_like(v)
    for _ in range(6):
        o, _ = chunk_kda(q, k, v, g, beta)
        torch.autograd.grad(o, (q, k, v, g, beta), do)
    torch.cuda.synchronize()
    from k3cli.ops.kda import chunk_bwd, chunk_fwd
    for mod in (chunk_fwd, chunk_bwd):
        for name in dir(mod):
            fn = getattr(mod, name)
            cache = getattr(fn, "device_caches", None) or getattr(getattr(fn, "fn", None), "device_caches", None)
            if not name.startswith("_kda_") or cache is None:
                continue
            for dev_cache in cache.values():
                for kern in dev_cache[0].values():
                    print(f"{name}: regs={kern.n_regs} spills={kern.n_spills} shared={kern.metadata.shared}")


if __name__ == "__main__":
    main(sys.argv[1:])
