"""Time one k3-toy training step for AttnRes off / full / block, and print the parameter counts
(total and active per token) of kda-toy, k3-toy and k3-0.5b.

The step is forward+backward on random tokens, plus an AdamW step with --optim. CPU runs fp32
(median of 3 rounds after one warm-up); CUDA runs under bf16 autocast like `k3 train`, with the
Triton kernels (median of --repeats rounds, default 20, after 3 warm-ups), and adds "block/torch-mix"
(block mode with the AttnRes mix in torch). The variants run interleaved, round by round, so drift
hits them alike. "host" is the time until the step's last launch returned; the last column is the
ratio to AttnRes off.

    .venv/bin/python scripts/time_k3_toy.py [--batch 8] [--seq 256] [--threads N] [--device cuda] [--optim]
        [--repeats N]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from k3cli.config import load_config
from k3cli.models import CausalLM


def make_step(model: CausalLM, ids: torch.Tensor, optim: bool = False):
    """One timed step -> (wall seconds incl. the device, host seconds until the last launch returned)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if optim else None
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=ids.is_cuda)

    def sync() -> None:
        if ids.is_cuda:
            torch.cuda.synchronize()

    def step() -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        with autocast:
            loss = model(ids, labels=ids).loss
        loss.backward()
        if opt is not None:
            opt.step()
        host = time.perf_counter() - t0
        sync()
        return time.perf_counter() - t0, host

    return step


# (label, AttnRes mode, mixer impl or None for the default)
VARIANTS = [("off", "off", None), ("full", "full", None), ("block", "block", None),
            ("block/torch-mix", "block", "two_phase")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--device", default="cpu", help="cpu (fp32) | cuda (bf16 autocast, Triton kernels)")
    ap.add_argument("--repeats", type=int, default=0, help="timed steps (default 3 on CPU, 20 on CUDA)")
    ap.add_argument("--optim", action="store_true", help="include an AdamW step (a full training step)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    repeats = args.repeats or (20 if cuda else 3)
    precision = "bf16 autocast" if cuda else "fp32"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device} {precision}")

    print("\nparameters            total        active")
    for preset in ("kda-toy", "k3-toy", "k3-0.5b"):
        with torch.device("meta"):
            m = CausalLM(load_config(preset).model)
        print(f"  {preset:<10} {m.num_parameters():>14,} {m.num_active_parameters():>13,}")

    what = "training step (fwd+bwd+AdamW)" if args.optim else "forward+backward"
    print(f"\nk3-toy {what}, B={args.batch}, T={args.seq}: median of {repeats} rounds after warm-up, "
          "the variants interleaved round by round; host = until the last launch returned", flush=True)
    steps = {}
    for label, mode, impl in VARIANTS:
        if not cuda and impl is not None:
            continue   # on CPU the default impl is the torch mix already
        torch.manual_seed(0)
        model = CausalLM(load_config("k3-toy", attnres=mode).model).to(args.device).train()
        if impl is not None:
            model.attnres.impl = impl
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=args.device)
        steps[label] = make_step(model, ids, args.optim)
        for _ in range(3 if cuda else 1):   # warm-up (CUDA: compile, autotune)
            steps[label]()
    times = {label: [] for label in steps}
    for _ in range(repeats):
        for label, step in steps.items():
            times[label].append(step())
    off = statistics.median(w for w, _ in times["off"])
    for label, ts in times.items():
        wall = statistics.median(w for w, _ in ts)
        host = statistics.median(h for _, h in ts)
        print(f"  attnres {label:<16} {wall * 1e3:9.2f} ms  (host {host * 1e3:7.2f} ms)  {wall / off:5.3f}x off")


if __name__ == "__main__":
    main()
