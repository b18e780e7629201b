"""Where a k3-toy training step spends host and device time, per AttnRes mode (CUDA, bf16 autocast).

For each mode: 3 warm-up steps, then torch.profiler over 3 steps of forward, backward and AdamW on
random tokens. Prints the step's wall time (inflated by the profiler), the CUDA kernel launches per
step, the device-busy time per step, and the top ops by self CPU time. A step whose device-busy
time is far below its wall time is host-bound.

    .venv/bin/python scripts/profile_step.py [--batch 8] [--seq 256] [--modes off block] [--device cuda]

`--device cpu` runs fp32 without device figures (a smoke test of the script).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from k3cli.config import load_config
from k3cli.models import CausalLM


def run(mode: str, batch: int, seq: int, device: str, steps: int = 3) -> None:
    torch.manual_seed(0)
    cuda = device.startswith("cuda")
    model = CausalLM(load_config("k3-toy", attnres=mode).model).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = sum(e.count for e in kernels) / steps
    busy_ms = sum(e.self_device_time_total for e in kernels) / steps / 1e3
    print(f"\n== attnres {mode}: step {wall * 1e3:.2f} ms wall, {launches:.0f} kernels/step, "
          f"device busy {busy_ms:.2f} ms/step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--modes", nargs="+", default=["off", "block"])
    ap.add_argument("--device", default="cuda", help="cuda (bf16 autocast) | cpu (fp32: a smoke test of the script)")
    args = ap.parse_args()
    for mode in args.modes:
        run(mode, args.batch, args.seq, args.device)


if __name__ == "__main__":
    main()
