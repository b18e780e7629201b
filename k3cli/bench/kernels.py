"""The kernel registry behind `k3 verify-equivalence` and `k3 bench-kernel`.

Each op folder under `k3cli/ops/` provides plain `verify_*` / `bench_*` functions; this module
picks the device, switches the Triton interpreter on where there is no GPU, and gives the
commands one table format.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

VERIFY_KERNELS = ("chunk_kda", "kda_gate", "decode", "attnres", "short_conv", "linear_ce")
BENCH_KERNELS = ("chunk_kda", "kda_gate", "decode", "attnres", "short_conv", "linear_ce")


def prepare_device() -> str:
    """'cuda' when a GPU is visible; otherwise 'cpu' with the Triton interpreter switched on.

    The interpreter flag is read when a `@triton.jit` function is defined, so this must run
    before any `k3cli.ops` module is imported.
    """
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        if any(m.startswith("k3cli.ops.") and m != "k3cli.ops.__init__" for m in sys.modules):
            raise RuntimeError("no CUDA device, and the Triton kernels were imported without "
                               "TRITON_INTERPRET=1; set it before starting Python")
        os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def _verify_fns() -> dict[str, Callable]:
    from k3cli.ops.attnres.verify import verify_attnres
    from k3cli.ops.kda.verify import verify_kda, verify_short_conv
    from k3cli.ops.linear_ce.verify import verify_linear_ce

    return {
        "chunk_kda": lambda shapes, dtype: verify_kda("chunk_kda", shapes, dtype),
        "kda_gate": lambda shapes, dtype: verify_kda("kda_gate", shapes, dtype),
        "decode": lambda shapes, dtype: verify_kda("fused_recurrent_kda", shapes, dtype),
        "attnres": lambda shapes, dtype: verify_attnres(shapes, dtype),
        "short_conv": lambda shapes, dtype: verify_short_conv(shapes, dtype),
        "linear_ce": lambda shapes, dtype: verify_linear_ce(shapes, dtype),
    }


def run_verify(kernels: list[str], shapes: str, dtype) -> list[tuple]:
    """Rows (kernel, name, rel_rms, max_abs, tol, passed) for every output and gradient."""
    fns = _verify_fns()
    rows = []
    for k in kernels:
        rows += [(k, *row) for row in fns[k](shapes, dtype)]
    return rows


# the default table's columns per kernel, (row key, header, format): each table fits 100 characters
BENCH_COLUMNS_NARROW = {
    "chunk_kda": [("B", "B", "d"), ("N", "seqs", "d"), ("T", "T", "d"), ("H", "H", "d"), ("HV", "HV", "d"),
                  ("K", "K=V", "d"), ("fwd_ms", "fwd ms", ".3f"), ("fwd_bwd_ms", "f+b ms", ".3f"),
                  ("fwd_io_frac_of_copy", "%copy", ".0%"), ("speedup_vs_torch_fwd_bwd", "×torch f+b", ".1f"),
                  ("fla_fwd_ms", "fla fwd", ".3f"), ("fla_fwd_bwd_ms", "fla f+b", ".3f"),
                  ("fla_doc_fwd_ms", "fla† fwd", ".3f"), ("fla_doc_fwd_bwd_ms", "fla† f+b", ".3f")],
    "kda_gate": [("B", "B", "d"), ("T", "T", "d"), ("HV", "HV", "d"), ("K", "K", "d"), ("fwd_ms", "fwd ms", ".3f"),
                 ("fwd_bwd_ms", "f+b ms", ".3f"), ("fwd_mtok_s", "fwd Mtok/s", ".1f"), ("fwd_io_gbps", "fwd GB/s", ".0f"),
                 ("speedup_vs_torch_fwd", "× torch fwd", ".1f"), ("speedup_vs_torch_fwd_bwd", "× torch f+b", ".1f")],
    "decode": [("B", "B", "d"), ("HV", "HV", "d"), ("K", "K=V", "d"), ("triton_ms", "ours ms", ".4f"),
               ("triton_GBps", "ours GB/s", ".0f"), ("torch_ms", "torch ms", ".4f"), ("fla_ms", "fla ms", ".4f"),
               ("fla_GBps", "fla GB/s", ".0f"), ("copy_GBps", "copy GB/s", ".0f")],
    "attnres": [("form", "form", "s"), ("L", "L", "d"), ("N", "N", "d"), ("D", "D", "d"), ("fwd_ms", "fwd ms", ".3f"),
                ("fwd_frac_copy", "%copy", ".0%"), ("vs_naive_fwd", "×naive fwd", ".1f"), ("fwdbwd_ms", "f+b ms", ".3f"),
                ("vs_naive_fwdbwd", "×naive f+b", ".1f"), ("fla_fwd_ms", "fla fwd", ".3f")],
    "short_conv": [("B", "B", "d"), ("T", "T", "d"), ("C", "C", "d"), ("documents", "docs", "s"),
                   ("fwd_ms", "fwd ms", ".3f"), ("fwd_bwd_ms", "f+b ms", ".3f"), ("fwd_frac_copy", "%copy", ".0%"),
                   ("vs_torch_fwd_bwd", "×torch f+b", ".1f"), ("vs_compiled_fwd_bwd", "×compiled f+b", ".2f")],
    "linear_ce": [("N", "N", "d"), ("D", "D", "d"), ("V", "V", "d"), ("torch_ms", "torch ms", ".3f"),
                  ("torch_peak_gib", "torch GiB", ".2f"), ("ours_ms", "ours ms", ".3f"), ("ours_peak_gib", "ours GiB", ".2f"),
                  ("liger_ms", "liger ms", ".3f"), ("liger_peak_gib", "liger GiB", ".2f"), ("cce_ms", "cce ms", ".3f"),
                  ("cce_peak_gib", "cce GiB", ".2f")],
}
# published fla† columns the default table shows only where fla was not timed in the run (100 characters)
BENCH_INSTEAD = {"fla_doc_fwd_ms": "fla_fwd_ms", "fla_doc_fwd_bwd_ms": "fla_fwd_bwd_ms"}

# every column per kernel (`--wide`)
BENCH_COLUMNS = {
    "chunk_kda": [("B", "B", "d"), ("N", "seqs", "d"), ("T", "T", "d"), ("H", "H", "d"), ("HV", "HV", "d"), ("K", "K=V", "d"),
                  ("fwd_ms", "fwd ms", ".3f"), ("fwd_p20_ms", "p20", ".3f"), ("fwd_p80_ms", "p80", ".3f"),
                  ("host_fwd_ms", "host fwd ms", ".3f"),
                  ("fwd_bwd_ms", "fwd+bwd ms", ".3f"), ("host_fwd_bwd_ms", "host f+b ms", ".3f"),
                  ("fwd_mtok_s", "fwd Mtok/s", ".1f"),
                  ("fwd_io_gbps", "fwd GB/s", ".0f"), ("fwd_io_frac_of_copy", "of copy", ".1%"),
                  ("speedup_vs_torch_fwd", "× torch fwd", ".1f"),
                  ("speedup_vs_torch_fwd_bwd", "× torch f+b", ".1f"),
                  ("fla_fwd_ms", "fla fwd ms", ".3f"), ("fla_fwd_bwd_ms", "fla f+b ms", ".3f"),
                  ("fla_doc_fwd_ms", "fla† fwd", ".3f"), ("fla_doc_fwd_bwd_ms", "fla† f+b", ".3f"),
                  ("unbounded_fwd_ms", "no-bound fwd", ".3f"), ("unbounded_fwd_bwd_ms", "no-bound f+b", ".3f"),
                  ("unbounded_vs_bounded_fwd_bwd", "× bounded f+b", ".2f"),
                  ("first_call_fwd_s", "1st call s", ".1f")],
    "kda_gate": None,  # every key of the row
    "decode": [("B", "B", "d"), ("HV", "HV", "d"), ("K", "K=V", "d"), ("triton_ms", "ours ms", ".4f"),
               ("triton_GBps", "ours state GB/s", ".0f"), ("torch_ms", "torch ms", ".4f"),
               ("fla_ms", "fla ms", ".4f"), ("fla_GBps", "fla state GB/s", ".0f"), ("copy_GBps", "copy GB/s", ".0f")],
    "attnres": [("form", "form", "s"), ("L", "L", "d"), ("N", "N", "d"), ("D", "D", "d"),
                ("fwd_ms", "fwd ms", ".3f"), ("fwd_spread_ms", "spread", ".3f"),
                ("fwd_GBps", "fwd GB/s", ".0f"), ("fwd_frac_copy", "of copy", ".1%"),
                ("naive_fwd_ms", "naive fwd", ".3f"), ("vs_naive_fwd", "× naive fwd", ".1f"),
                ("fwdbwd_ms", "f+b ms", ".3f"), ("vs_naive_fwdbwd", "× naive f+b", ".1f"),
                ("fla_fwd_ms", "fla fwd", ".3f"), ("fla_ref_fwd_ms", "fla† fwd", ".3f"),
                ("vs_fla_ref_fwd", "× fla†", ".2f")],
    "short_conv": [("B", "B", "d"), ("T", "T", "d"), ("C", "C", "d"), ("norm_dim", "norm", "d"),
                   ("documents", "docs", "s"), ("fwd_ms", "fwd ms", ".3f"), ("fwd_GBps", "fwd GB/s", ".0f"),
                   ("fwd_frac_copy", "of copy", ".1%"), ("fwd_bwd_ms", "f+b ms", ".3f"),
                   ("vs_torch_fwd", "× torch fwd", ".1f"), ("vs_torch_fwd_bwd", "× torch f+b", ".1f"),
                   ("compiled_fwd_ms", "compiled fwd", ".3f"), ("compiled_fwd_bwd_ms", "compiled f+b", ".3f"),
                   ("vs_compiled_fwd", "× compiled fwd", ".2f"), ("vs_compiled_fwd_bwd", "× compiled f+b", ".2f")],
    "linear_ce": None,  # every key of the row
}


def _progress_line(kernel: str, row: dict) -> str:
    """One line per finished shape, on stderr, so a long run shows where it is (and a run that is
    cut short keeps its finished rows)."""
    dims = " ".join(([str(row["form"])] if "form" in row else [])
                    + [f"{k}{row[k]}" for k in ("B", "T", "L", "N", "H", "HV", "K", "D") if k in row])
    times = " ".join(f"{k}={row[k]:.4g}" for k in row
                     if k.endswith("_ms") and "p20" not in k and "p80" not in k and isinstance(row[k], float))
    return f"[bench {kernel}] {dims}: {times}"


def run_bench(kernels: list[str], shapes: str, against_fla: bool,
              custom: list[tuple[int, ...]] | None = None) -> dict[str, list[dict]]:
    """Run each kernel's benchmark on the named shape set, or (chunk_kda / kda_gate) on `custom`
    (B, T, H, HV, K) shapes."""
    from k3cli.ops.attnres.bench import bench_attnres
    from k3cli.ops.kda.bench import bench_kda
    from k3cli.ops.kda.bench_conv import bench_short_conv
    from k3cli.ops.kda.bench_decode import SHAPES as DECODE_SHAPES
    from k3cli.ops.kda.bench_decode import bench_decode
    from k3cli.ops.linear_ce.bench import bench_linear_ce

    out = {}
    for k in kernels:
        def on_row(row, k=k):
            print(_progress_line(k, row), file=sys.stderr, flush=True)
        if k in ("chunk_kda", "kda_gate"):
            out[k] = bench_kda(k, custom or shapes, against_fla, on_row=on_row,
                               on_step=lambda msg, k=k: print(f"[bench {k}] {msg}", file=sys.stderr, flush=True))
        elif k == "decode":
            out[k] = bench_decode(DECODE_SHAPES["cpu" if shapes == "ci" else "gpu"], with_fla=against_fla)
            for row in out[k]:
                on_row(row)
        elif k == "attnres":
            out[k] = bench_attnres("ci" if shapes == "ci" else "k3", against_fla, on_row=on_row)
        elif k == "short_conv":
            out[k] = bench_short_conv(shapes, on_row=on_row)
        elif k == "linear_ce":
            out[k] = bench_linear_ce(shapes, on_row=on_row)
    return out
