"""Training-step time per AttnRes overlay and mixer implementation, interleaved round by round in one process.

Each variant is `OVERLAY` or `OVERLAY:IMPL` (IMPL: fused = the Triton kernels, two_phase = the torch form,
auto = what the model picks), optionally followed by `+KEY=VALUE` config overrides (`block+model.fp32_residual=false`);
every one runs `k3 bench-train`'s step and interleaved rounds (`time_variants` in
k3cli/bench/train.py: forward, backward, clipping, fused AdamW, MoE balancing on synthetic tokens), compiled with --compile. Prints the median step, its spread, the
ratio to the first variant and tokens/s. The rule `wants_kernels` (k3cli/layers/attnres.py) follows from it:

    .venv/bin/python scripts/time_attnres_forms.py --preset k3-toy --batch 512 --compile \\
        off block:fused block:two_phase full:fused full:two_phase

`--device cpu` (torch forms only) is a smoke test of the script.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from k3cli.bench.train import Variant, time_variants
from k3cli.config import load_config
from k3cli.train import Batch, resolve_device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+", help="OVERLAY[:IMPL][+KEY=VALUE...], the first the reference")
    ap.add_argument("--preset", default="k3-toy")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=15, help="timed rounds")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    variants = []
    for spec in args.variants:
        head, *overrides = spec.split("+")
        overlay, _, impl = head.partition(":")
        cfg = load_config(args.preset, overrides=overrides, attnres=overlay)
        if impl and cfg.model.attnres.mode == "off":
            raise SystemExit(f"{spec}: attnres={overlay} has no mixer to choose an implementation for")
        variants.append(Variant(spec, "triton" if cuda else "torch", args.compile, False, attnres=overlay, cfg=cfg,
                                attnres_impl=impl or None))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, variants[0].cfg.model.vocab_size, (args.batch, args.seq_len), generator=gen).to(device)
    time_variants(variants, variants[0].cfg, {False: Batch(ids, None)}, device, args.steps, args.warmup)
    ref = statistics.median(variants[0].times)
    print(f"\n{'variant':<36} {'step ms':>9} {'min':>8} {'max':>8} {'× ref':>7} {'tokens/s':>12}")
    for v in variants:
        med = statistics.median(v.times)
        print(f"{v.name:<36} {1e3 * med:9.2f} {1e3 * min(v.times):8.2f} {1e3 * max(v.times):8.2f} "
              f"{med / ref:7.3f} {args.batch * args.seq_len / med:12,.0f}")


if __name__ == "__main__":
    main()
