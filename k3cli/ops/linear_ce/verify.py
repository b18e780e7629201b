"""`k3 verify-equivalence --kernel linear_ce`: the chunked loss against `F.cross_entropy` on the full logits, in
fp32 on the same (rounded) inputs: the loss, dh and dw, each a row of relative RMS error, max abs error, the
tolerance and pass/fail (the table of k3cli/ops/kda/verify.py)."""
from __future__ import annotations

import torch

from k3cli.ops.linear_ce import linear_cross_entropy, linear_cross_entropy_reference

# relative RMS limits at the KDA table's output / gradient levels: bf16 logits and dlogits carry ~4e-3
TOL = {"loss": 0.005, "dh": 0.008, "dw": 0.008}
# (N, D, V, rows per chunk or None for the default): a short last chunk, one token, ignored labels
SHAPES = {"ci": [(300, 64, 1000, 128), (1, 16, 50, None), (97, 40, 333, 32)],
          "full": [(16384, 1024, 32768, None), (4097, 1024, 32768, 1000), (8192, 256, 4096, None)]}


def verify_linear_ce(shapes: str = "ci", dtype: str | torch.dtype = "bf16") -> list[tuple]:
    from k3cli.ops.kda.verify import _DTYPES, _row

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    if dev == "cpu" and dt == torch.bfloat16:
        dt = torch.float32   # the CPU tier checks fp32 (as the kernels' does)
    rows = []
    for N, D, V, per in SHAPES[shapes]:
        gen = torch.Generator().manual_seed(0)
        h = (torch.randn(N, D, generator=gen) / D ** 0.5).to(dev, dt)
        w = (torch.randn(V, D, generator=gen) / D ** 0.5).to(dev, dt)
        y = torch.randint(0, V, (N,), generator=gen)
        y[torch.rand(N, generator=gen) < 0.1] = -100
        y[0] = 0   # at least one counted token
        res = []
        for fn, hin, win in ((linear_cross_entropy_reference, h.float(), w.float()),
                             (lambda a, b, c, per=per: linear_cross_entropy(a, b, c, rows=per), h, w)):
            hl, wl = hin.detach().clone().requires_grad_(), win.detach().clone().requires_grad_()
            loss = fn(hl, wl, y.to(dev))
            res.append({"loss": loss.detach(), **dict(zip(("dh", "dw"), torch.autograd.grad(loss, (hl, wl))))})
        tag = f"N{N}-D{D}-V{V}-rows{per or 'auto'}-{str(dt).split('.')[-1]}"
        rows += [_row(f"{tag}/{n}", res[1][n], res[0][n], TOL[n]) for n in res[0]]
    return rows
