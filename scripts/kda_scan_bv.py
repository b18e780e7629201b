"""The forward state scan at narrower value blocks with 16-bit operands, each config in its own process.

    python scripts/kda_scan_bv.py [B,T,H,HV,K] [--variants=BV:W:S:KDT,...]   # CUDA, bf16; default B1 T16384 H16 K128

At K = 128 the scan has B*HV*V/BV programs (32 at B1 H16 BV 64), sequential over the chunks. Narrower value
blocks give more programs, but with 16-bit operands BV 32 hit an illegal memory access on the H200 (sessions
4 and 6), so with the register-transposed K_d tile (chunk.TUNING scan_kd_t off) prune_state_configs keeps BV 64
there; scan_kd_t (KD_T) loads K_d^T directly as a [BK, BT] tile and lets BV 32 / 16 through. This script asks
whether either form runs at BV 32 / 16, how fast, and whether O matches: each variant runs in a child process
(an illegal access poisons the CUDA context), which prints the scan time (with O stored, as the forward runs
it) and O's max abs and relative RMS difference from the autotuned scan with scan_kd_t off (BV 64).
"""
from __future__ import annotations

import subprocess
import sys

import torch
import triton

DEFAULT = "64:8:2:0,64:4:2:0,64:8:2:1,64:4:2:1,32:4:1:1,32:4:2:1,32:8:2:1,32:2:2:1,16:4:2:1,16:2:2:1,32:4:2:0"


def one(shape, variant) -> None:
    from kda_scan_configs import time_config  # scripts/ is on sys.path when run as a script

    from k3cli.ops.kda import chunk as C_
    from k3cli.ops.kda import chunk_fwd as F
    from k3cli.ops.kda.bench import _inputs

    dev = torch.device("cuda")
    B, T, H, HV, K = shape
    V, BT = K, 64
    bv, nw, ns, kdt = variant
    q, k, v, g, b = _inputs(*shape, torch.bfloat16, dev)
    prec = F.dot_precision(v.dtype)
    sprec = C_.scan_precision(prec, v)
    it = C_.fwd_intra(q, k, v, g, b, K ** -0.5, BT, prec)
    o_ref = F.kda_fwd_state(it, B, T, HV, BT, None, v.dtype, False, precision=sprec, kd_t=False)[0].float()
    o = torch.empty(B, T, HV, V, device=dev, dtype=v.dtype)
    cfg = triton.Config({"BV": bv}, num_warps=nw, num_stages=ns)
    # timed first: every launch writes the same O, compared after
    t = time_config(it, o, None, None, B, T, HV, K, V, BT, sprec, cfg, True, bool(kdt))
    d = o.float() - o_ref
    rms = (d.pow(2).mean() / o_ref.pow(2).mean()).sqrt().item()
    print(f"BV{bv:3d} w{nw} s{ns} kd_t={kdt}: {t:.3f} ms, O max|d| {d.abs().max().item():.3e} rel rms {rms:.2e} "
          f"({sprec} operands)", flush=True)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    shape = tuple(int(x) for x in args[0].split(",")) if args else (1, 16384, 16, 16, 128)
    if "--one" in sys.argv:
        one(shape, tuple(int(x) for x in args[1].split(":")))
        return
    spec = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--variants=")), DEFAULT)
    print(f"scan variants at {shape}, one process each", flush=True)
    for variant in spec.split(","):
        cmd = [sys.executable, __file__, ",".join(map(str, shape)), variant, "--one"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip() and "Warning" not in ln]
        if r.returncode == 0:
            print(lines[-1] if lines else f"{variant}: no output", flush=True)
        else:
            print(f"{variant}: exit {r.returncode}: " + " | ".join(lines[-3:]), flush=True)


if __name__ == "__main__":
    main()
