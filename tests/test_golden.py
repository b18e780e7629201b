"""Golden losses: the first steps of a tiny k3 (AttnRes block) and kda run on a fixed synthetic
corpus must reproduce the stored losses (to 1e-4 relative: summation order may differ across CPUs).

A change that moves these numbers changes what the model computes; if that is intended, regenerate
with `K3_REGEN_GOLDEN=1 pytest tests/test_golden.py` and say why in the commit.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from k3cli.config import load_config
from k3cli.train import train

GOLDEN = Path(__file__).parent / "golden" / "tiny_losses.json"
TINY = [
    "model.vocab_size=300", "model.hidden_size=32", "model.num_hidden_layers=4",
    "model.kda={num_heads: 2, num_v_heads: 4, head_k_dim: 8, head_v_dim: 8, chunk_size: 8}",
    "model.mla={num_heads: 2, q_lora_rank: 16, kv_lora_rank: 8, qk_head_dim: 8, v_head_dim: 8}",
    "model.moe={num_routed_experts: 4, top_k: 2, num_shared_experts: 1, d_ff: 16, latent_dim: 16}",
    "model.intermediate_size=64", "train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4",
    "train.steps=8", "train.warmup_steps=2", "train.ckpt_every=0", "train.eval_every=0", "train.log_every=1",
    "eval.batches=1", "eval.batch_size=2", "train.device=cpu",
]
# the document mask (data.document_mask, on by default) changes the losses from step 1: the rows of this
# corpus pack several documents; "-no-mask" keeps the losses of the model without it
RUNS = {"k3-block": ("k3-toy", "block", True), "kda-off": ("kda-toy", "off", True),
        "k3-block-no-mask": ("k3-toy", "block", False), "kda-off-no-mask": ("kda-toy", "off", False)}


def corpus(root: Path) -> Path:
    """Deterministic text from a fixed word list (no RNG library whose stream could change)."""
    words = ("state decay delta write read chunk gate expert router latent depth block query key value "
             "norm scale token sequence cache").split()
    d = root / "corpus"
    d.mkdir()
    for i in range(24):
        text = " ".join(words[(i * 7 + j * j * 3 + j) % len(words)] for j in range(200))
        (d / f"doc{i:02d}.txt").write_text(text + "\n")
    return d


def run_losses(tmp_path: Path, preset: str, attnres: str, mask: bool) -> list[float]:
    cfg = load_config(preset, overrides=TINY + [f"data.source={corpus(tmp_path)}", f"data.document_mask={mask}"],
                      attnres=attnres)
    run = tmp_path / "run"
    train(cfg, run, log=lambda m: None)
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", list(RUNS))
def test_first_losses_match_golden(name, tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one summation order for the reductions
    try:
        losses = run_losses(tmp_path, *RUNS[name])
    finally:
        torch.set_num_threads(threads)
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
    if os.environ.get("K3_REGEN_GOLDEN") == "1":
        golden[name] = losses
        GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
        pytest.skip(f"regenerated {GOLDEN.name}[{name}]")
    assert name in golden, f"no golden losses for {name}; regenerate with K3_REGEN_GOLDEN=1"
    assert len(losses) == len(golden[name])
    assert losses == pytest.approx(golden[name], rel=1e-4)
    assert losses[-1] < losses[0]  # and it learns
