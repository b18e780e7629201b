"""What the loop records: each step's scalars, kept on the device until a read step, and the
throughput of each log window (tokens/s, step and data-wait time, TFLOP/s, MFU, peak memory)."""
from __future__ import annotations

import math

import torch

from k3cli.config import RunConfig
from k3cli.models.flops import device_peak_tflops, flops_per_token


class StepRecords:
    """Each step's record (step, lr, time) with its device scalars from `TrainStep`; `read()` brings
    every pending step's scalars to the host in one transfer (the loop's only sync) and returns the
    records, plus the first step whose loss or gradient norm is not finite (None when all are)."""

    def __init__(self):
        self._pending: list[tuple[dict, torch.Tensor]] = []

    def add(self, record: dict, scalars: torch.Tensor) -> None:
        self._pending.append((record, scalars))

    def read(self) -> tuple[list[dict], dict | None]:
        if not self._pending:
            return [], None
        records, scalars = zip(*self._pending)
        self._pending = []
        values = torch.stack(scalars).tolist()
        out, bad = [], None
        for record, v in zip(records, values):
            record = {"step": record["step"], "loss": v[0], "lr": record["lr"], "grad_norm": v[1],
                      **({"moe_imbalance": v[2]} if len(v) > 2 else {}), **record}
            if bad is None and not (math.isfinite(v[0]) and math.isfinite(v[1])):
                bad = record
            out.append(record)
        return out, bad


def rounded(record: dict) -> dict:
    """A record as metrics.jsonl stores it."""
    out = dict(record, loss=round(record["loss"], 6), grad_norm=round(record["grad_norm"], 6))
    if "moe_imbalance" in out:
        out["moe_imbalance"] = round(out["moe_imbalance"], 4)
    if "val_loss" in out:
        out["val_loss"] = round(out["val_loss"], 6)
    return out


class Throughput:
    """Per log window: tokens/s, step and data-wait time, model TFLOP/s, MFU and peak memory.

    FLOPs per token are the analytic training count (`k3cli.models.flops`, docs/math.md §9); MFU
    is against `train.peak_tflops`, else the device's dense bf16 peak from the table (none on CPU).
    `window` takes this process's tokens: tokens/s is for all `world_size` processes together,
    TFLOP/s, MFU and memory are per process (per GPU)."""

    def __init__(self, cfg: RunConfig, device: torch.device, world_size: int = 1):
        self.device, self.world_size = device, world_size
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)["total"]
        self.peak, self.peak_name = cfg.train.peak_tflops or None, "train.peak_tflops"
        if self.peak is None and device.type == "cuda":
            found = device_peak_tflops(torch.cuda.get_device_name(device))
            if found is not None:
                self.peak, self.peak_name = found[0], f"{found[1]} dense bf16"
        self.steps = 0   # training steps since the last window

    def describe(self) -> str:
        peak = (f"MFU against {self.peak:g} TFLOP/s ({self.peak_name})" if self.peak else
                "no MFU (no peak known for this device; give one with --peak-tflops)")
        per = (f"; tokens/s of all {self.world_size} processes, TFLOP/s, MFU and memory per process"
               if self.world_size > 1 else "")
        return f"throughput: {self.flops_per_token / 1e6:.1f} MFLOP per token (forward+backward); {peak}{per}"

    def window(self, tokens: int, seconds: float, data_s: float) -> dict:
        """The record's fields for `tokens` over `seconds` of training steps, `data_s` of them waiting for batches."""
        seconds = max(seconds, 1e-9)
        tflops = tokens * self.flops_per_token / seconds / 1e12
        out = {"tokens_per_s": round(tokens * self.world_size / seconds, 1), "step_ms": round(1e3 * seconds / max(1, self.steps), 2),
               "data_ms": round(1e3 * data_s / max(1, self.steps), 3), "tflops": _sig(tflops)}
        if self.peak:
            out["mfu"] = _sig(tflops / self.peak)
        out["peak_mem_gb"] = round(peak_memory_bytes(self.device) / 2**30, 3)
        self.steps = 0
        return out


def _sig(x: float, digits: int = 5) -> float:
    """x rounded to `digits` significant digits (TFLOP/s on a CPU are 1e-3, on a GPU 1e2)."""
    return float(f"{x:.{digits}g}")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: the CUDA caching allocator's high-water mark, or the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


def format_record(r: dict) -> str:
    parts = [f"step {r['step']}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.3f}"]
    if "tokens_per_s" in r:
        parts.append(f"{r['tokens_per_s']:.0f} tok/s")
        parts.append(f"{r['step_ms']:.1f} ms/step (data {r['data_ms']:.2f})")
        parts.append(f"{r['tflops']:.3g} TFLOP/s" + (f" MFU {100 * r['mfu']:.1f}%" if "mfu" in r else ""))
        parts.append(f"mem {r['peak_mem_gb']:.2f} GB")
    if "moe_imbalance" in r:
        parts.append(f"moe max/mean {r['moe_imbalance']:.2f}")
    if "val_loss" in r:
        parts.append(f"val_loss {r['val_loss']:.4f}")
    return " | ".join(parts)
