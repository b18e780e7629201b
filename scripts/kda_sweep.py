"""Time and check chunk_kda launch/storage variants (k3cli.ops.kda.chunk.TUNING) on one GPU.

    python scripts/kda_sweep.py [fla] [VARIANT ...]     # all variants by default; 'fla' adds the peer
    python scripts/kda_sweep.py base fi_kb32 fi_kb64 fi_kb32_w4 gated_in states_in combo   # ~2 min

For each variant: relative RMS error of o, final state and every gradient against the fp32 torch
reference (B2 T1000 H4 HV8 K=V=128, bf16 inputs, with an initial state), and forward /
forward+backward medians at (8, 2048, 16, 16, 128) and (1, 16384, 16, 16, 128); fla's chunk_kda on
the same inputs when asked for and importable. Nothing here changes the defaults: copy a winner into TUNING.
"""
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "ops"))
from test_kda import TOL, make_inputs, rel_rms, run_with_grads  # noqa: E402

from k3cli.ops.kda import chunk as chunk_mod  # noqa: E402
from k3cli.ops.kda import chunk_kda  # noqa: E402
from k3cli.ops.kda.bench import _fla_chunk_kda, _fwd_bwd_fns, _inputs  # noqa: E402
from k3cli.ops.kda.naive import naive_chunk_kda  # noqa: E402

BASE = dict(chunk_mod.TUNING)
VARIANTS = {
    "base": {},
    # session 2, H200: whole-K stage 1 sits at 255 registers / 1 block per SM (ncu); key blocks cut that
    "fi_kb32": {"fwd_intra_BK": 32},
    "fi_kb64": {"fwd_intra_BK": 64},
    "fi_kb32_w4": {"fwd_intra_BK": 32, "fwd_intra_warps": 4},
    "fi_kb16_w4": {"fwd_intra_BK": 16, "fwd_intra_warps": 4},
    "gated_in": {"gated_dtype": "input"},
    "states_in": {"states_dtype": "input"},
    "inter_in": {"inter_dtype": "input"},
    # measured in session 2 (notes/session2_gpu.md): within 3 % of base
    "bi_k32v32w4": {"bwd_intra_BK": 32, "bwd_intra_BV": 32, "bwd_intra_warps": 4},
    "fi_w16": {"fwd_intra_warps": 16},
    "fi_w4": {"fwd_intra_warps": 4},
    "bi_k32v64w8": {"bwd_intra_BK": 32, "bwd_intra_BV": 64},
    "bi_k32v64w4": {"bwd_intra_BK": 32, "bwd_intra_BV": 64, "bwd_intra_warps": 4},
    "bi_k64v64w16": {"bwd_intra_warps": 16},
    "combo": {"fwd_intra_BK": 32, "bwd_intra_BK": 32, "bwd_intra_BV": 32, "bwd_intra_warps": 4,
              "gated_dtype": "input", "states_dtype": "input"},
}
SPEED_SHAPES = [(8, 2048, 16, 16, 128), (1, 16384, 16, 16, 128)]


def accuracy(ref, inputs):
    out = run_with_grads(chunk_kda, *inputs)
    return {n: rel_rms(out[n], ref[n]) for n in ref}


def speed(shape, fn=chunk_kda):
    args = _inputs(*shape, torch.bfloat16, torch.device("cuda"))
    fwd, fwd_bwd = _fwd_bwd_fns(fn, args, torch.device("cuda"))
    fwd(), fwd_bwd()
    return triton.testing.do_bench(fwd), triton.testing.do_bench(fwd_bwd)


def main(names):
    inputs = make_inputs(2, 1000, 4, 2, 128, 128, dtype=torch.bfloat16, device="cuda", h0=True)
    ref = run_with_grads(naive_chunk_kda, *[x.float() for x in inputs])
    rows = []
    fla = _fla_chunk_kda() if "fla" in names else None   # fla's first calls compile for minutes
    names = [n for n in names if n != "fla"]
    if fla is not None:
        row = {"variant": "fla"}
        for s in SPEED_SHAPES:
            row[f"{s}"] = speed(s, lambda *a: fla(*a))
        print(json.dumps(row), flush=True)
        rows.append(row)
    for name in names:
        over = VARIANTS[name]
        chunk_mod.TUNING.clear()
        chunk_mod.TUNING.update(BASE, **over)
        row = {"variant": name, "tuning": over}
        try:
            row["err"] = accuracy(ref, inputs)
            row["ok"] = all(e <= TOL[n] for n, e in row["err"].items())
            for s in SPEED_SHAPES:
                row[f"{s}"] = speed(s)
        except Exception as e:  # one broken variant must not cost the others' figures
            print(json.dumps({"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
            continue
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"{'variant':14s} {'ok':3s} {'max err/tol':>11s} " + " ".join(f"{str(s):>28s}" for s in SPEED_SHAPES))
    for r in rows:
        worst = max((e / TOL[n] for n, e in r.get("err", {}).items()), default=float("nan"))
        print(f"{r['variant']:14s} {str(r.get('ok', '-')):3s} {worst:11.2f} "
              + " ".join(f"{'fwd {:.3f} fb {:.3f}'.format(*r[str(s)]):>28s}" for s in SPEED_SHAPES))


if __name__ == "__main__":
    main(sys.argv[1:] or list(VARIANTS))
