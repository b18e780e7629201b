"""CausalLM end to end: presets build and train a step, AttnRes identities, causality, batch
invariance, loss, parameter counts (docs/math.md §1, §5, §6, §7.6–§7.8)."""
import pytest
import torch
import torch.nn.functional as F

from k3cli.config import load_config
from k3cli.layers.block import DecoderBlock, build_attn, build_ffn
from k3cli.models import CausalLM
from k3cli.models.layout import param_counts
from k3cli.testing import assert_close

# max |a − b| / max(1, max |b|), fp64
TOL = {"logits": 1e-12, "loss": 1e-12}


def model(preset: str, attnres: str = "off", *sets: str, seed: int = 0, dtype=torch.float32) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(load_config(preset, overrides=list(sets), attnres=attnres).model).to(dtype)


def ids(B: int, T: int, seed: int = 0, vocab: int = 4096) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


TOYS = [(p, a) for p in ("kda-toy", "k3-toy") for a in ("off", "full", "block")]


@pytest.mark.parametrize("preset,attnres", TOYS, ids=[f"{p}-{a}" for p, a in TOYS])
def test_toy_forward_backward(preset, attnres):
    m = model(preset, attnres).train()
    x = ids(2, 11)
    out = m(x, labels=x)
    assert out.logits is None and torch.isfinite(out.loss)
    assert abs(out.loss.item() - torch.log(torch.tensor(4096.0)).item()) < 0.5  # near-uniform at init
    out.loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == []
    assert len(m.moe_layers()) == (4 if preset == "k3-toy" else 0)
    assert all(moe.load_counts.sum() == 2 * 11 * moe.top_k for moe in m.moe_layers())
    assert m(x).logits.shape == (2, 11, 4096)


@pytest.mark.parametrize("preset,attnres", [t for t in TOYS if t[1] != "off"],
                         ids=[f"{p}-{a}" for p, a in TOYS if a != "off"])
def test_zero_init_attnres_equals_off(preset, attnres):
    # eps 0: the sublayers' RMSNorm makes the mix's 1/n_sources scale vanish exactly
    on = model(preset, attnres, "model.norm_eps=0", dtype=torch.float64).eval()
    off = model(preset, "off", "model.norm_eps=0", seed=1, dtype=torch.float64).eval()
    missing, unexpected = off.load_state_dict(on.state_dict(), strict=False)
    assert missing == [] and all(k.startswith("attnres.") for k in unexpected) and unexpected
    x = ids(2, 19)
    with torch.no_grad():
        assert_close("logits", on(x).logits, off(x).logits, TOL["logits"])


@pytest.mark.parametrize("preset", ["kda-toy", "k3-toy"])
def test_attnres_takes_no_random_numbers_from_the_base_model(preset):
    # a controlled AttnRes on/off comparison needs the same base weights for the same seed
    off = model(preset, "off").state_dict()
    for attnres in ("full", "block"):
        on = model(preset, attnres).state_dict()
        assert set(off) < set(on) and all(k.startswith("attnres.") for k in set(on) - set(off))
        assert all(torch.equal(off[k], on[k]) for k in off), f"{attnres}: a shared parameter differs at init"


CAUSAL = [("kda-toy", "off"), ("k3-toy", "off"), ("k3-toy", "block")]


@pytest.mark.parametrize("preset,attnres", CAUSAL, ids=[f"{p}-{a}" for p, a in CAUSAL])
def test_causality(preset, attnres):
    m = model(preset, attnres, dtype=torch.float64).eval()
    x = ids(1, 37)
    x2 = x.clone()
    x2[:, 20:] = ids(1, 17, seed=5)
    with torch.no_grad():
        a, b = m(x).logits[:, :20], m(x2).logits[:, :20]
    if preset == "kda-toy":
        assert torch.equal(a, b)  # bit-stable (docs/math.md §7.7); MoE capacity shapes may change rounding
    else:
        assert_close("logits", b, a, TOL["logits"])


@pytest.mark.parametrize("preset,attnres", CAUSAL, ids=[f"{p}-{a}" for p, a in CAUSAL])
def test_batch_invariance(preset, attnres):
    m = model(preset, attnres, dtype=torch.float64).eval()
    x = ids(3, 21)
    with torch.no_grad():
        batched = m(x).logits
        for i in range(3):
            assert_close(f"seq {i}", m(x[i:i + 1]).logits[0], batched[i], TOL["logits"])


@pytest.mark.parametrize("preset,attnres", [("kda-toy", "off"), ("k3-toy", "block")])
def test_bf16_autocast_runs(preset, attnres):
    m = model(preset, attnres, "model.num_hidden_layers=2")  # k3: KDA + MLA; bf16 on CPU is slow
    x = ids(2, 12)
    with torch.no_grad():
        ref = m(x, labels=x).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(x, labels=x).loss
    loss.backward()
    assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) < 0.05


def test_loss_is_shifted_cross_entropy():
    m = model("kda-toy", "off", "model.num_hidden_layers=1", dtype=torch.float64)
    x = ids(2, 9)
    labels = x.clone()
    labels[0, 4] = -100
    loss = m(x, labels=labels).loss
    ref = F.cross_entropy(m(x).logits[:, :-1].reshape(-1, 4096), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert_close("loss", loss, ref, TOL["loss"])
    assert m(x).loss is None


def test_tied_embeddings():
    untied = model("kda-toy", "off", "model.num_hidden_layers=1")
    tied = model("kda-toy", "off", "model.num_hidden_layers=1", "model.tie_word_embeddings=true")
    assert tied.lm_head is None
    assert untied.num_parameters() - tied.num_parameters() == 4096 * 256
    x = ids(1, 5)
    with torch.no_grad():
        h = tied.norm(tied.blocks[0](tied.embed_tokens(x)))
        torch.testing.assert_close(tied(x).logits, h @ tied.embed_tokens.weight.T)


@pytest.mark.parametrize("preset", ["kda-toy", "k3-toy", "k3-0.5b"])
@pytest.mark.parametrize("attnres", ["off", "block"])
def test_parameter_counts_match_layout(preset, attnres):
    cfg = load_config(preset, attnres=attnres).model
    with torch.device("meta"):  # k3-0.5b is ~2 GB in fp32; count without allocating
        m = CausalLM(cfg)
    counts = param_counts(cfg)
    assert m.num_parameters() == counts["total"]
    assert m.num_active_parameters() == counts["active"]
    moe = cfg.moe
    dropped = (moe.num_routed_experts - moe.top_k) * 3 * cfg.moe_latent_dim * moe.d_ff * len(m.moe_layers())
    assert m.num_active_parameters() == m.num_parameters() - dropped


def test_init_uses_initializer_range():
    m = model("kda-toy", "off", "model.initializer_range=0.05")
    assert abs(m.embed_tokens.weight.std().item() - 0.05) < 0.002
    assert abs(m.blocks[0].attn.q_proj.weight.std().item() - 0.05) < 0.005


def test_decoder_block_is_pre_norm_residual():
    cfg = load_config("k3-toy").model
    torch.manual_seed(0)
    block = DecoderBlock.from_spec(cfg, "mla", "moe").double().eval()
    x = torch.randn(2, 6, 256, dtype=torch.float64)
    h = x + block.attn(block.attn_norm(x))
    assert_close("block", block(x), h + block.ffn(block.ffn_norm(h)), TOL["logits"])


def test_unknown_kinds_are_clear_errors():
    cfg = load_config("k3-toy").model
    with pytest.raises(ValueError, match="unknown attention kind 'gqa'; valid: kda, mla"):
        build_attn(cfg, "gqa")
    with pytest.raises(ValueError, match="unknown FFN kind 'relu'; valid: swiglu, moe"):
        build_ffn(cfg, "relu")


GPU_CASES = [("kda-toy", "off"), ("k3-toy", "block"), ("k3-toy", "full")]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset,attnres", GPU_CASES, ids=[f"{p}-{a}" for p, a in GPU_CASES])
def test_cuda_kernels_match_torch_references(preset, attnres):
    """auto on CUDA (Triton chunk_kda + AttnRes kernels) vs the torch references, fp32, then bf16 autocast.

    Relative limits for TF32 Triton dots; the per-layer GPU tests hold the tighter ones. Routing is
    pinned by a large bias ladder, since a TF32-sized change flips near-tied experts (then logits
    differ by ~2e-2, which would hide a real error).
    """
    ref = model(preset, attnres, "model.kda.backend=torch").cuda()
    if ref.attnres is not None:
        ref.attnres.impl = "two_phase"
    fast = model(preset, attnres).cuda()
    for m in (ref, fast):
        for moe in m.moe_layers():
            moe.router_bias.copy_(torch.linspace(10.0, 0.0, moe.num_experts))
    x = ids(2, 100).cuda()
    outs = []
    for m in (ref, fast):
        out = m(x, labels=x)
        out.loss.backward()
        with torch.no_grad():
            outs.append((out.loss, m(x).logits))
    errs = {"loss": abs(outs[0][0].item() - outs[1][0].item()), "logits": rel_err(outs[1][1], outs[0][1])}
    errs |= {f"d{n}": rel_err(q.grad, p.grad) for (n, p), q in zip(ref.named_parameters(), fast.parameters())}
    worst = max((k for k in errs if k.startswith("d")), key=errs.get)
    print(f"{preset}-{attnres}: loss {errs['loss']:.2e} logits {errs['logits']:.2e} worst {worst} {errs[worst]:.2e}")
    assert errs["loss"] < 1e-3 and errs["logits"] < 1e-2 and errs[worst] < 5e-2
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = fast(x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - outs[1][0].item()) < 0.05


@pytest.mark.parametrize("preset, total, active, mla", [
    ("kimi-linear-48b-a3b", 48e9, 3e9, 7),   # published: 48B total, 3B active
    ("kimi-k3", 2.8e12, 104e9, 24),          # published: about 2.8T total, 104B active
])
def test_released_shapes_count_close_to_the_published_totals(preset, total, active, mla):
    cfg = load_config(preset).model
    with torch.device("meta"):
        m = CausalLM(cfg)
    counts = param_counts(cfg)
    assert m.num_parameters() == counts["total"] and m.num_active_parameters() == counts["active"]
    assert cfg.layer_types().count("mla") == mla and cfg.layer_types()[-1] == "mla"
    assert abs(counts["total"] / total - 1) < 0.03
    assert abs(counts["active"] / active - 1) < 0.17   # 3.48B against "3B" (embeddings counted) and 99.2B against 104B
