"""torch.compile of the whole model (slow tier: each case compiles a graph on the CPU).

fullgraph=True makes any graph break an error, so each case passing is the zero-break proof; the
values are compared with eager. aot_eager traces exactly what Inductor would receive (Dynamo +
AOT autograd, forward and backward) without generating code; one build goes through Inductor
itself, steps repeatedly with recompiles turned into errors, and resumes exactly. The GPU case trains
compiled on CUDA with the document mask, evaluates as `train` does, and trains on.
"""
import json
import math
import os

import pytest
import torch
from typer.testing import CliRunner

from k3cli.checkpoint import latest as find_latest_checkpoint
from k3cli.cli import app
from k3cli.config import load_config
from k3cli.distributed.compile import compile_model
from k3cli.models.causal_lm import CausalLM
from k3cli.testing import TINY_MODEL, TINY_TRAIN, write_corpus
from k3cli.train import train

pytestmark = pytest.mark.slow
BUILDS = [(p, m) for p in ("kda-toy", "k3-toy") for m in ("off", "full", "block")]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts from empty compile caches: entries of earlier tests' models would count
    towards the recompile limit of the same forward code object."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _loss_and_grads(model, forward, ids):
    model.zero_grad(set_to_none=True)
    loss = forward(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _build(preset, mode):
    cfg = load_config(preset, overrides=TINY_MODEL, attnres=mode)
    torch.manual_seed(0)
    return CausalLM(cfg.model).train()


@pytest.mark.parametrize("preset,mode", BUILDS)
def test_fullgraph_forward_backward_equals_eager(preset, mode):
    model = _build(preset, mode)
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    ref_loss, ref = _loss_and_grads(model, model, ids)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss, grads = _loss_and_grads(model, compiled, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)


def test_inductor_steps_without_recompiling_and_matches_eager():
    model = _build("k3-toy", "block")
    forward = compile_model(model)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 300, (2, 32), generator=g) for _ in range(4)]
    _loss_and_grads(model, forward, batches[0])          # compiles the training graph once
    for ids in batches[1:]:                               # new data, same shapes: no recompile
        with torch._dynamo.config.patch(error_on_recompile=True):
            loss, grads = _loss_and_grads(model, forward, ids)
        ref_loss, ref = _loss_and_grads(model, model, ids)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        for n in ref:
            torch.testing.assert_close(grads[n], ref[n], rtol=1e-4, atol=1e-5, msg=n)
    assert not any(k.startswith("_orig_mod") for k in model.state_dict())


@pytest.fixture
def one_thread():
    """Inductor's multi-threaded CPU kernels are not bitwise reproducible from one compilation to
    the next (measured: 1 ulp in one step's loss with 2 threads); one thread makes them so."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def compiling_once(monkeypatch) -> list:
    """Inside `k3 train`'s loop, compiled: after the first step (the training graph) and the first evaluation
    (its no-grad graphs) recompiles are errors. Returns the list the evaluations are counted in."""
    import k3cli.train.loop as loop_mod

    finished, evaluate, evals = loop_mod.CompileWatch.finished, loop_mod.Run.evaluate, []

    def first_step_done(self):
        torch._dynamo.config.error_on_recompile = True
        return finished(self)

    def evaluating(self):
        evals.append(1)
        if len(evals) > 1:
            return evaluate(self)
        torch._dynamo.config.error_on_recompile = False   # the first evaluation compiles its own graphs
        try:
            return evaluate(self)
        finally:
            torch._dynamo.config.error_on_recompile = True

    monkeypatch.setattr(loop_mod.CompileWatch, "finished", first_step_done)
    monkeypatch.setattr(loop_mod.Run, "evaluate", evaluating)
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", False)   # restored after the test
    return evals


def test_exact_resume_with_compile_on(tmp_path, monkeypatch, one_thread):
    """A compiled run compiles nothing after its first step and first evaluation (training steps, a second
    evaluation and checkpoints run with recompiles as errors), and resumes bit for bit."""
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    corpus = write_corpus(tmp_path)

    def cfg():
        return load_config("k3-toy", overrides=TINY_MODEL + TINY_TRAIN + [f"data.source={corpus}",
                                                                         "train.compile=true"])

    with monkeypatch.context() as m:
        evals = compiling_once(m)
        train(cfg(), tmp_path / "a", log=lambda m: None)
        assert len(evals) == 2   # steps 3 and 6
    train(cfg(), tmp_path / "b", log=lambda m: None, stop_at=3)
    train(cfg(), tmp_path / "b", resume=True, log=lambda m: None)
    rows = {r: [json.loads(line) for line in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
            for r in ("a", "b")}
    assert [m["loss"] for m in rows["a"]] == [m["loss"] for m in rows["b"]]
    assert [m.get("val_loss") for m in rows["a"]] == [m.get("val_loss") for m in rows["b"]]
    from safetensors.torch import load_file

    wa = load_file(find_latest_checkpoint(tmp_path / "a") / "model.safetensors")
    wb = load_file(find_latest_checkpoint(tmp_path / "b") / "model.safetensors")
    assert wa.keys() == wb.keys() and not any(k.startswith("_orig_mod") for k in wa)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


COMPILE_ONCE = """
import json, sys, torch
from k3cli.distributed.compile import compile_model, use_compile_cache
from k3cli.config import load_config
from k3cli.testing import TINY_MODEL
from k3cli.train import build_model
use_compile_cache(sys.argv[1])
model = build_model(load_config("k3-toy", overrides=TINY_MODEL + ["model.num_hidden_layers=1"]))
ids = torch.randint(1, 300, (2, 32))
compile_model(model)(ids, labels=ids).loss.backward()
from torch._dynamo.utils import counters
print(json.dumps({**counters["aot_autograd"], **counters["inductor"]}))
"""


def test_a_second_process_takes_the_compiled_step_from_the_cache(tmp_path):
    """What `k3 train` compiles is cached under $K3_CACHE_DIR whole: Inductor's graphs and AOTAutograd's
    forward/backward split (which bypassed its cache for the MoE router's autocast region)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}

    def run():
        out = subprocess.run([sys.executable, "-c", COMPILE_ONCE, str(tmp_path / "compile")], capture_output=True,
                             text=True, timeout=900, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert (tmp_path / "compile" / "aotautograd").is_dir()   # there, not in torch's default folder
    assert first.get("autograd_cache_bypass", 0) == 0 and first.get("autograd_cache_saved") == 1, first
    assert second.get("autograd_cache_hit") == 1 and second.get("fxgraph_cache_miss", 0) == 0, second


@pytest.mark.gpu
def test_compiled_training_then_evaluation_on_cuda_with_documents():
    """As `k3 train --set train.compile=true` runs on a GPU: compiled training steps on packed documents
    (varlen KDA, FlexAttention, masked short convs), the evaluation `train` runs, given the compiled
    forward (with documents on CUDA it evaluates uncompiled: Inductor's no-grad FlexAttention kernel
    faulted in this test), whose loss equals the eager model's, then compiled training again."""
    from k3cli.data import EOT_ID
    from k3cli.train import document_segments, evaluate_loss
    cfg = load_config("k3-toy", attnres="block")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = CausalLM(cfg.model).to(dev).train()
    forward = compile_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    gen = torch.Generator().manual_seed(0)

    def batch():
        ids = torch.randint(1, cfg.model.vocab_size, (8, 256), generator=gen)
        return torch.where(torch.rand(8, 256, generator=gen) < 4 / 256, EOT_ID, ids)
    def step():
        ids = batch()
        segments = document_segments(ids, dev, True)
        ids = ids.to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(ids, labels=ids, segments=segments).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    for _ in range(2):
        step()
    val = [batch(), batch()]
    compiled = evaluate_loss(forward, val, dev, torch.bfloat16, module=model, document_mask=True)
    eager = evaluate_loss(model, val, dev, torch.bfloat16, document_mask=True)
    assert compiled == pytest.approx(eager, rel=1e-2) and model.training
    assert math.isfinite(step())


def test_bench_train_compile_flag_times_the_compiled_step_beside_eager():
    # one layer: what is checked is the flag and its rows, and Inductor's CPU compile takes ~20 s a layer
    r = CliRunner().invoke(app, ["bench-train", "--preset", "kda-toy", "--compile", "--steps", "1", "--warmup", "1",
                                 "--json", *[a for s in TINY_MODEL + ["model.num_hidden_layers=1", "train.seq_len=32",
                                                                      "train.micro_batch_size=2", "train.device=cpu"]
                                             for a in ("--set", s)]])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    by = {row["variant"]: row for row in res["rows"]}
    assert {"eager", "compiled"} <= by.keys() and by["compiled"]["compiled"] and not by["eager"]["compiled"]
    assert res["ratios"]["compiled_vs_eager"] == pytest.approx(by["eager"]["step_ms"] / by["compiled"]["step_ms"])
