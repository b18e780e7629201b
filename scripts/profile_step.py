"""Where a training step spends device time, by component (CUDA, bf16 autocast).

The step is `k3 bench-train`'s (k3cli/bench/train.py: forward, backward, clipping, fused AdamW, MoE balancing on synthetic
tokens), eager or compiled. For each AttnRes overlay: warm-up steps (compilation), then torch.profiler
over `--steps` steps. Prints the step's wall time (the profiler lengthens it, by about a quarter for a
compiled k3-toy step), kernels per
step, device-busy time per step, the busy time grouped by component (kernel-name patterns below) and
the largest kernels. A step whose device-busy time is far below its wall time is host-bound.
`--document-mask` profiles the step on packed documents, as `k3 train` trains by default; `--host N` adds
the steps' rate when the host runs ahead (no synchronisation between them), with one batch kept on the device
and with a fresh batch each step from the loop's input pipeline, the garbage collector's time within each, and
the N host ops with the most CPU time of their own, to see where a host-bound step's enqueueing goes.

    .venv/bin/python scripts/profile_step.py --preset k3-toy --batch 512 --compile --attnres off block
    .venv/bin/python scripts/profile_step.py --preset k3-0.5b --batch 8 --seq-len 4096 --compile --trace /tmp/t.json
    .venv/bin/python scripts/profile_step.py --preset k3-0.5b --batch 16 --seq-len 4096 --compile --attnres off --matmuls 30
    .venv/bin/python scripts/profile_step.py --preset k3-toy --batch 512 --compile --attnres off --document-mask --host 30

`--device cpu` runs fp32 without device figures (a smoke test of the script).
"""
from __future__ import annotations

import argparse
import gc
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from k3cli.bench.train import Variant, build_variant, loader_feed, synthetic_batch, timed_step
from k3cli.config import load_config
from k3cli.train import Batch, resolve_device

# first match wins; names are CUDA kernel names as the profiler reports them
COMPONENTS = [
    ("KDA kernels (ours)", r"^_kda_|_fused_recurrent_kda"),
    ("AttnRes kernels (ours)", r"^(attnres_|merge_|phase1_|dw_kernel)"),
    ("attention (SDPA / FlexAttention)", r"flash|fmha|cudnn|sdpa|flex_attention"),
    ("matrix products", r"nvjet|gemm|cutlass|xmma|splitKreduce|sm90_"),
    ("optimizer (AdamW)", r"(?i)adam"),
    ("Inductor fused kernels", r"^triton_"),
    ("gathers, scatters, sorts", r"(?i)index|scatter|gather|sort|radix"),
    ("copies and fills", r"(?i)copy|fill|memset|memcpy|cat"),
]


ANNOTATION = re.compile(r"^(Optimizer\.|ProfilerStep#)")
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def kernel_events(events) -> list:
    """The CUDA kernels of a profile's averages, without user annotations (the optimizer's
    `Optimizer.step#AdamW.step` region is reported on the device too, spanning kernels already counted)."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False) and not ANNOTATION.match(e.key)]


def component(name: str) -> str:
    for label, pattern in COMPONENTS:
        if re.search(pattern, name):
            return label
    return "other"


def run(preset: str, attnres: str, batch: int, seq: int, device: torch.device, compiled: bool,
        mode: str, steps: int, warmup: int, top: int, trace: str | None, impl: str = "auto",
        matmuls: int = 0, masked: bool = False, host: int = 0) -> None:
    cfg = load_config(preset, attnres=attnres)
    cfg.train.compile_mode = mode
    cfg.train.seq_len, cfg.train.micro_batch_size = seq, batch
    cuda = device.type == "cuda"
    v = Variant("profile", "triton" if cuda else "torch", compiled, masked=masked, attnres_impl=impl if cuda else None)
    build_variant(cfg, v, device)
    if masked:   # bench-train's batch: documents of mean length T / 4
        batch_ = synthetic_batch(cfg, batch, device)
    else:
        batch_ = Batch(torch.randint(1, cfg.model.vocab_size, (batch, seq), device=device), None)
    t0 = time.perf_counter()
    for _ in range(warmup):
        timed_step(v, batch_, device)
    form = f" ({impl})" if cuda and attnres != "off" else ""
    print(f"\n== {preset} attnres={attnres}{form} B{batch} T{seq} {'compiled' if compiled else 'eager'}"
          f"{', document mask' if masked else ''}: warm-up {warmup} steps {time.perf_counter() - t0:.1f} s", flush=True)
    if host:
        run_ahead(v, lambda: batch_, steps, cuda, "one batch kept on the device")
        v.feed = loader_feed(cfg, v, device)
        try:
            for _ in range(2):   # let the worker fill its slots
                v.step(v.feed.next_batch)
            run_ahead(v, v.feed.next_batch, steps, cuda, "a fresh batch each step from the loop's input pipeline")
        finally:
            v.feed.close()
            v.feed = None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=matmuls > 0) as prof:
        times = [timed_step(v, batch_, device) for _ in range(steps)]
    wall, host_s = (sum(t[i] for t in times) / steps for i in (0, 1))
    if trace:
        prof.export_chrome_trace(trace.replace(".json", f"-{attnres}.json"))
    events = prof.key_averages()
    kernels = kernel_events(events)
    busy = sum(e.self_device_time_total for e in kernels) / steps / 1e3
    launches = sum(e.count for e in kernels) / steps
    print(f"step {wall * 1e3:.2f} ms wall, {host_s * 1e3:.2f} ms host, {launches:.0f} kernels/step, "
          f"device busy {busy:.2f} ms/step")
    if matmuls:
        print_matmuls(prof, steps, matmuls, cuda)
    if host or not cuda:
        print(events.table(sort_by="self_cpu_time_total", row_limit=host or top, max_name_column_width=60))
    if not cuda:
        return
    groups: dict[str, float] = {}
    for e in kernels:
        c = component(e.key)
        groups[c] = groups.get(c, 0.0) + e.self_device_time_total / steps / 1e3
    print(f"{'component':<36} {'ms/step':>9} {'share':>7}")
    for c, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"{c:<36} {ms:9.2f} {100 * ms / busy:6.1f}%")
    print(f"\n{'kernel':<90} {'calls':>6} {'ms/step':>9}")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"{e.key[:90]:<90} {e.count // steps:6d} {e.self_device_time_total / steps / 1e3:9.3f}")


def run_ahead(v: Variant, next_batch, steps: int, cuda: bool, feed: str) -> None:
    """Prints the steps' rate when the host runs ahead (no synchronisation between steps, as in k3 train) and
    the garbage collector's time and full collections within them, which a host-bound step pays in full."""
    gc_ms, gc_n, t = [0.0], [0], [0.0]

    def watch(phase, info):
        if phase == "start":
            t[0] = time.perf_counter()
        else:
            gc_ms[0] += (time.perf_counter() - t[0]) * 1e3
            gc_n[0] += info["generation"] == 2

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    gc.callbacks.append(watch)
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            v.step(next_batch)
        sync()
    finally:
        gc.callbacks.remove(watch)
    print(f"run ahead, {feed}: {(time.perf_counter() - t0) / steps * 1e3:.2f} ms/step over {steps} steps "
          f"(garbage collection {gc_ms[0] / steps:.2f} ms/step, {gc_n[0]} full collections)")


def print_matmuls(prof, steps: int, top: int, cuda: bool) -> None:
    """The `top` matrix-product ops by time per step, one row per (op, input shapes): which projection costs
    what (device time on CUDA, CPU time otherwise)."""
    rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in MATMUL_OPS]
    ms = (lambda e: e.device_time_total / steps / 1e3) if cuda else (lambda e: e.cpu_time_total / steps / 1e3)
    print(f"matrix-product ops: {sum(ms(e) for e in rows):.2f} ms/step")
    print(f"{'op':<12} {'input shapes':<80} {'calls':>6} {'ms/step':>9}")
    for e in sorted(rows, key=lambda e: -ms(e))[:top]:
        print(f"{e.key:<12} {str(e.input_shapes)[:80]:<80} {e.count // steps:6d} {ms(e):9.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="k3-toy")
    ap.add_argument("--attnres", nargs="+", default=["off", "block"], help="overlays, one profile each")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--compile", action="store_true", help="profile the torch.compile'd step")
    ap.add_argument("--mode", default="default", help="torch.compile mode (train.compile_mode)")
    ap.add_argument("--impl", default="auto", choices=("auto", "fused", "two_phase"),
                    help="the AttnRes mixer's implementation on CUDA (fused: the Triton kernels even when compiled)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=30, help="largest kernels listed")
    ap.add_argument("--matmuls", type=int, default=0, help="also list the N largest matrix products by input shape")
    ap.add_argument("--document-mask", action="store_true", help="packed documents with the document mask, as k3 train")
    ap.add_argument("--host", type=int, default=0, metavar="N",
                    help="also the run-ahead step rate (one kept batch; the loop's input pipeline) and the N host ops with the "
                         "most CPU time of their own")
    ap.add_argument("--trace", help="write a Chrome trace per overlay (NAME-<overlay>.json)")
    ap.add_argument("--device", default="cuda", help="cuda (bf16 autocast) | cpu (fp32: a smoke test of the script)")
    args = ap.parse_args()
    device = resolve_device(args.device)
    for attnres in args.attnres:
        run(args.preset, attnres, args.batch, args.seq_len, device, args.compile, args.mode, args.steps,
            args.warmup, args.top, args.trace, args.impl, args.matmuls, args.document_mask, args.host)


if __name__ == "__main__":
    main()
