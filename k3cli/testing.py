"""Helpers for tests and quick experiments: a tiny model config and a small real-text corpus.

`TINY_MODEL` shrinks any preset to a model that trains in well under a second per step on a CPU;
`TINY_TRAIN` is a matching short run. Both are `--set` overrides (`load_config(..., overrides=...)`).
`assert_close(name, actual, expected, tol, metric)` is the tests' one closeness check; the metrics
it re-exports from k3cli/ops/errors.py (scaled max, relative RMS, max abs) are what the tolerance
tables are stated in.
`kda_inputs` and `run_with_grads` give the KDA op tests their inputs and outputs-plus-gradients.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from k3cli.ops.errors import max_abs_error, relative_rms_error, scaled_max_error

__all__ = ["KIMI_TINY", "TINY_MODEL", "TINY_TRAIN", "WORDS", "assert_close", "kda_inputs", "max_abs_error", "one_error_line",
           "relative_rms_error", "run_with_grads", "scaled_max_error", "write_corpus"]

TINY_MODEL = [
    "model.vocab_size=300", "model.hidden_size=32", "model.num_hidden_layers=2",
    "model.kda={num_heads: 2, num_v_heads: 4, head_k_dim: 8, head_v_dim: 8, chunk_size: 8}",
    "model.mla={num_heads: 2, q_lora_rank: 16, kv_lora_rank: 8, qk_head_dim: 8, v_head_dim: 8}",
    "model.moe={num_routed_experts: 4, top_k: 2, num_shared_experts: 1, d_ff: 16, latent_dim: 16}",
]
# TINY_MODEL with every Kimi Linear option on: softplus KDA gate, direct query and shared key part in MLA, no
# MLA output gate, full-width SwiGLU experts with grouped routing and scaling, a dense first block, MLA by index
KIMI_TINY = TINY_MODEL + [
    "model.num_hidden_layers=3", 'model.mla_layers="1,2"', "model.first_dense_layers=1", "model.norm_eps=0.00001",
    "model.kda={num_heads: 2, num_v_heads: 2, head_k_dim: 8, head_v_dim: 8, chunk_size: 8, gate: softplus}",
    "model.mla={num_heads: 2, q_lora_rank: 0, kv_lora_rank: 8, qk_head_dim: 8, v_head_dim: 8, qk_rope_head_dim: 4, "
    "output_gate: false, latent_norm_eps: 0.000001}",
    "model.moe={num_routed_experts: 8, top_k: 2, num_shared_experts: 1, d_ff: 16, latent: false, expert_act: silu, "
    "num_expert_groups: 4, topk_groups: 2, routed_scaling_factor: 2.5}",
]

TINY_TRAIN = [
    "train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=6",
    "train.warmup_steps=2", "train.ckpt_every=2", "train.eval_every=3", "train.log_every=1",
    "train.keep_last=2", "eval.batches=2", "eval.batch_size=2", "train.device=cpu",
]

WORDS = ("the state decays per key dimension and the delta rule writes the residual of the prediction "
         "mixture of experts route tokens to latent experts while attention over depth mixes sublayers").split()


def write_corpus(root: Path, n_docs: int = 40, words_per_doc: int = 120, seed: int = 0) -> Path:
    """`n_docs` .txt files of words drawn from a fixed list, in `root/corpus`; returns that folder."""
    d = Path(root) / "corpus"
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(n_docs):
        idx = torch.randint(len(WORDS), (words_per_doc,), generator=g).tolist()
        (d / f"doc{i:02d}.txt").write_text(" ".join(WORDS[j] for j in idx) + "\n")
    return d


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float,
                 metric: Callable[[torch.Tensor, torch.Tensor], float] = scaled_max_error) -> None:
    """The one closeness check of the tests: fails, naming `name`, unless the shapes match and
    metric(actual, expected) ≤ tol (a NaN error fails). metric: scaled_max_error (default),
    relative_rms_error, max_abs_error, or any (actual, expected) -> float."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = metric(actual, expected)
    what = getattr(metric, "__name__", "error").replace("_", " ")
    assert err <= tol, f"{name}: {what} {err:.3g} > {tol:.3g}"


def one_error_line(result, code: int = 2, alone: bool = False) -> str:
    """The one `error:` line a failed CLI call (a typer.testing Result) ends with, after checking its exit
    code and that no traceback was printed; `alone`: and that it is all of stderr."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert not alone or len(lines) == 1, result.stderr
    return errors[0]


def kda_inputs(B, T, H, G, K, V, dtype=torch.float32, device="cpu", seed=0, h0=True, gate_scale=5.0):
    """KDA test inputs: L2-normalised q/k, gate in (-gate_scale, 0) (-5: as the lower-bound gate produces; the state then
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
