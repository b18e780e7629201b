"""KDA ops against the token-by-token definition (SPEC §2, §7.1, §7.2, §7.7, §7.8).

CPU tier: torch references always; Triton kernels under TRITON_INTERPRET=1 (tiny shapes).
GPU tier (@pytest.mark.gpu): bf16 full-size shapes, skipped without CUDA.
"""

import pytest
import torch
import torch.nn.functional as F

from k3cli.ops.kda import chunk_local_cumsum, naive_chunk_kda, naive_kda_gate, naive_recurrent_kda
from k3cli.ops.kda.verify import rel_rms

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.triton
gpu = pytest.mark.gpu

# relative RMS error limits against the fp32 (or fp64) reference, per output
TOL = {"o": 0.005, "ht": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dh0": 0.008,
       "dg": 0.02, "dbeta": 0.02, "dg_raw": 0.008, "dA_log": 0.008, "ddt_bias": 0.008}


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, tol: float | None = None) -> None:
    tol = TOL[name] if tol is None else tol
    err = rel_rms(x, ref)
    assert err <= tol, f"{name}: relative RMS error {err:.3g} > {tol}"


def make_inputs(B, T, H, G, K, V, dtype=torch.float32, device="cpu", seed=0, h0=True, gate_scale=5.0):
    """L2-normalised q/k, gate in (-gate_scale, 0) (-5: as the lower-bound gate produces; the state then
    forgets within a chunk, a small scale keeps it for the whole sequence), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    HV = H * G
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    g = -gate_scale * torch.sigmoid(torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64) - 1.0)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen, dtype=torch.float64))
    s0 = torch.randn(B, HV, K, V, generator=gen, dtype=torch.float64) if h0 else None
    low = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
    g = g.to(device=device, dtype=torch.float32 if dtype != torch.float64 else dtype)
    beta = beta.to(device=device, dtype=dtype)
    s0 = None if s0 is None else s0.to(device=device, dtype=torch.float32 if dtype != torch.float64 else dtype)
    return (*low, g, beta, s0)


def check_against_recurrent(inputs, tol=None, **kw):
    """chunk_kda's outputs and gradients against the fp32 recurrence on the same (fp32-cast) inputs."""
    from k3cli.ops.kda import chunk_kda
    ref = run_with_grads(naive_recurrent_kda, *[None if x is None else x.float() for x in inputs])
    out = run_with_grads(chunk_kda, *inputs, **kw)
    for name in ref:
        assert_close(name, out[name], ref[name], tol=tol)


def run_with_grads(fn, q, k, v, g, beta, h0, **kw):
    """Call fn, backprop a fixed random cotangent into o and the final state; return outputs + grads."""
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in (q, k, v, g, beta, h0)]
    o, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(123)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht)
    ((o * do).sum() + (ht * dht).sum()).backward()
    grads = {n: x.grad for n, x in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), leaves) if x is not None}
    return {"o": o.detach(), "ht": ht.detach(), **grads}


# ---------------------------------------------------------------- torch references
# (B, T, H, G, K, V, chunk)
NAIVE_CASES = [
    pytest.param(2, 100, 2, 2, 16, 32, 16, id="T100-G2-C16"),
    pytest.param(1, 1, 1, 1, 16, 16, 64, id="T1"),
    pytest.param(2, 63, 1, 1, 24, 8, 64, id="T63-K24-H1"),
    pytest.param(1, 130, 2, 1, 32, 32, 64, id="T130-C64"),
    pytest.param(1, 64, 3, 1, 16, 16, 64, id="T64-exact"),
    pytest.param(1, 50, 1, 2, 8, 8, 10, id="T50-C10-odd-chunk"),
]


@pytest.mark.parametrize("B,T,H,G,K,V,C", NAIVE_CASES)
def test_naive_chunk_matches_recurrent_fp64(B, T, H, G, K, V, C):
    inputs = make_inputs(B, T, H, G, K, V, dtype=torch.float64)
    ref = run_with_grads(naive_recurrent_kda, *inputs)
    out = run_with_grads(naive_chunk_kda, *inputs, chunk_size=C)
    for name, x in out.items():
        # both are exact algorithms in fp64: only rounding separates them
        assert_close(name, x, ref[name], tol=1e-10)


def test_naive_chunk_without_initial_state_and_fp32():
    q, k, v, g, beta, _ = make_inputs(2, 77, 2, 1, 16, 16, dtype=torch.float32, h0=False)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    o, s = naive_chunk_kda(q, k, v, g, beta, output_final_state=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert_close("o", o, o_ref, tol=1e-5)
    assert_close("ht", s, s_ref, tol=1e-5)
    o2, s2 = naive_chunk_kda(q, k, v, g, beta)
    assert s2 is None and torch.equal(o, o2)


def test_naive_chunk_fp16_returns_input_dtype():
    q, k, v, g, beta, h0 = make_inputs(1, 20, 1, 1, 16, 16, dtype=torch.float16)
    o, s = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float16 and s.dtype == torch.float32


def test_naive_chunk_causality_is_bit_stable():
    q, k, v, g, beta, h0 = make_inputs(1, 90, 2, 1, 16, 16)
    o, _ = naive_chunk_kda(q, k, v, g, beta, initial_state=h0)
    t = 40
    q2, k2, v2, g2, b2 = (x.clone() for x in (q, k, v, g, beta))
    for x in (q2, k2, v2):
        x[:, t + 1:] = torch.randn_like(x[:, t + 1:])
    g2[:, t + 1:] = -5 * torch.rand_like(g2[:, t + 1:])
    b2[:, t + 1:] = torch.rand_like(b2[:, t + 1:])
    o2, _ = naive_chunk_kda(q2, k2, v2, g2, b2, initial_state=h0)
    assert torch.equal(o[:, :t + 1], o2[:, :t + 1])


def test_naive_gate_and_cumsum():
    gen = torch.Generator().manual_seed(0)
    g_raw = torch.randn(2, 70, 3, 8, generator=gen)
    A_log = torch.randn(3, generator=gen)
    bias = torch.randn(3, 8, generator=gen)
    g = naive_kda_gate(g_raw, A_log, bias)
    assert g.dtype == torch.float32 and (g < 0).all() and (g > -5).all()
    expect = -5.0 * torch.sigmoid(A_log.exp()[:, None] * (g_raw + bias))
    torch.testing.assert_close(g, expect)
    c = chunk_local_cumsum(g, 16)
    torch.testing.assert_close(c[:, 16:32], g[:, 16:32].cumsum(1))
    torch.testing.assert_close(c[:, 64:], g[:, 64:].cumsum(1))
    r = chunk_local_cumsum(g, 16, reverse=True)
    torch.testing.assert_close(r[:, :16], g[:, :16].flip(1).cumsum(1).flip(1))


# ---------------------------------------------------------------- Triton chunk_kda (CPU interpreter tier)
# (B, T, H, G, K, V, chunk, dtype, with h0)
TRITON_CASES = [
    pytest.param(1, 1, 1, 1, 16, 16, 64, torch.float32, True, id="T1"),
    pytest.param(2, 63, 1, 1, 16, 16, 64, torch.float32, True, id="T63-H1"),
    pytest.param(1, 100, 2, 2, 16, 32, 64, torch.float32, True, id="T100-G2"),
    pytest.param(1, 130, 1, 1, 32, 32, 64, torch.float32, False, id="T130-K32-noh0"),
    pytest.param(1, 63, 1, 2, 24, 16, 64, torch.float32, True, id="T63-K24-G2"),
    pytest.param(1, 50, 2, 1, 16, 16, 16, torch.float32, True, id="T50-C16"),
    pytest.param(1, 70, 1, 1, 16, 16, 32, torch.float16, True, id="T70-C32-fp16"),
    # K > 64: the backward splits the key dim into 64-wide blocks (K = 96: a masked second block)
    pytest.param(1, 70, 1, 2, 96, 32, 64, torch.float32, True, id="T70-K96-G2-kblocks"),
    pytest.param(1, 40, 1, 1, 128, 128, 64, torch.float32, True, id="T40-K128"),
    # half inputs with K > 64: the default ("auto") stores W, U, Q e^Γ, K e^(γ-Γ) 2-byte
    pytest.param(1, 70, 1, 2, 96, 32, 64, torch.float16, True, id="T70-K96-G2-fp16-2byte-buffers"),
]


@needs_triton
@pytest.mark.parametrize("B,T,H,G,K,V,C,dtype,h0", TRITON_CASES)
def test_chunk_kda_matches_recurrent(B, T, H, G, K, V, C, dtype, h0):
    from k3cli.ops.kda import chunk_kda
    inputs = make_inputs(B, T, H, G, K, V, dtype=dtype, device=DEVICE, h0=h0)
    # the reference sees the same (rounded) inputs, in fp32
    ref_inputs = [None if x is None else x.float() for x in inputs]
    ref = run_with_grads(naive_recurrent_kda, *ref_inputs)
    out = run_with_grads(chunk_kda, *inputs, chunk_size=C)
    assert out["o"].dtype == dtype and out["ht"].dtype == torch.float32
    for name in ref:
        assert out[name].shape == ref[name].shape, name
        assert_close(name, out[name], ref[name])


# every TUNING alternative must compute the same function (scripts/kda_sweep.py times them on a GPU);
# the backward alternatives to the default bwd_subchunk name "bwd_subchunk": False
TUNING_CASES = [
    pytest.param({"fwd_scores": "chunk", "fwd_intra_BK": 16}, 1, 63, 1, 2, 40, 24, 64, id="fwd-kblock16-K40-G2-T63"),
    pytest.param({"fwd_scores": "chunk", "fwd_intra_BK": 32}, 2, 70, 1, 1, 96, 32, 32, id="fwd-kblock32-K96-C32"),
    pytest.param({"fwd_scores": "chunk", "fwd_intra_BK": 16, "fwd_intra_maxnreg": 128}, 1, 1, 1, 1, 32, 16, 64, id="fwd-kblock16-T1-r128"),
    pytest.param({"bwd_intra_BK": 16, "bwd_intra_BV": 16, "bwd_intra_warps": 4, "bwd_subchunk": False}, 1, 50, 1, 2, 48, 40, 16,
                 id="bwd-k16-v16"),
    pytest.param({"fwd_scores": "chunk", "fwd_intra_split": True, "fwd_intra_BK": 32}, 1, 70, 1, 2, 96, 40, 64, id="fwd-split-K96-G2"),
    pytest.param({"fwd_scores": "chunk", "fwd_intra_split": True}, 2, 1, 1, 1, 16, 16, 16, id="fwd-split-T1-C16"),
    pytest.param({"fwd_scores": "pairs"}, 2, 70, 1, 2, 96, 40, 64, id="fwd-pairs-K96-G2-T70"),
    pytest.param({"fwd_scores": "pairs"}, 1, 1, 1, 1, 24, 16, 64, id="fwd-pairs-T1-K24"),
    pytest.param({"fwd_scores": "pairs", "fwd_tail_BK": 16}, 1, 45, 2, 1, 40, 24, 32, id="fwd-pairs-C32-K40-tailBK16"),
    pytest.param({"fwd_scores": "pairs"}, 1, 37, 1, 1, 24, 16, 16, id="fwd-pairs-C16-one-subchunk"),
    pytest.param({"fwd_scores": "pairs", "bwd_subchunk": False}, 1, 50, 1, 2, 72, 24, 64,
                 id="fwd-pairs-unsplit-bwd-K72"),
    pytest.param({"fwd_scores": "pairs", "gated_dtype": "input", "inter_dtype": "input"}, 1, 70, 1, 2, 40, 24, 64,
                 id="fwd-pairs-2byte-buffers"),
    # the one-program-per-chunk stage 1 (session 4's default): whole-K with fp32 buffers, key-blocked with 2-byte
    pytest.param({"fwd_scores": "chunk"}, 2, 70, 1, 2, 40, 24, 64, id="fwd-chunk-wholeK-G2-T70"),
    pytest.param({"fwd_scores": "chunk"}, 1, 1, 1, 1, 96, 16, 64, id="fwd-chunk-T1-K96"),
    pytest.param({"fwd_scores": "sub"}, 2, 70, 1, 2, 96, 40, 64, id="fwd-sub-K96-G2-T70"),
    pytest.param({"fwd_scores": "sub"}, 1, 1, 1, 1, 24, 16, 64, id="fwd-sub-T1-K24"),
    pytest.param({"fwd_scores": "sub"}, 1, 50, 2, 2, 40, 24, 32, id="fwd-sub-H2-G2-C32"),
    pytest.param({"fwd_scores": "sub", "fwd_intra_sub_BK": 16}, 1, 45, 2, 1, 40, 24, 32, id="fwd-sub-C32-K40-BK16"),
    pytest.param({"fwd_scores": "sub"}, 1, 37, 1, 1, 24, 16, 16, id="fwd-sub-C16-one-subchunk"),
    # K > 64 runs per pair, 2 stages by default ("auto"): the per-sub-chunk launch there, and the tail from k, g
    pytest.param({"fwd_scores_per_pair": False, "fwd_scores_stages": 1}, 2, 70, 1, 2, 96, 40, 64,
                 id="fwd-per-subchunk-K96-G2-T70"),
    pytest.param({"fwd_scores_per_pair": False, "fwd_scores_stages": 2}, 1, 50, 1, 1, 96, 24, 32,
                 id="fwd-per-subchunk-stages2-K96-C32"),
    pytest.param({"fwd_tail_kg": False}, 2, 70, 1, 2, 96, 40, 64, id="fwd-tail-from-k-g-K96-G2-T70"),
    pytest.param({"fwd_tail_kg": False, "fwd_intra_split": True}, 1, 50, 1, 2, 40, 24, 64,
                 id="fwd-tail-from-k-g-split"),
    pytest.param({"fwd_scores_per_pair": True, "fwd_scores_stages": 3}, 1, 45, 2, 1, 40, 24, 32,
                 id="fwd-per-pair-stages3-C32-K40"),
    pytest.param({"fwd_scores_per_pair": True}, 1, 37, 1, 1, 24, 16, 16, id="fwd-per-pair-C16-one-subchunk"),
    pytest.param({"fwd_scores_per_pair": True, "fwd_intra_sub_BK": 16}, 1, 1, 1, 1, 40, 16, 64,
                 id="fwd-per-pair-T1-BK16"),
    pytest.param({"fwd_scores": "sub", "fwd_intra_split": True, "fwd_tail_BK": 16}, 1, 50, 1, 2, 40, 24, 64,
                 id="fwd-sub-split-tail-BK16"),
    # β K e^Γ from the Γ launch through the W buffer (the default; fwd-sub-* above run it at K96 / T1 / C32 / C16)
    pytest.param({"fwd_tail_kg": True, "fwd_intra_split": True, "fwd_segments": 3, "fwd_tail_BK": 16},
                 1, 90, 1, 1, 40, 24, 16, id="fwd-tail-kg-split-tail-segments3-C16"),
    pytest.param({"fwd_tail_kg": True, "inter_dtype": "input"}, 1, 70, 1, 2, 40, 24, 64,
                 id="fwd-tail-kg-2byte-W"),
    pytest.param({"fwd_scores": "pairs", "fwd_intra_split": True}, 2, 1, 1, 1, 16, 16, 64, id="fwd-pairs-split-tail-T1"),
    pytest.param({"fwd_scores": "sub", "bwd_subchunk": False}, 1, 50, 1, 2, 72, 24, 64, id="fwd-sub-unsplit-bwd-K72"),
    # the forward in chunk ranges (on CPU one after another; the carry between ranges is what is tested)
    pytest.param({"fwd_segments": 3}, 2, 200, 1, 2, 40, 24, 64, id="fwd-segments3-T200-G2"),
    pytest.param({"fwd_segments": 2}, 1, 65, 1, 1, 24, 16, 64, id="fwd-segments2-T65-last-chunk-one-token"),
    pytest.param({"fwd_segments": 2}, 1, 1, 1, 1, 24, 16, 64, id="fwd-segments2-T1-one-chunk-unsegmented"),
    pytest.param({"fwd_segments": 4, "fwd_store_states": True, "bwd_stored_gamma": True}, 1, 90, 2, 1, 40, 24, 16,
                 id="fwd-segments4-C16-store-states"),
    # range i's scan enqueued right after range i's stage 1 (chunk_fwd.StateScan from the stage-1 hook)
    pytest.param({"fwd_segments": 3, "fwd_segments_interleave": True}, 2, 200, 1, 2, 40, 24, 64,
                 id="fwd-segments3-interleave-T200-G2"),
    pytest.param({"fwd_segments": 4, "fwd_segments_interleave": True, "fwd_output": "split", "fwd_store_states": True},
                 1, 90, 2, 1, 40, 24, 16, id="fwd-segments4-interleave-split-store-states-C16"),
    # the forward scan reads K_d^T as a [BK, BT] tile by default (scan_kd_t); the register transpose, and the
    # backward's re-scan reading it as a tile (rescan_kd_t; T spans chunks, so the re-scan's carry is used)
    pytest.param({"scan_kd_t": False}, 2, 70, 1, 2, 40, 24, 64, id="scan-kd-transposed-K40-V24-G2-T70"),
    pytest.param({"scan_kd_t": False, "fwd_segments": 3, "fwd_output": "split"}, 1, 130, 1, 1, 24, 40, 32,
                 id="scan-kd-transposed-segments3-split-C32"),
    pytest.param({"scan_kd_t": False, "rescan_kd_t": True}, 1, 130, 2, 1, 40, 24, 64, id="rescan-kd-t-only-T130-H2"),
    pytest.param({"bwd_overlap_scans": False}, 1, 70, 1, 2, 40, 24, 64, id="bwd-no-overlap-scans"),
    # the parallel scan: runs of chunks from start states computed by the run summaries (M, E)
    pytest.param({"fwd_scan_parallel": 3}, 2, 200, 1, 2, 40, 24, 64, id="scan-parallel3-T200-G2"),
    pytest.param({"fwd_scan_parallel": 4}, 1, 130, 1, 1, 24, 72, 32, id="scan-parallel4-C32-V72-last-run-short"),
    pytest.param({"fwd_scan_parallel": 8}, 1, 90, 2, 1, 40, 16, 16, id="scan-parallel8-C16-K40-H2"),
    pytest.param({"fwd_scan_parallel": 2}, 1, 65, 1, 1, 24, 16, 64, id="scan-parallel2-T65-last-run-one-token"),
    pytest.param({"fwd_scan_parallel": 16}, 1, 65, 1, 1, 24, 16, 64, id="scan-parallel16-more-runs-than-chunks"),
    pytest.param({"fwd_scan_parallel": 4, "fwd_output": "split"}, 1, 150, 1, 2, 96, 40, 32,
                 id="scan-parallel4-output-split-K96-G2"),
    pytest.param({"fwd_scan_parallel": 4, "fwd_store_states": True, "states_dtype": "input"}, 1, 100, 1, 1, 32, 32, 16,
                 id="scan-parallel4-store-states-2byte"),
    # O from the stored states in its own launch, after a scan that only carries the state
    pytest.param({"fwd_output": "split"}, 2, 70, 1, 2, 96, 40, 64, id="fwd-output-split-K96-G2-T70"),
    pytest.param({"fwd_output": "split"}, 1, 1, 1, 1, 24, 16, 64, id="fwd-output-split-T1-K24"),
    pytest.param({"fwd_output": "split"}, 1, 45, 2, 1, 40, 72, 32, id="fwd-output-split-C32-V72"),
    pytest.param({"fwd_output": "split", "fwd_segments": 3}, 1, 90, 1, 1, 24, 16, 16, id="fwd-output-split-segments3-C16"),
    pytest.param({"fwd_output": "split", "states_dtype": "input"}, 1, 45, 1, 1, 96, 32, 32,
                 id="fwd-output-split-2byte-states-K96"),
    pytest.param({"bwd_stored_gamma": True}, 2, 70, 1, 2, 96, 40, 64, id="bwd-stored-gamma-K96-G2-T70"),
    pytest.param({"bwd_stored_gamma": True}, 1, 1, 1, 1, 24, 16, 16, id="bwd-stored-gamma-T1-C16"),
    pytest.param({"bwd_stored_gamma": True, "bwd_subchunk": False, "bwd_split": True}, 1, 45, 2, 1, 40, 24, 32,
                 id="bwd-stored-gamma-split-no-subchunk-C32"),
    pytest.param({"fwd_scores": "sub", "gated_dtype": "input", "inter_dtype": "input"}, 1, 70, 1, 2, 40, 24, 64,
                 id="fwd-sub-2byte-buffers"),
    pytest.param({"bwd_stored_mkk": True, "bwd_subchunk": False}, 2, 70, 1, 2, 96, 40, 64, id="bwd-stored-mkk-K96-G2"),
    pytest.param({"bwd_stored_mkk": True, "bwd_split": True, "bwd_intra_BK": 32, "bwd_subchunk": False}, 1, 50, 2, 1, 72, 24, 32,
                 id="bwd-stored-mkk-split-K72-C32"),
    pytest.param({"bwd_stored_mkk": True, "fwd_scores": "chunk", "fwd_intra_BK": 32, "bwd_subchunk": False}, 1, 45, 1, 2, 64, 16, 64, id="bwd-stored-mkk-kblock"),
    pytest.param({"bwd_subchunk": True}, 2, 70, 1, 2, 96, 40, 64, id="bwd-subchunk-K96-G2-T70"),
    pytest.param({"bwd_subchunk": True}, 1, 1, 1, 1, 16, 16, 64, id="bwd-subchunk-T1"),
    pytest.param({"bwd_subchunk_BK": 64}, 1, 50, 1, 2, 96, 24, 64, id="bwd-subchunk-BK64-K96"),
    pytest.param({"bwd_subchunk_BK": 16}, 1, 37, 1, 1, 40, 16, 32, id="bwd-subchunk-BK16-K40-C32"),
    pytest.param({"bwd_subchunk": True}, 1, 37, 1, 1, 24, 16, 16, id="bwd-subchunk-C16-one-subchunk"),
    pytest.param({"bwd_subchunk": True, "bwd_intra_BK": 16, "bwd_intra_BV": 16}, 1, 33, 1, 1, 8, 8, 32,
                 id="bwd-subchunk-BK16-K8"),
    pytest.param({"fwd_store_states": True}, 2, 70, 1, 2, 40, 24, 64, id="fwd-store-states-G2-T70"),
    pytest.param({"fwd_store_states": True, "states_dtype": "input"}, 1, 45, 1, 1, 96, 32, 32,
                 id="fwd-store-states-2byte-K96"),
    pytest.param({"bwd_split": True, "bwd_subchunk": False}, 1, 70, 1, 2, 96, 40, 64, id="bwd-split-K96-G2"),
    pytest.param({"bwd_split": True, "bwd_intra_BK": 16, "bwd_intra_BV": 16, "bwd_subchunk": False}, 2, 1, 1, 1, 24, 16, 16,
                 id="bwd-split-T1-K24"),
    # the per-chunk backward's products with 16-bit operands (fp16 inputs here; the interpreter's bf16 is
    # wrong): against the reference only
    pytest.param({"dot16_bwd": True}, 2, 70, 1, 2, 96, 40, 64, id="dot16-bwd-K96-G2"),
    pytest.param({"dot16_bwd": True, "bwd_subchunk": False}, 1, 45, 1, 1, 40, 24, 32, id="dot16-bwd-unsplit-C32"),
    pytest.param({"dot16_bwd": "narrow"}, 1, 37, 1, 2, 24, 16, 16, id="dot16-bwd-narrow-C16-G2"),
    # (V >= 64: on CUDA a narrower V keeps the TF32 products)
    pytest.param({"dot16_scan": True}, 2, 70, 1, 2, 96, 64, 64, id="dot16-scan-K96-V64-G2"),
    pytest.param({"dot16_scan": True, "fwd_output": "split", "fwd_scan_parallel": 3}, 1, 150, 1, 1, 40, 72, 32,
                 id="dot16-scan-split-parallel3-C32-V72"),
    pytest.param({"aqk_dtype": "input", "dot16_scan": False}, 2, 70, 1, 2, 40, 24, 64, id="aqk-2byte-G2-T70"),
    pytest.param({"aqk_dtype": "input", "dot16_scan": True, "fwd_output": "split"}, 1, 45, 2, 1, 40, 64, 32,
                 id="aqk-2byte-dot16-scan-split-C32"),
    pytest.param({"aqk_dtype": "input", "dot16_scan": False, "fwd_scores": "chunk"}, 1, 37, 1, 1, 24, 16, 16,
                 id="aqk-2byte-chunk-C16"),
    # the TF32 scan (fp16 inputs; the default rounds the scan's operands to fp16)
    pytest.param({"dot16_scan": False}, 1, 70, 1, 2, 96, 64, 64, id="scan-tf32-fp16-K96-G2"),
    pytest.param({"gated_dtype": "input", "states_dtype": "input", "inter_dtype": "input"},
                 1, 70, 1, 1, 32, 32, 64, id="input-dtype-buffers"),
    # "auto" stores 2-byte buffers from K = 65 up: fp32 ones are the alternative there
    pytest.param({"gated_dtype": "fp32", "inter_dtype": "fp32"}, 1, 70, 1, 2, 96, 24, 64, id="fp32-buffers-K96-G2"),
    # and 2-byte ones below
    pytest.param({"gated_dtype": "input", "inter_dtype": "input"}, 1, 70, 1, 1, 40, 24, 64, id="input-buffers-K40"),
]


@needs_triton
@pytest.mark.parametrize("tuning,B,T,H,G,K,V,C", TUNING_CASES)
def test_chunk_kda_tuning_alternatives_match_recurrent(tuning, B, T, H, G, K, V, C):
    from k3cli.ops.kda import chunk as chunk_mod
    from k3cli.ops.kda import chunk_kda
    chunk_mod.check_tuning(tuning)   # a misspelt key would silently test the default path
    # fp16 when a buffer dtype or 16-bit dot operands are the point of the case (the interpreter's bf16
    # is wrong, see README), compared with the same case without them as well; else fp32
    buffers = any(name.endswith("_dtype") for name in tuning)
    lowp = buffers or "dot16_bwd" in tuning or "dot16_scan" in tuning
    dtype = torch.float16 if lowp else torch.float32
    inputs = make_inputs(B, T, H, G, K, V, dtype=dtype, device=DEVICE, h0=True)
    ref = run_with_grads(naive_recurrent_kda, *[x.float() for x in inputs])

    def run_under(over):
        saved = dict(chunk_mod.TUNING)
        try:
            chunk_mod.TUNING.update(over)
            return run_with_grads(chunk_kda, *inputs, chunk_size=C)
        finally:
            chunk_mod.TUNING.clear()
            chunk_mod.TUNING.update(saved)

    out = run_under(tuning)
    # the same case with the buffer dtypes / 16-bit operands it names set to fp32 / unrounded (the rest default);
    # a buffer the case sets to fp32 compares with its shipped default instead. None when that is the case itself.
    plain = {"dot16_scan": False, "dot16_bwd": False, "aqk_dtype": "fp32", "inter_dtype": "fp32", "gated_dtype": "fp32",
             "states_dtype": "fp32"}
    over = {n: (chunk_mod.TUNING[n] if tuning[n] == plain[n] and n.endswith("_dtype") else plain[n])
            for n in tuning if n in plain}
    base = run_under({**tuning, **over}) if lowp and {**tuning, **over} != tuning else None
    assert base is not None or not buffers, "a buffer-dtype case must differ from its comparison run"
    for name in ref:
        assert out[name].shape == ref[name].shape, name
        assert_close(name, out[name], ref[name], tol=None if lowp else 1e-5)
        if buffers:
            # what the buffer dtypes change: their rounding only (measured ≤ 3.4e-4)
            assert_close(name, out[name], base[name], tol=1e-3)
    if tuning.get("dot16_bwd") and "dot16_scan" not in tuning:
        # the 16-bit operands were used: they move the gradients, not the forward
        assert not torch.equal(out["dq"], base["dq"]) and torch.equal(out["o"], base["o"])
    if tuning.get("aqk_dtype") == "input" and tuning.get("dot16_scan") is False:
        # the 2-byte Aqk buffer was used: its rounding moves the output (a 16-bit scan would round it anyway)
        assert not torch.equal(out["o"], base["o"])
    if tuning.get("dot16_scan") is True:
        # the scan's 16-bit operands were used: they move the output and the final state
        assert not torch.equal(out["o"], base["o"]) and not torch.equal(out["ht"], base["ht"])


# The default inputs' gate forgets the state within a chunk, so a wrong carry between chunks shows only near
# chunk boundaries; with a slow gate the initial state and every chunk's state reach the end of the sequence.
# The parallel scan's run maps (M) are non-trivial only then.
LONG_MEMORY_CASES = [
    pytest.param({}, 1, 200, 1, 2, 40, 24, 64, id="default-T200-G2"),
    pytest.param({"fwd_scan_parallel": 3}, 2, 200, 1, 2, 40, 24, 64, id="scan-parallel3-T200-G2"),
    pytest.param({"fwd_scan_parallel": 4}, 1, 130, 1, 1, 24, 72, 32, id="scan-parallel4-C32-V72"),
    pytest.param({"fwd_scan_parallel": 8}, 1, 150, 2, 1, 40, 16, 16, id="scan-parallel8-C16-H2"),
    pytest.param({"fwd_scan_parallel": 4, "fwd_output": "split"}, 1, 150, 1, 2, 96, 40, 32, id="scan-parallel4-split-K96"),
    pytest.param({"fwd_segments": 3}, 1, 200, 1, 1, 24, 16, 64, id="fwd-segments3"),
    pytest.param({"fwd_segments": 3, "fwd_segments_interleave": True}, 1, 200, 1, 1, 24, 16, 64,
                 id="fwd-segments3-interleave"),
    pytest.param({"fwd_output": "split"}, 1, 130, 1, 1, 24, 16, 32, id="fwd-output-split"),
    pytest.param({"scan_kd_t": False, "rescan_kd_t": True}, 1, 200, 1, 2, 40, 24, 64,
                 id="scan-kd-transposed-rescan-kd-t-T200-G2"),
]


@needs_triton
@pytest.mark.parametrize("tuning,B,T,H,G,K,V,C", LONG_MEMORY_CASES)
def test_chunk_kda_long_memory_matches_recurrent(tuning, B, T, H, G, K, V, C, monkeypatch):
    from k3cli.ops.kda import chunk as chunk_mod
    from k3cli.ops.kda import chunk_kda
    chunk_mod.check_tuning(tuning)
    for name, val in tuning.items():
        monkeypatch.setitem(chunk_mod.TUNING, name, val)
    inputs = make_inputs(B, T, H, G, K, V, dtype=torch.float32, device=DEVICE, h0=True, gate_scale=0.01)
    ref = run_with_grads(naive_recurrent_kda, *inputs)
    # the inputs are what this test is about: the initial state must still move the last 64 outputs by
    # over 5 % (relative RMS; 9-74 % for these cases), 5000 times the tolerance below
    o_no_h0, _ = naive_recurrent_kda(*inputs[:5], initial_state=None, output_final_state=True)
    assert rel_rms(o_no_h0[:, -64:], ref["o"][:, -64:]) > 0.05
    out = run_with_grads(chunk_kda, *inputs, chunk_size=C)
    for name in ref:
        assert_close(name, out[name], ref[name], tol=1e-5)


@needs_triton
@pytest.mark.parametrize("fwd_output", ["scan", "split"])
def test_chunk_kda_no_grad_forward_matches(fwd_output, monkeypatch):
    # without autograd the forward skips the backward-only Mkk store (and, split, drops S_n, Vn after O);
    # the outputs must not change
    from k3cli.ops.kda import chunk as chunk_mod
    from k3cli.ops.kda import chunk_kda
    monkeypatch.setitem(chunk_mod.TUNING, "fwd_output", fwd_output)
    x = make_inputs(1, 70, 1, 2, 24, 16, dtype=torch.float32, device=DEVICE)
    with torch.no_grad():
        o0, h0 = chunk_kda(*x[:5], initial_state=x[5], output_final_state=True)
    out = run_with_grads(chunk_kda, *x)
    assert torch.equal(o0, out["o"]) and torch.equal(h0, out["ht"])


@needs_triton
def test_chunk_kda_dg_keeps_g_precision():
    # half q, k, v with an fp32 g (what the model's fused gate produces): dg is accumulated and stored in
    # fp32, not rounded through the half dtype on the way (a regression of session 5's direct stores)
    from k3cli.ops.kda import chunk_kda
    x = make_inputs(1, 70, 1, 1, 24, 16, dtype=torch.float16, device=DEVICE)
    assert x[3].dtype == torch.float32
    out = run_with_grads(chunk_kda, *x)
    assert out["dg"].dtype == torch.float32
    assert not torch.equal(out["dg"], out["dg"].half().float()), "dg went through fp16"
    ref = run_with_grads(naive_recurrent_kda, *[None if t is None else t.float() for t in x])
    assert_close("dg", out["dg"], ref["dg"])


def test_auto_segments_rule():
    # TUNING fwd_segments "auto": 4 ranges only where measured to help (few scan programs, many chunks)
    from k3cli.ops.kda.chunk import auto_segment_count, check_tuning
    assert auto_segment_count(1, 16, 128, 256) == 4      # B1 T16384 H16 K=V=128: 32 programs
    assert auto_segment_count(8, 16, 128, 32) == 0       # B8 T2048 H16: 256 programs
    assert auto_segment_count(1, 16, 128, 16) == 0       # too few chunks
    assert auto_segment_count(8, 8, 16, 32) == 0         # the toy shape: 64 programs
    check_tuning({"fwd_segments": "auto"})


def test_auto_segments_gating(monkeypatch):
    # "auto" applies the rule only on CUDA, with the sub-chunk stage 1 and without the parallel scan; a set
    # value is returned as it is
    from types import SimpleNamespace

    from k3cli.ops.kda import chunk as chunk_mod
    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    monkeypatch.setitem(chunk_mod.TUNING, "fwd_segments", "auto")
    assert chunk_mod.auto_segments(cuda, 1, 16, 128, 256) == 4
    assert chunk_mod.auto_segments(cpu, 1, 16, 128, 256) == 0
    monkeypatch.setitem(chunk_mod.TUNING, "fwd_scores", "pairs")
    assert chunk_mod.auto_segments(cuda, 1, 16, 128, 256) == 0
    monkeypatch.setitem(chunk_mod.TUNING, "fwd_scores", "sub")
    monkeypatch.setitem(chunk_mod.TUNING, "fwd_scan_parallel", 4)
    assert chunk_mod.auto_segments(cuda, 1, 16, 128, 256) == 0
    monkeypatch.setitem(chunk_mod.TUNING, "fwd_scan_parallel", 0)
    monkeypatch.setitem(chunk_mod.TUNING, "fwd_segments", 3)
    assert chunk_mod.auto_segments(cpu, 8, 16, 128, 32) == 3


def test_chunk_kda_checks_tuning_before_reading_it(monkeypatch):
    # a mistyped entry is one clear ValueError from the forward, not a TypeError from deep inside it
    from k3cli.ops.kda import chunk as chunk_mod
    from k3cli.ops.kda import chunk_kda
    x = make_inputs(1, 8, 1, 1, 16, 16)
    for bad in ("Auto", "4", 2.0):
        monkeypatch.setitem(chunk_mod.TUNING, "fwd_segments", bad)
        with pytest.raises(ValueError, match="fwd_segments"):
            chunk_kda(*x[:5])


def test_auto_score_plan_and_aqk_dtype(monkeypatch):
    from k3cli.ops.kda import chunk as chunk_mod
    assert chunk_mod.scores_plan(128) == (True, 2) and chunk_mod.scores_plan(65) == (True, 2)
    assert chunk_mod.scores_plan(64) == (False, 1) and chunk_mod.scores_plan(16) == (False, 1)
    monkeypatch.setitem(chunk_mod.TUNING, "fwd_scores_stages", 3)
    assert chunk_mod.scores_plan(16) == (False, 3)
    v16, v32 = torch.zeros(1, 1, 1, 64, dtype=torch.float16), torch.zeros(1, 1, 1, 64)
    # "auto": 2-byte exactly when the forward scan rounds its operands to the input dtype
    assert chunk_mod.aqk_dtype("tf32", v16) == torch.float16 and chunk_mod.aqk_dtype("tf32x3", v32) == torch.float32
    monkeypatch.setitem(chunk_mod.TUNING, "dot16_scan", False)
    assert chunk_mod.aqk_dtype("tf32", v16) == torch.float32
    monkeypatch.setitem(chunk_mod.TUNING, "aqk_dtype", "input")
    assert chunk_mod.aqk_dtype("tf32", v16) == torch.float16


def test_check_tuning_rejects_bad_entries():
    from k3cli.ops.kda.chunk import check_tuning
    for bad, msg in (({"fwd_intra_bk": 32}, "unknown keys"), ({"gated_dtype": "bf16"}, "must be one of"),
                     ({"bwd_intra_BK": 24}, "power of two"), ({"fwd_intra_warps": 3}, "power of two"),
                     ({"dot16_bwd": "wide"}, "False, True or 'narrow'"),
                     ({"fwd_scores": "tiles"}, "must be one of"),
                     ({"bwd_stored_gamma": True, "fwd_scores": "pairs"}, "Γ buffer"),
                     ({"fwd_segments": 1}, "int >= 2"), ({"fwd_segments": 2, "fwd_scores": "chunk"}, "needs"),
                     ({"bwd_stored_gamma": True, "bwd_subchunk": False}, "split backward only"),
                     ({"fwd_segments": "Auto"}, "'auto', 0"), ({"fwd_scan_parallel": 1}, "int >= 2"),
                     ({"fwd_scan_parallel": True}, "int >= 2"), ({"fwd_output": "fused"}, "'scan' or 'split'"),
                     ({"fwd_scan_parallel": 2, "fwd_segments": 2}, "do not combine"),
                     ({"dot16_scan": "narrow"}, "False or True"), ({"fwd_scores_stages": 0}, "1, 2, 3 or 4"),
                     ({"fwd_scores_per_pair": "Auto"}, "'auto', False or True"),
                     ({"fwd_scores_per_pair": "yes"}, "False or True"), ({"fwd_scores_stages": True}, "1, 2, 3 or 4"),
                     ({"fwd_scores_stages": 2.0}, "1, 2, 3 or 4"), ({"dot16_scan": 1}, "False or True"),
                     ({"fwd_scores_per_pair": True, "fwd_scores": "pairs"}, "score launch of fwd_scores 'sub'"),
                     ({"fwd_tail_kg": 1}, "False or True"), ({"fwd_segments_priority": "on"}, "False or True"),
                     ({"fwd_segments_interleave": 1}, "False or True"), ({"fast_launch": "yes"}, "False or True"),
                     ({"scan_kd_t": None}, "False or True"), ({"rescan_kd_t": 0}, "False or True")):
        with pytest.raises(ValueError, match=msg):
            check_tuning(bad)


@needs_triton
def test_chunk_kda_in_kernel_l2norm_and_gate():
    from k3cli.ops.kda import chunk_kda
    gen = torch.Generator().manual_seed(1)
    B, T, H, K, V = 1, 40, 2, 16, 16
    q = torch.randn(B, T, H, K, generator=gen).to(DEVICE).requires_grad_()
    k = torch.randn(B, T, H, K, generator=gen).to(DEVICE).requires_grad_()
    v = torch.randn(B, T, H, V, generator=gen).to(DEVICE).requires_grad_()
    g_raw = torch.randn(B, T, H, K, generator=gen).to(DEVICE).requires_grad_()
    beta = torch.rand(B, T, H, generator=gen).to(DEVICE).requires_grad_()
    A_log = torch.randn(H, generator=gen).to(DEVICE).requires_grad_()
    dt_bias = torch.randn(H, K, generator=gen).to(DEVICE).requires_grad_()
    leaves = (q, k, v, g_raw, beta, A_log, dt_bias)
    do = torch.randn(B, T, H, V, generator=gen).to(DEVICE)

    def l2(x):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    o_ref, _ = naive_recurrent_kda(l2(q), l2(k), v, naive_kda_gate(g_raw, A_log, dt_bias), beta)
    ref = torch.autograd.grad((o_ref * do).sum(), leaves)
    o, _ = chunk_kda(q, k, v, g_raw, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     A_log=A_log, dt_bias=dt_bias)
    got = torch.autograd.grad((o * do).sum(), leaves)
    assert_close("o", o, o_ref)
    for name, x, r in zip(("dq", "dk", "dv", "dg_raw", "dbeta", "dA_log", "ddt_bias"), got, ref):
        assert_close(name if name in TOL else "dg", x, r)


def _perturb_after(t, *xs):
    out = []
    for x in xs:
        y = x.clone()
        y[:, t + 1:] = y[:, t + 1:].flip(1) * 0.5 - 0.1 if y.is_floating_point() else y[:, t + 1:]
        out.append(y)
    return out


@needs_triton
@pytest.mark.parametrize("tuning", [{}, {"fwd_scores": "pairs"}, {"fwd_scores": "chunk"}],
                         ids=["default", "fwd-pairs", "fwd-chunk"])
def test_chunk_kda_causality_bit_stable(tuning):
    from k3cli.ops.kda import chunk as chunk_mod
    from k3cli.ops.kda import chunk_kda
    saved = dict(chunk_mod.TUNING)
    chunk_mod.TUNING.update(tuning)
    try:
        _check_causality(chunk_kda)
    finally:
        chunk_mod.TUNING.clear()
        chunk_mod.TUNING.update(saved)


def _check_causality(chunk_kda):
    q, k, v, g, beta, h0 = make_inputs(1, 100, 1, 1, 16, 16, device=DEVICE)
    o, _ = chunk_kda(q, k, v, g, beta, initial_state=h0)
    # inside sub-chunk 0, at a chunk end, past it, and mid-way through later 16-row sub-chunks
    for t in (10, 20, 40, 63, 70):
        q2, k2, v2, b2 = _perturb_after(t, q, k, v, beta)
        g2 = g.clone()
        g2[:, t + 1:] = -4.0 * torch.rand_like(g2[:, t + 1:])
        o2, _ = chunk_kda(q2, k2, v2, g2, b2, initial_state=h0)
        assert torch.equal(o[:, :t + 1], o2[:, :t + 1]), f"output at <= {t} changed"
        assert not torch.equal(o[:, t + 1:], o2[:, t + 1:])


@needs_triton
def test_chunk_kda_batch_invariance():
    from k3cli.ops.kda import chunk_kda
    q, k, v, g, beta, h0 = make_inputs(3, 70, 2, 1, 16, 16, device=DEVICE)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o1, ht1 = chunk_kda(q[1:2], k[1:2], v[1:2], g[1:2], beta[1:2], initial_state=h0[1:2],
                        output_final_state=True)
    assert torch.equal(o[1:2], o1) and torch.equal(ht[1:2], ht1)


VALIDATION_CASES = [
    pytest.param({"k": "short"}, ValueError, "k shape", id="k-shape"),
    pytest.param({"v": "badB"}, ValueError, "v shape", id="v-batch"),
    pytest.param({"v": "HV3"}, ValueError, "multiple of q/k heads", id="gva-heads"),
    pytest.param({"g": "shape"}, ValueError, "g shape", id="g-shape"),
    pytest.param({"beta": "shape"}, ValueError, "beta", id="beta-shape"),
    pytest.param({"q": "int"}, TypeError, "q dtype", id="q-int"),
    pytest.param({"k": "fp16"}, TypeError, "share a dtype", id="mixed-dtype"),
    pytest.param({"h0": "fp16"}, TypeError, "initial_state dtype", id="h0-dtype"),
    pytest.param({"h0": "shape"}, ValueError, "initial_state shape", id="h0-shape"),
    pytest.param({"lower_bound": -6.0}, ValueError, "lower_bound", id="lower-bound-low"),
    pytest.param({"lower_bound": 0.0}, ValueError, "lower_bound", id="lower-bound-zero"),
    pytest.param({"chunk_size": 48}, ValueError, "chunk_size", id="chunk-size"),
    pytest.param({"gate": "noA"}, ValueError, "A_log", id="gate-no-A_log"),
    pytest.param({"q": "list"}, TypeError, "q must be a torch.Tensor", id="q-not-tensor"),
]


def test_dot_precision_follows_input_dtype_and_torch_tf32_settings():
    """fp32 inputs get fp32-accurate dots (plain TF32 cost 1.4e-2 in a whole-model decode check on
    the H200) unless the user allowed TF32 matmuls in torch, through either API; bf16 / fp16 use TF32."""
    from k3cli.ops.kda.chunk_fwd import dot_precision
    matmul = torch.backends.cuda.matmul
    has_new = hasattr(matmul, "fp32_precision")
    saved = matmul.fp32_precision if has_new else matmul.allow_tf32
    try:
        if has_new:
            matmul.fp32_precision = "ieee"
        else:
            matmul.allow_tf32 = False
        assert dot_precision(torch.float32) == "tf32x3"
        assert dot_precision(torch.bfloat16) == "tf32" and dot_precision(torch.float16) == "tf32"
        # 16-bit operands (TUNING dot16_bwd) only for 16-bit inputs
        assert dot_precision(torch.bfloat16, True) == "bf16" and dot_precision(torch.float16, "narrow") == "fp16n"
        assert dot_precision(torch.float32, True) == "tf32x3"
        if has_new:
            matmul.fp32_precision = "tf32"
            assert dot_precision(torch.float32) == "tf32"
            matmul.fp32_precision = "none"   # defer to the global setting (default ieee)
            assert dot_precision(torch.float32) == ("tf32" if torch.backends.fp32_precision == "tf32" else "tf32x3")
        matmul.allow_tf32 = True   # the legacy API, mixed with the new one: its read would raise
        assert dot_precision(torch.float32) == "tf32"
    finally:
        if has_new:
            matmul.fp32_precision = saved
        else:
            matmul.allow_tf32 = saved


@pytest.mark.parametrize("bad,exc,msg", VALIDATION_CASES)
def test_chunk_kda_validation(bad, exc, msg):
    from k3cli.ops.kda import chunk_kda
    q, k, v, g, beta, h0 = make_inputs(1, 8, 2, 1, 16, 16)
    kw = {"initial_state": h0}
    if bad.get("k") == "short":
        k = k[:, :4]
    if bad.get("v") == "badB":
        v = torch.cat([v, v])
    if bad.get("v") == "HV3":
        v = torch.randn(1, 8, 3, 16)
    if bad.get("g") == "shape":
        g = g[..., :8]
    if bad.get("beta") == "shape":
        beta = beta[..., None]
    if bad.get("q") == "int":
        q = q.long()
    if bad.get("q") == "list":
        q = q.tolist()
    if bad.get("k") == "fp16":
        k = k.half()
    if bad.get("h0") == "fp16":
        kw["initial_state"] = h0.half()
    if bad.get("h0") == "shape":
        kw["initial_state"] = h0[:, :, :8]
    if "lower_bound" in bad:
        kw["lower_bound"] = bad["lower_bound"]
    if "chunk_size" in bad:
        kw["chunk_size"] = bad["chunk_size"]
    if bad.get("gate") == "noA":
        kw["use_gate_in_kernel"] = True
    with pytest.raises(exc, match=msg):
        chunk_kda(q, k, v, g, beta, **kw)


# ---------------------------------------------------------------- fused gate
# (B, T, HV, K, chunk, cumsum, bias, dtype)
GATE_CASES = [
    pytest.param(2, 70, 3, 24, 16, True, True, torch.float32, id="T70-K24-C16-cumsum"),
    pytest.param(1, 1, 1, 16, 64, True, True, torch.float32, id="T1"),
    pytest.param(1, 100, 2, 16, 64, False, True, torch.float32, id="T100-nocumsum"),
    pytest.param(1, 33, 2, 8, 64, True, False, torch.float16, id="T33-nobias-fp16"),
]


@needs_triton
@pytest.mark.parametrize("B,T,HV,K,C,cumsum,bias,dtype", GATE_CASES)
def test_kda_gate_matches_torch(B, T, HV, K, C, cumsum, bias, dtype):
    from k3cli.ops.kda import kda_gate
    gen = torch.Generator().manual_seed(0)
    g_raw = (torch.randn(B, T, HV, K, generator=gen) * 2).to(DEVICE, dtype).requires_grad_()
    A_log = torch.randn(HV, generator=gen).to(DEVICE).requires_grad_()
    dt_bias = torch.randn(HV, K, generator=gen).to(DEVICE).requires_grad_() if bias else None
    leaves = [g_raw, A_log] + ([dt_bias] if bias else [])
    ref = naive_kda_gate(g_raw.float(), A_log, dt_bias)
    ref = chunk_local_cumsum(ref, C) if cumsum else ref
    out = kda_gate(g_raw, A_log, dt_bias, chunk_size=C, cumsum=cumsum)
    assert out.dtype == torch.float32
    assert_close("o", out, ref, tol=1e-5)
    do = torch.randn(ref.shape, generator=gen).to(DEVICE)
    g_ref = torch.autograd.grad((ref * do).sum(), leaves)
    g_out = torch.autograd.grad((out * do).sum(), leaves)
    for name, x, r in zip(("dg_raw", "dA_log", "ddt_bias"), g_out, g_ref):
        assert_close(name, x, r, tol=1e-3 if dtype == torch.float16 else 1e-5)


def test_kda_gate_validation():
    from k3cli.ops.kda import kda_gate
    g_raw = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(g_raw, torch.zeros(3))
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(g_raw, torch.zeros(2), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(g_raw, torch.zeros(2), lower_bound=-7.0)


# ---------------------------------------------------------------- GPU tier: bf16, full sizes
# (B, T, H, G, K=V)
GPU_CASES = [
    pytest.param(2, 63, 1, 1, 16, id="T63-H1-K16"),
    pytest.param(2, 1000, 4, 2, 64, id="T1000-H4-G2-K64"),
    pytest.param(2, 2048, 16, 1, 128, id="T2048-H16-K128"),
    pytest.param(2, 1000, 16, 2, 128, id="T1000-H16-G2-K128"),
    pytest.param(3, 2048, 4, 1, 64, id="T2048-H4-K64"),
    pytest.param(2, 63, 4, 2, 128, id="T63-H4-G2-K128"),
    pytest.param(2, 1000, 1, 2, 16, id="T1000-H1-G2-K16"),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,T,H,G,K", GPU_CASES)
def test_chunk_kda_bf16_gpu(B, T, H, G, K):
    check_against_recurrent(make_inputs(B, T, H, G, K, K, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
@gpu
def test_chunk_kda_fp32_gpu_is_fp32_accurate():
    """fp32 inputs get fp32-accurate dots (tf32x3, chunk_fwd.dot_precision): against the fp32
    recurrence at 1e-4 (plain TF32 moved a whole fp32 model 2.9e-3 to 1.4e-2, scaled max, from its
    exact-fp32 decode in session 2). Passed on the H200 in session 3 (notes/session3_gpu.md)."""
    check_against_recurrent(make_inputs(2, 300, 4, 2, 128, 128, dtype=torch.float32, device="cuda"), tol=1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tuning", [{"fwd_scan_parallel": 8}, {"fwd_scan_parallel": 4, "fwd_output": "split"},
                                    {"fwd_segments": 5}])
def test_chunk_kda_long_memory_gpu(tuning, monkeypatch):
    """The carried-state paths on a GPU, where runs / ranges execute concurrently (the interpreter runs
    programs in order, so e.g. a final state written by a run other than the last would go unseen there):
    fp32, a slow gate, against the fp32 recurrence at the GPU tier's fp32 tolerance."""
    from k3cli.ops.kda import chunk as chunk_mod
    for name, val in tuning.items():
        monkeypatch.setitem(chunk_mod.TUNING, name, val)
    check_against_recurrent(make_inputs(1, 1500, 2, 2, 64, 64, dtype=torch.float32, device="cuda", gate_scale=0.01),
                            tol=1e-4)


@pytest.mark.gpu
@gpu
def test_chunk_kda_segmented_forward_gpu_is_exact():
    """TUNING fwd_segments: stage 1 on a side stream, the scan per chunk range on the current stream
    after that range's event, or with fwd_segments_priority (the default) stage 1 on the current stream and
    the scans on a high-priority side stream. Same kernels, the state carried through fp32 buffers: the
    outputs and the gradients must equal the unsegmented run exactly (a missing stream wait shows as a
    mismatch), also with each range's scan enqueued right after its stage 1 (fwd_segments_interleave). Then
    TUNING bwd_overlap_scans (the backward's re-scan on a side stream) likewise."""
    from k3cli.ops.kda import chunk as chunk_mod
    from k3cli.ops.kda import chunk_kda
    inputs = make_inputs(1, 4000, 4, 2, 128, 128, dtype=torch.bfloat16, device="cuda")
    saved = dict(chunk_mod.TUNING)
    try:
        # the reference run: one range, the re-scan on the current stream ("auto" picks 4 ranges here)
        assert chunk_mod.auto_segments(inputs[0], 1, 8, 128, 63) == 4
        chunk_mod.TUNING.update(fwd_segments=0, bwd_overlap_scans=False)
        base = run_with_grads(chunk_kda, *inputs)
        for n, first, inter in ((2, False, False), (5, False, False), ("auto", False, False), (3, True, False),
                                ("auto", True, False), (3, False, True), ("auto", True, True), (8, True, True)):
            chunk_mod.TUNING.update(fwd_segments=n, fwd_segments_priority=first, fwd_segments_interleave=inter)
            out = run_with_grads(chunk_kda, *inputs)
            for name in base:
                assert torch.equal(out[name], base[name]), \
                    f"fwd_segments={n} (scans first: {first}, interleaved: {inter}): {name} differs"
        chunk_mod.TUNING["fwd_segments_interleave"] = saved["fwd_segments_interleave"]
        # the backward's re-scan on a side stream, concurrent with the reverse scan: same kernels, same values
        chunk_mod.TUNING["fwd_segments"] = 0
        chunk_mod.TUNING["bwd_overlap_scans"] = True
        out = run_with_grads(chunk_kda, *inputs)
        for name in base:
            assert torch.equal(out[name], base[name]), f"bwd_overlap_scans: {name} differs"
        # and the shipped defaults ("auto" ranges with the overlapped re-scan)
        chunk_mod.TUNING.clear()
        chunk_mod.TUNING.update(saved)
        out = run_with_grads(chunk_kda, *inputs)
        for name in base:
            assert torch.equal(out[name], base[name]), f"shipped defaults: {name} differs"
    finally:
        chunk_mod.TUNING.clear()
        chunk_mod.TUNING.update(saved)


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of x whose data pointer is one element past a 16-byte boundary."""
    buf = torch.empty(x.numel() + 1, device=x.device, dtype=x.dtype)
    out = buf[1:].view(x.shape)
    out.copy_(x)
    assert out.data_ptr() % 16 != 0
    return out


@pytest.mark.gpu
@gpu
def test_chunk_kda_fast_launch_gpu_is_exact():
    """TUNING fast_launch (k3cli/ops/launch.py): launches after the first call the cached compiled kernels
    directly. Outputs and gradients must equal Triton's own launch path exactly, on the call that fills the
    cache and on the ones that hit it, for shapes that change the specialisation (T = 1, T not a multiple of
    the chunk, GVA, K = 16 / 64 / 128, the 4-range forward) and for misaligned inputs, which Triton compiles
    without the 16-byte alignment hint (a cache keyed too coarsely would run the aligned kernel on them)."""
    from k3cli.ops import launch
    from k3cli.ops.kda import chunk as chunk_mod
    from k3cli.ops.kda import chunk_fwd, chunk_kda
    saved = dict(chunk_mod.TUNING)
    try:
        cases = [(2, 1, 2, 2, 64), (2, 63, 4, 2, 128), (3, 2048, 4, 1, 64), (1, 4000, 4, 2, 128), (2, 1000, 1, 2, 16)]
        for B, T, H, G, K in cases:
            inputs = make_inputs(B, T, H, G, K, K, dtype=torch.bfloat16, device="cuda")
            chunk_mod.TUNING["fast_launch"] = False
            base = run_with_grads(chunk_kda, *inputs)
            chunk_mod.TUNING["fast_launch"] = True
            for rep in range(3):   # the first fills the launch cache (or finds it filled), the others hit it
                out = run_with_grads(chunk_kda, *inputs)
                for name in base:
                    assert torch.equal(out[name], base[name]), f"{(B, T, H, G, K)} call {rep}: {name} differs"
            # the same values through misaligned input pointers, against Triton's path on those pointers
            odd = [_misaligned(x) if x is not None and x.dtype == torch.bfloat16 else x for x in inputs]
            results = []
            for fast in (False, True, True):
                chunk_mod.TUNING["fast_launch"] = fast
                leaves = [x.detach().requires_grad_(True) for x in odd[:5]]
                o, ht = chunk_kda(*leaves, initial_state=odd[5], output_final_state=True)
                results.append((o, ht, *torch.autograd.grad((o.float() ** 2).sum() + ht.sum(), leaves)))
            for fast_res in results[1:]:
                for a, b in zip(results[0], fast_res):
                    assert torch.equal(a, b), f"{(B, T, H, G, K)} misaligned inputs differ"
        assert launch.configure(True), "a launch hook is set: the fast path is off"
        cached = [k for k in vars(chunk_fwd).values() if isinstance(k, launch.FastLaunch) and k.launches]
        assert cached, "no launch was cached: the fast path never ran"
    finally:
        chunk_mod.TUNING.clear()
        chunk_mod.TUNING.update(saved)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tuning", [{}, {"fwd_scores": "pairs"}, {"fwd_scores": "chunk"}],
                         ids=["default", "fwd-pairs", "fwd-chunk"])
def test_chunk_kda_causality_bf16_gpu(tuning):
    """Issue 5: perturbing tokens after t leaves outputs at <= t bit-identical (bf16, K=128, GVA);
    t inside sub-chunk 0, at and past a chunk end, and mid-way through later 16-row sub-chunks."""
    from k3cli.ops.kda import chunk as chunk_mod
    from k3cli.ops.kda import chunk_kda
    saved = dict(chunk_mod.TUNING)
    chunk_mod.TUNING.update(tuning)
    try:
        q, k, v, g, beta, h0 = make_inputs(2, 300, 4, 2, 128, 128, dtype=torch.bfloat16, device="cuda")
        o, _ = chunk_kda(q, k, v, g, beta, initial_state=h0)
        for t in (0, 20, 40, 63, 64, 200):
            q2, k2, v2, b2 = _perturb_after(t, q, k, v, beta)
            g2 = g.clone()
            g2[:, t + 1:] = -4.0 * torch.rand_like(g2[:, t + 1:])
            o2, _ = chunk_kda(q2, k2, v2, g2, b2, initial_state=h0)
            assert torch.equal(o[:, :t + 1], o2[:, :t + 1]), f"output at <= {t} changed"
    finally:
        chunk_mod.TUNING.clear()
        chunk_mod.TUNING.update(saved)


@pytest.mark.gpu
@gpu
def test_chunk_kda_batch_invariance_bf16_gpu():
    from k3cli.ops.kda import chunk_kda
    q, k, v, g, beta, h0 = make_inputs(4, 1000, 4, 2, 128, 128, dtype=torch.bfloat16, device="cuda")
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o1, ht1 = chunk_kda(q[2:3], k[2:3], v[2:3], g[2:3], beta[2:3], initial_state=h0[2:3],
                        output_final_state=True)
    assert_close("o", o1, o[2:3])
    assert_close("ht", ht1, ht[2:3])


def test_check_tuning_shortcut_does_not_pass_retyped_values(monkeypatch):
    """check_tuning skips a TUNING equal to the last one it passed; True == 1 and 4 == 4.0 must not count."""
    from k3cli.ops.kda import chunk as chunk_mod
    for name, good, bad in (("fwd_tail_kg", True, 1), ("fwd_segments", 4, 4.0), ("fast_launch", True, 1)):
        monkeypatch.setitem(chunk_mod.TUNING, name, good)
        chunk_mod.check_tuning(chunk_mod.TUNING)   # passes, and is remembered
        monkeypatch.setitem(chunk_mod.TUNING, name, bad)   # equal as a dict value, not of a valid type
        with pytest.raises(ValueError, match=name):
            chunk_mod.check_tuning(chunk_mod.TUNING)
        monkeypatch.setitem(chunk_mod.TUNING, name, good)


@needs_triton
def test_prune_state_configs_narrow_blocks_with_16bit_operands_need_kd_t(monkeypatch):
    """With 16-bit scan operands on a GPU, BV 32 / 16 configs stay only when the scan reads K_d^T directly
    (TUNING scan_kd_t); TF32 operands keep every width; BV is clamped to the padded value width."""
    from k3cli.ops.kda import chunk_fwd

    monkeypatch.setattr(chunk_fwd, "interpreting", lambda x=None: False)
    two = {n: torch.empty(1, dtype=torch.bfloat16) for n in ("w", "kd", "qg", "aqk")}
    base = {"V": 128, "BK": 128, "BT": 64, **two}

    def widths(**named):
        return sorted({c.kwargs["BV"] for c in chunk_fwd.prune_state_configs(chunk_fwd.STATE_CONFIGS, {**base, **named})})

    assert widths(PREC="bf16", KD_T=False) == [64]
    assert widths(PREC="bf16", KD_T=True) == [16, 32, 64]
    assert widths(PREC="tf32", KD_T=False) == [16, 32, 64]
    assert widths(PREC="bf16", KD_T=True, V=16) == [16]
    # 2-stage configs are kept where two stages of 2-byte [BT, BK] tiles fit in shared memory
    kept = chunk_fwd.prune_state_configs(chunk_fwd.STATE_CONFIGS, {**base, "PREC": "bf16", "KD_T": True})
    assert any(c.num_stages == 2 and c.kwargs["BV"] == 16 and c.num_warps == 4 for c in kept)
