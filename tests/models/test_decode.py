"""Prefill + token-by-token decode == the full forward (docs/math.md §2.5, §5, §7.3), fp32 on CPU.

Small model dims (config overrides) keep each case to a second or two; the AttnRes queries and the
KDA gate parameters are randomised so that every path carries signal (zero-init AttnRes is uniform).
"""
import os

import pytest
import torch

from k3cli.config import load_config
from k3cli.layers.kda import KDAAttention, KDACache
from k3cli.layers.mla import MLACache
from k3cli.models import CausalLM
from k3cli.testing import assert_close, max_abs_error, scaled_max_error

# max |decoded − full| over all logits, fp32 (docs/math.md §7.3); fp64 shows the paths agree up to
# rounding (measured ≤ 3e-13; the gate runs in fp32 even for fp64 inputs)
# layer_triton: scaled max error of the Triton prefill+decode vs the torch forward in fp32 (the
# interpreter computes in fp32: measured ≤ 1e-6); on CUDA the decode recurrence is elementwise fp32
# and the chunked prefill's fp32 dots are tf32x3 (chunk.plan), hence 1e-4
TOL = {"logits": 1e-4, "logits_fp64": 1e-10, "layer_triton": 1e-4 if torch.cuda.is_available() else 1e-5}

SMALL = [
    "model.vocab_size=257", "model.hidden_size=48", "model.num_hidden_layers=4", "model.intermediate_size=64",
    "model.initializer_range=0.05",
    "model.kda={num_heads: 2, num_v_heads: 4, head_k_dim: 8, head_v_dim: 12, chunk_size: 16}",
    "model.mla={num_heads: 2, q_lora_rank: 16, kv_lora_rank: 8, qk_head_dim: 8, v_head_dim: 8}",
    "model.moe={num_routed_experts: 4, top_k: 2, num_shared_experts: 1, d_ff: 16, latent_dim: 24}",
]


@pytest.fixture(autouse=True)
def one_thread():
    """Decode is many tiny ops: with a second job on a 2-core box, OpenMP threads oversubscribe
    (measured 2.9 s vs 0.06 s per case); one thread, restored after each test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def build(preset: str, attnres: str, seed: int = 0, overrides: tuple[str, ...] = ()) -> CausalLM:
    torch.manual_seed(seed)
    m = CausalLM(load_config(preset, overrides=SMALL + list(overrides), attnres=attnres).model).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith("attnres.") and "query" in name:
                p.normal_(std=0.25)
            elif name.endswith("A_log"):
                p.normal_(std=0.5)
    return m


def ids(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 257, (B, T), generator=torch.Generator().manual_seed(seed))


def decode_all(m: CausalLM, x: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Prefill x[:, :prompt_len], then feed the rest one token at a time; all logits [B, T, vocab]."""
    logits, cache = m.prefill(x[:, :prompt_len])
    out = [logits]
    for t in range(prompt_len, x.shape[1]):
        out.append(m.decode_step(x[:, t:t + 1], cache))
    assert cache.position == x.shape[1]
    return torch.cat(out, 1)


CASES = [(p, a) for p in ("kda-toy", "k3-toy") for a in ("off", "full", "block")]
# (prompt length, total length): a 1-token prompt; prompts shorter than, equal to and not a multiple
# of the chunk size (16); decode crossing chunk boundaries
LENGTHS = [(1, 20), (5, 21), (16, 19), (23, 40)]


@pytest.mark.parametrize("preset,attnres", CASES, ids=[f"{p}-{a}" for p, a in CASES])
def test_prefill_plus_decode_equals_forward(preset, attnres):
    m = build(preset, attnres)
    x = ids(2, 40)
    with torch.no_grad():
        full = m(x).logits
    for prompt, total in LENGTHS:
        dec = decode_all(m, x[:, :total], prompt)
        assert_close(f"prompt {prompt}, total {total}: logits", dec, full[:, :total], TOL["logits"], max_abs_error)


@pytest.mark.parametrize("preset,attnres", CASES, ids=[f"{p}-{a}" for p, a in CASES])
def test_prefill_plus_decode_equals_forward_fp64(preset, attnres):
    m = build(preset, attnres).double()
    x = ids(2, 40)
    with torch.no_grad():
        full = m(x).logits
    for prompt, total in ((1, 40), (23, 40)):
        assert_close(f"prompt {prompt}: logits", decode_all(m, x[:, :total], prompt), full[:, :total],
                     TOL["logits_fp64"], max_abs_error)


def test_decode_without_the_cache_differs():
    """Negative control: the equivalence above is sensitive to the cache (a fresh one gives other logits)."""
    m = build("k3-toy", "block")
    x = ids(1, 12)
    _, cache = m.prefill(x[:, :11])
    _, fresh = m.prefill(x[:, 10:11])
    with torch.no_grad():
        full = m(x).logits
    assert_close("logits", m.decode_step(x[:, 11:], cache), full[:, 11:], TOL["logits"], max_abs_error)
    assert max_abs_error(m.decode_step(x[:, 11:], fresh), full[:, 11:]) > 100 * TOL["logits"]


def test_decode_a_few_tokens_per_step():
    m = build("k3-toy", "full")
    x = ids(2, 17)
    with torch.no_grad():
        full = m(x).logits
    logits, cache = m.prefill(x[:, :6])
    rest = [m.decode_step(x[:, t:t + 3], cache) for t in (6, 9, 12)] + [m.decode_step(x[:, 15:], cache)]
    assert_close("logits", torch.cat([logits, *rest], 1), full, TOL["logits"], max_abs_error)


def test_cache_contents():
    """KDA: fp32 state [B, HV, K, V] + short_conv − 1 inputs per conv; MLA: only c, r numbers per token."""
    m = build("k3-toy", "off")
    B, T = 2, 9
    _, cache = m.prefill(ids(B, T))
    m.decode_step(ids(B, 1, seed=1), cache)
    kinds = [type(c) for c in cache.layers]
    assert kinds == [KDACache, KDACache, KDACache, MLACache]
    kda = cache.layers[0]
    assert kda.state.shape == (B, 4, 8, 12) and kda.state.dtype == torch.float32
    assert kda.conv_q.shape == (B, 3, 2 * 8) and kda.conv_v.shape == (B, 3, 4 * 12)
    mla = cache.layers[3]
    r = m.config.mla.kv_lora_rank
    assert mla.length == T + 1 and mla.c.shape == (B, T + 1, r)
    assert [f for f in vars(mla) if isinstance(getattr(mla, f), torch.Tensor)] == ["buf"]
    assert mla.buf.shape[0] == B and mla.buf.shape[2] == r


def test_decode_step_errors_are_clear():
    m = build("kda-toy", "off")
    _, cache = m.prefill(ids(2, 3))
    with pytest.raises(ValueError, match="batch size"):
        m.decode_step(ids(1, 1), cache)
    with pytest.raises(ValueError, match="prefill"):
        m.decode_step(ids(2, 1), m.new_cache(2))


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("T,prompt", [(5, 1), (21, 17)], ids=["prompt1", "prompt17"])
def test_kda_layer_triton_decode_equals_torch_forward(T, prompt):
    """backend=triton: prefill by chunk_kda, decode by fused_recurrent_kda (in-kernel L2 norm and gate)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    tri = KDAAttention(32, 2, 4, 16, 16, chunk_size=16, backend="triton").to(dev)
    ref = KDAAttention(32, 2, 4, 16, 16, chunk_size=16, backend="torch").to(dev)
    ref.load_state_dict(tri.state_dict())
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(1)).to(dev)
    cache = tri.new_cache()
    with torch.no_grad():
        full = ref(x)
        out = [tri(x[:, :prompt], cache)] + [tri(x[:, t:t + 1], cache) for t in range(prompt, T)]
    assert_close("o", torch.cat(out, 1), full, TOL["layer_triton"], scaled_max_error)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attnres", ["off", "block"])
def test_prefill_plus_decode_equals_forward_cuda(attnres):
    """On CUDA the layers pick the Triton kernels (chunk_kda, fused_recurrent_kda, fused AttnRes), all
    in fp32 here (chunk_kda's dots fp32-accurate, tf32x3, for fp32 inputs): compare scaled."""
    m = build("k3-toy", attnres).cuda()
    x = ids(2, 40).cuda()
    with torch.no_grad():
        full = m(x).logits
    dec = decode_all(m, x, 7)
    assert_close("logits", dec, full, TOL["layer_triton"], scaled_max_error)
