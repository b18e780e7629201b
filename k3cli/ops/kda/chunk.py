"""Triton chunked KDA: autograd wrapper and public entry point (kernels in chunk_fwd.py, chunk_bwd.py).

Launches with the default TUNING: forward 4 (Γ with the gated operands, sub-chunk or block-pair scores,
solve + W, U, state scan), or on CUDA for few long sequences (fwd_segments "auto") those 4 per chunk range,
the scans on a high-priority side stream (fwd_segments_priority); backward 5
(state re-scan, on a side stream concurrent with the reverse state scan, and the per-chunk gradients as
V side, intra-chunk score gradients, key side) plus, with GVA, the group sum of dq, dk in torch. The TUNING
alternatives change that count (one per-chunk backward launch without bwd_subchunk / bwd_split, no
re-scan with fwd_store_states or fwd_output "split", one more O launch with the latter, a run-summary
launch and small torch products with fwd_scan_parallel, other stage-1 plans with fwd_scores /
fwd_intra_split).
"""
from __future__ import annotations

import torch

from k3cli.layers.norm import l2norm
from k3cli.ops import launch
from k3cli.ops.kda.checks import check_kda_inputs
from k3cli.ops.kda.chunk_bwd import kda_bwd_intra, kda_bwd_state
from k3cli.ops.kda.chunk_fwd import Intra, StateScan, dot_precision, kda_fwd_intra, kda_fwd_o, kda_fwd_state

_CHUNK_SIZES = (16, 32, 64)

# Launch and storage choices, in one place so scripts/kda_sweep.py can time alternatives on a GPU.
# fwd_scores: how stage 1 forms the intra-chunk scores Aqk, Akk.
#   "sub" (default): Γ = chunk-local cumsum g into an fp32 buffer with the gated operands (one program per
#     chunk, head and 64 key columns), then one program per (chunk, 16-row query sub-chunk) forms its
#     16 x 16 blocks c <= a from that Γ (fwd_intra_sub_warps, fwd_intra_sub_BK: key columns per step), then
#     the solve and W, U (the "tail": fwd_tail_warps, fwd_tail_BK; fwd_intra_split: as two launches).
#     Why (H200, bf16, session 5, notes/session5_gpu.md): small programs at 1-2 warps, many per SM; at
#     B8 T2048 H16 K=V=128 the forward went from 1.684 to 1.083 ms, B1 T16384 from 2.219 to 1.625.
#     Memory: the Γ buffer, [B*HV, T, K] fp32, lives during the forward only (unless bwd_stored_gamma).
#   "pairs": one program per (chunk, head) forms each 16 x 16 block pair once in whole-K [16, K] tiles,
#     Γ from running sub-chunk sums, plus the gated operands (fwd_intra_pairs_warps), then the same tail:
#     1.127 ms at the shape above (1 warp).
#   "chunk": session 4's default, one program per (chunk, head) for everything (fwd_intra_warps,
#     fwd_intra_BK: None = whole K; fwd_intra_split: three launches; fwd_intra_maxnreg: register cap).
# bwd_stored_mkk: stage 1 also stores the raw Mkk (when a gradient is needed), and the per-chunk backward
#   reads it for dβ instead of recomputing the intra-chunk scores in every key block.
# bwd_subchunk (default): the split backward with stored Mkk, whose intra-chunk score gradients come
#   from a launch per (chunk, 16-row sub-chunk, 32-column key block) instead of masked [BT, BK] tiles in
#   the key-side kernel (implies bwd_split and bwd_stored_mkk; bwd_subchunk_warps / _BK: that launch's
#   warps and key columns; session 6: 32 at 1 warp beat 16 (fwd+bwd 4.616 ms at B8 T2048 H16 K128 against
#   4.091) and 64 at 2 warps (4.286)).
#   Why (H200, bf16, fwd / fwd+bwd ms, notes/session4_gpu.md): B8 T2048 H16 K=V=128 from 1.662 / 6.680
#   (session 3's defaults) to 1.682 / 5.713 with 2 warps, B1 T16384 from 2.199 / 8.469 to 2.214 / 7.558;
#   relative RMS errors against the fp32 reference unchanged to 4 digits. Session 5: 1 warp (fwd+bwd
#   5.093 -> 4.808 ms at B8 with fwd_scores "sub") and bwd_intra_warps 4 for the V-side and key-side
#   launches (5.093 -> 4.853; 2 warps: 18.7 ms).
# dot16_bwd: the per-chunk backward's products take operands rounded to the input dtype (bf16 / fp16)
#   instead of fp32 operands at TF32; the anchored score products keep fp32 range (chunk_fwd._dot_wide).
#   Off by default: it made fwd+bwd 8 % faster at K = 128 (5.73 -> 5.27 ms above, with fwd_store_states),
#   but dg's relative RMS error at B2 T1000 H1 G2 K=V=16 rose from 0.0044 to 0.029, over the 0.02
#   (H200, session 4). "narrow": the same except the anchored score products and their gradients, which
#   stay TF32 (in bf16 the likeliest source of that dg error; identical to True for fp16, whose range
#   forces it there anyway). Not yet timed or checked on a GPU.
# fwd_segments: "auto" (default), 0, or n >= 2: the forward in n chunk ranges, stage 1 of all ranges on a side
#   CUDA stream and the state scan of range i on the current stream as soon as stage 1 of range i is done,
#   so the scan (B*HV*V/BV programs, few when B*HV is small) overlaps the parallel stage 1 of later ranges.
#   Same kernels and values as unsegmented (GPU test: bit-equal). H200, bf16, session 6: B1 T16384 H16
#   K=V=128 forward 1.634 -> 1.502 ms at 4 ranges, but B8 T2048 H16 1.083 -> 1.466; "auto" picks 4 ranges
#   only for few scan programs and many chunks (auto_segments). On CPU the ranges run one after another.
# fwd_segments_priority (default on): with fwd_segments, the other way round: stage 1 on the current stream and
#   the scans on a high-priority side stream, so that a range's 32-odd scan programs (8 warps each, about an
#   SM's registers) are dispatched ahead of the later ranges' thousands of pending stage-1 programs instead
#   of waiting for SMs to drain. H200, bf16, session 7 (notes/session7_call4, one process, fla's chunk_kda in
#   the same run at 1.188 / 5.532 ms): B1 T16384 H16 K=V=128 forward / fwd+bwd 1.595 / 4.772 ms with 4
#   ranges -> 1.191 / 4.758 (2 ranges: 1.280, with priority 1.267; 8 with priority 2.073; one range 1.461);
#   outputs bit-equal to one range (GPU test). Session 8 (notes/session8_gpu.md): that forward-only figure has
#   two modes, ~1.19 and 1.56-1.85 ms (13 of 24 timings slow; one range 1.455-1.461 in every timing). Cause
#   not established; likeliest the launch path: the host takes 0.88-0.95 ms to enqueue one call (12 stage-1
#   launches, 4 scan launches, the stream switches), 74-80 % of the device time (one range: 0.39 ms).
#   Forward+backward was stable: 4.729-4.755 ms against one range's 5.004-5.031, hence still the default.
#   Session 9, with fast_launch: 18 rounds at 1.175-1.194 ms (fla 1.18 in the same processes); 8 ranges
#   1.139-1.167 in 14 of 18 rounds but 1.24-1.46 in 4 (fwd+bwd 4.698-4.715 against 4.726-4.745), so still 4.
# bwd_overlap_scans (default on): the backward's forward re-scan (S_n, Vn) on a side CUDA stream, concurrent
#   with the reverse scan (dS_n, dVn), which does not read it; both are sequential over chunks and, with few
#   B*HV, leave most SMs idle. H200, bf16, session 6: forward+backward B1 T16384 H16 K128 5.962 -> 5.475 ms,
#   B8 T2048 4.091 -> 4.082 (bit-equal outputs, GPU test). A no-op with fwd_store_states and on CPU. Memory:
#   the re-scan's S_n, Vn are allocated on the side stream, whose cached blocks only side-stream allocations
#   reuse, so about one re-scan's S_n + Vn (~0.4 GB at B1 T16384 H16 K=V=128) stays reserved there.
# bwd_stored_gamma: keep fwd_scores "sub"'s Γ buffer ([B*HV, T, K] fp32, about q and k's size in bf16) for
#   the backward, whose split kernels then read Γ instead of forming cumsums of g. H200, bf16, session 6:
#   fwd+bwd 4.091 -> 4.159 ms at B8 T2048 H16 K128, 5.962 -> 6.037 at B1 T16384: slower, off.
# fwd_store_states: when a gradient is needed, the forward scan also stores S_n and Vn (memory: one
#   [B*HV, NT, K, V] states buffer and one [B*HV, T, V] fp32 buffer per call, about as much as q, k, v, g
#   themselves at K = V = 128) and the backward skips its re-scan (session 4: 0.29 ms of 5.7 at B8 T2048 H16 K128;
#   session 6: fwd+bwd 4.091 -> 3.909 ms there, B1 T16384 5.962 -> 5.344).
#   Off by default for that memory.
# Session 7's forward defaults, measured together (H200, bf16, notes/session7_call1/, scripts/kda_sweep.py;
#   forward / fwd+bwd ms at B8 T2048 H16 K=V=128 and B1 T16384 H16 K=V=128; session 6's defaults in the same
#   run: 1.073 / 4.051 and 1.487 / 5.301): kg + dot16_scan + per pair with 2 stages 0.839 / 3.845 and 1.262 /
#   5.672; kg + dot16_scan + 2-byte Aqk 0.921 / 3.847 and 1.370 / 4.757. All four were not swept together;
#   `k3 bench-kernel` timed them in calls 2-3 (B8 0.828 / 3.779, B1 1.546 / 4.817 before
#   fwd_segments_priority). Against the fp32 reference (B2 T1000 H4 HV8 K=V=128, bf16) o's relative RMS
#   error goes 2.75e-3 -> 3.07e-3 (tolerance 5e-3), dv's 2.00e-3 -> 2.03e-3 and dβ's 2.16e-3 -> 2.18e-3 (the
#   2-byte Aqk), the rest unchanged to 3 digits.
# fwd_scores_per_pair, fwd_scores_stages ("auto" both): fwd_scores "sub"'s score launch with one program per
#   16 x 16 block pair (a, c), c <= a (10 per 64-token chunk, each one block) instead of per query sub-chunk
#   (4, with 1 to 4 blocks each), and its pipeline stages (1-4: the key-block loop's loads of the next block
#   issued while this one multiplies). "auto": per pair with 2 stages when K > 64 (more than one key block),
#   else per sub-chunk at 1 stage (scores_plan). Session 7, alone: per pair 1.078 / 1.471 ms forward (B8 /
#   B1 above; base 1.079 / 1.494), with 2 stages 0.980 / 1.435, 3 stages 0.996 / 1.380, 2 warps + 2 stages
#   1.023 / 1.395; per sub-chunk with 2 stages 1.008 / 1.892. K <= 64 is not re-timed: the toy-shape
#   path is session 5's.
# fwd_tail_kg (default on; fwd_scores "sub" only, the other plans' tails read k, g): the Γ launch also stores β K e^Γ (in the W buffer, W's dtype), and the
#   tail reads it there instead of reading k and g (fp32) again and re-forming Γ; W = Tm (β K e^Γ) overwrites
#   it in place. Saves the tail's k and g reads (2 + 4 bytes per key element with bf16 k, fp32 g) for one
#   store in W's dtype (2 bytes at K > 64, 4 below); W's input is then rounded to W's dtype before the
#   product (as fla's W). Session 7, alone: 1.073 / 4.051 -> 1.029 / 4.004 ms at B8, 1.487 / 5.301 ->
#   1.419 / 5.238 at B1; errors unchanged to 3 digits. With the 16-bit scan it helped at B8 in every
#   combination (0.981 -> 0.937, 0.969 -> 0.921) but not in the B1 forward (1.285 -> 1.314, 1.264 -> 1.370),
#   where the overlap of the ranges moves the figure by more than that between runs.
# dot16_scan (default on): the forward state scan (and the backward's re-scan, the split O launch, the parallel
#   scan's summaries) multiply operands rounded to the input dtype (bf16 / fp16; the state itself stays fp32,
#   as in fla's state scan) instead of fp32 operands at TF32. Session 7, alone: forward 1.073 -> 0.981 ms at B8,
#   1.487 -> 1.285 at B1 (fwd+bwd 3.937, 5.594: the B1 backward slower until Aqk is 2-byte, below); o's error
#   2.75e-3 -> 3.07e-3. Session 6 hit an illegal memory access at BV 32 with 16-bit operands (also seen in
#   session 4; Triton has open reports of wgmma illegal accesses with 32-wide tiles on Hopper), so with the
#   register-transposed K_d (scan_kd_t off) the scan's autotuner keeps only BV 64 configs for them; with
#   scan_kd_t (the default) it also times BV 32 and 16 (below). V < 64 keeps the TF32 products
#   (scan_precision). fp32 inputs keep their fp32 products.
# fwd_scan_parallel: 0 (off), or n >= 2: the forward scan (and the backward's re-scan) as n runs of chunks
#   scanned at once. The scan step is affine in the state, S' = (diag(e^γ) - K_d^T W) S + K_d^T U, so each
#   run's map S_end = M S_start + E comes first from a parallel launch (E: the run scanned from 0; the
#   columns of M: from unit vectors with U = 0, chunk_fwd._kda_fwd_seg_summary_kernel), then the start
#   states in n - 1 small fp32 products, then all runs' scans at once (n times the programs). About 2-3x
#   the scan's arithmetic, for n times the parallelism: aimed at few long sequences (B*HV*V/BV programs
#   far below the SM count). Not with fwd_segments. H200, bf16, session 6 (forward / fwd+bwd ms): B1 T16384
#   H16 K128 1.635 / 5.984 -> 1.494 / 5.857 at 4 runs (8: 1.524 / 5.860), B8 T2048 1.081 -> 1.468 at 4:
#   no better than fwd_segments, with 2-3x the scan's arithmetic; off.
# fwd_output: "scan" (default): the state scan also forms O, chunk after chunk; "split": the scan only
#   carries the state and stores S_n, Vn (as fwd_store_states), and a parallel launch per (chunk, head,
#   value block) forms O from them (chunk_fwd._kda_fwd_o_kernel). Shortens the sequential scan's step (its
#   Q e^Γ load, two products and the O store leave it), which bounds the forward when B*HV is small, for
#   one more launch and the S_n store; with a gradient the backward reuses S_n, Vn (no re-scan). H200, bf16,
#   session 6: forward B8 T2048 H16 K128 1.077 -> 1.226 ms, B1 T16384 1.637 -> 1.676 (fwd+bwd 4.093 -> 3.948,
#   6.059 -> 5.386, what fwd_store_states gives too): the scan's step did not get shorter; off. With
#   states_dtype "input" O comes from the 2-byte S_n (o's error 2.775e-3 against 2.747e-3 at B2 T1000 K128).
# bwd_split: per-chunk backward as two launches (V side once, key side per key block; kda_bwd_intra).
# bwd_intra_BK / _BV: its key / value blocks (None = the launcher's choice).
# "*_dtype" entries: "fp32", "input" (the dtype of q/k/v: bf16 halves that buffer's traffic), or
#   "auto": "input" for K > 64, "fp32" below.
#   inter: W, U (stage 1 -> state scans); gated: Q e^Γ, K e^(γ-Γ); states: per-chunk S_n and dS_n;
#   aqk: scale·Aqk (stage 1 -> the forward scan's O, the backward's reverse scan), [B*HV, T, BT]; "auto"
#   (default) is "input" exactly when the forward scan takes 16-bit operands (dot16_scan, V >= 64), which
#   round it so anyway: it then changes only the reverse scan's dVn and halves the buffer's traffic. Session 7,
#   with dot16_scan: fwd+bwd 3.937 -> 3.887 ms at B8, 5.594 -> 4.815 at B1 (one run each; why the B1
#   backward gained that much is not established: the scans' shared-memory estimate fits two stages either
#   way at K = V = 128); dv's error 2.00e-3 -> 2.03e-3, dβ's 2.16e-3 -> 2.18e-3.
#   Why "auto" for W, U, Q e^Γ, K e^(γ-Γ) (H200, bf16, session 3, notes/session3_gpu.md): at K = V = 128
#   2-byte buffers took B8 T2048 H16 from 1.865 / 7.389 to 1.664 / 6.679 ms (fwd / fwd+bwd) and
#   B1 T16384 from 3.049 / 11.234 to 2.207 / 8.525, max relative RMS error 3.1e-3 (dq) against the fp32
#   reference; at the toy shape (B8 T2048 H8 K16) they made the forward slower, 0.266 ms against
#   0.209 ms with fp32 buffers (session 1), because 2-byte Q e^Γ / K e^(γ-Γ) need the key-blocked
#   stage-1 kernel. K in between (e.g. 64) is not measured; it keeps fp32.
# fast_launch (default on): the kernels' launches after the first with a given specialisation call the compiled
#   kernel's launcher directly (k3cli/ops/launch.py), not Triton's per-launch binding and specialisation, and
#   the launch grids use plain Python arithmetic. Same compiled kernels, same values (GPU test: bit-equal, run at
#   b0a72db, and with the later key types and step-aside cases at b892d83, session 10).
#   Why (H200, session 9, scripts/kda_host_profile.py, notes/session9_gpu.md): an empty Triton launch with 20
#   tensor arguments took 32-44 us of host time (25.9 us this way), and the 4-range forward at B1 T16384 H16
#   K=V=128 (16 launches) 0.73-1.46 ms per call of ~1.19 on the device; with fast_launch 0.55 against 0.89 in
#   one process (0.42-0.87 over 18 rounds of scripts/kda_b1_repeat.py; forward 1.175-1.194 ms, fla 1.18).
# fwd_segments_interleave (off; session 10: 8 ranges interleaved 1.147-1.495 ms over 6 rounds, fla 1.177, see
#   below; 4 ranges not timed): with fwd_segments, enqueue range i's scan right after
#   range i's stage 1 instead of after all of stage 1 (chunk_fwd.StateScan). Same kernels, streams and events;
#   only the host's enqueue order changes, so that a host slower than the device starts the first scan early.
#   Why (H200, session 9, notes/session9_gpu.md): a slow host would explain some of the ranged forward's slow
#   rounds (not established; Triton's launch path: 1.408 / 1.427 ms in two of 8 rounds, the host enqueue
#   measured right after 1.462 / 0.769 ms per call; 1.185-1.191 otherwise). When the host is the bottleneck,
#   the first scan waits until the host has enqueued every range's stage 1, and the time tends to one range's
#   (1.46 ms).
# scan_kd_t (default on): the forward state scan reads K_d^T for its K_d^T Vn product as a [BK, BT] tile straight
#   from memory (KD_T) instead of transposing the loaded [BT, BK] tile, and its autotuner may then pick 32- and
#   16-column value blocks with 16-bit operands (2-4x the programs: 64 / 128 at B1 H16 V128 instead of 32).
#   H200, bf16, session 10 (notes/session10_gpu.md, scripts/kda_scan_bv.py, each config in its own process): the
#   B1 T16384 H16 K=V=128 scan alone 0.868 ms at BV 64, 8 warps, 2 stages (the autotuner's pick in session 8),
#   0.752 at 4 warps (now in STATE_CONFIGS; 0.696 with K_d^T loaded) -> 0.548 at BV 16, 4 warps, 2 stages,
#   0.597 at BV 32; O bit-equal at every config tried. No illegal access in 11 configs: BV 16-64 with K_d^T
#   loaded, BV 32 and 64 with the register transpose (the session-4/6 access is not reproduced; BV 16 with the transpose was not run, so prune_state_configs
#   still keeps BV 64 for it). B1 forward, 4 ranges, same process: 1.001 ms against 1.209 off (whose autotuner
#   had the new 4-warp configs too) and fla's 1.320 (5 rounds each, scripts/kda_b1_repeat.py). At B1 T16384 H16
#   (the only `k3` bench shape in 4 ranges) one range with scan_kd_t was not timed against 4, nor the ranges
#   rule's threshold (auto_segment_count, counted at 64-column blocks); the other shapes ran in one range.
# rescan_kd_t (default off): the same for the backward's re-scan, which takes the forward scan's precision
#   (16-bit operands under dot16_scan, so off it also keeps BV 64). B1 fwd+bwd, one process, 3 rounds (session
#   10): 4.624 ms with scan_kd_t only, 4.826 with both, 4.797 with neither; off.
#   STATE_CONFIGS is shared with the backward's reverse scan and the parallel scan's summaries: the 4-warp,
#   2-stage entries added in session 10 are in their autotuners too (not timed separately there).
# Measured and dropped (session 10): 8 ranges with scan_kd_t (1.038-1.536 ms over 6 rounds against 4 ranges'
#   0.988-0.990), also interleaved (1.037-1.546); without scan_kd_t interleaved 8 ranges 1.147-1.495 (fla 1.177).
# Measured and dropped (session 8, notes/session8_gpu.md): one scan launch for all ranges that waits in the
#   kernel for per-chunk flags set by stage 1's tail (release / acquire atomics). Enqueued after stage 1 it
#   gained nothing (B1 T16384 forward 1.200 against 1.195); enqueued before stage 1 it hung on the H200 (likely
#   CUDA's lazy module loading, which may synchronize to load stage 1's kernels while the scan spins).
# Measured and dropped (session 4, notes/session4_gpu.md): stage-1 scores per query sub-chunk program
#   (1.3-1.9x slower forward at 4 / 8 warps), scores and score gradients as 16 x 16 block pairs in batched
#   3-D products (1.6-2.6x slower forward, 12 % slower fwd+bwd), 16-bit operands in stage 1 and the state scans
#   (an illegal memory access on the H200, not investigated).
TUNING = {"fwd_intra_warps": 8, "fwd_intra_BK": None, "fwd_intra_maxnreg": None, "fwd_intra_split": False,
          "fwd_scores": "sub", "fwd_intra_pairs_warps": 4, "fwd_intra_sub_warps": 1,
          "fwd_intra_sub_BK": 64, "fwd_tail_warps": 2, "fwd_tail_BK": 32,
          "bwd_stored_mkk": False, "bwd_subchunk": True, "bwd_subchunk_warps": 1, "bwd_subchunk_BK": 32, "dot16_bwd": False,
          "fwd_store_states": False, "bwd_split": False, "bwd_intra_BK": None, "bwd_intra_BV": None,
          "bwd_intra_warps": 4, "bwd_stored_gamma": False, "fwd_segments": "auto", "fwd_segments_priority": True,
          "bwd_overlap_scans": True,
          "fwd_output": "scan", "fwd_scan_parallel": 0, "dot16_scan": True,
          "fwd_scores_per_pair": "auto", "fwd_scores_stages": "auto", "fwd_tail_kg": True,
          "inter_dtype": "auto", "gated_dtype": "auto", "states_dtype": "fp32", "aqk_dtype": "auto",
          "fast_launch": True, "fwd_segments_interleave": False, "scan_kd_t": True,
          "rescan_kd_t": False}
_DTYPE_CHOICES = ("auto", "fp32", "input")
_FWD_SCORES = ("sub", "pairs", "chunk")
_AUTO_INPUT_MIN_K = 65


_CHECKED: dict = {}   # the last TUNING that passed check_tuning, as {key: (type, value)} (checked on every call)


def check_tuning(tuning: dict) -> None:
    """Reject unknown keys and values a launcher would silently misread."""
    if tuning is TUNING and _CHECKED == {k: (v.__class__, v) for k, v in tuning.items()}:
        return
    unknown = set(tuning) - set(TUNING)
    if unknown:
        raise ValueError(f"chunk_kda TUNING: unknown keys {sorted(unknown)}; valid: {sorted(TUNING)}")
    for name in ("inter_dtype", "gated_dtype", "states_dtype", "aqk_dtype"):
        if tuning.get(name, "fp32") not in _DTYPE_CHOICES:
            raise ValueError(f"chunk_kda TUNING: {name}={tuning[name]!r} must be one of {_DTYPE_CHOICES}")
    for name in ("fwd_intra_BK", "bwd_intra_BK", "bwd_intra_BV", "fwd_intra_sub_BK", "fwd_tail_BK", "bwd_subchunk_BK"):
        b = tuning.get(name)
        if b is not None and (b < 16 or b & (b - 1)):
            raise ValueError(f"chunk_kda TUNING: {name}={b} must be None or a power of two >= 16")
    if tuning.get("fwd_scores", "sub") not in _FWD_SCORES:
        raise ValueError(f"chunk_kda TUNING: fwd_scores={tuning['fwd_scores']!r} must be one of {_FWD_SCORES}")
    if tuning.get("bwd_stored_gamma") and tuning.get("fwd_scores", "sub") != "sub":
        raise ValueError("chunk_kda TUNING: bwd_stored_gamma keeps the Γ buffer of fwd_scores 'sub'; "
                         "the other stage-1 plans do not store one")
    if tuning.get("bwd_stored_gamma") and not (tuning.get("bwd_split", False) or tuning.get("bwd_subchunk", True)):
        raise ValueError("chunk_kda TUNING: bwd_stored_gamma is read by the split backward only "
                         "(bwd_subchunk or bwd_split)")
    nseg = tuning.get("fwd_segments", 0)
    if nseg == "auto":
        nseg = 0   # resolved per call (auto_segments), never against the other options' constraints
    elif not isinstance(nseg, int) or isinstance(nseg, bool) or nseg < 0 or nseg == 1:
        raise ValueError(f"chunk_kda TUNING: fwd_segments={nseg!r} must be 'auto', 0 (off) or an int >= 2")
    npar = tuning.get("fwd_scan_parallel", 0)
    if not isinstance(npar, int) or isinstance(npar, bool) or npar < 0 or npar == 1:
        raise ValueError(f"chunk_kda TUNING: fwd_scan_parallel={npar!r} must be 0 (off) or an int >= 2")
    if npar and nseg:
        raise ValueError("chunk_kda TUNING: fwd_scan_parallel and fwd_segments do not combine")
    if nseg and tuning.get("fwd_scores", "sub") != "sub":
        raise ValueError("chunk_kda TUNING: fwd_segments needs fwd_scores 'sub'")
    if tuning.get("fwd_output", "scan") not in ("scan", "split"):
        raise ValueError(f"chunk_kda TUNING: fwd_output={tuning['fwd_output']!r} must be 'scan' or 'split'")
    stages = tuning.get("fwd_scores_stages", "auto")
    if stages != "auto" and (not isinstance(stages, int) or isinstance(stages, bool) or stages not in (1, 2, 3, 4)):
        raise ValueError(f"chunk_kda TUNING: fwd_scores_stages={stages!r} must be 'auto', 1, 2, 3 or 4")
    for name in ("dot16_scan", "fwd_tail_kg", "fwd_segments_priority", "fast_launch", "fwd_segments_interleave",
                 "scan_kd_t", "rescan_kd_t"):
        if not isinstance(tuning.get(name, False), bool):
            raise ValueError(f"chunk_kda TUNING: {name}={tuning[name]!r} must be False or True")
    per_pair = tuning.get("fwd_scores_per_pair", "auto")
    if per_pair != "auto" and not isinstance(per_pair, bool):
        raise ValueError(f"chunk_kda TUNING: fwd_scores_per_pair={per_pair!r} must be 'auto', False or True")
    if (per_pair is True or (stages != "auto" and stages > 1)) and tuning.get("fwd_scores", "sub") != "sub":
        raise ValueError("chunk_kda TUNING: fwd_scores_per_pair / fwd_scores_stages shape the score launch of "
                         "fwd_scores 'sub' only")
    if tuning.get("dot16_bwd", False) not in (False, True, "narrow"):
        raise ValueError(f"chunk_kda TUNING: dot16_bwd={tuning['dot16_bwd']!r} must be False, True or 'narrow'")
    for name in ("fwd_intra_warps", "bwd_intra_warps", "bwd_subchunk_warps", "fwd_intra_pairs_warps",
                 "fwd_intra_sub_warps", "fwd_tail_warps"):
        if tuning.get(name, 8) not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"chunk_kda TUNING: {name}={tuning[name]} must be a power of two <= 32")
    if tuning is TUNING:   # by type and value: True == 1 and 4 == 4.0 as dict values
        _CHECKED.clear()
        _CHECKED.update({k: (v.__class__, v) for k, v in tuning.items()})


def set_tuning(base: dict, over: dict | None = None) -> None:
    """TUNING = `base` (e.g. a saved copy of the shipped defaults) with `over` on top: how the scripts switch
    between the variants they time (chunk_kda checks the result on its next call)."""
    TUNING.clear()
    TUNING.update(base)
    TUNING.update(over or {})


def _stage_prec(name: str, prec: str, dtype: torch.dtype) -> str:
    """The dot precision of one stage: `prec`, or with TUNING[name] (dot16_bwd) and 16-bit inputs,
    operands rounded to the input dtype (dot_precision)."""
    if TUNING[name] and dtype in (torch.bfloat16, torch.float16):
        return dot_precision(dtype, operands16=TUNING[name])
    return prec


def scan_precision(prec: str, v: torch.Tensor) -> str:
    """The forward scan's dot precision: `prec`, or with TUNING dot16_scan 16-bit operands (on CUDA at V >= 64
    only). On CUDA a narrower V keeps `prec`: at V <= 32 16-bit operands would need value blocks below 64, which
    with the register-transposed K_d (TUNING scan_kd_t off) chunk_fwd.prune_state_configs drops; with scan_kd_t
    they would run, but V < 64 with 16-bit scan operands has not been timed or checked on a GPU."""
    return _stage_prec("dot16_scan", prec, v.dtype) if v.shape[-1] >= 64 or not v.is_cuda else prec


def aqk_dtype(prec: str, v: torch.Tensor) -> torch.dtype:
    """TUNING aqk_dtype as this call stores scale·Aqk: "auto" is the input dtype exactly when the forward
    scan's products take 16-bit operands (scan_precision), which round it so anyway; else fp32."""
    choice = TUNING["aqk_dtype"]
    if choice == "auto":
        choice = "input" if scan_precision(prec, v) in ("bf16", "fp16") else "fp32"
    return torch.float32 if choice == "fp32" else v.dtype


def scores_plan(K: int) -> tuple[bool, int]:
    """TUNING fwd_scores_per_pair and fwd_scores_stages as this call runs them: "auto" is one program per
    16 x 16 block pair with 2 pipeline stages when K > 64 (more than one key block of the score launch),
    else one program per query sub-chunk, 1 stage (where the launch has one key block: nothing to pipeline)."""
    per_pair, stages = TUNING["fwd_scores_per_pair"], TUNING["fwd_scores_stages"]
    wide = K >= _AUTO_INPUT_MIN_K
    if per_pair == "auto":
        per_pair = wide
    if stages == "auto":
        stages = 2 if wide else 1
    return per_pair, stages


def _tuned_dtype(name: str, dtype: torch.dtype, K: int) -> torch.dtype:
    """The storage dtype TUNING[name] picks for inputs of `dtype` and key width K."""
    choice = TUNING[name]
    if choice == "auto":
        choice = "input" if K >= _AUTO_INPUT_MIN_K else "fp32"
    return torch.float32 if choice == "fp32" else dtype


# fwd_segments "auto": 4 ranges where the scan has few programs and many chunks. Measured (H200, bf16,
# session 6, notes/session6_gpu.md): B1 T16384 H16 K=V=128 (32 programs at BV 64, 256 chunks) forward 1.634 ->
# 1.502 ms with 4 ranges (2: 1.519, 8: 2.731); B8 T2048 H16 (256 programs) 1.083 -> 1.466, so off there.
_AUTO_SEG_MAX_PROGRAMS = 32
_AUTO_SEG_MIN_CHUNKS = 32


def auto_segments(q: torch.Tensor, B: int, HV: int, V: int, NT: int) -> int:
    """TUNING fwd_segments as this call runs it: "auto" resolved (4 or 0), else the set value."""
    n = TUNING["fwd_segments"]
    if n != "auto":
        return n
    usable = q.is_cuda and TUNING["fwd_scores"] == "sub" and not TUNING["fwd_scan_parallel"]
    return auto_segment_count(B, HV, V, NT) if usable else 0


def auto_segment_count(B: int, HV: int, V: int, NT: int) -> int:
    """The "auto" rule: 4 ranges when the scan has at most 32 programs (B*HV*ceil(V/64)) and 32+ chunks."""
    few = B * HV * -(-V // 64) <= _AUTO_SEG_MAX_PROGRAMS and NT >= _AUTO_SEG_MIN_CHUNKS
    return 4 if few else 0


def segment_ranges(NT: int, n: int) -> list[tuple[int, int]] | None:
    """TUNING fwd_segments: `n` nearly equal chunk ranges covering [0, NT), or None when off or NT < 2."""
    n = min(n, NT)
    if n < 2:
        return None
    cuts = [NT * i // n for i in range(n + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device, high_priority: bool = False):
    """One side CUDA stream per device (and priority), reused by every call: the caching allocator keeps
    blocks per allocating stream, so a new stream per call (torch hands out 32 round-robin) could pin up to
    32 copies of what was allocated on it. `high_priority`: the device's highest stream priority (its
    pending blocks are dispatched before those of default-priority streams)."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), high_priority)
    if key not in _SIDE_STREAMS:
        prio = torch.cuda.Stream.priority_range()[1] if high_priority else 0
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device, priority=prio)
    return _SIDE_STREAMS[key]


class _Overlap:
    """Stream hooks of the segmented forward: stage 1 of each chunk range on a side stream, an event
    after each, the scan of a range on the current stream after that range's event. With `scan_first`
    (TUNING fwd_segments_priority) the other way round: stage 1 on the current stream, the scans on a
    high-priority side stream, so that a range's scan programs are dispatched ahead of the later ranges'
    pending stage-1 programs. Only the current stream allocates. No-ops off CUDA."""

    def __init__(self, device: torch.device, scan_first: bool = False):
        self.cuda = device.type == "cuda"
        self.scan_first = scan_first
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            self.side = _side_stream(device, high_priority=scan_first)
            self.side.wait_stream(self.main)   # the inputs and buffers were made on the main stream
            self.events = {}

    def stage1(self, n0, n1, what, it=None):
        if not self.cuda:
            return
        if self.scan_first:
            if what == "done":
                self.events[n0] = self.main.record_event()
        elif what == "start":
            torch.cuda.set_stream(self.side)
        else:
            self.events[n0] = self.side.record_event()
            torch.cuda.set_stream(self.main)

    def scan(self, n0, n1, what):
        if not self.cuda:
            return
        if self.scan_first:
            # the scan's buffers were allocated on the main stream before its first range: launch on the side
            # stream (join() puts the main stream behind it before anything reads or frees them)
            torch.cuda.set_stream(self.side)
            self.side.wait_event(self.events[n0])
        else:
            self.main.wait_event(self.events[n0])

    def after_scan(self):
        """Back to stage 1's stream after a scan launch (the interleaved order, fwd_segments_interleave)."""
        if self.cuda and self.scan_first:
            torch.cuda.set_stream(self.main)

    def join(self):
        if self.cuda:
            torch.cuda.set_stream(self.main)
            self.main.wait_stream(self.side)


# The stages as chunk_kda runs them (TUNING applied); bench_stages times these same calls.
def fwd_intra(q, k, v, g, beta, scale, C, prec, segments=None, on_segment=None, need_grad=True) -> Intra:
    """Stage 1 as chunk_kda runs it; without `need_grad` the raw Mkk (read by the backward only) is not stored."""
    check_tuning(TUNING)
    K = q.shape[-1]
    per_pair, stages = scores_plan(K)
    return kda_fwd_intra(q, k, v, g, beta, scale, C, _tuned_dtype("inter_dtype", v.dtype, K),
                         _tuned_dtype("gated_dtype", v.dtype, K),
                         num_warps=TUNING["fwd_intra_warps"], precision=prec, key_block=TUNING["fwd_intra_BK"],
                         maxnreg=TUNING["fwd_intra_maxnreg"], split=TUNING["fwd_intra_split"],
                         store_mkk=need_grad and (TUNING["bwd_stored_mkk"] or TUNING["bwd_subchunk"]),
                         pairs=TUNING["fwd_scores"] == "pairs", pairs_warps=TUNING["fwd_intra_pairs_warps"],
                         sub=TUNING["fwd_scores"] == "sub", sub_warps=TUNING["fwd_intra_sub_warps"],
                         sub_key_block=TUNING["fwd_intra_sub_BK"], tail_warps=TUNING["fwd_tail_warps"],
                         tail_key_block=TUNING["fwd_tail_BK"], segments=segments, on_segment=on_segment,
                         sub_per_pair=per_pair, sub_stages=stages,
                         sub_kg=TUNING["fwd_tail_kg"] and TUNING["fwd_scores"] == "sub",
                         aqk_dtype=aqk_dtype(prec, v))


def recompute_states(it: Intra, h0, B, T, HV, C, v_dtype, prec):
    """The chunk start states S_n and pseudo-values Vn for the backward (recomputed, not stored)."""
    sd = _tuned_dtype("states_dtype", v_dtype, it.w.shape[-1])
    _, _, h, vn = kda_fwd_state(it, B, T, HV, C, h0, v_dtype, False, store_o=False, store_h=True, h_dtype=sd,
                                precision=prec, parallel=TUNING["fwd_scan_parallel"], kd_t=TUNING["rescan_kd_t"])
    return h, vn


def bwd_state(it: Intra, do, dht, B, T, HV, C, need_dh0, v_dtype, prec):
    sd = _tuned_dtype("states_dtype", v_dtype, it.w.shape[-1])
    return kda_bwd_state(it, do, dht, B, T, HV, C, need_dh0, dh_dtype=sd, precision=prec)


def bwd_intra(q, k, v, g, beta, tm, mkk, h, dh, do, vn, dvn, scale, C, prec, gc=None):
    # without GVA (HV = H) dq, dk are stored in the inputs' dtype directly (no group sum follows); dg in g's
    gd = q.dtype if v.shape[2] == q.shape[2] else torch.float32
    return kda_bwd_intra(q, k, v, g, beta, tm, mkk, h, dh, do, vn, dvn, scale, C, BK=TUNING["bwd_intra_BK"],
                         BV=TUNING["bwd_intra_BV"], num_warps=TUNING["bwd_intra_warps"],
                         precision=_stage_prec("dot16_bwd", prec, v.dtype),
                         split=TUNING["bwd_split"] or TUNING["bwd_subchunk"], subchunk=TUNING["bwd_subchunk"],
                         subchunk_warps=TUNING["bwd_subchunk_warps"], grad_dtype=gd, gc=gc, dg_dtype=g.dtype,
                         subchunk_key_block=TUNING["bwd_subchunk_BK"])


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, chunk_size, output_final_state):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        h0 = None if initial_state is None else initial_state.contiguous()
        check_tuning(TUNING)   # before any entry is read (fwd_intra checks again for the scripts' direct calls)
        launch.configure(TUNING["fast_launch"])
        B, T, HV = v.shape[:3]
        prec = dot_precision(v.dtype)
        scan_prec = scan_precision(prec, v)
        NT = -(-T // chunk_size)
        segs = segment_ranges(NT, auto_segments(q, B, HV, v.shape[-1], NT))
        ov = _Overlap(q.device, scan_first=TUNING["fwd_segments_priority"]) if segs else None
        need_grad = any(ctx.needs_input_grad[:6])
        # TUNING fwd_store_states: keep the chunk states S_n and Vn for the backward (memory for one scan)
        keep = TUNING["fwd_store_states"] and need_grad
        split_o = TUNING["fwd_output"] == "split"   # the scan stores S_n, Vn and O comes from them after
        sd = _tuned_dtype("states_dtype", v.dtype, q.shape[-1])
        scan_args = dict(out_dtype=v.dtype, output_final_state=output_final_state, store_o=not split_o,
                         store_h=keep or split_o, h_dtype=sd, precision=scan_prec, segments=segs,
                         kd_t=TUNING["scan_kd_t"])
        try:
            if segs and TUNING["fwd_segments_interleave"]:
                # enqueue range i's scan right after range i's stage 1 (not after all of stage 1), so that a
                # host slower than the device still starts the first scan early
                scan = None   # made on range 0's "done", the first point where stage 1's buffers exist

                def stage1_then_scan(n0, n1, what, it=None):
                    nonlocal scan
                    ov.stage1(n0, n1, what)
                    if what == "done":
                        scan = scan or StateScan(it, B, T, HV, chunk_size, h0, **scan_args)
                        scan.launch(segs.index((n0, n1)), ov.scan)
                        ov.after_scan()

                it = fwd_intra(q, k, v, g, beta, scale, chunk_size, prec, segments=segs, on_segment=stage1_then_scan,
                               need_grad=need_grad)
                o, ht, h, vn = scan.finish()
            else:
                it = fwd_intra(q, k, v, g, beta, scale, chunk_size, prec, segments=segs,
                               on_segment=ov and ov.stage1, need_grad=need_grad)
                o, ht, h, vn = kda_fwd_state(it, B, T, HV, chunk_size, h0, on_segment=ov and ov.scan,
                                             parallel=TUNING["fwd_scan_parallel"], **scan_args)
        finally:
            if ov is not None:
                ov.join()   # the current stream again, after all of stage 1 (also when a launch raised)
        if split_o:
            o = kda_fwd_o(it, h, vn, B, T, HV, chunk_size, v.dtype, precision=scan_prec)
            if not need_grad:
                h = vn = None
        # free Γ now, not earlier: with fwd_segments the side stream may still have been reading it
        if not (TUNING["bwd_stored_gamma"] and need_grad):
            it = it._replace(gc=None)
        ctx.save_for_backward(q, k, v, g, beta, h0, *it, h, vn)
        ctx.scale, ctx.chunk_size, ctx.prec, ctx.scan_prec = scale, chunk_size, prec, scan_prec
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, *saved = ctx.saved_tensors
        it, (h, vn) = Intra(*saved[:-2]), saved[-2:]
        scale, C, prec = ctx.scale, ctx.chunk_size, ctx.prec
        B, T, H, K = q.shape
        HV = v.shape[2]
        do = do.contiguous()
        dht = None if dht is None else dht.contiguous().float()
        check_tuning(TUNING)
        launch.configure(TUNING["fast_launch"])
        main = side = None
        if h is None and TUNING["bwd_overlap_scans"] and q.is_cuda:
            # the re-scan (S_n, Vn) and the reverse scan (dS_n, dVn) do not read each other's outputs: run the
            # re-scan on a side stream so the two sequential kernels share the GPU
            main = torch.cuda.current_stream(q.device)
            side = _side_stream(q.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                h, vn = recompute_states(it, h0, B, T, HV, C, v.dtype, ctx.scan_prec)
            h.record_stream(main)    # made on the side stream, read on the main one
            vn.record_stream(main)
        elif h is None:
            h, vn = recompute_states(it, h0, B, T, HV, C, v.dtype, ctx.scan_prec)
        dh, dvn, dh0 = bwd_state(it, do, dht, B, T, HV, C, h0 is not None, v.dtype, prec)
        if side is not None:
            main.wait_stream(side)
        dq, dk, dv, dg, dbeta = bwd_intra(q, k, v, g, beta, it.tm, it.mkk, h, dh, do, vn, dvn, scale, C, prec,
                                          gc=it.gc)
        if HV != H:
            # GVA: value head hv used q/k head hv // G, so sum each group's gradients
            dq = dq.view(B, T, H, HV // H, K).sum(3).to(q.dtype)
            dk = dk.view(B, T, H, HV // H, K).sum(3).to(k.dtype)
        return dq, dk, dv, dg.to(g.dtype), dbeta.to(beta.dtype), dh0, None, None, None


def _validate(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias, lower_bound,
              chunk_size):
    check_kda_inputs("chunk_kda", q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias,
                     lower_bound, same_dtype=True)
    if chunk_size not in _CHUNK_SIZES:
        raise ValueError(f"chunk_kda: chunk_size={chunk_size} must be one of {_CHUNK_SIZES}")


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
              lower_bound=-5.0, chunk_size=64):
    """Chunked Kimi Delta Attention (SPEC §2.2) with Triton forward and backward.

    Args:
        q, k: [B, T, H, K] (fp32 / fp16 / bf16); v: [B, T, HV, V], HV = G * H.
        g: [B, T, HV, K] per-step log-decay (<= 0, >= lower_bound per step for fp32 safety), or the
            raw gate input g_raw when use_gate_in_kernel (then A_log [HV], dt_bias [HV, K] apply §2.3).
        beta: [B, T, HV] write strength (already through its sigmoid).
        scale: query scale, default K ** -0.5.
        initial_state: [B, HV, K, V] fp32 or None.
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6) before the recurrence.
    Returns:
        o [B, T, HV, V] in v.dtype, final state [B, HV, K, V] fp32 (or None).
    """
    _validate(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias, lower_bound,
              chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        from k3cli.ops.kda.gate import kda_gate
        g = kda_gate(g, A_log, dt_bias, lower_bound=lower_bound, chunk_size=chunk_size, cumsum=False)
    return ChunkKDAFunction.apply(q, k, v, g, beta, initial_state, scale, chunk_size, output_final_state)
