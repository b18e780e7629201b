"""Time one forward+backward of k3-toy on CPU (B=8, T=256; median of 3 after a warm-up) for AttnRes
off / full / block, and print total / active parameter counts of kda-toy, k3-toy and k3-0.5b.

    .venv/bin/python scripts/time_k3_toy.py [--batch 8] [--seq 256] [--threads N] [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from k3cli.config import load_config
from k3cli.models import CausalLM


def time_step(model: CausalLM, ids: torch.Tensor, repeats: int = 3) -> float:
    def step() -> float:
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        sync()
        return time.perf_counter() - t0

    def sync() -> None:
        if ids.is_cuda:
            torch.cuda.synchronize()

    step()  # warm-up
    return statistics.median(step() for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (fp32; CUDA uses the Triton kernels)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device} fp32")

    print("\nparameters            total        active")
    for preset in ("kda-toy", "k3-toy", "k3-0.5b"):
        with torch.device("meta"):
            m = CausalLM(load_config(preset).model)
        print(f"  {preset:<10} {m.num_parameters():>14,} {m.num_active_parameters():>13,}")

    print(f"\nk3-toy forward+backward, B={args.batch}, T={args.seq} (median of 3 after a warm-up)")
    for attnres in ("off", "full", "block"):
        torch.manual_seed(0)
        model = CausalLM(load_config("k3-toy", attnres=attnres).model).to(args.device).train()
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=args.device)
        print(f"  attnres {attnres:<6} {time_step(model, ids) * 1e3:9.1f} ms")


if __name__ == "__main__":
    main()
