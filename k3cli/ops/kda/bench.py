"""KDA kernel timings for the CLI (`k3 bench-kernel ...` wraps `bench_kda`).

Per shape: first-call time (compile + autotune), forward and forward+backward medians with the
20th/80th percentile spread (warm-up excluded), Mtok/s, forward I/O bytes/s against a
device-to-device copy ceiling measured in the same run, the torch reference (`naive_chunk_kda`)
measured in the same run, and fla's `chunk_kda` only if `import fla` works. The fla figures from
/work/shared/BENCHMARKS.md (H200, fla-core 0.6.0) ride along as `fla_doc_*`: documented, not measured.
"""
from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.nn.functional as F

from k3cli.ops.kda.chunk_fwd import interpreting
from k3cli.ops.kda.naive import chunk_local_cumsum, naive_chunk_kda, naive_kda_gate
from k3cli.ops.kda.varlen import cu_seqlens_of

# (B, T, H, HV, K=V)
SHAPES = {
    "ci": [(1, 128, 2, 2, 16), (1, 100, 1, 2, 32)],
    "toy": [(8, 2048, 8, 8, 16)],
    "k3": [(8, 2048, 16, 16, 128), (4, 4096, 16, 16, 128), (2, 8192, 16, 16, 128), (1, 16384, 16, 16, 128),
           (1, 32768, 32, 32, 128), (4, 4096, 32, 32, 128), (4, 4096, 8, 16, 128), (8, 2048, 8, 8, 16),
           (16, 2048, 8, 8, 32)],
}
# (sequence lengths, H = HV, K = V): chunk_kda with cu_seqlens, one flattened row. "k3": 16,384 tokens in 20
# documents from 1 to 4,096 tokens, on and off the chunk (against fla's cu_seqlens path)
VARLEN_SHAPES = {
    "ci": [((1, 15, 17, 40), 1, 16)],
    "toy": [],
    "k3": [((4096, 2048, 2000, 1500, 1200, 1000, 900, 800, 700, 600, 500, 400, 300, 200, 104, 17, 16, 1, 1, 1), 16,
            128)],
}
# BENCHMARKS.md, fla 0.6.0 on H200: (fwd ms, fwd+bwd ms); toy fwd is quoted as 0.92-1.12 (upper end kept)
FLA_DOC = {(8, 2048, 16, 16, 128): (0.893, 4.79), (4, 4096, 16, 16, 128): (1.228, 4.92),
           (2, 8192, 16, 16, 128): (1.096, 5.36), (1, 16384, 16, 16, 128): (1.393, 6.28),
           (1, 32768, 32, 32, 128): (3.880, 19.85), (4, 4096, 32, 32, 128): (1.946, 9.94),
           (4, 4096, 8, 16, 128): (0.929, 4.97), (8, 2048, 8, 8, 16): (1.12, 2.70),
           (16, 2048, 8, 8, 32): (0.93, None)}
# the torch reference materialises O(T * 16 * K) per head; skip it above this many elements
_TORCH_REF_LIMIT = 2 ** 31


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device, reps: int = 10) -> tuple[float, float, float]:
    """(median, p20, p80) in ms; CUDA uses triton.testing.do_bench (warm-up excluded)."""
    if device.type == "cuda":
        import triton
        med, p20, p80 = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
        return med, p20, p80
    if interpreting():
        reps = 1   # the interpreter's times say nothing of a GPU and it compiles nothing: one run exercises the path
    else:
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return statistics.median(ts), ts[int(0.2 * (len(ts) - 1))], ts[int(0.8 * (len(ts) - 1))]


# host enqueue time / device time above which a row is flagged as near launch-bound
NEAR_LAUNCH_BOUND = 0.6


def host_ms(fn, device, calls: int = 20) -> float | None:
    """CUDA only: the host's time (ms) to enqueue one call, the median of 3 x `calls` calls enqueued back to
    back after a synchronize (few enough to stay below the launch queue's depth). Where it comes near the
    device time, do_bench's figure can measure the launch path (Python, Triton's launcher) and move with the
    host's speed, not the kernels' (chunk_kda's 4-range forward at B1 T16384 H16 K128 once took 0.88-0.95 ms
    to enqueue per call of ~1.2 ms on the device, and its forward-only figure then had two modes)."""
    if device.type != "cuda":
        return None
    return statistics.median(host for host, _ in enqueue_samples(fn, device, calls))


def enqueue_samples(fn, device, calls: int = 20, samples: int = 3) -> list[tuple[float, float]]:
    """CUDA only: `samples` times, `calls` calls enqueued back to back after a synchronize, as (host ms to
    enqueue one call, wall ms per call once the device has finished them)."""
    fn()
    torch.cuda.synchronize(device)
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize(device)
        out.append(((t1 - t0) / calls * 1e3, (time.perf_counter() - t0) / calls * 1e3))
    return out


def _host_note(host: float | None, device_ms: float, flag: bool = False, what: str = "forward") -> str:
    """", host enqueue ... ms per forward" (or `what`) for a progress line (empty off CUDA); with `flag`, a
    note when the host time is NEAR_LAUNCH_BOUND or more of the device time."""
    if host is None:
        return ""
    note = f", host enqueue {host:.3g} ms per {what}"
    if flag and host >= NEAR_LAUNCH_BOUND * device_ms:
        note += (f" ({host / device_ms:.0%} of the device time: near launch-bound, the {what} figure may move "
                 "with the host's speed)")
    return note


def copy_ceiling_gbps(device) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), measured now."""
    n = (1 << 29) if device.type == "cuda" else (1 << 24)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms, _, _ = time_fn(lambda: y.copy_(x), device)
    return 2 * n / (ms * 1e-3) / 1e9


def _first_call(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError:
        return None
    return fla_chunk_kda


def _inputs(B, T, H, HV, K, dtype, device):
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(device, dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(device, dtype)
    v = torch.randn(B, T, HV, K, generator=gen).to(device, dtype)
    g = (-5.0 * torch.sigmoid(torch.randn(B, T, HV, K, generator=gen) - 1.0)).to(device)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen)).to(device, dtype)
    return q, k, v, g, beta


def _fwd_bwd_fns(fn, args, device, out_like=2):
    """fwd (no autograd) and fwd+bwd closures; the cotangent is shaped like args[out_like]."""
    leaves = [a.detach().clone().requires_grad_(True) for a in args]
    do = torch.randn(args[out_like].shape, device=device, dtype=torch.float32).to(args[out_like].dtype)

    def fwd():
        with torch.no_grad():
            return fn(*args)

    def fwd_bwd():
        o = fn(*leaves)[0]
        return torch.autograd.grad(o, leaves, do)

    return fwd, fwd_bwd


def _bench_chunk(shape, device, against_fla, on_step=None, lens=None):
    """One chunk_kda row at shape (B, T, H, HV, K); with `lens` (B = 1, T = sum) the row holds those sequences
    (cu_seqlens: on the CPU for ours, as chunk_kda reads it on the host; on the device for fla)."""
    from k3cli.ops.kda import chunk_kda, naive_chunk_kda_varlen
    B, T, H, HV, K = shape
    step = (lambda msg: on_step(f"{shape}: {msg}")) if on_step is not None else (lambda msg: None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args = _inputs(B, T, H, HV, K, dtype, device)
    cu = None if lens is None else cu_seqlens_of(lens)
    ours = chunk_kda if cu is None else functools.partial(chunk_kda, cu_seqlens=cu)
    fwd, fwd_bwd = _fwd_bwd_fns(ours, args, device)
    row = {"kernel": "chunk_kda", "B": B, "T": T, "H": H, "HV": HV, "K": K, "V": K, "dtype": str(dtype),
           "N": B if cu is None else len(lens),
           "first_call_fwd_s": _first_call(fwd, device), "first_call_fwd_bwd_s": _first_call(fwd_bwd, device)}
    step(f"first call (compile + autotune) fwd {row['first_call_fwd_s']:.1f} s, "
         f"fwd+bwd {row['first_call_fwd_bwd_s']:.1f} s")
    row["fwd_ms"], row["fwd_p20_ms"], row["fwd_p80_ms"] = time_fn(fwd, device)
    row["host_fwd_ms"] = host_ms(fwd, device)   # right after the forward's timing, in the same state
    row["fwd_bwd_ms"], row["fwd_bwd_p20_ms"], row["fwd_bwd_p80_ms"] = time_fn(fwd_bwd, device)
    row["host_fwd_bwd_ms"] = host_ms(fwd_bwd, device)   # the backward's host path can bound it alone
    step(f"fwd {row['fwd_ms']:.4g} ms" + _host_note(row["host_fwd_ms"], row["fwd_ms"], flag=True)
         + f"; fwd+bwd {row['fwd_bwd_ms']:.4g} ms"
         + _host_note(row["host_fwd_bwd_ms"], row["fwd_bwd_ms"], flag=True, what="forward+backward"))
    # the same call without a decay bound (lower_bound=None: the softplus gate's path, pair-by-pair diagonal
    # score blocks), timed on the same inputs in the same run
    uf, ufb = _fwd_bwd_fns(functools.partial(ours, lower_bound=None), args, device)
    _first_call(uf, device), _first_call(ufb, device)
    row["unbounded_fwd_ms"], row["unbounded_fwd_bwd_ms"] = time_fn(uf, device)[0], time_fn(ufb, device)[0]
    row["unbounded_vs_bounded_fwd_bwd"] = row["unbounded_fwd_bwd_ms"] / row["fwd_bwd_ms"]
    step(f"without a decay bound: fwd {row['unbounded_fwd_ms']:.4g} ms, fwd+bwd {row['unbounded_fwd_bwd_ms']:.4g} ms "
         f"({row['unbounded_vs_bounded_fwd_bwd']:.2f}x the bounded fwd+bwd)")
    esz = args[0].element_size()
    io_bytes = B * T * (2 * H * K * esz + HV * K * esz + HV * K * 4 + HV * esz + HV * K * esz)
    row["fwd_mtok_s"] = B * T / (row["fwd_ms"] * 1e-3) / 1e6
    row["fwd_io_gbps"] = io_bytes / (row["fwd_ms"] * 1e-3) / 1e9
    ref_fwd = ref_fb = None
    if B * T * HV * 16 * K <= _TORCH_REF_LIMIT:
        try:
            ref = naive_chunk_kda if cu is None else functools.partial(naive_chunk_kda_varlen, cu_seqlens=cu)
            rf, rfb = _fwd_bwd_fns(ref, args, device)
            ref_fwd = time_fn(rf, device, reps=3)[0]
            ref_fb = time_fn(rfb, device, reps=3)[0]
        except torch.OutOfMemoryError:
            pass
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row["torch_ref_fwd_ms"], row["torch_ref_fwd_bwd_ms"] = ref_fwd, ref_fb
    step("torch reference " + ("skipped (too large)" if ref_fwd is None else f"fwd {ref_fwd:.4g} ms, fwd+bwd {ref_fb:.4g} ms"))
    row["speedup_vs_torch_fwd"] = None if ref_fwd is None else ref_fwd / row["fwd_ms"]
    row["speedup_vs_torch_fwd_bwd"] = None if ref_fb is None else ref_fb / row["fwd_bwd_ms"]
    fla = _fla_chunk_kda() if against_fla else None
    row["fla_fwd_ms"] = row["fla_fwd_bwd_ms"] = row["fla_first_call_fwd_s"] = row["fla_first_call_fwd_bwd_s"] = None
    row["fla_host_fwd_ms"] = row["fla_host_fwd_bwd_ms"] = None
    if fla is not None:
        kw = {} if cu is None else {"cu_seqlens": cu.to(device, torch.long)}
        ff, ffb = _fwd_bwd_fns(lambda *a: fla(*a, **kw), args, device)
        step("fla: compiling (tens of seconds per new shape)")
        row["fla_first_call_fwd_s"], row["fla_first_call_fwd_bwd_s"] = _first_call(ff, device), _first_call(ffb, device)
        step(f"fla first call (compile + autotune) fwd {row['fla_first_call_fwd_s']:.1f} s, "
             f"fwd+bwd {row['fla_first_call_fwd_bwd_s']:.1f} s")
        row["fla_fwd_ms"] = time_fn(ff, device)[0]
        row["fla_host_fwd_ms"] = host_ms(ff, device)
        step(f"fla fwd {row['fla_fwd_ms']:.4g} ms" + _host_note(row["fla_host_fwd_ms"], row["fla_fwd_ms"]))
        row["fla_fwd_bwd_ms"] = time_fn(ffb, device)[0]
        row["fla_host_fwd_bwd_ms"] = host_ms(ffb, device)
        step(f"fla fwd+bwd {row['fla_fwd_bwd_ms']:.4g} ms"
             + _host_note(row["fla_host_fwd_bwd_ms"], row["fla_fwd_bwd_ms"], what="forward+backward"))
    doc = FLA_DOC.get(shape, (None, None))
    row["fla_doc_fwd_ms"], row["fla_doc_fwd_bwd_ms"] = doc
    return row


def _bench_gate(shape, device):
    from k3cli.ops.kda import kda_gate
    B, T, _, HV, K = shape
    gen = torch.Generator().manual_seed(0)
    g_raw = torch.randn(B, T, HV, K, generator=gen).to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    A_log = torch.zeros(HV, device=device)
    bias = torch.zeros(HV, K, device=device)
    fwd, fwd_bwd = _fwd_bwd_fns(lambda a, b, c: (kda_gate(a, b, c),), (g_raw, A_log, bias), device, 0)
    row = {"kernel": "kda_gate", "B": B, "T": T, "HV": HV, "K": K, "dtype": str(g_raw.dtype),
           "first_call_fwd_s": _first_call(fwd, device), "first_call_fwd_bwd_s": _first_call(fwd_bwd, device)}
    row["fwd_ms"], row["fwd_p20_ms"], row["fwd_p80_ms"] = time_fn(fwd, device)
    row["fwd_bwd_ms"], row["fwd_bwd_p20_ms"], row["fwd_bwd_p80_ms"] = time_fn(fwd_bwd, device)
    io_bytes = B * T * HV * K * (g_raw.element_size() + 4)
    row["fwd_mtok_s"] = B * T / (row["fwd_ms"] * 1e-3) / 1e6
    row["fwd_io_gbps"] = io_bytes / (row["fwd_ms"] * 1e-3) / 1e9
    rf, rfb = _fwd_bwd_fns(lambda a, b, c: (chunk_local_cumsum(naive_kda_gate(a, b, c), 64),),
                           (g_raw, A_log, bias), device, 0)
    row["torch_ref_fwd_ms"] = time_fn(rf, device, reps=3)[0]
    row["torch_ref_fwd_bwd_ms"] = time_fn(rfb, device, reps=3)[0]
    row["speedup_vs_torch_fwd"] = row["torch_ref_fwd_ms"] / row["fwd_ms"]
    row["speedup_vs_torch_fwd_bwd"] = row["torch_ref_fwd_bwd_ms"] / row["fwd_bwd_ms"]
    return row


def bench_kda(kernel: str = "chunk_kda", shapes: str | list[tuple[int, ...]] = "toy", against_fla: bool = False,
              on_row=None, on_step=None) -> list[dict]:
    """Benchmark a KDA kernel on a shape set ("ci" | "toy" | "k3") or a list of (B, T, H, HV, K=V)
    shapes; one dict per shape.

    CUDA runs bf16 with triton.testing.do_bench; CPU (TRITON_INTERPRET=1) runs fp32 with a
    perf_counter loop and is only meaningful as a smoke test. `on_row(row)` is called as each shape
    finishes (progress output; a long run that is cut short still shows its finished rows);
    `on_step(message)` (chunk_kda) after each phase of a shape: first call, timings, reference, fla.
    """
    if kernel not in ("chunk_kda", "kda_gate"):
        raise ValueError(f"bench_kda: unknown kernel {kernel!r}; valid: 'chunk_kda', 'kda_gate'")
    if isinstance(shapes, str) and shapes not in SHAPES:
        raise ValueError(f"bench_kda: unknown shape set {shapes!r}; valid: {sorted(SHAPES)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ceiling = copy_ceiling_gbps(device)
    rows = []
    cases = [(tuple(x), None) for x in (SHAPES[shapes] if isinstance(shapes, str) else shapes)]
    if kernel == "chunk_kda" and isinstance(shapes, str):
        cases += [((1, sum(lens), H, H, K), lens) for lens, H, K in VARLEN_SHAPES[shapes]]
    for shape, lens in cases:
        row = (_bench_chunk(shape, device, against_fla, on_step, lens) if kernel == "chunk_kda"
               else _bench_gate(shape, device))
        row["copy_ceiling_gbps"] = ceiling
        row["fwd_io_frac_of_copy"] = row["fwd_io_gbps"] / ceiling
        rows.append(row)
        if on_row is not None:
            on_row(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
