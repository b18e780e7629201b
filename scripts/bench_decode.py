"""Per-token decode latency of k3-toy (random weights, B = 1) at several context lengths, with and
without the decode cache.

With the cache: prefill the context once, then time single-token `CausalLM.decode_step` calls (median,
after one warm-up step). Without it (the baseline): a full forward over the context plus the new
token, for every new token. The cached figure should stay flat as the context grows; the baseline
grows with it. Also prints the prefill time (on CUDA the first context includes compilation).

    .venv/bin/python scripts/bench_decode.py [--contexts 128 512 2048 8192] [--steps 16]
        [--baseline-max 2048] [--attnres off|full|block] [--threads 1] [--device cpu|cuda]

The baseline runs at every context unless capped with --baseline-max; on a 2-core CPU the default
table takes about 15 s (the 8192-token forward takes about 2 s and runs twice).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from k3cli.config import load_config
from k3cli.models import CausalLM
from k3cli.train import flush_denormals


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


@torch.inference_mode()
def bench_context(model: CausalLM, ctx: int, steps: int, baseline: bool, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(ctx)
    ids = torch.randint(0, model.config.vocab_size, (1, ctx + steps), generator=gen).to(device)
    prefill_s = timed(lambda: model.prefill(ids[:, :ctx]), device)
    _, cache = model.prefill(ids[:, :ctx])
    model.decode_step(ids[:, ctx:ctx + 1], cache)                                # warm-up step
    cached = [timed(lambda t=t: model.decode_step(ids[:, t:t + 1], cache), device)
              for t in range(ctx + 1, ctx + steps)]
    row = {"context": ctx, "prefill_ms": prefill_s * 1e3, "cached_ms": statistics.median(cached) * 1e3}
    if baseline:
        reps = max(2, min(steps, 4096 // ctx))
        full = [timed(lambda t=t: model(ids[:, :t + 1]), device) for t in range(ctx, ctx + reps)]
        row["full_ms"] = statistics.median(full) * 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048, 8192])
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per context (median)")
    ap.add_argument("--baseline-max", type=int, default=None,
                    help="longest context for the no-cache baseline (default: no cap)")
    ap.add_argument("--attnres", default="block", choices=["off", "full", "block"])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    flush_denormals(device)
    cap = args.baseline_max if args.baseline_max is not None else max(args.contexts)
    torch.manual_seed(0)
    model = CausalLM(load_config("k3-toy", attnres=args.attnres).model).to(device).eval()
    print(f"k3-toy (attnres {args.attnres}, random weights), B = 1, {device}"
          + (f", {torch.get_num_threads()} thread(s)" if device.type == "cpu" else "")
          + f"; median of {args.steps - 1} decode steps after a warm-up")
    print(f"{'context':>8} {'prefill ms':>11} {'cached ms/tok':>14} {'no-cache ms/tok':>16} {'speed-up':>9}")
    for ctx in args.contexts:
        r = bench_context(model, ctx, args.steps, ctx <= cap, device)
        full = f"{r['full_ms']:>16.2f} {r['full_ms'] / r['cached_ms']:>8.1f}x" if "full_ms" in r \
            else f"{'(skipped)':>16} {'-':>9}"
        print(f"{ctx:>8} {r['prefill_ms']:>11.1f} {r['cached_ms']:>14.2f} {full}", flush=True)
    if any(c > cap for c in args.contexts):
        print(f"no-cache baseline skipped above {cap} tokens (--baseline-max)")


if __name__ == "__main__":
    main()
