"""Time and check chunk_kda launch/storage variants (k3cli.ops.kda.chunk.TUNING) on one GPU.

    python scripts/kda_sweep.py [fla] [VARIANT ...]     # all variants by default; 'fla' adds the peer
    python scripts/kda_sweep.py base nospill fi_kb32 bwd_split c32 c32_kb16_w4 gated_in bufs_in states_in   # ~2 min

For each variant: relative RMS error of o, final state and every gradient against the fp32 torch
reference (B2 T1000 H4 HV8 K=V=128, bf16 inputs, with an initial state), and forward /
forward+backward medians at (8, 2048, 16, 16, 128) and (1, 16384, 16, 16, 128); fla's chunk_kda on
the same inputs when asked for and importable. Nothing here changes the defaults: copy a winner into TUNING.
Without CUDA (TRITON_INTERPRET=1) it only runs tiny fp16 accuracy checks: a smoke test of the script.
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
# Each entry overrides the CURRENT chunk.TUNING, so an older entry now runs on top of later defaults.
# Session 4 made bwd_subchunk (2 warps) the default (entries that time the unsplit / split backward name
# "bwd_subchunk": False); session 5 made stage 1 the stored-Γ sub-chunk scores (fwd_scores "sub"; entries
# for the one-program-per-chunk stage 1 name "fwd_scores": "chunk") and the backward's per-chunk launches
# 4 warps, its score gradients 1 warp. "s4_defaults" and "s3_defaults" are the states before.
# Session 7 made the forward options in S6 below the defaults; "s6_defaults" is the state before, and the
# session-6 / session-7 entries that were timed against it carry it (**S6).
# Results: notes/session{2,...,7}_gpu.md and notes/session*_sweep*.jsonl.
S6 = {"fwd_tail_kg": False, "dot16_scan": False, "aqk_dtype": "fp32", "fwd_scores_per_pair": False,
      "fwd_scores_stages": 1, "fwd_segments_priority": False}
VARIANTS = {
    "base": {},
    "s6_defaults": S6,
    # session 6 made fwd_segments "auto" (4 ranges for few scan programs and many chunks) and bwd_overlap_scans
    # the defaults; this is the state before
    "s5_defaults": {**S6, "fwd_segments": 0, "bwd_overlap_scans": False},
    "s4_defaults": {**S6, "fwd_scores": "chunk", "bwd_subchunk_warps": 2, "bwd_intra_warps": 8, "fwd_segments": 0,
                    "bwd_overlap_scans": False},
    "s3_defaults": {**S6, "fwd_scores": "chunk", "bwd_subchunk": False, "bwd_intra_warps": 8, "fwd_segments": 0,
                    "bwd_overlap_scans": False},
    # session 2, H200: whole-K stage 1 sits at 255 registers / 1 block per SM (ncu); key blocks cut that
    "fi_kb32": {"fwd_scores": "chunk", "fwd_intra_BK": 32},
    "fi_kb64": {"fwd_scores": "chunk", "fwd_intra_BK": 64},
    "fi_kb32_w4": {"fwd_scores": "chunk", "fwd_intra_BK": 32, "fwd_intra_warps": 4},
    "fi_kb16_w4": {"fwd_scores": "chunk", "fwd_intra_BK": 16, "fwd_intra_warps": 4},
    "fi_kb16_w16": {"fwd_scores": "chunk", "fwd_intra_BK": 16, "fwd_intra_warps": 16},   # 128 regs: 16 resident warps per SM
    "fi_kb16_r128": {"fwd_scores": "chunk", "fwd_intra_BK": 16, "fwd_intra_maxnreg": 128},  # 2 blocks per SM, 280 B spill stack
    "gated_in": {"gated_dtype": "input"},
    "states_in": {"states_dtype": "input"},
    "inter_in": {"inter_dtype": "input"},
    # 2-byte W, Q e^Γ, K e^(γ-Γ): the state scans' two-stage configs fit in shared memory at K = 128
    "bufs_in": {"inter_dtype": "input", "gated_dtype": "input"},
    # measured in session 2 (notes/session2_gpu.md): within 3 % of base
    "bi_k32v32w4": {"bwd_subchunk": False, "bwd_intra_BK": 32, "bwd_intra_BV": 32, "bwd_intra_warps": 4},
    "fi_w16": {"fwd_scores": "chunk", "fwd_intra_warps": 16},
    "fi_w4": {"fwd_scores": "chunk", "fwd_intra_warps": 4},
    "bi_k32v64w8": {"bwd_subchunk": False, "bwd_intra_BK": 32, "bwd_intra_BV": 64},
    "bi_k32v64w4": {"bwd_subchunk": False, "bwd_intra_BK": 32, "bwd_intra_BV": 64, "bwd_intra_warps": 4},
    "bi_k64v64w16": {"bwd_subchunk": False, "bwd_intra_warps": 16},
    # spill-free per scripts/ptxas_report.py (sm_90, 8 warps): stage 1 BK32, split backward BK32 BV32
    "nospill": {"fwd_scores": "chunk", "bwd_subchunk": False, "fwd_intra_BK": 32, "bwd_split": True, "bwd_intra_BK": 32, "bwd_intra_BV": 32},
    # scores / solve / W,U launches: 232 / 125 / 196 registers at 8 warps (ptxas_report), no spills
    "fi_split_kb32": {"fwd_scores": "chunk", "fwd_intra_split": True, "fwd_intra_BK": 32},
    "fi_split_kb32_w16": {"fwd_scores": "chunk", "fwd_intra_split": True, "fwd_intra_BK": 32, "fwd_intra_warps": 16},   # all spill-free
    "bwd_split": {"bwd_subchunk": False, "bwd_split": True},
    "bwd_split_k32v32": {"bwd_subchunk": False, "bwd_split": True, "bwd_intra_BK": 32, "bwd_intra_BV": 32},
    "bwd_split_k32v32_w16": {"bwd_subchunk": False, "bwd_split": True, "bwd_intra_BK": 32, "bwd_intra_BV": 32, "bwd_intra_warps": 16},
    # the session-2 guess from ptxas_report: every launch spill-free or nearly, 2-stage scans
    "guess": {"fwd_scores": "chunk", "bwd_subchunk": False, "fwd_intra_split": True, "fwd_intra_BK": 32, "fwd_intra_warps": 16, "bwd_split": True,
              "bwd_intra_BK": 32, "bwd_intra_BV": 32, "inter_dtype": "input", "gated_dtype": "input"},
    # session 3: the backward reads the forward's stored Mkk for dβ instead of recomputing the scores per key
    # block (ptxas K128 8 warps: bwd_intra 255 regs, 1296 B stack vs 1192 recomputing; fewer instructions)
    "bwd_mkk": {"bwd_subchunk": False, "bwd_stored_mkk": True},
    "bwd_mkk_split_k32v32": {"bwd_subchunk": False, "bwd_stored_mkk": True, "bwd_split": True, "bwd_intra_BK": 32, "bwd_intra_BV": 32},
    # session 3: score gradients per (chunk, 16-row sub-chunk, 32-column key block) (ptxas K128: 80 regs,
    # no spills), the key-side kernel without its sub-chunk loop (BK32 BV32: 183 regs, no spills)
    "bwd_subchunk": {"bwd_subchunk": True},
    "bwd_subchunk_k32v32": {"bwd_subchunk": True, "bwd_intra_BK": 32, "bwd_intra_BV": 32},
    "bwd_subchunk_k32v32_w8": {"bwd_subchunk": True, "bwd_intra_BK": 32, "bwd_intra_BV": 32, "bwd_subchunk_warps": 8},
    # session 3: the forward keeps S_n, Vn for the backward (no re-scan; memory for one scan's states)
    "store_states": {"fwd_store_states": True},
    # bf16 per-chunk states for the backward scans (not reached by session 3's sweep)
    "states_in_s3": {"states_dtype": "input"},
    # the pre-session-3 default at K = 128 (TUNING "auto" now picks 2-byte buffers there)
    "fp32_bufs": {"inter_dtype": "fp32", "gated_dtype": "fp32"},
    # session 4, on session 3's defaults: combinations with the backward winner bwd_subchunk
    "bsub_store": {"bwd_subchunk": True, "fwd_store_states": True},
    "bsub_mkk_w8": {"bwd_subchunk": True, "bwd_subchunk_warps": 8},
    "bsub_w2": {"bwd_subchunk": True, "bwd_subchunk_warps": 2},
    "bsub_store_w2": {"bwd_subchunk": True, "fwd_store_states": True, "bwd_subchunk_warps": 2},
    # session 4: the per-chunk backward's products with 16-bit operands (dot16_bwd; off: dg error at K16)
    "d16_bwd": {"bwd_subchunk": True, "fwd_store_states": True, "dot16_bwd": True},
    "d16n_bwd": {"dot16_bwd": "narrow"},   # the anchored score products stay TF32 (untimed)
    "d16_bwd_only": {"dot16_bwd": True},
    # session 4, after the device time: stage-1 scores as 16 x 16 block pairs in 2-D whole-K tiles, one
    # program per (chunk, head), then the solve + W, U launch (ptxas K128: 255 registers, no spill at 4 warps)
    "pairs": {"fwd_scores": "pairs"},
    "pairs_w8": {"fwd_scores": "pairs", "fwd_intra_pairs_warps": 8},
    "pairs_w2": {"fwd_scores": "pairs", "fwd_intra_pairs_warps": 2},
    "pairs_store": {"fwd_scores": "pairs", "fwd_store_states": True},
    # session 5 (measured with the tail at 8 warps, whole K; now fwd_tail_*): pairs at fewer warps (2 warps:
    # stage-1 scores 0.59 ms against 0.82), the solve and W, U as two launches after them, and the
    # per-sub-chunk scores from a stored Γ (fwd_scores "sub")
    "pairs_w1": {"fwd_scores": "pairs", "fwd_intra_pairs_warps": 1},
    "pairs_w2_split": {"fwd_scores": "pairs", "fwd_intra_pairs_warps": 2, "fwd_intra_split": True},
    "pairs_w1_split": {"fwd_scores": "pairs", "fwd_intra_pairs_warps": 1, "fwd_intra_split": True},
    "pairs_w2_split_bk32": {"fwd_scores": "pairs", "fwd_intra_pairs_warps": 2, "fwd_intra_split": True,
                            "fwd_tail_BK": 32},
    "pairs_w2_w4": {"fwd_scores": "pairs", "fwd_intra_pairs_warps": 2, "fwd_tail_warps": 4},
    "sub": {"fwd_scores": "sub"},
    "sub_w2": {"fwd_scores": "sub", "fwd_intra_sub_warps": 2},
    "sub_bk16": {"fwd_scores": "sub", "fwd_intra_sub_BK": 16},
    "sub_split": {"fwd_scores": "sub", "fwd_intra_split": True},
    "sub_split_bk32": {"fwd_scores": "sub", "fwd_intra_split": True, "fwd_tail_BK": 32},
    # session 5, call 3: the best launches of call 2 (scripts/kda_stage1_sub.py) together
    "s5": {"fwd_scores": "sub", "fwd_intra_sub_BK": 64, "fwd_tail_warps": 2, "fwd_tail_BK": 32},
    "s5_split": {"fwd_scores": "sub", "fwd_intra_sub_BK": 64, "fwd_tail_warps": 2, "fwd_tail_BK": 32,
                 "fwd_intra_split": True},
    "s5_bk64": {"fwd_scores": "sub", "fwd_intra_sub_BK": 64, "fwd_tail_warps": 2, "fwd_tail_BK": 64},
    "s5_pairs": {"fwd_scores": "pairs", "fwd_intra_pairs_warps": 1, "fwd_tail_warps": 2, "fwd_tail_BK": 32},
    "s5_bw4": {"fwd_scores": "sub", "fwd_intra_sub_BK": 64, "fwd_tail_warps": 2, "fwd_tail_BK": 32,
               "bwd_intra_warps": 4},
    "s5_bw2": {"fwd_scores": "sub", "fwd_intra_sub_BK": 64, "fwd_tail_warps": 2, "fwd_tail_BK": 32,
               "bwd_intra_warps": 2},
    "s5_bsw1": {"fwd_scores": "sub", "fwd_intra_sub_BK": 64, "fwd_tail_warps": 2, "fwd_tail_BK": 32,
                "bwd_subchunk_warps": 1},
    "s5_bw4_k32": {"fwd_scores": "sub", "fwd_intra_sub_BK": 64, "fwd_tail_warps": 2, "fwd_tail_BK": 32,
                   "bwd_intra_warps": 4, "bwd_intra_BK": 32, "bwd_intra_BV": 32},
    # session 5, untimed: the backward reads the forward's stored Γ (no cumsums of g in its split kernels)
    "sgamma": {"bwd_stored_gamma": True},
    # session 5, untimed: the forward in chunk ranges, stage 1 on a side stream overlapping the scan
    "seg2": {"fwd_segments": 2},
    "seg4": {"fwd_segments": 4},
    "seg8": {"fwd_segments": 8},
    # session 5, untimed: the backward's re-scan on a side stream, concurrent with the reverse scan
    "no_ovl": {"bwd_overlap_scans": False},   # session 6 default: on
    "seg4_no_ovl": {"fwd_segments": 4, "bwd_overlap_scans": False},
    # session 5, untimed: the score-gradient launch over 16 / 64 key columns (ptxas K128: 1 warp 232 / 255
    # registers + 472 B stack; 2 warps 166 / 254, no spill) against the default 32
    "bsub_bk16": {"bwd_subchunk_BK": 16},
    "bsub_bk64_w2": {"bwd_subchunk_BK": 64, "bwd_subchunk_warps": 2},
    # session 5, untimed: the stage-1 tail (solve + W, U) at 1 warp / as two launches, the key side BK32 BV64
    "tail_w1": {"fwd_tail_warps": 1},
    "tail_split": {"fwd_intra_split": True},
    "bi_k32v64": {"bwd_intra_BK": 32, "bwd_intra_BV": 64},
    "sgamma_store": {"bwd_stored_gamma": True, "fwd_store_states": True},
    # session 6: O in its own parallel launch after a scan that only carries the state (and stores S_n, Vn,
    # which the backward then reuses); with the states stored 2-byte; with the segmented forward
    # session 6: the parallel scan (runs of chunks from start states computed by the run summaries)
    "par2": {"fwd_scan_parallel": 2},
    "par4": {"fwd_scan_parallel": 4},
    "par8": {"fwd_scan_parallel": 8},
    "par16": {"fwd_scan_parallel": 16},
    "par8_store": {"fwd_scan_parallel": 8, "fwd_store_states": True},
    "par4_store": {"fwd_scan_parallel": 4, "fwd_store_states": True},
    # session 6, untimed: the stage-1 score launch per 16 x 16 block pair, with pipelined key-block loads
    "pp": {**S6, "fwd_scores_per_pair": True},
    "pp_s2": {**S6, "fwd_scores_per_pair": True, "fwd_scores_stages": 2},
    "pp_s3": {**S6, "fwd_scores_per_pair": True, "fwd_scores_stages": 3},
    "pp_w2_s2": {**S6, "fwd_scores_per_pair": True, "fwd_scores_stages": 2, "fwd_intra_sub_warps": 2},
    "sub_s2": {**S6, "fwd_scores_stages": 2},
    # session 6, untimed: the forward scan with 16-bit dot operands (scan alone at B8, BV64 w8 s1: 0.433 -> 0.338 ms)
    "scan16": {**S6, "dot16_scan": True},
    "scan16_store": {**S6, "dot16_scan": True, "fwd_store_states": True},
    # session 7: β K e^Γ from the Γ launch to the tail (no second k, g read there); with the 16-bit scan
    "kg": {**S6, "fwd_tail_kg": True},
    "kg_scan16": {**S6, "fwd_tail_kg": True, "dot16_scan": True},
    "kg_scan16_pp_s2": {**S6, "fwd_tail_kg": True, "dot16_scan": True, "fwd_scores_per_pair": True,
                        "fwd_scores_stages": 2},
    "kg_scan16_aqk16": {**S6, "fwd_tail_kg": True, "dot16_scan": True, "aqk_dtype": "input"},
    "scan16_aqk16": {**S6, "dot16_scan": True, "aqk_dtype": "input"},
    # session 7: the B1 forward's overlap of stage 1 and the scan with the faster stages (timed before
    # fwd_segments_priority became the default: "base" there is "noprio" now; "seg2" above now has priority)
    "seg0": {"fwd_segments": 0},
    "noprio": {"fwd_segments_priority": False},
    "prio": {"fwd_segments_priority": True},
    "seg2_prio": {"fwd_segments": 2, "fwd_segments_priority": True},
    "seg8_prio": {"fwd_segments": 8, "fwd_segments_priority": True},
    "osplit": {"fwd_output": "split"},
    "osplit_s16": {"fwd_output": "split", "states_dtype": "input"},
    "osplit_seg4": {"fwd_output": "split", "fwd_segments": 4},
    # chunk 32: [32, 32] score tiles, twice the sequential scan steps (chunk_size is chunk_kda's argument)
    "c32": {"chunk_size": 32},
    "c32_kb16_w4": {"fwd_scores": "chunk", "chunk_size": 32, "fwd_intra_BK": 16, "fwd_intra_warps": 4},
    "combo": {"fwd_scores": "chunk", "bwd_subchunk": False, "fwd_intra_BK": 32, "bwd_intra_BK": 32, "bwd_intra_BV": 32, "bwd_intra_warps": 4,
              "gated_dtype": "input", "states_dtype": "input"},
}
SPEED_SHAPES = [(8, 2048, 16, 16, 128), (1, 16384, 16, 16, 128)]
if os.environ.get("SWEEP_FIRST_SHAPE") == "1":   # a quick screen: the first shape only
    SPEED_SHAPES = SPEED_SHAPES[:1]
elif os.environ.get("SWEEP_LAST_SHAPE") == "1":   # the second (B1 T16384) only
    SPEED_SHAPES = SPEED_SHAPES[1:]


def accuracy(ref, inputs, chunk_size=64):
    out = run_with_grads(chunk_kda, *inputs, chunk_size=chunk_size)
    return {n: rel_rms(out[n], ref[n]) for n in ref}


def speed(shape, fn=chunk_kda, chunk_size=None):
    if chunk_size is not None:
        def fn(*a, _fn=fn):
            return _fn(*a, chunk_size=chunk_size)
    args = _inputs(*shape, torch.bfloat16, torch.device("cuda"))
    fwd, fwd_bwd = _fwd_bwd_fns(fn, args, torch.device("cuda"))
    fwd(), fwd_bwd()
    return triton.testing.do_bench(fwd), triton.testing.do_bench(fwd_bwd)


def main(names):
    global SPEED_SHAPES
    if torch.cuda.is_available():
        inputs = make_inputs(2, 1000, 4, 2, 128, 128, dtype=torch.bfloat16, device="cuda", h0=True)
    else:  # smoke test of the script itself (TRITON_INTERPRET=1): tiny fp16 accuracy checks, no timing
        inputs = make_inputs(1, 70, 1, 2, 32, 32, dtype=torch.float16, device="cpu", h0=True)
        SPEED_SHAPES = []
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
        chunk = over.get("chunk_size", 64)
        tuning = {k: v for k, v in over.items() if k != "chunk_size"}
        chunk_mod.check_tuning(tuning)
        chunk_mod.set_tuning(BASE, tuning)
        row = {"variant": name, "tuning": over}
        try:
            row["err"] = accuracy(ref, inputs, chunk)
            row["ok"] = all(e <= TOL[n] for n, e in row["err"].items())
            for s in SPEED_SHAPES:
                row[f"{s}"] = speed(s, chunk_size=chunk)
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
