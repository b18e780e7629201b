"""Which part of the CUDA prefill+decode path departs from the full forward (k3-toy, AttnRes block)?

Prints the scaled max error of prefill+decode vs the full forward, per combination of KDA backend
(triton | torch) and AttnRes implementation (fused | two_phase | naive), with fp32 matmuls in
full precision; and per decode position for the default combination.
"""
import sys

import torch

sys.path.insert(0, "tests/models")
from test_decode import build, decode_all, ids  # noqa: E402

from k3cli.layers.attnres import AttnResMixer  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
x = ids(2, 40).cuda()
for attnres in ("off", "block"):
    for backend in ("triton", "torch"):
        for impl in ("fused", "two_phase", "naive"):
            m = build("k3-toy", attnres, overrides=(f"model.kda.backend={backend}",)).cuda()
            for mod in m.modules():
                if isinstance(mod, AttnResMixer):
                    mod.impl = impl
            with torch.no_grad():
                full = m(x).logits
                dec = decode_all(m, x, 7)
            per_pos = ((dec - full).abs().amax(dim=(0, 2)) / full.abs().max()).tolist()
            print(f"attnres={attnres:5s} kda={backend:6s} impl={impl:9s} err={max(per_pos):.3g} "
                  f"prefill={max(per_pos[:7]):.3g} decode={' '.join(f'{e:.2g}' for e in per_pos[7:12])}", flush=True)
            if attnres == "off":
                break
