"""Analytic FLOPs per token (k3cli/models/flops.py, docs/math.md §9) against torch's FlopCounterMode.

The counter sees only matmul-like ops, on the torch reference path (CPU, fp32), so the comparison is
made on what both count. Where the reference computes something other than what the analytic count
charges, the test converts the analytic term to the reference's form, exactly:

- KDA chunk: `torch_chunk_kda` is not the kernels' form. It forms the full C×C scores (the kernels
  keep the blocks on and below the diagonal), solves for W and U with `solve_triangular` (the
  kernels invert Tm by block products), and batches the chunk recurrence as P = Q_g − Aqk·W,
  M = diag(e^γ) − K_dᵀW, R = K_dᵀU, S ← M·S + R, O = P·S + Aqk·U (the kernels run Vn = U − W·S).
  `_torch_chunk_macs` lists those products; the solve is counted as forward substitution.
- MLA attention: the counter charges SDPA (and the absorbed einsums) the full T×T square; the
  analytic count keeps the T(T + 1)/2 causal pairs.
- AttnRes: the scores are matrix-vector products (counted), the weighted sums are elementwise
  multiply-adds (not counted): the counter sees half of the analytic term.
- Routed experts: measured from the MoE modules' counts minus their exactly known router, latent and
  shared-expert products. The grouped dispatch (the default) computes exactly the analytic top-k rows;
  the tiled one computes padded rows (whole tiles per expert, zero rows included), a number that depends
  on the routing and must lie between the analytic rows and the dense reference's every expert on every
  token, plus the one-hot products that pick each tile's weights.
- Not counted by either side: norms, activations, gates, softmax, exp, the loss.

Counter gaps filled through `custom_mapping`: CPU SDPA (`_scaled_dot_product_flash_attention_for_cpu`
and its backward), `mv`, `linalg_solve_triangular`, `_grouped_mm`; and `convolution_backward`, which torch's
formula charges as a dense conv (25× too much for the depthwise short convs here).

Forward + backward: the counter over loss.backward() is 3× its forward up to the backward's own
extra products (SDPA recomputes the scores: 5 products instead of 4; the solve's dA is a full C×C
product; mv's weight gradient is an elementwise outer product): within `FB_MARGIN`, and `mm`
(every projection) at exactly 3×.
"""
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from k3cli.config import load_config
from k3cli.layers.moe import grouped_mm_runs, tile_rows
from k3cli.layers.norm import RMSNorm
from k3cli.models import flops as fl
from k3cli.models.causal_lm import CausalLM
from k3cli.models.layout import param_counts
from k3cli.testing import TINY_MODEL

aten = torch.ops.aten
B, T = 2, 32
# every count here is an integer sum, so like-with-like agrees to rounding
RATIO_TOL = 1e-9
# measured forward+backward / forward: 3.001 (kda-toy), 3.004-3.021 (k3-toy)
FB_MARGIN = 0.02
CASES = [("kda-toy", "off", ()), ("k3-toy", "off", ()), ("k3-toy", "full", ()), ("k3-toy", "block", ()),
         # r = 12 makes the absorbed width 2r differ from d_q + d_v = 16
         ("k3-toy", "off", ("model.mla.absorb=true", "model.mla.kv_lora_rank=12")),
         ("k3-toy", "off", ("model.moe.dispatch=tiled",))]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _solve_flop(a, b, *args, out_shape=None, **kw):
    # forward substitution: row i takes i (unit diagonal) or i + 1 multiply-adds per right-hand column
    n = a[-1]
    cols = b[-1] if kw.get("left", True) else b[-2]
    per = n * (n - 1) // 2 if kw.get("unitriangular", False) else n * (n + 1) // 2
    return 2 * math.prod(out_shape[:-2]) * cols * per


def _conv_bwd_flop(grad_out, x, w, *args, out_shape=None, **kw):
    # grad input and grad weight each repeat the forward's multiply-adds, for any groups
    mask = args[7] if len(args) > 7 else kw.get("output_mask", (True, True, False))
    return 2 * math.prod(grad_out) * math.prod(w[1:]) * (int(mask[0]) + int(mask[1]))


def _grouped_mm_flop(a, b, *args, out_shape=None, **kw) -> int:
    """Each row of a [M, K] meets one group's [K, N] (2D x 3D), or each of the M positions of a [K, M] x
    b [M, N] lands in one group's [K, N] output (2D x 2D, the weight gradient): 2·M·K·N either way."""
    return 2 * a[0] * a[1] * b[-1]


def _linear_ce_flop(h, w, *args, out_shape=None, **kw) -> int:
    """The loss (k3cli/ops/linear_ce): the logits' product, and with gradients (its last argument) dh's and
    dw's, made in its forward."""
    return 2 * h[0] * h[1] * w[0] * (3 if args[-1] else 1)


CUSTOM = {
    torch.ops.k3.linear_ce: _linear_ce_flop,
    aten._grouped_mm: _grouped_mm_flop,
    aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, out_shape=None, **kw:
        sdpa_flop_count(q, k, v),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda go, q, k, v, *a, out_shape=None, **kw:
        sdpa_backward_flop_count(go, q, k, v),
    aten.mv: lambda a, b, *args, out_shape=None, **kw: 2 * a[0] * a[1],
    aten.linalg_solve_triangular: _solve_flop,
    aten.convolution_backward: _conv_bwd_flop,
}


def _torch_chunk_macs(C: int, K: int, V: int) -> int:
    """Multiply-adds of torch_chunk_kda per chunk and value head (the products listed above)."""
    scores = 2 * C * C * K
    solve = C * (C - 1) // 2 * (K + V)
    batched = C * C * K + K * C * K + K * C * V
    scan = K * K * V + C * K * V + C * C * V
    return scores + solve + batched + scan


def _build(preset, mode, extra):
    torch.manual_seed(0)
    cfg = load_config(preset, overrides=TINY_MODEL + list(extra), attnres=mode).model
    return cfg, CausalLM(cfg)


def _count(model, ids, backward=False):
    fc = FlopCounterMode(display=False, custom_mapping=CUSTOM)
    # a forward alone runs without autograd: the loss (k3cli/ops/linear_ce) then makes only the logits, where
    # with autograd its forward also makes the head's two gradient products (and its backward none)
    with fc, torch.set_grad_enabled(backward):
        out = model(ids, labels=ids)
        if backward:
            out.loss.backward()
    return fc


def _tiled(cfg) -> bool:
    """Whether the model's MoE layers run the tiled dispatch here (fp32 on the CPU, eager)."""
    m = cfg.moe
    return m.dispatch == "tiled" or (m.dispatch == "grouped" and not grouped_mm_runs(
        torch.zeros(1), cfg.moe_latent_dim, m.d_ff))


def _onehot_gather_flops(cfg) -> int:
    """Forward FLOPs of the tiled dispatch's one-hot expert-weight products: 3 weights of P tiles x E experts x
    (latent x d_ff) per MoE layer (k3cli/layers/moe.py, gather_experts)."""
    if "moe" not in [f for _, f in cfg.layer_specs()] or not _tiled(cfg):
        return 0
    m = cfg.moe
    S = B * T * m.top_k
    P = -(-S // tile_rows(S, m.num_routed_experts)) + m.num_routed_experts
    n_moe = [f for _, f in cfg.layer_specs()].count("moe")
    return n_moe * 3 * 2 * P * m.num_routed_experts * cfg.moe_latent_dim * m.d_ff


def _counter_view(cfg, fc) -> dict:
    """The analytic forward FLOPs of the batch, converted term by term to what the counter sees."""
    tokens = B * T
    f = {k: v * tokens for k, v in fl.flops_per_token(cfg, T)["forward_components"].items()}
    kda, n_kda = cfg.kda, cfg.layer_types().count("kda")
    chunks = -(-T // kda.chunk_size)
    f["kda_chunk"] = 2 * n_kda * B * kda.num_v_heads * chunks * _torch_chunk_macs(
        kda.chunk_size, kda.head_k_dim, kda.head_v_dim)
    f["mla_attention"] *= 2 * T / (T + 1)
    f["attnres"] /= 2
    # the routed experts' share of each MoE block: its count minus the products known exactly
    counts = fc.get_flop_counts()
    moe_blocks = [i for i, (_, ffn) in enumerate(cfg.layer_specs()) if ffn == "moe"]
    known = sum(f[k] for k in ("moe_router", "moe_latent_proj", "moe_shared_experts")) + _onehot_gather_flops(cfg)
    f["moe_routed_measured"] = sum(sum(counts[f"CausalLM.blocks.{i}.ffn"].values()) for i in moe_blocks) - known
    f["moe_onehot_gather"] = _onehot_gather_flops(cfg)   # dispatch overhead the analytic count leaves out
    return f


@pytest.mark.parametrize("preset,mode,extra", CASES, ids=lambda x: "-".join(x) if isinstance(x, tuple) else x)
def test_analytic_matches_counter(preset, mode, extra):
    cfg, model = _build(preset, mode, extra)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    fc = _count(model, ids)
    counted = fc.get_total_flops()
    view = _counter_view(cfg, fc)
    routed_exact, routed = view.pop("moe_routed_experts"), view.pop("moe_routed_measured")
    expected = sum(view.values()) + routed
    raw = fl.flops_per_token(cfg, T)["forward"] * B * T
    print(f"{preset} {mode} {' '.join(extra)}: analytic/counter {raw / counted:.4f}, "
          f"like-with-like {expected / counted:.9f}, routed rows computed/used "
          f"{routed / routed_exact if routed_exact else float('nan'):.3f}")
    assert abs(expected / counted - 1) <= RATIO_TOL
    if routed_exact and not _tiled(cfg):
        assert routed == routed_exact   # one row per token-slot, no padding
    elif routed_exact:
        # padding only adds rows, and never past running every expert on every token
        m = cfg.moe
        assert routed_exact <= routed <= routed_exact * m.num_routed_experts / m.top_k


@pytest.mark.parametrize("preset,mode,extra", CASES[:4], ids=lambda x: "-".join(x) if isinstance(x, tuple) else x)
def test_forward_backward_is_three_forwards(preset, mode, extra):
    cfg, model = _build(preset, mode, extra)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    fwd, both = _count(model, ids), _count(model, ids, backward=True)
    ratio = both.get_total_flops() / fwd.get_total_flops()
    print(f"{preset} {mode}: counter forward+backward / forward {ratio:.4f}")
    assert abs(ratio / 3 - 1) <= FB_MARGIN
    # every product has two in the backward, except the MoE's one-hot weight gathers (gather_experts): the
    # one-hot matrix takes no gradient, so theirs is one
    onehot = _onehot_gather_flops(cfg)
    mm_fwd, mm_both = (c.get_flop_counts()["Global"][aten.mm] for c in (fwd, both))
    assert (mm_both - 2 * onehot) / (mm_fwd - onehot) == 3.0
    grouped_fwd, grouped_both = (c.get_flop_counts()["Global"].get(aten._grouped_mm, 0) for c in (fwd, both))
    has_moe = "moe" in [f for _, f in cfg.layer_specs()]
    assert grouped_both == 3 * grouped_fwd and (grouped_fwd > 0) == (has_moe and not _tiled(cfg))


def test_matmul_params_match_the_model():
    """matmul_params = the active parameters minus the embedding and those used elementwise."""
    for preset, mode in (("kda-toy", "off"), ("k3-toy", "block")):
        cfg, model = _build(preset, mode, ())
        elementwise = sum(p.numel() for n, p in model.named_parameters()
                          if n.endswith(("A_log", "dt_bias")) or n.startswith("attnres."))
        elementwise += sum(m.weight.numel() for m in model.modules() if isinstance(m, RMSNorm))
        counts = param_counts(cfg)
        assert fl.flops_per_token(cfg, T)["matmul_params"] == counts["active"] - counts["embedding"] - elementwise


def test_scaling_and_convention():
    cfg = load_config("k3-0.5b").model
    a, b = fl.flops_per_token(cfg, 2048), fl.flops_per_token(cfg, 4096)
    # KDA chunk work is linear in T (constant per token), MLA attention grows with T
    assert a["components"]["kda_chunk"] == b["components"]["kda_chunk"]
    assert b["components"]["mla_attention"] / a["components"]["mla_attention"] == pytest.approx(4097 / 2049)
    assert a["total"] == pytest.approx(3 * a["forward"])
    assert a["components"]["embedding"] == 0
    assert a["total"] == pytest.approx(sum(a["components"].values()))
    # only top_k of the n_r routed experts are charged
    m = cfg.moe
    assert a["components"]["moe_routed_experts"] == 6 * 12 * m.top_k * 3 * cfg.moe_latent_dim * m.d_ff
    # one chunk of 64 at K = V = 128: scores 10 blocks of 16×16×128 twice, solve 40 16³ products,
    # W and U 64²·256, the scan 3·64·128² + 64²·128
    assert fl.kda_chunk_macs(64, 128, 128) == {"scores": 655360, "solve": 163840, "wu": 1048576,
                                                "state": 3670016}


def test_device_peaks_and_mfu():
    assert fl.device_peak_tflops("NVIDIA H100 80GB HBM3") == (989.4, "H100")
    assert fl.device_peak_tflops("NVIDIA H100 PCIe") == (756.5, "H100 PCIe")
    assert fl.device_peak_tflops("NVIDIA H200") == (989.4, "H200")
    assert fl.device_peak_tflops("NVIDIA A100-SXM4-80GB") == (312.0, "A100")
    assert fl.device_peak_tflops("NVIDIA L40S") == (362.05, "L40S")
    assert fl.device_peak_tflops("NVIDIA GeForce RTX 4090") == (165.2, "RTX 4090")
    assert fl.device_peak_tflops("NVIDIA RTX A1000") is None
    assert fl.device_peak_tflops("cpu") is None
    assert fl.mfu(1e5, 2e9, 400.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        fl.mfu(1.0, 1.0, 0.0)
